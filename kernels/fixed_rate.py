"""A fixed-rate bf16 code (SplitZip's idea) beside the Huffman store: paging's second compressed GPU tier.

Why: paging decodes a whole layer of experts per step at batch 32 and up, and the Huffman decoder reaches 59% of
the memory-bandwidth bound on an H100 (benchmarks/RESULTS.md, Expert stores against DFloat11): each lane's next
code starts where
the last one ended, so lookups are a dependent chain. SplitZip (public, MIT) decodes bf16 at about 2.18 TB/s
with fixed-length exponent codes, so every value's code sits at a known place and a value decodes with no
chain at all. The price is size: about 75% of bf16 against Huffman's 67.7%.

The code, for n bf16 values (sign s, exponent e, mantissa m):
- `sm`: n bytes, (s << 7) | m, as the Huffman store keeps them;
- `codes`: n / 2 bytes, a 4-bit code per value (value 2j in byte j's low nibble, 2j + 1 in its high one): the
  index of e among the tensor's 15 most frequent exponents (`table`, most frequent first), or 15 = escape;
- `escapes`: the escaped values' exponents, one byte each, in value order;
- `starts`: int32, for every `block` values (BLOCK by default) the number of escapes before them (and the total
  at the end), so a program decoding one block finds its escapes without looking at any other block.
Expert weights use 10-14 distinct exponents in practice, so escapes are rare: a few hundred a million on
trained-like weights, few in a 1,024-value block but in most of a GEMM's tiles.

Paging keeps it per expert row (`FixedRows`, `encode_rows` with torch ops on the GPU at serving start-up,
`decode_rows`: one masked launch per tensor of a layer; `serve --paging-codec fixed`, esftctl.runtime.paging.tiers).

`decode_reference` is the plain PyTorch decoder; `decode` the Triton kernel, one program per block: unpack the
nibbles, look the codes up in the table, and only in a block that has escapes (a scalar branch: most have none)
take them at their rank (a prefix sum within the block); join with `sm`. `FixedRate.check` bounds everything the
kernel reads by what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BLOCK = 1024  # values a decode program (and an escape count in `starts`) covers: the fastest on an H100
ESCAPE = 15


@dataclass(frozen=True)
class FixedRate:
    count: int
    block: int  # values per escape count (and per decode program): a power of two
    table: torch.Tensor  # uint8 [16], entry 15 unused
    sm: torch.Tensor  # uint8 [count]
    codes: torch.Tensor  # uint8 [ceil(count / 2)]
    escapes: torch.Tensor  # uint8 [escapes]
    starts: torch.Tensor  # int32 [ceil(count / BLOCK) + 1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.table, self.sm, self.codes, self.escapes, self.starts))

    def check(self) -> None:
        """ValueError unless every read of the decoders stays inside these buffers."""
        if self.block < 2 or self.block & (self.block - 1):
            raise ValueError(f"fixed-rate block of {self.block!r} values: a power of two")
        blocks = -(-self.count // self.block)
        shapes = {"table": (self.table, 16, torch.uint8), "sm": (self.sm, self.count, torch.uint8),
                  "codes": (self.codes, -(-self.count // 2), torch.uint8),
                  "starts": (self.starts, blocks + 1, torch.int32)}
        for name, (t, n, dtype) in shapes.items():
            if t.dtype != dtype or t.dim() != 1 or t.numel() != n:
                raise ValueError(f"fixed-rate {name}: {t.dtype} x {t.numel()}, expected {dtype} x {n}")
        if self.escapes.dtype != torch.uint8 or self.escapes.dim() != 1:
            raise ValueError("fixed-rate escapes must be uint8 bytes")
        starts = self.starts.cpu().long()
        codes = self.codes.cpu()
        per_block = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:self.count] == ESCAPE
        per_block = torch.nn.functional.pad(per_block.long(), (0, blocks * self.block - self.count))
        per_block = per_block.view(blocks, self.block)
        want = torch.cat([torch.zeros(1, dtype=torch.long), per_block.sum(1).cumsum(0)])
        if not torch.equal(starts, want) or int(want[-1]) != self.escapes.numel():
            raise ValueError("fixed-rate escape counts do not match the codes")

    def to(self, device) -> "FixedRate":
        return FixedRate(self.count, self.block, *(t.to(device) for t in (self.table, self.sm, self.codes, self.escapes,
                                                                self.starts)))


def encode(values: torch.Tensor, *, block: int = BLOCK) -> FixedRate:
    """The fixed-rate code of a bf16 tensor's values (flattened), on the CPU."""
    if values.dtype != torch.bfloat16:
        raise ValueError(f"fixed-rate codes take bf16 values, not {values.dtype}")
    bits = values.detach().reshape(-1).cpu().view(torch.int16).to(torch.int32) & 0xFFFF
    n = bits.numel()
    exps = (bits >> 7) & 0xFF
    order = torch.argsort(torch.bincount(exps, minlength=256), descending=True, stable=True)[:ESCAPE]
    code_of = torch.full((256,), ESCAPE, dtype=torch.int32)
    code_of[order] = torch.arange(ESCAPE, dtype=torch.int32)
    codes = code_of[exps]
    escaped = codes == ESCAPE
    padded = torch.nn.functional.pad(codes, (0, n % 2))
    packed = (padded[0::2] | (padded[1::2] << 4)).to(torch.uint8)
    blocks = -(-n // block)
    per_block = torch.nn.functional.pad(escaped.to(torch.int32), (0, blocks * block - n)).view(blocks, block).sum(1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), per_block.cumsum(0)]).to(torch.int32)
    table = torch.cat([order.to(torch.uint8), torch.zeros(1, dtype=torch.uint8)])
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return FixedRate(n, block, table, sm, packed, exps[escaped].to(torch.uint8), starts)


def decode_reference(code: FixedRate) -> torch.Tensor:
    """The bf16 values (flat), in plain PyTorch."""
    codes = code.codes.long()
    codes = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:code.count]
    exps = code.table.long()[codes]
    exps[codes == ESCAPE] = code.escapes.long()
    sm = code.sm.long()
    bits = ((sm & 0x80) << 8) | (exps << 7) | (sm & 0x7F)
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16) if bits.numel() else \
        torch.empty(0, dtype=torch.bfloat16)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_kernel(table_ptr, sm_ptr, codes_ptr, escapes_ptr, starts_ptr, out_ptr, n, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        pairs = start // 2 + tl.arange(0, BLOCK // 2)
        byte = tl.load(codes_ptr + pairs, mask=pairs < (n + 1) // 2, other=0).to(tl.int32)
        code = tl.interleave(byte & 15, byte >> 4)  # value 2j's code is byte j's low nibble
        offsets = start + tl.arange(0, BLOCK)
        ok = offsets < n
        exp = tl.load(table_ptr + code).to(tl.int32)
        first = tl.load(starts_ptr + tl.program_id(0))
        if tl.load(starts_ptr + tl.program_id(0) + 1) > first:  # this block has escapes
            escaped = ok & (code == 15)
            rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
            exp = tl.where(escaped, tl.load(escapes_ptr + first + rank, mask=escaped, other=0).to(tl.int32), exp)
        sm = tl.load(sm_ptr + offsets, mask=ok, other=0).to(tl.int32)
        bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        tl.store(out_ptr + offsets, bits.to(tl.int16), mask=ok)

except ImportError:
    triton = None


def decode(code: FixedRate, out: torch.Tensor, *, num_warps: int = 4) -> None:
    """Decode into `out` (contiguous bf16 on the GPU, `count` values): one launch, no host work, capturable.
    The code must be on out's device and checked (`check`) once before."""
    if triton is None:
        raise RuntimeError("GPU decoding needs Triton")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() != code.count:
        raise ValueError(f"decode into {code.count} contiguous bf16 values")
    if code.count:
        escapes = code.escapes if code.escapes.numel() else code.table  # a real address even with no escapes
        _decode_kernel[(triton.cdiv(code.count, code.block),)](code.table, code.sm, code.codes, escapes,
                                                               code.starts, out.view(torch.int16), code.count,
                                                               BLOCK=code.block, num_warps=num_warps)


# ---- a layer's rows: the batched code the paging tier keeps (esftctl.runtime.paging.tiers.FixedTier) ----------
#
# One code per expert row of a tensor (w13 row [2I, H], w2 row [H, I]), all rows of a tensor in regular arrays, so
# a decode is one launch over a (blocks per row, rows) grid with no descriptor table, and a program whose row the
# step does not need (or that the host tier delivers: at/after `first_host`) ends at once. A DeepSeek-V2-Lite
# layer's w13 is 64 rows of 5.8M values: 5.6K blocks a row, 16 escapes a row at most in practice.

ENCODE_ROWS_AT_ONCE = 8  # rows encoded together: bounds the temporaries
ENCODE_BYTES_PER_VALUE = 40  # temporaries per value of those rows (int32 and int64 work): 1.9 GB for 8 w13 rows


@dataclass(frozen=True)
class FixedRows:
    count: int  # values per row
    block: int  # values per decode program and escape count: a power of two
    table: torch.Tensor  # uint8 [rows, 16]
    sm: torch.Tensor  # uint8 [rows, count]
    codes: torch.Tensor  # uint8 [rows, ceil(count / 2)]
    escapes: torch.Tensor  # uint8 [escapes], every row's in row order
    base: torch.Tensor  # int64 [rows]: where a row's escapes start in `escapes`
    starts: torch.Tensor  # int32 [rows, blocks + 1]: escapes of the row before each block (the row's total last)

    @property
    def rows(self) -> int:
        return self.sm.shape[0]

    @property
    def nbytes(self) -> int:
        parts = (self.table, self.sm, self.codes, self.escapes, self.base, self.starts)
        return sum(t.numel() * t.element_size() for t in parts)

    def over_the_bus(self) -> "FixedRows":
        """The code with its sign-mantissa bytes and exponent codes (0.75 of bf16's bytes) in pinned host memory, which
        the GPU's decoder reads over the bus through zero-copy views (esftctl.kernels.row_fetch.mapped_on_device), its
        small tables left where they are; a code off the GPU as it is (no bus to cross)."""
        if self.sm.device.type != "cuda":
            return self
        from esftctl.kernels.row_fetch import mapped_on_device

        return replace(self, **{name: mapped_on_device(getattr(self, name).cpu().pin_memory(), self.sm.device)
                                for name in ("sm", "codes")})

    def row(self, r: int) -> FixedRate:
        """Row r as a single code (for the references and `check`)."""
        n = int(self.starts[r, -1])
        at = int(self.base[r])
        return FixedRate(self.count, self.block, self.table[r], self.sm[r], self.codes[r],
                         self.escapes[at:at + n], self.starts[r])

    def check(self) -> None:
        """ValueError unless every read of the batched decoder stays inside these buffers."""
        rows, blocks = self.rows, -(-self.count // self.block)
        shapes = {"table": (self.table, (rows, 16), torch.uint8), "sm": (self.sm, (rows, self.count), torch.uint8),
                  "codes": (self.codes, (rows, -(-self.count // 2)), torch.uint8),
                  "base": (self.base, (rows,), torch.int64), "starts": (self.starts, (rows, blocks + 1), torch.int32)}
        for name, (t, shape, dtype) in shapes.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"fixed-rate rows {name}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        totals = self.starts[:, -1].cpu().long()
        want = torch.cat([torch.zeros(1, dtype=torch.long), totals.cumsum(0)])
        if not torch.equal(self.base.cpu(), want[:-1]) or int(want[-1]) != self.escapes.numel():
            raise ValueError("fixed-rate rows: escape bases do not match the rows' escape counts")
        for r in range(rows):
            self.row(r).check()


def _encode_chunk(bits: torch.Tensor, block: int):
    """The codes of a few rows at once ([r, n] int32 bf16 bits), with torch ops on their device."""
    r, n = bits.shape
    exps = (bits >> 7) & 0xFF
    counts = torch.zeros(r, 256, dtype=torch.int64, device=bits.device).scatter_add_(
        1, exps.long(), torch.ones_like(exps, dtype=torch.int64))
    order = torch.argsort(counts, dim=1, descending=True, stable=True)[:, :ESCAPE]  # ties by exponent, as `encode`
    code_of = torch.full((r, 256), ESCAPE, dtype=torch.int32, device=bits.device)
    code_of.scatter_(1, order, torch.arange(ESCAPE, dtype=torch.int32, device=bits.device).expand(r, ESCAPE))
    codes = torch.gather(code_of, 1, exps.long())
    escaped = codes == ESCAPE
    padded = torch.nn.functional.pad(codes, (0, n % 2))
    packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).to(torch.uint8)
    blocks = -(-n // block)
    per_block = torch.nn.functional.pad(escaped.to(torch.int32), (0, blocks * block - n)).view(r, blocks, block).sum(2)
    starts = torch.nn.functional.pad(per_block.cumsum(1), (1, 0)).to(torch.int32)
    table = torch.nn.functional.pad(order.to(torch.uint8), (0, 1))
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return table, sm, packed, exps[escaped].to(torch.uint8), starts


def encode_rows(values: torch.Tensor, *, block: int = BLOCK, rows_at_once: int = ENCODE_ROWS_AT_ONCE) -> FixedRows:
    """The fixed-rate code of each row of a bf16 tensor ([rows, ...]: each row flattened), on its own device (the
    GPU at serving start-up): row r's code is `encode(values[r])`'s."""
    if values.dtype != torch.bfloat16 or values.dim() < 1:
        raise ValueError(f"fixed-rate codes take bf16 rows, not {values.dtype} {tuple(values.shape)}")
    if block < 2 or block & (block - 1):
        raise ValueError(f"fixed-rate block of {block!r} values: a power of two")
    flat = values.detach().reshape(values.shape[0], -1)
    parts = [_encode_chunk(flat[r:r + rows_at_once].view(torch.int16).to(torch.int32) & 0xFFFF, block)
             for r in range(0, flat.shape[0], rows_at_once)]
    table, sm, codes, escapes, starts = (torch.cat([p[k] for p in parts]) if parts else None for k in range(5))
    if not parts:
        raise ValueError("fixed-rate codes need at least one row")
    base = torch.nn.functional.pad(starts[:, -1].long().cumsum(0), (1, 0))[:-1].contiguous()
    return FixedRows(flat.shape[1], block, table, sm, codes, escapes, base, starts)


def decode_rows_reference(code: FixedRows, rows) -> torch.Tensor:
    """The given rows' bf16 values ([len(rows), count]), in plain PyTorch."""
    out = [decode_reference(code.row(r).to("cpu")) for r in rows]
    return torch.stack(out) if out else torch.empty(0, code.count, dtype=torch.bfloat16)


if triton is not None:
    @triton.jit
    def _decode_rows_kernel(table_ptr, sm_ptr, codes_ptr, escapes_ptr, base_ptr, starts_ptr, out_ptr, out_stride,
                            needed_ptr, first_host_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        # Paging: only rows this step needs, below the host tier's first row; the others' programs end here.
        if (tl.load(needed_ptr + row) != 0) & (row < tl.load(first_host_ptr)):
            blocks = (n + BLOCK - 1) // BLOCK
            half = (n + 1) // 2
            for step in range(STEPS):  # STEPS blocks a program: fewer programs that end at once for unneeded rows
                blk = tl.program_id(0) * STEPS + step
                if blk < blocks:
                    start = blk.to(tl.int64) * BLOCK
                    pairs = start // 2 + tl.arange(0, BLOCK // 2)
                    byte = tl.load(codes_ptr + row * half + pairs, mask=pairs < half, other=0).to(tl.int32)
                    code = tl.interleave(byte & 15, byte >> 4)
                    offsets = start + tl.arange(0, BLOCK)
                    ok = offsets < n
                    exp = tl.load(table_ptr + row * 16 + code).to(tl.int32)
                    starts = starts_ptr + row * (blocks + 1) + blk
                    first = tl.load(starts)
                    if tl.load(starts + 1) > first:  # this block has escapes
                        escaped = ok & (code == 15)
                        rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
                        at = tl.load(base_ptr + row) + first + rank
                        exp = tl.where(escaped, tl.load(escapes_ptr + at, mask=escaped, other=0).to(tl.int32), exp)
                    sm = tl.load(sm_ptr + row * n + offsets, mask=ok, other=0).to(tl.int32)
                    bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
                    tl.store(out_ptr + row * out_stride + offsets, bits.to(tl.int16), mask=ok)


ROW_STEPS = 8  # blocks one program of the row decoder covers. With one, a DeepSeek-V2-Lite layer's unneeded rows
# still start and end 540K programs; with eight, 68K: a batch-1 masked decode (6 rows of 64) took a third of the time
# it took with one (16 no faster, 32 slower), a whole one the same either way, and `bench paging`'s fixed tier at batch
# 1 twice as fast. Eight: an H200 decodes 6 rows of 64 in 0.109 ms, every row in 0.780 ms (benchmarks/RESULTS.md,
# Expert stores against DFloat11).


def decode_rows(code: FixedRows, out: torch.Tensor, needed: torch.Tensor | None = None,
                first_host: torch.Tensor | None = None, *, num_warps: int = 4, steps: int = ROW_STEPS) -> None:
    """Decode every row into `out` ([rows, ...] bf16 on the GPU, each row's `count` values contiguous), or (paging)
    only rows r with needed[r] != 0 and r < first_host[0] (int32, read on the device: capturable, and a captured
    launch follows their later values). The code must be on out's device and checked (`check`) once before."""
    if triton is None:
        raise RuntimeError("GPU decoding needs Triton")
    rows = code.rows
    if out.dtype != torch.bfloat16 or out.shape[0] != rows or out[0].numel() != code.count or \
            not out[0].is_contiguous():
        raise ValueError(f"decode into {rows} rows of {code.count} contiguous bf16 values")
    if (needed is None) != (first_host is None):
        raise ValueError("a masked decode needs both `needed` and `first_host`")
    if needed is not None and (needed.dtype != torch.int32 or needed.numel() < rows or first_host.numel() != 1
                               or first_host.dtype != torch.int32):
        raise ValueError(f"`needed` must be int32 marks for at least {rows} rows, `first_host` one int32")
    escapes = code.escapes if code.escapes.numel() else code.table  # a real address even with no escapes
    if needed is None:  # every row: one kernel for both (a whole decode is no hot path)
        needed = torch.ones(rows, dtype=torch.int32, device=out.device)
        first_host = torch.full((1,), rows, dtype=torch.int32, device=out.device)
    grid = (triton.cdiv(triton.cdiv(code.count, code.block), steps), rows)
    _decode_rows_kernel[grid](code.table, code.sm, code.codes, escapes, code.base, code.starts, out.view(torch.int16),
                              out.stride(0), needed, first_host, code.count, BLOCK=code.block, STEPS=steps,
                              num_warps=num_warps)
