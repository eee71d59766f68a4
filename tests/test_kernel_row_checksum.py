"""Row checksums (esftctl.kernels.row_checksum): the definition pinned by hand, the dispatch, and the Triton kernel
against the reference (the interpreter on the CPU, the kernel itself on a GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_interpreted

from esftctl.kernels.row_checksum import row_checksums, row_checksums_reference


def test_the_definition_weighs_each_word_by_its_place():
    words = torch.tensor([[1, 2, -1], [0, 0, 0]], dtype=torch.int16)
    assert row_checksums_reference(words).tolist() == [1 * 1 + 2 * 2 - 1 * 3, 0]
    ones = torch.ones(1, 252, dtype=torch.int16)  # the weights run 1..251, then start again at 1
    assert row_checksums_reference(ones).tolist() == [251 * 252 // 2 + 1]
    odd = torch.tensor([[1, 2, 3]], dtype=torch.uint8)  # bytes 1 2 | 3 0: words 0x0201 and 3
    assert row_checksums_reference(odd).tolist() == [0x0201 * 1 + 3 * 2]
    parts = (torch.tensor([[5]], dtype=torch.int16), torch.tensor([[7, 1]], dtype=torch.int16))
    assert row_checksums_reference(*parts).tolist() == [5 + 7 + 2]  # each part's places count from 1


def test_chosen_rows_and_bad_rows():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 3, 8, generator=g).to(torch.bfloat16), torch.randn(4, 8, 2, generator=g)
    every = row_checksums(w13, w2)
    assert torch.equal(every, row_checksums_reference(w13, w2)) and len(set(every.tolist())) == 4
    assert row_checksums(w13, w2, rows=[3, 1]).tolist() == [every[3], every[1]]
    w13[1, 2, 5] += 1
    assert row_checksums(w13, w2, rows=[1, 2]).tolist()[0] != every[1]  # one value changed
    assert row_checksums(w13.flip(0), w2.flip(0)).flip(0).tolist() != every.tolist()  # rows moved
    for rows, parts in (([4], (w13, w2)), ([-1], (w13, w2)), ([0], (w13, w2[:3]))):
        with pytest.raises(ValueError, match="rows"):
            row_checksums(*parts, rows=rows)


KERNEL = """
import torch
from esftctl.kernels.row_checksum import BLOCK, _row_words, row_checksums_kernel, row_checksums_reference
device = "{device}"
at = dict(device=torch.device(device), address=lambda t: t.data_ptr())  # the interpreter reads host addresses
g = torch.Generator().manual_seed(3)
w13 = torch.randn(5, 6, 700, generator=g).to(torch.bfloat16).to(device)  # 4,200 words a row: two blocks
assert w13[0].numel() > BLOCK
w2 = torch.randint(0, 256, (5, 10, 3), generator=g).to(torch.uint8).to(device)  # FP8's bytes
scales = torch.rand(5, 2, 3, generator=g).to(device)
rows = [4, 0, 2]
want = row_checksums_reference(*(t[rows] for t in (w13, w2, scales)))
assert torch.equal(row_checksums_kernel(w13, w2, scales, rows=rows, **at), want)
big = torch.randn(10, 6, 700, generator=g).to(torch.bfloat16).to(device)
strided = big[::2]  # rows two apart: read in place, not copied
assert _row_words(strided).data_ptr() == big.data_ptr()
assert torch.equal(row_checksums_kernel(strided, rows=[1, 3], **at), row_checksums_reference(strided[[1, 3]]))
extreme = torch.full((2, 3 * BLOCK), -32768, dtype=torch.int16, device=device)  # the largest sums
assert torch.equal(row_checksums_kernel(extreme, rows=[1], **at), row_checksums_reference(extreme[1:]))
assert _row_words(torch.zeros(3, 5, dtype=torch.uint8)) is None  # odd bytes a row: the reference's
print("ok")
"""


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernel itself (test_kernel_equals_the_reference_on_cuda)")
    run_interpreted(KERNEL.format(device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_equals_the_reference_on_cuda():
    exec(KERNEL.format(device="cuda"), {})
    odd = torch.randint(0, 256, (3, 5), dtype=torch.uint8, device="cuda")  # the dispatch falls back
    assert torch.equal(row_checksums(odd, rows=[2, 0]), row_checksums_reference(odd[[2, 0]]))
    g = torch.Generator().manual_seed(4)
    staged = torch.randn(3, 4, 3000, generator=g).to(torch.bfloat16).pin_memory()  # read over the bus, not copied
    scales = torch.rand(3, 2, 2, generator=g).pin_memory()
    sums = row_checksums(staged, scales, device="cuda")
    assert sums.is_cuda and torch.equal(sums.cpu(), row_checksums_reference(staged, scales))
    plain = torch.randn(3, 8)  # not pinned: the reference, the result on the device asked for
    assert torch.equal(row_checksums(plain, device="cuda").cpu(), row_checksums_reference(plain))
