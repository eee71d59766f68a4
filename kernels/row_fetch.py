"""Fetch the expert rows a step uses from pinned host memory into a layer's rows, deciding on the GPU.

A paged layer's rows are filled just before its kernel runs (esftctl.runtime.paging). Which rows a step needs is
known only on the GPU (the router's top-k ids, after the reroute), so the choice is made there, in two launches
that take the same arguments every step and so replay inside CUDA graphs:

    mark:   listing = the distinct rows among the step's ids (every row, for a whole layer), count = how many,
            needed[r] = 1 for those; nothing at all while `active` is 0 (a layer kept resident)
    fetch:  for every listed row r >= first_host_row, each of its segments (its w13 row, its w2 row) with a
            source: dst[:] = src[:]

The fetch is a persistent kernel of `programs` programs striding over (listed row, segment, chunk): its work is
what the step needs, and `programs` bounds the SMs it takes, so that a fetch overlapping another layer's kernel
leaves it the rest (measured on an H100: a fetch over every SM stalled a concurrent matrix product almost
completely, since zero-copy reads hold their SMs while they wait on the bus).

The segment table holds addresses: sources are pinned host memory the GPU reads over the bus (zero-copy: 50 GB/s
on an H100, 92% of its copy engine's 54 GB/s, in benchmarks/RESULTS.md), destinations the layer's rows. A source
entry changes when an adapter's rows come or go (between steps), and captured graphs read the new one. Rows below
`first_host_row` come from the store tier instead (esftctl.kernels.huffman_decode, masked by the same `needed`).

The plain PyTorch references (`mark_rows_reference`, `fetch_rows_reference`) are the CPU path and what the GPU
tests compare with.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 18  # bytes of a segment one program copies at a time: a 11.5 MB w13 row is 44 chunks
VECTOR = 16  # segments start and end on 16-byte boundaries: the copies are 128-bit loads and stores


def mark_rows_reference(ids: torch.Tensor | None, needed: torch.Tensor, active: bool,
                        held: list[int] | None = None) -> list[int]:
    """While `active`: needed[r] = 1 where r is among `ids` and those rows listed (ids outside the rows, a paged
    layer's adapter rows, are not), or with `ids` None every row needed and the `held` rows listed; else nothing."""
    needed.zero_()
    if not active:
        return []
    if ids is None:
        needed.fill_(1)
        return sorted(held if held is not None else range(len(needed)))
    ids = ids.flatten().long()
    needed[ids[(ids >= 0) & (ids < len(needed))]] = 1
    return needed.nonzero().flatten().tolist()


def fetch_rows_reference(rows: list[int], first_host_row: int,
                         segments: dict[int, list[tuple[torch.Tensor | None, torch.Tensor]]]) -> int:
    """Copy every (source, destination) segment of the listed rows from `first_host_row` on; the bytes copied."""
    copied = 0
    for row in rows:
        for src, dst in segments.get(row, []) if row >= first_host_row else []:
            if src is not None:
                dst.copy_(src)
                copied += dst.numel() * dst.element_size()
    return copied


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _mark_kernel(ids_ptr, n_ids, needed_ptr, listing_ptr, count_ptr, n_rows, active_ptr, stats_ptr,
                     held_ptr, held_count_ptr, ALL: tl.constexpr, BLOCK: tl.constexpr):
        """One program, so that clearing, marking and counting follow each other without another launch: ALL
        lists the held rows and needs every row; else each id's first marking lists it. stats += (rows listed,
        1 while active)."""
        active = tl.load(active_ptr) != 0
        lanes = tl.arange(0, BLOCK)
        if ALL:
            fill = active.to(tl.int32)
        else:
            fill = tl.zeros_like(active.to(tl.int32))
        for start in range(0, n_rows, BLOCK):
            ok = start + lanes < n_rows
            tl.store(needed_ptr + start + lanes, tl.zeros([BLOCK], dtype=tl.int32) + fill, mask=ok)
            if ALL:
                tl.store(listing_ptr + start + lanes, tl.load(held_ptr + start + lanes, mask=ok, other=0), mask=ok)
        count = tl.where(active, tl.load(held_count_ptr), 0)
        if ALL:
            tl.store(count_ptr, count)
        else:
            tl.store(count_ptr, 0)
            tl.debug_barrier()  # the clearing above is seen by every thread's marking below
            for start in range(0, tl.where(active, n_ids, 0), BLOCK):
                ok = start + lanes < n_ids
                ids = tl.load(ids_ptr + start + lanes, mask=ok, other=0).to(tl.int32)
                ok = ok & (ids >= 0) & (ids < n_rows)
                first = tl.atomic_xchg(needed_ptr + ids, 1, mask=ok) == 0
                slot = tl.atomic_add(count_ptr + tl.zeros_like(ids), 1, mask=ok & first)
                tl.store(listing_ptr + slot, ids, mask=ok & first)
            tl.debug_barrier()
            count = tl.load(count_ptr)
        tl.store(stats_ptr, tl.load(stats_ptr) + count.to(tl.int64))
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + active.to(tl.int64))

    @triton.jit
    def _fetch_kernel(listing_ptr, count_ptr, n_rows, chunks, src_ptr, dst_ptr, nbytes_ptr, first_host_ptr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Item i = (listed row i // (2 * chunks), segment (i // chunks) % 2, chunk i % chunks); each copied as
        [BLOCK, 4] int32 tiles masked by whole 16-byte vectors, so loads stay 128 bits wide."""
        first_host = tl.load(first_host_ptr)
        n_items = tl.load(count_ptr) * 2 * chunks
        lanes = tl.arange(0, BLOCK)[:, None]
        words = lanes * 4 + tl.arange(0, 4)[None, :]
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            row = tl.load(listing_ptr + item // (2 * chunks))
            seg = ((item // chunks) % 2) * n_rows + row
            src = tl.load(src_ptr + seg)
            nbytes = tl.load(nbytes_ptr + seg)
            start = (item % chunks).to(tl.int64) * CHUNK
            if (row >= first_host) & (src != 0) & (start < nbytes):
                source = tl.multiple_of((src + start).to(tl.pointer_type(tl.int32)), 16)
                dest = tl.multiple_of((tl.load(dst_ptr + seg) + start).to(tl.pointer_type(tl.int32)), 16)
                vectors = tl.minimum(nbytes - start, CHUNK) // 16
                for k in range(0, CHUNK // 16, BLOCK):
                    mask = (k + lanes) < vectors
                    tl.store(dest + 4 * k + words, tl.load(source + 4 * k + words, mask=mask), mask=mask)

except ImportError:  # the CPU build has no Triton: the pager uses the references there
    triton = None


def host_device_pointer(tensor: torch.Tensor) -> int:
    """The address a kernel reads a pinned host tensor at (the host's own under unified addressing; the driver
    says so, and refuses memory that is not pinned)."""
    from cuda.bindings import runtime

    err, ptr = runtime.cudaHostGetDevicePointer(tensor.data_ptr(), 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"host rows must be pinned memory the GPU can map ({err})")
    return int(ptr)


class _MappedHost:
    """Pinned host memory as a CUDA array (torch.as_tensor keeps this object, and so the host tensor, alive)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host_device_pointer(host), False), "version": 3}


def mapped_on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory (zero-copy: a kernel's loads from it cross the bus), same dtype and
    shape: what a kernel that refuses CPU tensors (Triton's) takes to read the host directly."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("zero-copy views need contiguous pinned host tensors")
    raw = torch.as_tensor(_MappedHost(host), device=device)
    return raw.view(host.dtype).view(host.shape)


class RowFetch:
    """One layer's fetch state on the device: its segment table (row r's w13 is segment r, its w2 segment
    rows + r), the step's marks, the tier boundary, the active flag, and `stats` = (rows fetched, marks while
    active), summed since the start."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, address=None):
        """`w13` [rows, ...], `w2` [rows, ...]: the layer's rows at their fixed addresses (mapped or not);
        `address`: a host row -> the address kernels read it at (default: the driver's, for pinned memory;
        Triton's CPU interpreter reads host addresses as they are)."""
        rows, device = w13.shape[0], w13.device
        self.rows, self.address = rows, address or host_device_pointer
        row_bytes = [w13[0].numel() * w13.element_size(), w2[0].numel() * w2.element_size()]
        if any(b % VECTOR for b in row_bytes) or w13.data_ptr() % VECTOR or w2.data_ptr() % VECTOR:
            raise ValueError(f"expert rows must start and end on {VECTOR}-byte boundaries")
        self.dst = torch.tensor([w13.data_ptr() + r * row_bytes[0] for r in range(rows)]
                                + [w2.data_ptr() + r * row_bytes[1] for r in range(rows)], dtype=torch.int64).to(device)
        self.nbytes = torch.tensor([row_bytes[0]] * rows + [row_bytes[1]] * rows, dtype=torch.int64).to(device)
        self.row_bytes = row_bytes
        self.src = torch.zeros(2 * rows, dtype=torch.int64, device=device)
        self.chunks = -(-max(row_bytes) // CHUNK)
        self.needed = torch.zeros(rows, dtype=torch.int32, device=device)
        self.listing = torch.zeros(rows, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.active = torch.ones(1, dtype=torch.int32, device=device)
        self.first_host = torch.zeros(1, dtype=torch.int32, device=device)
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)
        self.held = torch.zeros(rows, dtype=torch.int32, device=device)  # the rows with a source, listed first
        self.held_count = torch.zeros(1, dtype=torch.int32, device=device)

    def set_sources(self, sources: list[tuple[torch.Tensor | None, torch.Tensor | None]],
                    held: list[int] | None = None) -> None:
        """Every row's pinned host copies (w13, w2), or None where the row is not held or comes from the store tier
        alone; `held`: the rows a whole-layer fetch lists (and counts), by default those with a source. In one copy
        to the device, ordered before the next launch on the current stream."""
        values = [0] * (2 * self.rows)
        for row, pair in enumerate(sources):
            for k, (t, nbytes) in enumerate(zip(pair, self.row_bytes)):
                if t is None:
                    continue
                if t.data_ptr() % VECTOR or t.numel() * t.element_size() != nbytes:
                    raise ValueError(f"row {row}: host rows must be {VECTOR}-byte aligned and a row's size")
                values[k * self.rows + row] = self.address(t)
        if held is None:
            held = [r for r in range(self.rows) if values[r] or values[self.rows + r]]
        self.src.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=False)
        self.held.copy_(torch.tensor(held + [0] * (self.rows - len(held)), dtype=torch.int32), non_blocking=False)
        self.held_count.fill_(len(held))

    def mark(self, ids: torch.Tensor | None) -> None:
        """List the rows `ids` names (every held row with None), unless the layer is inactive: one launch."""
        flat = self.held if ids is None else ids.reshape(-1)
        _mark_kernel[(1,)](flat, flat.numel(), self.needed, self.listing, self.count, self.rows, self.active,
                           self.stats, self.held, self.held_count, ALL=ids is None, BLOCK=1024, num_warps=8)

    def fetch(self, programs: int) -> None:
        """Copy the listed rows' host-tier segments, `programs` programs striding over the work."""
        _fetch_kernel[(programs,)](self.listing, self.count, self.rows, self.chunks, self.src, self.dst, self.nbytes,
                                   self.first_host, CHUNK=CHUNK, BLOCK=512, num_warps=8)
