"""Canonical, length-limited Huffman coding of bf16 exponents, vectorized with numpy, decodable in chunks.

A bf16 value is 1 sign, 8 exponent and 7 mantissa bits. The exponent byte is entropy-coded; sign and
mantissa stay one raw byte per value (`split_bf16`). The coded stream of a tensor is cut into chunks of
at most `chunk` symbols whose starting bit offsets are recorded, so chunks decode independently: the CPU
decoder steps all chunks of a tensor in lockstep with numpy, the GPU decoder (esftctl.kernels.huffman_decode)
gives each chunk a lane.

Which values a chunk holds is chosen for the GPU (`chunk_layout`): LANES chunks, decoded side by side by one
warp, share a block of LANES * chunk values, taking turns by GROUP values. When a warp writes its lanes'
next GROUP values each, it writes LANES * GROUP contiguous values (and reads as many sign-and-mantissa
bytes): whole cache lines, not one line per lane.

Codes are canonical (a code is fully described by its lengths) and at most MAX_LENGTH bits long, so a
decoder resolves a symbol with one lookup in a 2**MAX_LENGTH table of (symbol, length).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from esftctl.formats import native

MAX_LENGTH = 12
LANES = 32  # chunks that share a block of values: one warp's lanes
GROUP = 16  # values a chunk takes in turn: a lane's vector of output
MAX_CHUNK = 1 << 16  # values per chunk at most (native/huffman.h has the same): LANES * chunk stays far from overflow


def check_chunk(chunk: object) -> int:
    """`chunk` if it is a chunk size the coders take (a multiple of GROUP up to MAX_CHUNK), else ValueError."""
    if type(chunk) is not int or not GROUP <= chunk <= MAX_CHUNK or chunk % GROUP:
        raise ValueError(f"chunk size must be a multiple of {GROUP} from {GROUP} to {MAX_CHUNK}, not {chunk!r}")
    return chunk


def check_lengths(lengths: object) -> np.ndarray:
    """Code lengths as a stored table gives them, if they describe a prefix code: 256 integers from 0 (unused)
    to MAX_LENGTH whose Kraft sum is at most 1; else ValueError. A decoder's lookup tables are only right then."""
    if not isinstance(lengths, list) or len(lengths) != 256 or any(
            type(n) is not int or not 0 <= n <= MAX_LENGTH for n in lengths):
        raise ValueError(f"a code table must be 256 code lengths from 0 to {MAX_LENGTH}")
    if sum(1 << (MAX_LENGTH - n) for n in lengths if n) > 1 << MAX_LENGTH:
        raise ValueError("code lengths that no prefix code has (Kraft sum above 1)")
    return np.array(lengths, dtype=np.int64)


def split_bf16(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns (uint16) -> (exponent bytes, sign-and-mantissa bytes)."""
    bits = bits.astype(np.uint16, copy=False)
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


def split_and_count(bits: np.ndarray, threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """split_bf16 and the exponents' histogram ([256] int64), in one native pass over `bits` where the package
    was built with its C extension (read-only arrays), else with numpy."""
    lib = native.module()
    if lib is None:
        exponent, sign_mantissa = split_bf16(bits)
        return exponent, sign_mantissa, np.bincount(exponent, minlength=256)
    exponent, sign_mantissa, counts = lib.split_bf16(np.ascontiguousarray(bits, dtype=np.uint16),
                                                     native.threads(threads))
    return (np.frombuffer(exponent, dtype=np.uint8), np.frombuffer(sign_mantissa, dtype=np.uint8),
            np.frombuffer(counts, dtype=np.int64))


def join_bf16(exponent: np.ndarray, sign_mantissa: np.ndarray) -> np.ndarray:
    e = exponent.astype(np.uint16)
    sm = sign_mantissa.astype(np.uint16)
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of a histogram."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def code_lengths(counts: np.ndarray, max_length: int = MAX_LENGTH) -> np.ndarray:
    """Huffman code lengths (0 for unused symbols), then limited to `max_length` keeping Kraft's sum <= 1."""
    lengths = np.zeros(len(counts), dtype=np.int64)
    used = [int(s) for s in np.nonzero(counts)[0]]
    if len(used) == 1:
        lengths[used[0]] = 1
        return lengths
    heap = [(int(counts[s]), i, [s]) for i, s in enumerate(used)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        c1, _, s1 = heapq.heappop(heap)
        c2, _, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, tie, s1 + s2))
        tie += 1
    if lengths.max() > max_length:
        lengths[lengths > max_length] = max_length
        # Over-full now: lengthen the rarest symbols that still can be, until the code fits again.
        budget = 1 << max_length
        by_rarity = sorted(used, key=lambda s: (counts[s], -lengths[s]))
        while sum(budget >> int(lengths[s]) for s in used) > budget:
            for s in by_rarity:
                if lengths[s] < max_length:
                    lengths[s] += 1
                    break
    return lengths


@dataclass(frozen=True)
class Code:
    """A canonical prefix code over byte symbols, from its code lengths."""

    lengths: np.ndarray  # [256] int, 0 = unused

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def codes(self) -> np.ndarray:
        """[256] code values (MSB-first), canonical: by (length, symbol)."""
        codes = np.zeros(256, dtype=np.uint64)
        code, prev_len = 0, 0
        for s in sorted(np.nonzero(self.lengths)[0], key=lambda s: (self.lengths[s], s)):
            code <<= int(self.lengths[s]) - prev_len
            codes[s] = code
            code += 1
            prev_len = int(self.lengths[s])
        return codes

    @cached_property
    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """decode_table(MAX_LENGTH), made once."""
        return self.decode_table()

    def decode_table(self, width: int = MAX_LENGTH) -> tuple[np.ndarray, np.ndarray]:
        """Lookup tables of 2**width entries: the next `width` bits -> (symbol, code length)."""
        symbols = np.zeros(1 << width, dtype=np.uint8)
        lengths = np.zeros(1 << width, dtype=np.uint8)
        codes = self.codes()
        for s in np.nonzero(self.lengths)[0]:
            n = int(self.lengths[s])
            start = int(codes[s]) << (width - n)
            symbols[start:start + (1 << (width - n))] = s
            lengths[start:start + (1 << (width - n))] = n
        return symbols, lengths


def multi_symbol_table(code: Code, width: int = MAX_LENGTH, most: int = 4) -> np.ndarray:
    """For every `width`-bit window, all whole codes at its front (up to `most`), as one int64 entry:
    symbols in bits 0-31 (first in the low byte), their count in bits 32-35, bits consumed in 36-40.

    Codes are at most `width` bits, so a window that starts at a code boundary always yields at least one
    symbol; at 2.6 bits per exponent a window yields about four, so a decoder needs a quarter of the steps.
    """
    sym_of, len_of = (t.astype(np.int64) for t in code.decode_table(width))
    window = np.arange(1 << width, dtype=np.int64)
    mask = (1 << width) - 1
    symbols = np.zeros_like(window)
    count = np.zeros_like(window)
    used = np.zeros_like(window)
    alive = np.ones(len(window), dtype=bool)
    for k in range(most):
        peek = (window << used) & mask
        n = len_of[peek]
        fits = alive & (n > 0) & (used + n <= width)
        symbols |= np.where(fits, sym_of[peek] << (8 * k), 0)
        count += fits
        used += np.where(fits, n, 0)
        alive = fits
    return symbols | (count << 32) | (used << 36)


def build_code(counts: np.ndarray, max_length: int = MAX_LENGTH) -> Code:
    return Code(code_lengths(np.asarray(counts, dtype=np.int64), max_length))


def chunk_layout(count: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, lengths): the value indices in stream order, chunk after chunk, and each chunk's length.

    Chunk c of block b holds values b * LANES * chunk + g * LANES * GROUP + c * GROUP + j, for groups g
    and j < GROUP, that are below `count`; empty chunks at the end are left out.
    """
    check_chunk(chunk)
    blocks = -(-count // (LANES * chunk))
    index = (np.arange(blocks, dtype=np.int64)[:, None, None, None] * (LANES * chunk)
             + np.arange(LANES, dtype=np.int64)[None, :, None, None] * GROUP
             + np.arange(chunk // GROUP, dtype=np.int64)[None, None, :, None] * (LANES * GROUP)
             + np.arange(GROUP, dtype=np.int64)[None, None, None, :])
    inside = index < count
    lengths = inside.sum(axis=(2, 3)).reshape(-1)
    return index[inside], lengths[: int(np.count_nonzero(lengths))]


def chunk_count(count: int, chunk: int) -> int:
    """How many chunks chunk_layout makes of `count` values: LANES per whole block, then one per GROUP
    values that the last block starts, at most LANES."""
    whole, rest = divmod(count, LANES * chunk)
    return whole * LANES + min(LANES, -(-rest // GROUP))


def chunk_firsts(count: int, chunk: int) -> np.ndarray:
    """The index of each chunk's first value (chunk_layout's chunks, in order), without laying out the values."""
    k = np.arange(chunk_count(count, chunk), dtype=np.int64)
    return (k // LANES) * (LANES * chunk) + (k % LANES) * GROUP


def encode(symbols: np.ndarray, code: Code, chunk: int, threads: int | None = None) -> tuple[bytes, np.ndarray]:
    """Pack `symbols` MSB-first in chunk_layout's order; return (bytes, each chunk's starting bit, uint64).

    The native encoder (native/huffman_encode.c, built with the package) writes the same bytes with `threads`
    threads (default: every core); without it, `encode_reference` does."""
    lib = native.module()
    if lib is None:
        return encode_reference(symbols, code, chunk)
    check_chunk(chunk)
    data, starts = lib.encode(np.ascontiguousarray(symbols, dtype=np.uint8),
                              np.ascontiguousarray(code.lengths, dtype=np.uint8),
                              np.ascontiguousarray(code.codes(), dtype=np.uint64), chunk, native.threads(threads))
    return data, np.frombuffer(starts, dtype=np.uint64).copy()


def encode_reference(symbols: np.ndarray, code: Code, chunk: int) -> tuple[bytes, np.ndarray]:
    """The numpy encoder (7-15 M values/s on one core): the reference the native one is tested against."""
    order, chunk_lengths = chunk_layout(len(symbols), chunk)
    symbols = symbols[order]
    lengths = code.lengths.astype(np.uint64)[symbols]
    values = code.codes()[symbols]
    if np.any(lengths == 0):
        raise ValueError("a symbol has no code")
    ends = np.cumsum(lengths, dtype=np.uint64)
    starts = ends - lengths
    total_bits = int(ends[-1]) if len(ends) else 0
    words = np.zeros(total_bits // 64 + 2, dtype=np.uint64)
    word = (starts >> np.uint64(6)).astype(np.int64)
    room = np.uint64(64) - (starts & np.uint64(63))  # bits left in the symbol's first word
    fits = lengths <= room
    # Codes within one word: shifted to their place. Codes across two: high part here, low part next word.
    shift_in = np.where(fits, room - lengths, np.uint64(0))
    spill = np.where(fits, np.uint64(0), lengths - room)
    first = np.where(fits, values << shift_in, values >> spill)
    second = np.where(fits, np.uint64(0), values << (np.uint64(64) - spill) % np.uint64(64))
    _or_into(words, word, first)
    crossing = ~fits
    _or_into(words, word[crossing] + 1, second[crossing])
    data = words.byteswap().tobytes()[: (total_bits + 7) // 8]
    first_symbol = np.cumsum(chunk_lengths) - chunk_lengths
    return data, starts[first_symbol].astype(np.uint64)


def _or_into(words: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """words[index] |= values for sorted `index` with repeats (OR-reduced per word first)."""
    if len(index) == 0:
        return
    starts = np.concatenate([[0], np.nonzero(np.diff(index))[0] + 1])
    words[index[starts]] |= np.bitwise_or.reduceat(values, starts)


def decode_bf16(data: bytes | np.ndarray, offsets: np.ndarray, code: Code, chunk: int, sign_mantissa: np.ndarray, *,
                out: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Decode a tensor's exponents and join them with its sign-and-mantissa bytes into `out` (uint16 bf16 bits, one
    per value), with the native decoder (native/huffman_decode.c, `threads` threads: default every core) where the
    package was built with it, else with `decode` and `join_bf16`."""
    lib = native.module()
    count = len(sign_mantissa)
    if lib is None:
        out[:] = join_bf16(decode(data, offsets, count, code, chunk), sign_mantissa)
        return out
    symbols, lengths = code.table
    lib.decode_bf16(data, np.ascontiguousarray(offsets, dtype=np.uint64), count, symbols, lengths, chunk,
                    np.ascontiguousarray(sign_mantissa, dtype=np.uint8), out, native.threads(threads))
    return out


def decode(data: bytes, offsets: np.ndarray, count: int, code: Code, chunk: int) -> np.ndarray:
    """Decode `count` symbols; all chunks advance together, one symbol per step (vectorized over chunks): the
    reference of the native decoder (about 33 M values/s). Like it, a window that matches no code, or a chunk
    that ends past its successor's start (the last: past the data's end), is ValueError; reads past the data
    see zero bits."""
    out = np.zeros(count, dtype=np.uint8)
    if count == 0:
        return out
    order, lengths = chunk_layout(count, chunk)
    if len(offsets) != len(lengths):
        raise ValueError(f"{len(offsets)} chunk offsets for {len(lengths)} chunks")
    width = MAX_LENGTH
    table_sym, table_len = code.decode_table(width)
    buf = np.frombuffer(bytes(data) + b"\0\0\0\0", dtype=np.uint8).astype(np.uint32)
    pos = offsets.astype(np.uint64).astype(np.int64)
    nbits = 8 * (len(buf) - 4)
    if np.any(pos < 0) or np.any(pos > nbits):
        raise ValueError("corrupt Huffman stream (a chunk starts past the data's end)")
    limit = np.append(pos[1:], nbits)
    first = np.cumsum(lengths) - lengths
    stream = np.zeros(count, dtype=np.uint8)
    for step in range(int(lengths.max())):
        live = lengths > step
        p = pos[live]
        byte = np.minimum(p >> 3, len(buf) - 3)  # at the end: the last bytes, then zeros (pos > limit then)
        window = (buf[byte] << 16) | (buf[byte + 1] << 8) | buf[byte + 2]  # 24 bits >= 12 + 7
        peek = (window >> (24 - width - (p & 7)).astype(np.uint32)) & ((1 << width) - 1)
        if not table_len[peek].all():
            raise ValueError("corrupt Huffman stream (a code that does not exist)")
        stream[first[live] + step] = table_sym[peek]
        pos[live] = p + table_len[peek]
    if np.any(pos > limit):
        raise ValueError("corrupt Huffman stream (a chunk past its end)")
    out[order] = stream
    return out
