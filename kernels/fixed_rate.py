"""A fixed-rate bf16 code (SplitZip's idea) beside the Huffman store: measured, not yet a store format.

Why: paging decodes a whole layer of experts per step at batch 32 and up, and the Huffman decoder reaches 59% of
the memory-bandwidth bound on an H100 (benchmarks/RESULTS.md, 2026-11-23): each lane's next code starts where
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
Expert weights use 10-14 distinct exponents in practice, so escapes are rare (a few per million).

`decode_reference` is the plain PyTorch decoder; `decode` the Triton kernel, one program per block: unpack the
nibbles, look the codes up in the table, and only in a block that has escapes (a scalar branch: most have none)
take them at their rank (a prefix sum within the block); join with `sm`. `FixedRate.check` bounds everything the
kernel reads by what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

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
