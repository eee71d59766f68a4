"""The routed-row fetch (esftctl.kernels.row_fetch) against its PyTorch reference, and the Huffman decoder's masked
runs: on the CPU the references' own rules, on CUDA the kernels (fresh random rows, poisoned destinations, random
ids with repeats, every setting read on the device and followed by a captured graph's replays)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_interpreted

from esftctl.kernels.row_fetch import fetch_rows_reference, mark_rows_reference

ROWS, A, B = 12, (24, 16), (16, 12)  # rows, a w13 row's shape, a w2 row's shape (bf16: 768 and 384 bytes)


def test_reference_marks_the_routed_rows_once_and_nothing_when_inactive():
    needed = torch.zeros(ROWS, dtype=torch.int32)
    ids = torch.tensor([[3, 5], [5, 11], [3, 0]])
    assert mark_rows_reference(ids, needed, True) == [0, 3, 5, 11]
    assert needed.tolist() == [int(r in (0, 3, 5, 11)) for r in range(ROWS)]
    assert mark_rows_reference(None, needed, True) == list(range(ROWS))
    assert mark_rows_reference(ids, needed, False) == [] and not needed.any()


def test_reference_fetch_skips_the_store_tier_and_rows_without_a_source():
    src = {r: [(torch.full((4,), float(r)), torch.zeros(4))] for r in range(6)}
    src[4] = [(None, torch.zeros(4))]
    copied = fetch_rows_reference([1, 2, 4, 5], 2, src)
    assert copied == 2 * 4 * 4  # rows 2 and 5: row 1 is the store's, row 4 has no source
    assert [float(src[r][0][1][0]) for r in range(6)] == [0, 0, 2, 0, 0, 5]


INTERPRETED = """
import torch
from esftctl.kernels.row_fetch import RowFetch, fetch_rows_reference, mark_rows_reference
g = torch.Generator().manual_seed(0)
h13, h2 = torch.randn({rows}, *{a}, generator=g).bfloat16(), torch.randn({rows}, *{b}, generator=g).bfloat16()
d13, d2 = torch.full(({rows}, *{a}), 7.0).bfloat16(), torch.full(({rows}, *{b}), 7.0).bfloat16()
want13, want2 = d13.clone(), d2.clone()
fetch = RowFetch(d13, d2, address=lambda t: t.data_ptr())  # the interpreter reads host addresses as they are
held = [r for r in range({rows}) if r != 9]
fetch.set_sources([(h13[r], h2[r]) if r in held else (None, None) for r in range({rows})])
fetch.first_host.fill_(2)
ids = torch.tensor([[3, 5], [5, 11], [3, 0], [9, 1]], dtype=torch.int32)
needed = torch.zeros({rows}, dtype=torch.int32)
rows = mark_rows_reference(ids, needed, True)
fetch_rows_reference(rows, 2, {{r: [(h13[r], want13[r]), (h2[r], want2[r])] for r in held}})
fetch.mark(ids)
fetch.fetch(3)
assert torch.equal(fetch.needed, needed) and sorted(fetch.listing[:int(fetch.count)].tolist()) == rows
assert torch.equal(d13, want13) and torch.equal(d2, want2) and fetch.stats.tolist() == [len(rows), 1]
fetch.mark(None)
assert sorted(fetch.listing[:int(fetch.count)].tolist()) == held and bool(fetch.needed.all())
fetch.active.zero_()
fetch.mark(ids)
assert int(fetch.count) == 0 and not fetch.needed.any() and fetch.stats.tolist() == [len(rows) + len(held), 2]
print("ok")
"""


def test_kernels_in_the_interpreter():
    """The kernels' logic run by Triton's CPU interpreter (host addresses stand in for the bus), so machines
    without a GPU check it too: marks, listing, the persistent fetch's striding, the tier boundary, inactivity.
    (Where a GPU runs the kernels themselves, the interpreter is not needed: Triton 3.6's, on the H100 machine,
    cannot run the fetch's strided loop.)"""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernels themselves (test_kernels_equal_the_reference)")
    code = INTERPRETED.format(rows=ROWS, a=A, b=B)
    run_interpreted(code)


def _rows(device="cpu", pin=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(ROWS, *A, generator=g).to(torch.bfloat16)
    w2 = torch.randn(ROWS, *B, generator=g).to(torch.bfloat16)
    return (w13.pin_memory(), w2.pin_memory()) if pin else (w13.to(device), w2.to(device))


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 7, 512])
def test_kernels_equal_the_reference(programs):
    from esftctl.kernels.row_fetch import RowFetch

    host13, host2 = _rows(pin=True, seed=programs)
    dev13, dev2 = torch.full((ROWS, *A), 7.0, dtype=torch.bfloat16, device="cuda"), \
        torch.full((ROWS, *B), 7.0, dtype=torch.bfloat16, device="cuda")
    fetch = RowFetch(dev13, dev2)
    held = [r for r in range(ROWS) if r != 9]  # row 9 has no source
    fetch.set_sources([(host13[r], host2[r]) if r in held else (None, None) for r in range(ROWS)])
    fetch.first_host.fill_(2)  # rows 0 and 1: the store tier's
    want13, want2 = dev13.cpu(), dev2.cpu()
    g = torch.Generator().manual_seed(programs)
    ids = torch.randint(0, ROWS, (9, 3), generator=g, dtype=torch.int32)  # repeats on purpose
    needed = torch.zeros(ROWS, dtype=torch.int32)
    rows = mark_rows_reference(ids, needed, True)
    fetch_rows_reference(rows, 2, {r: [(host13[r], want13[r]), (host2[r], want2[r])] for r in held})
    fetch.mark(ids.cuda())
    fetch.fetch(programs)
    torch.cuda.synchronize()
    assert torch.equal(fetch.needed.cpu(), needed)
    assert sorted(fetch.listing[: int(fetch.count)].tolist()) == rows
    assert torch.equal(dev13.cpu(), want13) and torch.equal(dev2.cpu(), want2)
    assert fetch.stats.tolist() == [len(rows), 1]
    fetch.mark(None)  # a whole layer: every held row listed (not row 9), every row needed
    torch.cuda.synchronize()
    assert sorted(fetch.listing[: int(fetch.count)].tolist()) == held and bool(fetch.needed.all())


@pytest.mark.gpu
def test_a_captured_fetch_follows_its_settings_and_sources():
    from esftctl.kernels.row_fetch import RowFetch

    host13, host2 = _rows(pin=True, seed=3)
    other13, other2 = _rows(pin=True, seed=4)
    dev13, dev2 = torch.zeros(ROWS, *A, dtype=torch.bfloat16, device="cuda"), \
        torch.zeros(ROWS, *B, dtype=torch.bfloat16, device="cuda")
    fetch = RowFetch(dev13, dev2)
    fetch.set_sources([(host13[r], host2[r]) for r in range(ROWS)])
    ids = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fetch.mark(ids)
        fetch.fetch(64)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fetch.mark(ids)
        fetch.fetch(64)
    cases = [([1, 2, 3, 4, 1, 2, 3, 4], True, 0, host13), ([5, 6, 7, 8, 9, 10, 11, 0], True, 8, host13),
             ([1, 2, 3, 4, 5, 6, 7, 8], False, 0, host13), ([0, 3, 6, 9, 0, 3, 6, 9], True, 0, other13)]
    for chosen, active, first_host, source in cases:
        dev13.fill_(7)
        ids.copy_(torch.tensor(chosen, dtype=torch.int32).view(4, 2))
        fetch.active.fill_(int(active))
        fetch.first_host.fill_(first_host)
        fetch.set_sources([(source[r], (host2 if source is host13 else other2)[r]) for r in range(ROWS)])
        graph.replay()
        torch.cuda.synchronize()
        for r in range(ROWS):
            fetched = active and r in chosen and r >= first_host
            assert torch.equal(dev13[r].cpu(), source[r]) if fetched else bool((dev13[r] == 7).all()), (chosen, r)


@pytest.mark.gpu
def test_masked_decode_writes_only_needed_rows_below_the_host_tier(tmp_path):
    from test_formats_store import _store_of

    experts, inter, hidden = 6, 32, 64
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(torch.bfloat16)
    tensors = {}
    for e in range(experts):
        tensors |= {f"{e}.gate": w13[e, :inter], f"{e}.up": w13[e, inter:], f"{e}.down": w2[e]}
    store = _store_of(tensors, tmp_path / "s", chunk=256)
    dev13, dev2 = torch.full_like(w13, 7, device="cuda"), torch.full_like(w2, 7, device="cuda")
    targets, rows = [], []
    for e in range(experts):
        targets += [(f"{e}.gate", dev13[e, :inter]), (f"{e}.up", dev13[e, inter:]), (f"{e}.down", dev2[e])]
        rows += [e, e, e]
    plan = store.plan(targets, rows=rows)
    needed = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32, device="cuda")
    first_host = torch.tensor([4], dtype=torch.int32, device="cuda")
    plan.run(needed, first_host)
    torch.cuda.synchronize()
    for e in range(experts):
        decoded = e in (0, 2, 3)  # needed and below row 4
        assert torch.equal(dev13[e].cpu(), w13[e]) if decoded else bool((dev13[e] == 7).all()), e
        assert torch.equal(dev2[e].cpu(), w2[e]) if decoded else bool((dev2[e] == 7).all()), e
    plan.run()  # unmasked: every row
    torch.cuda.synchronize()
    assert torch.equal(dev13.cpu(), w13) and torch.equal(dev2.cpu(), w2)


def test_reference_marks_ignore_ids_past_the_rows():
    """A paged layer's fetch covers its base rows: routed ids past them (adapter rows) are neither marked nor
    listed, as the mark kernel's bound on n_rows does."""
    needed = torch.zeros(4, dtype=torch.int32)
    assert mark_rows_reference(torch.tensor([[1, 6], [5, 3]]), needed, True) == [1, 3]
    assert needed.tolist() == [0, 1, 0, 1]


def test_zero_copy_views_refuse_memory_that_is_not_pinned():
    from esftctl.kernels.row_fetch import mapped_on_device

    with pytest.raises(ValueError, match="pinned"):
        mapped_on_device(torch.zeros(8), torch.device("cpu"))


@pytest.mark.gpu
def test_a_zero_copy_view_reads_and_writes_the_host():
    from esftctl.kernels.row_fetch import mapped_on_device

    host = torch.arange(4096, dtype=torch.int32).pin_memory()
    view = mapped_on_device(host, torch.device("cuda"))
    assert view.is_cuda and view.shape == host.shape and torch.equal(view.clone().cpu(), host)
    view.mul_(2)  # a kernel's stores land in host memory
    torch.cuda.synchronize()
    assert torch.equal(host, torch.arange(4096, dtype=torch.int32) * 2)
