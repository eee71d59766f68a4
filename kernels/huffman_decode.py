"""GPU decoding of Huffman-coded bf16 exponents (esftctl.formats.huffman's format) straight into bf16 tensors.

One launch decodes any set of stored tensors into any destinations (for paging: the mapped rows of a
layer's virtual weight tensors). Every chunk of every tensor becomes one lane, described by five numbers:
its absolute bit position in the store's data on the device, where its sign-and-mantissa bytes start,
the device address of its first output value, how many of the tensor's values lie from there on, and its
code table. A program is one warp: the 32 chunks of a block (esftctl.formats.huffman.chunk_layout), which take
turns by GROUP values, so each time the warp writes a group it writes 32 * GROUP contiguous values and
reads as many contiguous sign-and-mantissa bytes. "Does any lane still need values for this group?" is a
warp vote.

A lane keeps its next bits in a 64-bit register. One aligned 32-bit refill leaves at least STEPS * WIDTH
bits there, enough for STEPS dependent lookups in a multi-symbol table (esftctl.formats.huffman.multi_symbol_table:
every whole code at the front of a WIDTH-bit window, up to four, and the bits they use); at about 2.6 bits
per exponent a lookup yields about four values. Decoded bytes enter a 20-byte queue at the top with funnel
shifts, so a step never needs to know where its values land; once GROUP are queued, the oldest GROUP are
joined with their sign-and-mantissa bytes and written as contiguous bf16 values, as vectors where the plan
proved the destinations start on a group boundary. The kernel is kept lean on purpose: at ~50 registers a
lane, twice as many warps fit on an SM as with a wider queue, and the coalesced layout keeps their byte
streams from thrashing L1 (RESULTS.md has the measurements).

The plain reference is the CPU decoder (esftctl.formats.huffman.decode + join_bf16); the tests compare the two.
A DecodePlan holds the descriptors on the device, so `run()` is one launch with no host work, and can be
captured in a CUDA graph.

The descriptors are device addresses, so a store's numbers must be checked before they become ones:
`DecodePlan.build` refuses (ValueError) every segment that would make a lane read or write outside its buffers,
the bounds the C decoder checks (a destination of exactly the tensor's values, the chunk count its size needs,
chunk starts in order inside the data, the sign-and-mantissa bytes inside the data, a table that exists), and the
kernel masks every word load past the data's end, so that no chunk offset makes it read outside the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from esftctl.formats.huffman import GROUP, LANES, MAX_LENGTH, check_chunk, chunk_count, chunk_firsts

MAX_COUNT = (1 << 31) - 1  # values per tensor at most: a lane counts the values left in int32

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _bswap32(x):
        """The stream is MSB-first bytes: a little-endian 32-bit load reads them reversed."""
        return ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | ((x >> 24) & 0xFF)

    @triton.jit
    def _funnel(high, low, shift):
        """The low 32 bits of the 64-bit value high:low shifted right by `shift` (0 to 32) bits."""
        return (((high.to(tl.uint64) << 32) | low.to(tl.uint64)) >> shift).to(tl.uint32)

    @triton.jit
    def _decode_chunks_kernel(words_ptr, n_words, data_ptr, multi_ptr, bit_ptr, sm_ptr, dst_ptr, remaining_ptr,
                              table_ptr, n_chunks, row_ptr, needed_ptr, first_host_ptr, CHUNK: tl.constexpr,
                              WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                              STEPS: tl.constexpr, MASKED: tl.constexpr):
        tl.static_assert(GROUP == 16, "the queue holds a group of 16 values and the up to 3 decoded past it")
        tl.static_assert(STEPS * WIDTH <= 32, "one 32-bit refill must cover STEPS lookups in a 64-bit buffer")
        tl.static_assert(BLOCK == 32, "a program is one block of formats.huffman.chunk_layout: LANES = 32 chunks")
        STRIDE: tl.constexpr = BLOCK * GROUP  # a block's lanes take turns by GROUP values
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < n_chunks
        groups = CHUNK // GROUP
        if MASKED:  # paging: only the rows this step needs, below the host tier's first row
            row = tl.load(row_ptr + lanes, mask=ok, other=0)
            ok = ok & (tl.load(needed_ptr + row, mask=ok, other=0) != 0) & (row < tl.load(first_host_ptr))
            groups = tl.where(tl.max(ok.to(tl.int32), axis=0) > 0, groups, 0)  # a warp with nothing to do ends
        bit = tl.load(bit_ptr + lanes, mask=ok, other=0)
        sm_at = tl.load(sm_ptr + lanes, mask=ok, other=0)
        out = tl.load(dst_ptr + lanes, mask=ok, other=0).to(tl.pointer_type(tl.int16))
        n = tl.load(remaining_ptr + lanes, mask=ok, other=0)
        base = tl.load(table_ptr + lanes, mask=ok, other=0).to(tl.int64) << WIDTH
        word = bit >> 5
        first = _bswap32(tl.load(words_ptr + word, mask=ok & (word < n_words), other=0).to(tl.uint32)).to(tl.uint64)
        buf = (first << 32) << (bit & 31).to(tl.uint64)
        nbits = 32 - (bit & 31).to(tl.int32)
        word += 1
        # The queue: the last 20 decoded exponents, one byte each, oldest in the low byte of q0.
        q0 = tl.zeros([BLOCK], dtype=tl.uint32)
        q1 = tl.zeros([BLOCK], dtype=tl.uint32)
        q2 = tl.zeros([BLOCK], dtype=tl.uint32)
        q3 = tl.zeros([BLOCK], dtype=tl.uint32)
        q4 = tl.zeros([BLOCK], dtype=tl.uint32)
        queued = tl.zeros([BLOCK], dtype=tl.int32)
        HALF: tl.constexpr = GROUP // 2
        half_cols = tl.arange(0, HALF)[None, :]
        shifts = (8 * (half_cols % 4)).to(tl.uint32)
        if ALIGNED:  # the plan checked: every chunk's bytes and destination start on a GROUP-value boundary
            sm_at = tl.multiple_of(sm_at, GROUP)
            out = tl.multiple_of(out, 2 * GROUP)
        sm_ptrs = data_ptr + sm_at[:, None]
        out_ptrs = out[:, None]
        for g in range(0, groups):
            left = n - g * STRIDE  # the tensor's values from this group's first on
            live = ok & (left > 0)
            while tl.max(tl.where(live, GROUP - queued, 0), axis=0) > 0:
                need = live & (queued < GROUP) & (nbits < STEPS * WIDTH)
                # Past the data's end (a corrupt stream's chunk runs on): zero bits, never a read outside it.
                w = _bswap32(tl.load(words_ptr + word, mask=need & (word < n_words), other=0).to(tl.uint32))
                w = w.to(tl.uint64)
                buf = tl.where(need, buf | (w << (32 - nbits).to(tl.uint64)), buf)
                nbits = tl.where(need, nbits + 32, nbits)
                word = tl.where(need, word + 1, word)
                for _ in tl.static_range(STEPS):
                    active = live & (queued < GROUP)
                    entry = tl.load(multi_ptr + base + (buf >> (64 - WIDTH)).to(tl.int64), mask=active, other=0)
                    # A window with no whole code lies past the stream's end (only in a tensor's last group,
                    # which then decodes filler it never writes): it counts as one byte, so the lane fills up.
                    count = tl.maximum(((entry >> 32) & 0xF).to(tl.int32), active.to(tl.int32))
                    used = ((entry >> 36) & 0x1F).to(tl.uint64)
                    step = (8 * count).to(tl.uint64)  # 0 for a lane that is done: its queue stays
                    q0, q1, q2 = _funnel(q1, q0, step), _funnel(q2, q1, step), _funnel(q3, q2, step)
                    q3, q4 = _funnel(q4, q3, step), _funnel(entry.to(tl.uint32), q4, step)
                    buf = buf << used
                    nbits -= used.to(tl.int32)
                    queued += count
            # The group's values are the oldest GROUP of the `queued` (16 to 19) at the top of the queue.
            skip = (8 * (20 - queued)).to(tl.uint64)
            whole = ok & (left >= GROUP)
            tail = live & ~whole
            any_tail = tl.max(tail.to(tl.int32), axis=0) > 0
            for half in tl.static_range(2):  # 8 values a half: one row of a tile per thread, no shuffles
                qa, qb, qc = (q0, q1, q2) if half == 0 else (q2, q3, q4)
                ea, eb = _funnel(qb, qa, skip)[:, None], _funnel(qc, qb, skip)[:, None]
                exponents = ((tl.where(half_cols < 4, ea, eb) >> shifts) & 0xFF).to(tl.int16)
                at = half * HALF + half_cols
                # Whole groups: one mask per lane, so each lane's bytes move as vectors (8 B in, 16 B out).
                sm = tl.load(sm_ptrs + at, mask=whole[:, None], other=0).to(tl.int16)
                tl.store(out_ptrs + at, (sm & -128) << 8 | (exponents << 7) | (sm & 0x7F), mask=whole[:, None])
                if any_tail:  # the tensor's last, partial group: value by value
                    mask = tail[:, None] & (at < left[:, None])
                    sm = tl.load(sm_ptrs + at, mask=mask, other=0).to(tl.int16)
                    tl.store(out_ptrs + at, (sm & -128) << 8 | (exponents << 7) | (sm & 0x7F), mask=mask)
            sm_ptrs += STRIDE
            out_ptrs += STRIDE
            queued -= GROUP

except ImportError:
    triton = None


@dataclass(frozen=True)
class Segment:
    """One tensor to decode: each chunk's absolute starting bit in the data, where its sign-and-mantissa bytes
    start in the data, its value count, its code table, and its destination."""

    bits: np.ndarray  # int64, one per chunk
    sm_offset: int
    count: int
    table: int
    out: torch.Tensor
    row: int = 0  # the expert row the destination belongs to (a masked run decodes only the rows it is told)


def check_segment(s: Segment, *, chunk: int, data_bytes: int, tables: int, device: torch.device) -> None:
    """ValueError unless decoding `s` stays inside its buffers: the kernel writes `count` values from the
    destination's start, reads as many sign-and-mantissa bytes from `sm_offset`, and reads words from each chunk's
    starting bit on (masked at the data's end)."""
    out = s.out
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != device:
        raise ValueError(f"destinations must be contiguous bf16 tensors on {device}")
    if type(s.count) is not int or not 0 <= s.count <= MAX_COUNT or out.numel() != s.count:
        raise ValueError(f"a destination of {out.numel()} values for a tensor of {s.count!r} (at most {MAX_COUNT})")
    if len(s.bits) != chunk_count(s.count, chunk):
        raise ValueError(f"{len(s.bits)} chunk offsets for {chunk_count(s.count, chunk)} chunks")
    if len(s.bits) and (s.bits[0] < 0 or s.bits[-1] > 8 * data_bytes or np.any(np.diff(s.bits) < 0)):
        raise ValueError("chunk offsets out of order or outside the data")
    if type(s.sm_offset) is not int or s.sm_offset < 0 or s.sm_offset + s.count > data_bytes:
        raise ValueError("sign-and-mantissa bytes outside the data")
    if type(s.table) is not int or not 0 <= s.table < tables:
        raise ValueError(f"code table {s.table!r} of {tables}")


class DecodePlan:
    """Chunk descriptors for decoding a set of tensors into fixed destinations, ready on the device."""

    BLOCK = LANES  # lanes per program: one warp, so "does any lane still need values?" is a warp vote
    STEPS = 2  # lookups per bit-buffer refill and per vote

    def __init__(self, data: torch.Tensor, tables: torch.Tensor, chunk: int, descriptors: dict[str, torch.Tensor],
                 keepalive: list[torch.Tensor], aligned: bool = False):
        """Descriptors as `build` makes them (which checks them against the buffers: build plans with it)."""
        if data.numel() % 4:
            raise ValueError("the data buffer must hold whole 32-bit words")
        self.data, self.tables, self.chunk = data, tables, chunk
        self.words = data.view(torch.int32)
        self.d = descriptors
        self._keepalive = keepalive  # the destinations: their addresses are baked into the descriptors
        self.n_chunks = int(descriptors["bits"].numel())
        # Vector loads and stores need every destination to start on a group boundary in memory.
        self.aligned = aligned

    @classmethod
    def build(cls, data: torch.Tensor, tables: torch.Tensor, chunk: int, segments: list[Segment]) -> "DecodePlan":
        """A plan writing every segment into its destination in one launch: `data` the store's bytes on the device
        (whole words), `tables` its multi-symbol tables ([tables, 2**MAX_LENGTH] int64). ValueError, before
        anything reaches the device, for a segment that check_segment refuses."""
        check_chunk(chunk)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
            raise ValueError("the data buffer must be uint8 bytes in whole 32-bit words")
        if tables.dim() != 2 or tables.shape[1] != 1 << MAX_LENGTH:
            raise ValueError(f"decode tables must be [n, {1 << MAX_LENGTH}]")
        bits, sm, dst, remaining, table, row = [], [], [], [], [], []
        for s in segments:
            check_segment(s, chunk=chunk, data_bytes=data.numel(), tables=tables.shape[0], device=data.device)
            firsts = chunk_firsts(s.count, chunk)
            # Each tensor's chunks start a warp: its lanes then read and write whole lines. Lanes that pad
            # the last warp have no values.
            pad = -len(firsts) % LANES
            bits.append(np.pad(np.asarray(s.bits, dtype=np.int64), (0, pad)))
            sm.append(np.pad(s.sm_offset + firsts, (0, pad)))
            dst.append(np.pad(s.out.data_ptr() + 2 * firsts, (0, pad)))
            remaining.append(np.pad((s.count - firsts).astype(np.int32), (0, pad)))
            table.append(np.full(len(firsts) + pad, s.table, dtype=np.int32))
            row.append(np.full(len(firsts) + pad, s.row, dtype=np.int32))
        descriptors = {k: torch.from_numpy(np.concatenate(v) if v else np.zeros(0, dtype=np.int64)).to(data.device)
                       for k, v in (("bits", bits), ("sm", sm), ("dst", dst), ("remaining", remaining),
                                    ("table", table), ("row", row))}
        aligned = all(s.out.data_ptr() % (2 * GROUP) == 0 and s.sm_offset % GROUP == 0 for s in segments)
        return cls(data, tables, chunk, descriptors, [s.out for s in segments], aligned)

    def run(self, needed: torch.Tensor | None = None, first_host: torch.Tensor | None = None) -> None:
        """Decode every segment, or (paging) only those whose row is needed (`needed` [rows] int32, nonzero) and
        below `first_host` (int32 [1]): both read on the device, so a captured run follows their later values."""
        if triton is None:
            raise RuntimeError("GPU decoding needs Triton")
        if self.n_chunks == 0:
            return
        masked = needed is not None
        _decode_chunks_kernel[(triton.cdiv(self.n_chunks, self.BLOCK),)](
            self.words, self.words.numel(), self.data, self.tables, self.d["bits"], self.d["sm"], self.d["dst"],
            self.d["remaining"], self.d["table"], self.n_chunks, self.d["row"], needed if masked else self.d["row"],
            first_host if masked else self.d["row"], CHUNK=self.chunk, WIDTH=MAX_LENGTH, GROUP=GROUP,
            BLOCK=self.BLOCK, ALIGNED=self.aligned, STEPS=self.STEPS, MASKED=masked, num_warps=self.BLOCK // 32)
