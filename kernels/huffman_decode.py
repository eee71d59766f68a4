"""GPU decoding of Huffman-coded bf16 exponents (esftctl.huffman's format) straight into bf16 tensors.

One launch decodes any set of stored tensors into any destinations (for paging: the mapped rows of a
layer's virtual weight tensors). Every chunk of every tensor becomes one lane, described by five numbers:
its absolute bit position in the store's data on the device, where its sign-and-mantissa bytes start,
the device address of its first output value, how many values it holds, and its code table. A lane
decodes one value per step: it peeks MAX_LENGTH bits (from 3 bytes), resolves the symbol with one lookup
in its table (entry = symbol | length << 8; 16 KiB per table, cache-resident), joins it with the
sign-and-mantissa byte and writes the final bf16 bit pattern.

The plain reference is the CPU decoder (esftctl.huffman.decode + join_bf16); the tests compare the two.
A DecodePlan holds the descriptors on the device, so `run()` is one launch with no host work, and can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from esftctl.huffman import MAX_LENGTH

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_chunks_kernel(data_ptr, tables_ptr, bit_ptr, sm_ptr, dst_ptr, len_ptr, table_ptr, n_chunks,
                              CHUNK: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < n_chunks
        pos = tl.load(bit_ptr + lanes, mask=ok, other=0)
        sm_at = tl.load(sm_ptr + lanes, mask=ok, other=0)
        out = tl.load(dst_ptr + lanes, mask=ok, other=0).to(tl.pointer_type(tl.int16))
        n = tl.load(len_ptr + lanes, mask=ok, other=0)
        table = tl.load(table_ptr + lanes, mask=ok, other=0).to(tl.int64) << WIDTH
        for step in range(0, CHUNK):
            live = ok & (step < n)
            byte = pos >> 3
            b0 = tl.load(data_ptr + byte, mask=live, other=0).to(tl.uint32)
            b1 = tl.load(data_ptr + byte + 1, mask=live, other=0).to(tl.uint32)
            b2 = tl.load(data_ptr + byte + 2, mask=live, other=0).to(tl.uint32)
            window = (b0 << 16) | (b1 << 8) | b2
            peek = (window >> (24 - WIDTH - (pos & 7)).to(tl.uint32)) & ((1 << WIDTH) - 1)
            entry = tl.load(tables_ptr + table + peek, mask=live, other=0)
            sm = tl.load(data_ptr + sm_at + step, mask=live, other=0).to(tl.int32)
            bits = ((sm & 0x80) << 8) | ((entry & 0xFF) << 7) | (sm & 0x7F)
            tl.store(out + step, bits.to(tl.int16), mask=live)
            pos += tl.where(live, entry >> 8, 0)

except ImportError:
    triton = None


class DecodePlan:
    """Chunk descriptors for decoding a set of tensors into fixed destinations, ready on the device."""

    BLOCK = 32

    def __init__(self, data: torch.Tensor, tables: torch.Tensor, chunk: int, descriptors: dict[str, torch.Tensor],
                 keepalive: list[torch.Tensor]):
        self.data, self.tables, self.chunk = data, tables, chunk
        self.d = descriptors
        self._keepalive = keepalive  # the destinations: their addresses are baked into the descriptors
        self.n_chunks = int(descriptors["bits"].numel())

    def run(self) -> None:
        if triton is None:
            raise RuntimeError("GPU decoding needs Triton")
        if self.n_chunks == 0:
            return
        _decode_chunks_kernel[(triton.cdiv(self.n_chunks, self.BLOCK),)](
            self.data, self.tables, self.d["bits"], self.d["sm"], self.d["dst"], self.d["len"], self.d["table"],
            self.n_chunks, CHUNK=self.chunk, WIDTH=MAX_LENGTH, BLOCK=self.BLOCK)
