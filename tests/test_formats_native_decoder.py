"""The native Huffman decoder (native/huffman_decode.c) against the numpy reference (decode, then join_bf16).

The same edges as the encoder's tests (no values, one, one symbol only, sizes that end inside a group, a chunk
and a block), chunk sizes and thread counts: the bf16 bits must be the reference's. A corrupted stream is an
error, never a read past the buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import trained_like_bits

from esftctl.formats import native
from esftctl.formats.huffman import (
    GROUP,
    LANES,
    build_code,
    decode,
    decode_bf16,
    encode_reference,
    join_bf16,
    split_bf16,
)

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native decoder was not built (no C compiler)")


def cases():
    g = np.random.default_rng(1)
    chunk = 64
    block = LANES * chunk
    yield "empty", np.zeros(0, dtype=np.uint16), chunk
    yield "one value", np.array([0x3F80], dtype=np.uint16), chunk
    yield "one symbol", (np.full(5000, 0x4000, dtype=np.uint16) | g.integers(0, 0x7F, 5000).astype(np.uint16)), chunk
    for n in (GROUP - 1, GROUP + 1, chunk + 3, block - 1, block + 1, 3 * block + 17):
        yield f"random {n}", g.integers(0, 1 << 16, n).astype(np.uint16), chunk
    for chunk in (16, 1024):
        yield f"trained-like, chunk {chunk}", trained_like_bits(307, 977, 2).reshape(-1), chunk


def _encoded(bits: np.ndarray, chunk: int):
    exponent, sign_mantissa = split_bf16(bits)
    code = build_code(np.bincount(exponent, minlength=256) if len(bits) else np.eye(256, dtype=np.int64)[0])
    data, offsets = encode_reference(exponent, code, chunk)
    return data, offsets, code, sign_mantissa


@pytest.mark.parametrize("name,bits,chunk", list(cases()), ids=[c[0] for c in cases()])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_native_decoder_gives_the_reference_bits(name, bits, chunk, threads):
    data, offsets, code, sign_mantissa = _encoded(bits, chunk)
    want = join_bf16(decode(data, offsets, len(bits), code, chunk), sign_mantissa)
    assert np.array_equal(want, bits)  # the reference round-trips
    out = np.full(len(bits), 0xDEAD, dtype=np.uint16)
    decode_bf16(np.frombuffer(data, dtype=np.uint8), offsets, code, chunk, sign_mantissa, out=out, threads=threads)
    assert np.array_equal(out, want)


def test_native_decoder_refuses_a_corrupt_stream():
    bits = trained_like_bits(50, 1000, 3).reshape(-1)
    data, offsets, code, sign_mantissa = _encoded(bits, 64)
    out = np.empty(len(bits), dtype=np.uint16)
    with pytest.raises(ValueError, match="corrupt Huffman stream"):  # chunks start past the stream's end
        decode_bf16(data, offsets + np.uint64(8 * len(data)), code, 64, sign_mantissa, out=out)
    with pytest.raises(ValueError, match="chunk offsets for"):
        decode_bf16(data, offsets[:-1], code, 64, sign_mantissa, out=out)
    with pytest.raises(ValueError, match="one uint16 of output per value"):
        decode_bf16(data, offsets, code, 64, sign_mantissa, out=out[:-1])


@pytest.mark.parametrize("corrupt", ["starts past the end", "runs into its successor", "no such code"])
def test_reference_decoder_refuses_what_the_native_one_does(corrupt):
    """Where the package has no native decoder the numpy reference decodes: a corrupt stream must be the same
    ValueError there (the store turns it into one line naming the file), never an IndexError or wrong values."""
    bits = trained_like_bits(50, 1000, 3).reshape(-1)
    data, offsets, code, sign_mantissa = _encoded(bits, 64)
    if corrupt == "starts past the end":
        offsets = offsets + np.uint64(8 * len(data) + 1)
    elif corrupt == "runs into its successor":
        offsets = offsets.copy()
        offsets[1:] = offsets[:-1]
    else:
        code = build_code(np.eye(256, dtype=np.int64)[0])  # one symbol, code "0": a 1 bit is no code
    out = np.empty(len(bits), dtype=np.uint16)
    for decoder in (lambda: decode(data, offsets, len(bits), code, 64),
                    lambda: decode_bf16(data, offsets, code, 64, sign_mantissa, out=out)):
        with pytest.raises(ValueError, match="corrupt Huffman stream"):
            decoder()
