"""GPU decoding of Huffman-coded bf16 exponents (esftctl.huffman's format) straight into bf16 tensors.

One launch decodes any set of stored tensors into any destinations (for paging: the mapped rows of a
layer's virtual weight tensors). Every chunk of every tensor becomes one lane, described by five numbers:
its absolute bit position in the store's data on the device, where its sign-and-mantissa bytes start,
the device address of its first output value, how many of the tensor's values lie from there on, and its
code table. A program is one warp: the 32 chunks of a block (esftctl.huffman.chunk_layout), which take
turns by GROUP values, so each time the warp writes a group it writes 32 * GROUP contiguous values.

A lane keeps its next bits in a 64-bit register, never fewer than MAX_LENGTH of them; whenever 32 more fit,
the next aligned 32-bit word is fetched beside the step's table lookup (not before it), so the two loads'
latencies overlap. Each dependent step looks up the next MAX_LENGTH bits in a multi-symbol table
(esftctl.huffman.multi_symbol_table): every whole code at the window's front, up to four, and the bits they
use; at about 2.6 bits per exponent a step yields about four values. Values queue in registers (one byte
each) until GROUP are ready; then they are joined with their sign-and-mantissa bytes and written as GROUP
contiguous bf16 values. Where the plan proved the destinations start on a group boundary in memory, those
bytes move as vectors: one 16-byte load and two 16-byte stores a lane, not 32 scalar ones. "Does any lane
still need values for this group?" is a warp vote.

The plain reference is the CPU decoder (esftctl.huffman.decode + join_bf16); the tests compare the two.
A DecodePlan holds the descriptors on the device, so `run()` is one launch with no host work, and can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from esftctl.huffman import GROUP, LANES, MAX_LENGTH

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _bswap32(x):
        """The stream is MSB-first bytes: a little-endian 32-bit load reads them reversed."""
        return ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | ((x >> 24) & 0xFF)

    @triton.jit
    def _decode_chunks_kernel(words_ptr, data_ptr, multi_ptr, bit_ptr, sm_ptr, dst_ptr, remaining_ptr, table_ptr,
                              n_chunks, CHUNK: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        STRIDE: tl.constexpr = BLOCK * GROUP  # a block's lanes take turns by GROUP values
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < n_chunks
        bit = tl.load(bit_ptr + lanes, mask=ok, other=0)
        sm_at = tl.load(sm_ptr + lanes, mask=ok, other=0)
        out = tl.load(dst_ptr + lanes, mask=ok, other=0).to(tl.pointer_type(tl.int16))
        n = tl.load(remaining_ptr + lanes, mask=ok, other=0)
        base = tl.load(table_ptr + lanes, mask=ok, other=0).to(tl.int64) << WIDTH
        word = bit >> 5
        first = _bswap32(tl.load(words_ptr + word, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
        second = _bswap32(tl.load(words_ptr + word + 1, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
        buf = ((first << 32) | second) << (bit & 31).to(tl.uint64)
        nbits = 64 - (bit & 31).to(tl.int32)
        word += 2
        # A queue of decoded exponents, one byte each: lo holds 0-7, hi 8-15, spill 16-18.
        lo = tl.zeros([BLOCK], dtype=tl.uint64)
        hi = tl.zeros([BLOCK], dtype=tl.uint64)
        spill = tl.zeros([BLOCK], dtype=tl.uint64)
        queued = tl.zeros([BLOCK], dtype=tl.int32)
        cols = tl.arange(0, GROUP)
        quarter = (cols // 4)[None, :]
        shifts = (8 * (cols % 4)).to(tl.uint32)[None, :]
        if ALIGNED:  # the plan checked: every chunk's bytes and destination start on a GROUP-value boundary
            sm_at = tl.multiple_of(sm_at, GROUP)
            out = tl.multiple_of(out, 2 * GROUP)
        sm_ptrs = data_ptr + sm_at[:, None] + cols[None, :]
        out_ptrs = out[:, None] + cols[None, :]
        for g in range(0, CHUNK // GROUP):
            left = n - g * STRIDE  # the tensor's values from this group's first on
            want = tl.minimum(left, GROUP)
            while tl.max(want - queued, axis=0) > 0:
                active = queued < want
                # The buffer holds at least WIDTH bits at every step, so this step's lookup never waits for
                # a refill: the next word is fetched beside the lookup and joins the buffer after it.
                need = active & (nbits <= 32)
                w = _bswap32(tl.load(words_ptr + word, mask=need, other=0).to(tl.uint32)).to(tl.uint64)
                entry = tl.load(multi_ptr + base + (buf >> (64 - WIDTH)).to(tl.int64), mask=active, other=0)
                count = ((entry >> 32) & 0xF).to(tl.int32)
                used = tl.where(active, ((entry >> 36) & 0x1F).to(tl.int32), 0)
                symbols = (entry & 0xFFFFFFFF).to(tl.uint64)
                q = queued
                in_lo = active & (q < 8)
                in_hi = active & (q >= 8)
                lo |= tl.where(in_lo, symbols << (8 * q).to(tl.uint64), 0)
                carry_lo = tl.where(in_lo & (q > 4), symbols >> (64 - 8 * q).to(tl.uint64), 0)
                hi |= tl.where(in_hi, symbols << (8 * (q - 8)).to(tl.uint64), 0) | carry_lo
                spill |= tl.where(in_hi & (q > 12), symbols >> (64 - 8 * (q - 8)).to(tl.uint64), 0)
                buf = buf << used.to(tl.uint64)
                nbits -= used
                buf = tl.where(need, buf | (w << (32 - nbits).to(tl.uint64)), buf)
                nbits = tl.where(need, nbits + 32, nbits)
                word = tl.where(need, word + 1, word)
                # A window with no whole code can only be bits past the stream's end: stop that lane.
                queued = tl.where(active, tl.where(count == 0, want, queued + count), queued)
            # 32-bit words of the queue; which word a column reads is known at compile time.
            w0, w1 = lo.to(tl.uint32)[:, None], (lo >> 32).to(tl.uint32)[:, None]
            w2, w3 = hi.to(tl.uint32)[:, None], (hi >> 32).to(tl.uint32)[:, None]
            packed = tl.where(quarter < 2, tl.where(quarter == 0, w0, w1), tl.where(quarter == 2, w2, w3))
            exponents = ((packed >> shifts) & 0xFF).to(tl.int16)
            # Whole groups: one mask per lane, so each lane's bytes move as vectors (16 B in, 32 B out).
            whole = ok & (left >= GROUP)
            sm = tl.load(sm_ptrs, mask=whole[:, None], other=0).to(tl.int16)
            tl.store(out_ptrs, (sm & -128) << 8 | (exponents << 7) | (sm & 0x7F), mask=whole[:, None])
            tail = ok & (left > 0) & ~whole
            if tl.max(tail.to(tl.int32), axis=0) > 0:  # a tensor's last, partial group
                mask = tail[:, None] & (cols[None, :] < left[:, None])
                sm = tl.load(sm_ptrs, mask=mask, other=0).to(tl.int16)
                tl.store(out_ptrs, (sm & -128) << 8 | (exponents << 7) | (sm & 0x7F), mask=mask)
            sm_ptrs += STRIDE
            out_ptrs += STRIDE
            lo, hi, spill = spill, tl.zeros([BLOCK], dtype=tl.uint64), tl.zeros([BLOCK], dtype=tl.uint64)
            queued = tl.maximum(queued - GROUP, 0)

except ImportError:
    triton = None


class DecodePlan:
    """Chunk descriptors for decoding a set of tensors into fixed destinations, ready on the device."""

    BLOCK = LANES  # lanes per program: one warp, so "does any lane still need values?" is a warp vote

    def __init__(self, data: torch.Tensor, tables: torch.Tensor, chunk: int, descriptors: dict[str, torch.Tensor],
                 keepalive: list[torch.Tensor], aligned: bool = False):
        if data.numel() % 4:
            raise ValueError("the data buffer must hold whole 32-bit words")
        self.data, self.tables, self.chunk = data, tables, chunk
        self.words = data.view(torch.int32)
        self.d = descriptors
        self._keepalive = keepalive  # the destinations: their addresses are baked into the descriptors
        self.n_chunks = int(descriptors["bits"].numel())
        # Vector loads and stores need every destination to start on a group boundary in memory.
        self.aligned = aligned

    def run(self) -> None:
        if triton is None:
            raise RuntimeError("GPU decoding needs Triton")
        if self.n_chunks == 0:
            return
        _decode_chunks_kernel[(triton.cdiv(self.n_chunks, self.BLOCK),)](
            self.words, self.data, self.tables, self.d["bits"], self.d["sm"], self.d["dst"], self.d["remaining"],
            self.d["table"], self.n_chunks, CHUNK=self.chunk, WIDTH=MAX_LENGTH,
            GROUP=GROUP, BLOCK=self.BLOCK, ALIGNED=self.aligned, num_warps=self.BLOCK // 32)
