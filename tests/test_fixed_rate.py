"""The fixed-rate bf16 code (esftctl.kernels.fixed_rate): bytes pinned on a small example, round trips through
the PyTorch reference on trained-like weights and on edge values, the consistency check refusing what would
make the kernel read outside its buffers, and the Triton kernel against the reference (interpreter on the CPU,
the kernel itself on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

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
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


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
