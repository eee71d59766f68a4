"""The native Huffman encoder (native/huffman_encode.c) against the numpy reference, bit for bit, and its bf16
split with the exponents' histogram against split_bf16 and np.bincount.

Random and trained-like bf16 exponents, every edge the layout has (no values, one value, one symbol only, sizes
that end inside a group, a chunk and a block), chunk sizes and thread counts: the bytes and the chunk offsets
must be the reference's, and the stream must decode back.
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
    encode,
    encode_reference,
    split_and_count,
    split_bf16,
)

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native encoder was not built (no C compiler)")


def cases():
    g = np.random.default_rng(0)
    chunk = 64
    block = LANES * chunk
    yield "empty", np.zeros(0, dtype=np.uint8), chunk
    yield "one value", np.array([7], dtype=np.uint8), chunk
    yield "one symbol", np.full(5000, 3, dtype=np.uint8), chunk
    for n in (GROUP - 1, GROUP + 1, chunk + 3, block - 1, block + 1, 3 * block + 17):
        yield f"random {n}", g.integers(0, 256, n).astype(np.uint8), chunk
    for chunk in (16, 1024):
        yield f"trained-like, chunk {chunk}", split_bf16(trained_like_bits(307, 977, 1).reshape(-1))[0], chunk


@pytest.mark.parametrize("name,symbols,chunk", list(cases()), ids=[c[0] for c in cases()])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_native_encoder_writes_the_reference_stream(name, symbols, chunk, threads):
    counts = np.bincount(symbols, minlength=256) if len(symbols) else np.eye(256, dtype=np.int64)[0]
    code = build_code(counts)
    want_data, want_offsets = encode_reference(symbols, code, chunk)
    data, offsets = encode(symbols, code, chunk, threads=threads)
    assert data == want_data
    assert offsets.dtype == np.uint64 and np.array_equal(offsets, want_offsets)
    assert np.array_equal(decode(data, offsets, len(symbols), code, chunk), symbols)


def test_native_encoder_refuses_a_symbol_without_a_code():
    code = build_code(np.bincount(np.array([1, 2, 2], dtype=np.uint8), minlength=256))
    with pytest.raises(ValueError, match="a symbol has no code"):
        encode(np.array([1, 2, 5], dtype=np.uint8), code, 16)


@pytest.mark.parametrize("n", [0, 1, 17, 300_001])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_split_gives_the_reference_bytes_and_histogram(n, threads):
    bits = np.random.default_rng(n).integers(0, 1 << 16, n).astype(np.uint16)
    exponent, sign_mantissa, counts = split_and_count(bits, threads=threads)
    want_exponent, want_sign_mantissa = split_bf16(bits)
    assert np.array_equal(exponent, want_exponent) and np.array_equal(sign_mantissa, want_sign_mantissa)
    assert counts.dtype == np.int64 and np.array_equal(counts, np.bincount(want_exponent, minlength=256))


def test_native_encoder_refuses_a_chunk_size_past_the_bound():
    """LANES * chunk overflowed at 2**59 (SIGFPE, no message): the encoder refuses what the decoder refuses. In a
    subprocess, so that a signal fails this test rather than the run."""
    import subprocess
    import sys

    code = ("from esftctl import _native\n"
            "for chunk in (1 << 59, 1 << 58, 65536 + 16, 8):\n"
            "    try:\n"
            "        _native.encode(bytes(40), bytes(256), bytes(2048), chunk, 1)\n"
            "        print('encoded', chunk)\n"
            "    except ValueError as e:\n"
            "        print('refused', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(line.startswith("refused") and "from 16 to 65536" in line for line in proc.stdout.splitlines())
    assert len(proc.stdout.splitlines()) == 4
    with pytest.raises(ValueError, match="from 16 to 65536"):
        encode(np.zeros(40, dtype=np.uint8), build_code(np.eye(256, dtype=np.int64)[0]), 1 << 59)
