"""GPU decoding of Huffman-coded bf16 exponents (esftctl.huffman's format) straight into bf16 tensors.

One launch decodes any set of stored tensors into any destinations (for paging: the mapped rows of a
layer's virtual weight tensors). Every chunk of every tensor becomes one lane, described by five numbers:
its absolute bit position in the store's data on the device, where its sign-and-mantissa bytes start,
the device address of its first output value, how many values it holds, and its code table.

A lane keeps its next bits in a 64-bit register, refilled from aligned 32-bit words only when fewer than
MAX_LENGTH bits remain. Each step looks up the next MAX_LENGTH bits in a multi-symbol table
(esftctl.huffman.multi_symbol_table): every whole code at the window's front, up to four, with the bits
they use; at about 2.6 bits per exponent one dependent lookup yields about four values. Those values are
joined with their sign-and-mantissa bytes and written as up to four contiguous bf16 values per lane.

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
    def _bswap32(x):
        """The stream is MSB-first bytes: a little-endian 32-bit load reads them reversed."""
        return ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | ((x >> 24) & 0xFF)

    @triton.jit
    def _decode_chunks_kernel(words_ptr, data_ptr, multi_ptr, bit_ptr, sm_ptr, dst_ptr, len_ptr, table_ptr,
                              n_chunks, WIDTH: tl.constexpr, MOST: tl.constexpr, BLOCK: tl.constexpr):
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < n_chunks
        bit = tl.load(bit_ptr + lanes, mask=ok, other=0)
        sm_at = tl.load(sm_ptr + lanes, mask=ok, other=0)
        out = tl.load(dst_ptr + lanes, mask=ok, other=0).to(tl.pointer_type(tl.int16))
        n = tl.load(len_ptr + lanes, mask=ok, other=0)
        base = tl.load(table_ptr + lanes, mask=ok, other=0).to(tl.int64) << WIDTH
        # A 64-bit register holds the next bits, MSB-aligned; refilled 32 bits at a time from aligned words.
        word = bit >> 5
        first = _bswap32(tl.load(words_ptr + word, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
        buf = (first << 32) << (bit & 31).to(tl.uint64)
        nbits = 32 - (bit & 31).to(tl.int32)
        word += 1
        done = tl.where(ok, 0, n)
        k = tl.arange(0, MOST)
        while tl.max(n - done, axis=0) > 0:
            active = done < n
            need = active & (nbits < WIDTH)
            w = _bswap32(tl.load(words_ptr + word, mask=need, other=0).to(tl.uint32)).to(tl.uint64)
            buf = tl.where(need, buf | (w << (32 - nbits).to(tl.uint64)), buf)
            nbits = tl.where(need, nbits + 32, nbits)
            word = tl.where(need, word + 1, word)
            # One lookup yields every whole code at the front of the window (about four exponents).
            entry = tl.load(multi_ptr + base + (buf >> (64 - WIDTH)).to(tl.int64), mask=active, other=0)
            count = ((entry >> 32) & 0xF).to(tl.int32)
            used = ((entry >> 36) & 0x1F).to(tl.int32)
            take = tl.minimum(count, n - done)
            mask = active[:, None] & (k[None, :] < take[:, None])
            symbols = ((entry & 0xFFFFFFFF)[:, None] >> (8 * k)[None, :].to(tl.int64)).to(tl.int32) & 0xFF
            at = done[:, None] + k[None, :]
            sm = tl.load(data_ptr + sm_at[:, None] + at, mask=mask, other=0).to(tl.int32)
            bits = ((sm & 0x80) << 8) | (symbols << 7) | (sm & 0x7F)
            tl.store(out[:, None] + at, bits.to(tl.int16), mask=mask)
            buf = buf << tl.where(active, used, 0).to(tl.uint64)
            nbits -= tl.where(active, used, 0)
            # A window with no whole code can only be bits past the stream's end: stop that lane.
            done = tl.where(active & (count == 0), n, done + tl.where(active, take, 0))

except ImportError:
    triton = None


MOST = 4  # symbols per lookup (esftctl.huffman.multi_symbol_table)


class DecodePlan:
    """Chunk descriptors for decoding a set of tensors into fixed destinations, ready on the device."""

    BLOCK = 128  # lanes per program: one per thread with 4 warps

    def __init__(self, data: torch.Tensor, tables: torch.Tensor, chunk: int, descriptors: dict[str, torch.Tensor],
                 keepalive: list[torch.Tensor]):
        if data.numel() % 4:
            raise ValueError("the data buffer must hold whole 32-bit words")
        self.data, self.tables, self.chunk = data, tables, chunk
        self.words = data.view(torch.int32)
        self.d = descriptors
        self._keepalive = keepalive  # the destinations: their addresses are baked into the descriptors
        self.n_chunks = int(descriptors["bits"].numel())

    def run(self) -> None:
        if triton is None:
            raise RuntimeError("GPU decoding needs Triton")
        if self.n_chunks == 0:
            return
        _decode_chunks_kernel[(triton.cdiv(self.n_chunks, self.BLOCK),)](
            self.words, self.data, self.tables, self.d["bits"], self.d["sm"], self.d["dst"], self.d["len"],
            self.d["table"], self.n_chunks, WIDTH=MAX_LENGTH, MOST=MOST, BLOCK=self.BLOCK, num_warps=self.BLOCK // 32)
