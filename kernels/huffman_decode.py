"""GPU decoding of Huffman-coded bf16 exponents (esftctl.huffman's format) straight into bf16 tensors.

One launch decodes any set of stored tensors into any destinations (for paging: the mapped rows of a
layer's virtual weight tensors). Every chunk of every tensor becomes one lane, described by five numbers:
its absolute bit position in the store's data on the device, where its sign-and-mantissa bytes start,
the device address of its first output value, how many values it holds, and its code table.

A lane keeps its next bits in a 64-bit register, refilled from aligned 32-bit words only when fewer than
MAX_LENGTH bits remain (about every twelve values at 2.6 bits each). It resolves a value with one lookup
in a 256-entry first-level table (codes of up to 8 bits, nearly all), falling back to the full
2**MAX_LENGTH table for longer codes (entry = symbol | length << 8). Values are decoded GROUP at a time
per lane and then joined with their sign-and-mantissa bytes and written as GROUP contiguous bf16 values,
so loads of those bytes and the stores are contiguous per lane rather than one scattered value per step.

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
    def _decode_chunks_kernel(words_ptr, data_ptr, fast_ptr, tables_ptr, bit_ptr, sm_ptr, dst_ptr, len_ptr,
                              table_ptr, n_chunks, CHUNK: tl.constexpr, WIDTH: tl.constexpr, FAST: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK: tl.constexpr):
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < n_chunks
        bit = tl.load(bit_ptr + lanes, mask=ok, other=0)
        sm_at = tl.load(sm_ptr + lanes, mask=ok, other=0)
        out = tl.load(dst_ptr + lanes, mask=ok, other=0).to(tl.pointer_type(tl.int16))
        n = tl.load(len_ptr + lanes, mask=ok, other=0)
        which = tl.load(table_ptr + lanes, mask=ok, other=0).to(tl.int64)
        fast_base, full_base = which << FAST, which << WIDTH
        # A 64-bit register holds the next bits, MSB-aligned; refilled 32 bits at a time from aligned words.
        word = bit >> 5
        first = _bswap32(tl.load(words_ptr + word, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
        buf = (first << 32) << (bit & 31).to(tl.uint64)
        nbits = 32 - (bit & 31).to(tl.int32)
        word += 1
        cols = tl.arange(0, GROUP)
        for g in range(0, CHUNK, GROUP):
            # Four symbols per 32-bit register (GROUP <= 16), unpacked into a [BLOCK, GROUP] tile once per group.
            p0 = tl.zeros([BLOCK], dtype=tl.int32)
            p1 = tl.zeros([BLOCK], dtype=tl.int32)
            p2 = tl.zeros([BLOCK], dtype=tl.int32)
            p3 = tl.zeros([BLOCK], dtype=tl.int32)
            for j in tl.static_range(GROUP):
                active = ok & (g + j < n)
                need = active & (nbits < WIDTH)
                w = _bswap32(tl.load(words_ptr + word, mask=need, other=0).to(tl.uint32)).to(tl.uint64)
                buf = tl.where(need, buf | (w << (32 - nbits).to(tl.uint64)), buf)
                nbits = tl.where(need, nbits + 32, nbits)
                word = tl.where(need, word + 1, word)
                # Codes of up to FAST bits (nearly all) resolve in a 256-entry table; longer ones in the full one.
                entry = tl.load(fast_ptr + fast_base + (buf >> (64 - FAST)).to(tl.int64), mask=active,
                                other=0).to(tl.int32)
                slow = active & ((entry >> 8) == 0)
                full = tl.load(tables_ptr + full_base + (buf >> (64 - WIDTH)).to(tl.int64), mask=slow, other=0)
                entry = tl.where(slow, full, entry)
                length = tl.where(active, entry >> 8, 0)
                buf = buf << length.to(tl.uint64)
                nbits -= length
                symbol = (entry & 0xFF) << (8 * (j % 4))
                if j // 4 == 0:
                    p0 |= symbol
                elif j // 4 == 1:
                    p1 |= symbol
                elif j // 4 == 2:
                    p2 |= symbol
                else:
                    p3 |= symbol
            quarter = (cols // 4)[None, :]
            packed = tl.where(quarter == 0, p0[:, None], tl.where(quarter == 1, p1[:, None],
                              tl.where(quarter == 2, p2[:, None], p3[:, None])))
            symbols = (packed >> (8 * (cols % 4))[None, :]) & 0xFF
            index = g + cols
            live = ok[:, None] & (index[None, :] < n[:, None])
            sm = tl.load(data_ptr + sm_at[:, None] + index[None, :], mask=live, other=0).to(tl.int32)
            bits = ((sm & 0x80) << 8) | (symbols << 7) | (sm & 0x7F)
            tl.store(out[:, None] + index[None, :], bits.to(tl.int16), mask=live)

except ImportError:
    triton = None


FAST_WIDTH = 8  # bits of the first-level table


def fast_table(full: torch.Tensor) -> torch.Tensor:
    """[tables, 2**MAX_LENGTH] entries -> [tables, 2**FAST_WIDTH] int16 entries for codes of <= FAST_WIDTH
    bits, 0 (length 0) where the code is longer and the full table must be read."""
    step = 1 << (MAX_LENGTH - FAST_WIDTH)
    sampled = full[:, ::step]
    return torch.where((sampled >> 8) <= FAST_WIDTH, sampled, torch.zeros_like(sampled)).to(torch.int16)


class DecodePlan:
    """Chunk descriptors for decoding a set of tensors into fixed destinations, ready on the device."""

    BLOCK = 128  # lanes per program: one per thread with 4 warps
    GROUP = 16

    def __init__(self, data: torch.Tensor, tables: torch.Tensor, chunk: int, descriptors: dict[str, torch.Tensor],
                 keepalive: list[torch.Tensor]):
        if data.numel() % 4:
            raise ValueError("the data buffer must hold whole 32-bit words")
        self.data, self.tables, self.chunk = data, tables, chunk
        self.words = data.view(torch.int32)
        self.fast = fast_table(tables)
        self.d = descriptors
        self._keepalive = keepalive  # the destinations: their addresses are baked into the descriptors
        self.n_chunks = int(descriptors["bits"].numel())

    def run(self) -> None:
        if triton is None:
            raise RuntimeError("GPU decoding needs Triton")
        if self.n_chunks == 0:
            return
        _decode_chunks_kernel[(triton.cdiv(self.n_chunks, self.BLOCK),)](
            self.words, self.data, self.fast, self.tables, self.d["bits"], self.d["sm"], self.d["dst"], self.d["len"],
            self.d["table"], self.n_chunks, CHUNK=self.chunk, WIDTH=MAX_LENGTH, FAST=FAST_WIDTH,
            GROUP=min(self.GROUP, triton.next_power_of_2(self.chunk)), BLOCK=self.BLOCK, num_warps=self.BLOCK // 32)
