"""The fixed-rate bf16 code (esftctl.kernels.fixed_rate): bytes pinned on a small example, round trips through
the PyTorch reference on trained-like weights and on edge values, the consistency check refusing what would
make the kernel read outside its buffers, and the Triton kernel against the reference (interpreter on the CPU,
the kernel itself on CUDA)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import run_interpreted

from esftctl.kernels.fixed_rate import BLOCK, ESCAPE, FixedRate, decode_reference, encode


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


def test_bytes_of_a_small_example_are_pinned():
    values = torch.tensor([1.0, -2.0, 1.5, 0.0, 1.0], dtype=torch.bfloat16)  # exponents 127, 128, 127, 0, 127
    code = encode(values)
    assert code.table.tolist()[:3] == [127, 0, 128]  # by frequency, ties by exponent
    assert code.sm.tolist() == [0x00, 0x80, 0x40, 0x00, 0x00]
    assert code.codes.tolist() == [0x20, 0x10, 0x00]  # codes 0, 2 | 0, 1 | 0
    assert code.escapes.numel() == 0 and code.starts.tolist() == [0, 0]
    assert code.nbytes == 16 + 5 + 3 + 0 + 8
    assert _same(decode_reference(code), values)


def test_round_trip_of_trained_like_weights_at_about_three_quarters_of_bf16():
    from esftctl.bench.shapes import DEEPSEEK_V2_LITE
    from esftctl.bench.synthetic_model import trained_like_expert

    w = torch.cat([t.reshape(-1) for t in trained_like_expert(DEEPSEEK_V2_LITE, 0).values()])
    code = encode(w)
    code.check()
    assert _same(decode_reference(code), w)
    assert 0.75 <= code.nbytes / (2 * w.numel()) < 0.76


def test_escapes_infinities_nans_and_subnormals_round_trip():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3 * BLOCK + 7, generator=g) * torch.exp2(torch.randint(-60, 60, (3 * BLOCK + 7,), generator=g))
    wide = wide.to(torch.bfloat16)
    wide[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40])
    code = encode(wide)
    code.check()
    assert code.escapes.numel() > BLOCK  # 120 exponents, 15 codes: most values escape
    assert _same(decode_reference(code), wide)
    assert _same(decode_reference(encode(wide[:0])), wide[:0])


@pytest.mark.parametrize("field", ["starts", "escapes", "codes", "sm"])
def test_check_refuses_codes_whose_counts_do_not_add_up(field):
    g = torch.Generator().manual_seed(2)
    code = encode((torch.randn(BLOCK + 3, generator=g) * torch.exp2(torch.randint(-40, 40, (BLOCK + 3,), generator=g)))
                  .to(torch.bfloat16))
    assert code.escapes.numel() > 0
    parts = {k: getattr(code, k) for k in ("table", "sm", "codes", "escapes", "starts")}
    t = parts[field].clone()
    parts[field] = t[:-1] if field != "starts" else t + torch.tensor([0, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="fixed-rate"):
        FixedRate(code.count, code.block, **parts).check()


INTERPRETED = """
import torch
from esftctl.kernels.fixed_rate import BLOCK, decode, decode_reference, encode
g = torch.Generator().manual_seed(1)
w = (torch.randn(2 * BLOCK + 5, generator=g) * torch.exp2(torch.randint(-12, 12, (2 * BLOCK + 5,), generator=g)))
w = w.to(torch.bfloat16)
code = encode(w)
code.check()
assert code.escapes.numel() > 0
out = torch.full_like(w, 7.0)
decode(code, out)
assert torch.equal(out.view(torch.int16), decode_reference(code).view(torch.int16))
print("ok")
"""


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernel itself (test_kernel_equals_the_reference_on_cuda)")
    run_interpreted(INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, BLOCK, 5 * BLOCK + 1001])
def test_kernel_equals_the_reference_on_cuda(n):
    from esftctl.kernels.fixed_rate import decode

    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-10, 10, (n,), generator=g))).to(torch.bfloat16)
    code = encode(w)
    code.check()
    out = torch.full((n,), 7.0, dtype=torch.bfloat16, device="cuda")
    decode(code.to("cuda"), out)
    assert _same(out.cpu(), decode_reference(code)) and ESCAPE == 15


# ---- a layer's rows (encode_rows, decode_rows): the paging tier's batched code ---------------------------------

def _rows(rows: int, n: int, seed: int, spread: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-spread, spread, (rows, n), generator=g))
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("n,at_once", [(2 * BLOCK + 5, 2), (BLOCK, 8), (1, 3)])
def test_batched_encode_is_the_reference_row_by_row(n, at_once):
    from esftctl.kernels.fixed_rate import decode_rows_reference, encode_rows

    w = _rows(5, n, n)
    w[3] = (torch.randn(n) * 0.01).to(torch.bfloat16)  # few exponents: no escapes in this row
    code = encode_rows(w.view(5, 1, n), rows_at_once=at_once)
    code.check()
    for r in range(5):
        want, got = encode(w[r]), code.row(r)
        for field in ("table", "sm", "codes", "escapes", "starts"):
            assert torch.equal(getattr(want, field), getattr(got, field)), (r, field)
    assert _same(decode_rows_reference(code, range(5)), w)
    assert code.nbytes == sum(encode(w[r]).nbytes for r in range(5)) + 8 * 5  # + the escape bases


def test_batched_check_refuses_bases_that_do_not_add_up():
    from esftctl.kernels.fixed_rate import encode_rows

    code = encode_rows(_rows(3, BLOCK + 3, 4, spread=40))
    assert int(code.starts[0, -1]) > 0
    with pytest.raises(ValueError, match="fixed-rate rows"):
        replace(code, base=code.base + 1).check()
    with pytest.raises(ValueError, match="fixed-rate rows starts"):
        replace(code, starts=code.starts[:, :-1].contiguous()).check()
    with pytest.raises(ValueError, match="bf16 rows"):
        encode_rows(_rows(2, 4, 1).float())


INTERPRETED_ROWS = """
import torch
from esftctl.kernels.fixed_rate import BLOCK, decode_rows, decode_rows_reference, encode_rows
g = torch.Generator().manual_seed(1)
w = (torch.randn(5, 2 * BLOCK + 5, generator=g) * torch.exp2(torch.randint(-12, 12, (5, 2 * BLOCK + 5), generator=g)))
w = w.to(torch.bfloat16)
code = encode_rows(w, rows_at_once=2)
code.check()
assert code.escapes.numel() > 0
out = torch.full((7, 2 * BLOCK + 5), 7.0, dtype=torch.bfloat16)  # rows past the code's are never written
needed = torch.tensor([1, 0, 1, 1, 1, 1, 1], dtype=torch.int32)
decode_rows(code, out[:5], needed, torch.tensor([3], dtype=torch.int32))
for r in range(7):
    want = w[r] if r in (0, 2) else torch.full_like(w[0], 7.0)
    assert torch.equal(out[r].view(torch.int16), want.view(torch.int16)), r
for steps in (1, 2, 8):  # blocks a program: one each, a last program half past the row's end, all in one
    out.fill_(7.0)
    decode_rows(code, out[:5], steps=steps)
    assert torch.equal(out[:5].view(torch.int16), decode_rows_reference(code, range(5)).view(torch.int16)), steps
print("ok")
"""


def test_batched_masked_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernel itself (test_batched_kernel_on_cuda)")
    run_interpreted(INTERPRETED_ROWS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, BLOCK, 5 * BLOCK + 1001])
def test_batched_kernel_on_cuda(n):
    from esftctl.kernels.fixed_rate import decode_rows, decode_rows_reference, encode_rows

    w = _rows(6, n, n, spread=10)
    code = encode_rows(w.cuda())  # the GPU encoder: the same code as the CPU one
    code.check()
    cpu = encode_rows(w)
    assert all(torch.equal(getattr(code, f).cpu(), getattr(cpu, f)) for f in ("table", "sm", "codes", "escapes",
                                                                               "base", "starts"))
    out = torch.full((6, n), 7.0, dtype=torch.bfloat16, device="cuda")
    needed = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int32, device="cuda")
    decode_rows(code, out, needed, torch.tensor([4], dtype=torch.int32, device="cuda"))
    ref = decode_rows_reference(code, range(6))
    for r in range(6):
        assert _same(out[r].cpu(), ref[r] if r in (0, 1, 3) else torch.full((n,), 7.0, dtype=torch.bfloat16)), r
    for steps in (1, 4, 8):
        out.fill_(7.0)
        decode_rows(code, out, steps=steps)
        assert _same(out.cpu(), w), steps
