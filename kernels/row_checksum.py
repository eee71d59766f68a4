"""Checksums of expert rows, the check that a loaded adapter's rows hold what was staged, in one launch per part.

    checksum(row) = sum over the parts p (w13, w2, FP8 scales, biases), over the row's 16-bit words w_i of p:
                    int64(w_i) * (1 + i mod 251)

so a changed, missing or moved value, or another row, changes it, whatever the dtype (esftctl.runtime.moe_layer's
stage and check_rows take it on the staged rows and on the rows the kernel reads). `row_checksums_reference` is
the definition and the CPU path: one row at a time, its weighted copy the only temporary, and about six small
launches per row and part: a third of the runtime's time in a warm load of a 2.47 GiB adapter on an H100
(benchmarks/lab/load_cost.py measures it). The kernel reads the chosen rows of a part once: each
program sums BLOCK words of one row and writes that partial sum, and one torch sum per part adds a row's partial
sums (no atomics: the same bits every run), with no temporary beyond those sums (R x ceil(words / BLOCK) int64).
"""

from __future__ import annotations

from typing import Callable

import torch

BLOCK = 4096  # 16-bit words a program sums: a DeepSeek-V2-Lite w13 row (5.8 M words) is 1,408 programs
_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as 16-bit words (a zero byte after an odd count)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16)


def row_checksums_reference(*parts: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the checksum of each row of parts [n, ...] (any layout, any dtype), int64 [n]."""
    first = parts[0]
    out = torch.empty(first.shape[0], dtype=torch.int64, device=first.device)
    for k in range(first.shape[0]):
        total = torch.zeros((), dtype=torch.int64, device=first.device)
        for t in (p[k] for p in parts):
            words = _words(t)
            key = (words.numel(), words.device)
            if key not in _WEIGHTS:
                _WEIGHTS[key] = (torch.arange(words.numel(), device=words.device) % 251 + 1).to(torch.int32)
            total += (words.to(torch.int64) * _WEIGHTS[key]).sum()
        out[k] = total
    return out


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_sums_kernel(address_ptr, rows_ptr, row_stride, n_words, out_ptr, n_blocks, BLOCK: tl.constexpr):
        """Program (r, b): words [b BLOCK, (b + 1) BLOCK) of row rows[r] of the part at *address_ptr (device
        memory, or pinned host memory read over the bus)."""
        words_ptr = tl.load(address_ptr).to(tl.pointer_type(tl.int16))
        r, b = tl.program_id(0), tl.program_id(1)
        row = tl.load(rows_ptr + r).to(tl.int64)
        offsets = b * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_words
        words = tl.load(words_ptr + row * row_stride + offsets, mask=mask, other=0).to(tl.int64)
        weights = (offsets % 251 + 1).to(tl.int64)
        tl.store(out_ptr + r * n_blocks + b, tl.sum(words * weights, axis=0))

except ImportError:  # the CPU build has no Triton: row_checksums() uses the reference there
    triton = None


def _row_words(part: torch.Tensor) -> torch.Tensor | None:
    """part [n, ...] as int16 words [n, words per row], a view (rows may be strided, each row's own values must
    be contiguous), or None where it cannot be one (an odd byte count, a row not contiguous)."""
    if part.dim() == 0 or part.shape[0] == 0 or not part[0].is_contiguous():
        return None
    flat = torch.as_strided(part, (part.shape[0], part[0].numel()), (part.stride(0), 1), part.storage_offset())
    try:
        return flat.view(torch.uint8).view(torch.int16)
    except RuntimeError:  # odd bytes a row, or an odd row stride or offset in bytes
        return None


def row_checksums(*parts: torch.Tensor, rows: list[int] | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The checksums (int64 [len(rows)], on `device`, default the parts') of `rows` (default: every row) of parts
    [n, ...]: the kernel on a GPU, which reads parts in pinned host memory over the bus (a load's staged rows: no
    copy, no device memory), the reference elsewhere or for a part it cannot read as words."""
    first = parts[0]
    device = torch.device(device) if device is not None else first.device
    chosen = list(range(first.shape[0])) if rows is None else [int(r) for r in rows]
    if any(not 0 <= r < first.shape[0] for r in chosen) or any(p.shape[0] != first.shape[0] for p in parts):
        raise ValueError(f"rows {chosen} of parts with {[p.shape[0] for p in parts]} rows")
    if device.type == "cuda" and triton is not None and chosen and all(
            _row_words(p) is not None and (p.device == device or p.is_pinned()) for p in parts):
        return row_checksums_kernel(*parts, rows=chosen, device=device, address=_address)
    if rows is None:  # every row: read in place, one at a time
        return row_checksums_reference(*parts).to(device)
    index = torch.tensor(chosen, dtype=torch.long, device=first.device)
    return row_checksums_reference(*(p.index_select(0, index) for p in parts)).to(device)


def _address(t: torch.Tensor) -> int:
    """Where a GPU kernel reads t: its own address on the device, pinned host memory's mapped one."""
    from esftctl.kernels.row_fetch import host_device_pointer

    return t.data_ptr() if t.is_cuda else host_device_pointer(t)


def row_checksums_kernel(*parts: torch.Tensor, rows: list[int], device: torch.device,
                         address: Callable[[torch.Tensor], int]) -> torch.Tensor:
    """The kernel's checksums of `rows` (checked, at least one) of parts that _row_words can read, at
    `address(words)` from `device`: one launch and one sum per part. Under TRITON_INTERPRET=1 the tests run it on
    CPU tensors at their host addresses."""
    words = [_row_words(p) for p in parts]
    addresses = torch.tensor([address(w) for w in words], dtype=torch.int64).to(device)
    index = torch.tensor(rows, dtype=torch.int64).to(device)
    total = torch.zeros(len(rows), dtype=torch.int64, device=device)
    for k, w in enumerate(words):
        n_words = w.shape[1]
        n_blocks = triton.cdiv(max(n_words, 1), BLOCK)
        partial = torch.empty(len(rows) * n_blocks, dtype=torch.int64, device=device)
        _row_sums_kernel[(len(rows), n_blocks)](addresses[k:], index, w.stride(0), n_words, partial, n_blocks,
                                                BLOCK=BLOCK)
        total += partial.view(len(rows), n_blocks).sum(1)
    return total
