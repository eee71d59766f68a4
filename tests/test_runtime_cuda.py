"""Runtime core on CUDA: the driver's virtual memory API, eviction under queued work, staging in pinned memory
(the reroute and router kernels: tests/test_kernel_reroute.py, tests/test_kernel_router.py).

Skipped without a GPU; run on the device machine (see the issue notes for what they printed there).
"""

from __future__ import annotations

import pytest
import torch

from esftctl.formats.checkpoint import ExpertWeights

pytestmark = pytest.mark.gpu


def _expert(i, h, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return ExpertWeights(*(torch.randn(s, generator=g, device=device).to(torch.bfloat16)
                           for s in ((i, h), (i, h), (h, i))))


@pytest.fixture(scope="module")
def pool():
    from esftctl.runtime.address_space import PhysicalPagePool

    p = PhysicalPagePool(0)
    yield p
    p.trim()


def test_granularity_and_memory_follow_mappings(pool):
    from esftctl.runtime.address_space import CudaAddressSpace

    page = pool.page_size
    assert page >= 64 << 10 and page & (page - 1) == 0
    pool.trim()
    free0 = torch.cuda.mem_get_info()[0]
    space = CudaAddressSpace(64 * page, pool)  # reserving costs no memory
    assert free0 - torch.cuda.mem_get_info()[0] < page
    for p in range(0, 64, 2):
        space.map_pages([p])
    used = free0 - torch.cuda.mem_get_info()[0]
    assert 32 * page <= used < 34 * page
    view = space.view(torch.float32, (64 * page // 4,))
    per = page // 4
    for p in range(0, 64, 2):
        view[p * per:(p + 1) * per].fill_(p)
    torch.cuda.synchronize()
    assert all(float(view[p * per + 7]) == p for p in range(0, 64, 2))
    for p in range(0, 64, 2):
        space.unmap_pages([p])
    assert pool.free_pages == 32  # back in the pool, not yet returned
    pool.trim()
    assert free0 - torch.cuda.mem_get_info()[0] < page
    space.close()


def test_reserve_sets_memory_aside_and_takes_draw_it_down(pool):
    """Reserved pages hold device memory at once; maps made later use it up before the device gives more, so
    the memory in use stays at the reservation while mappings fit in it."""
    from esftctl.runtime.address_space import CudaAddressSpace

    page = pool.page_size
    pool.trim()
    free0 = torch.cuda.mem_get_info()[0]
    pool.reserve(40)
    assert pool.reserved_pages == 40 and 40 * page <= free0 - torch.cuda.mem_get_info()[0] < 42 * page
    space = CudaAddressSpace(64 * page, pool)
    space.map_pages(range(0, 3))  # one handle of 2 pages and one of 1: taken from the reserve
    space.map_pages(range(10, 30))
    assert pool.reserved_pages == 40 - 23
    assert 40 * page <= free0 - torch.cuda.mem_get_info()[0] < 42 * page  # no more than reserved
    space.map_pages(range(30, 60))  # past the reserve: 13 more pages from the device
    assert pool.reserved_pages == 0 and 53 * page <= free0 - torch.cuda.mem_get_info()[0] < 55 * page
    space.close()
    pool.trim()
    pool.release_reserve()
    assert free0 - torch.cuda.mem_get_info()[0] < page


def test_runs_of_pages_map_as_few_large_handles(pool):
    """A run of pages is backed by power-of-two handles of at most 32 pages (one driver mapping each); pages
    inside a handle can go and come back while its other pages keep their data, and the handle's memory
    returns to the pool only when all its pages are gone."""
    from esftctl.runtime.address_space import CudaAddressSpace

    page = pool.page_size
    pool.trim()
    space = CudaAddressSpace(120 * page, pool)
    space.map_pages(range(40, 110))  # 70 pages: 32 + 32 + 4 + 2
    assert space.handles == 4 and pool.in_use == 70
    space.unmap_pages(range(40, 110))
    assert space.handles == 0 and pool.in_use == 0 and pool.free_pages == 70
    space.map_pages(range(10, 20))  # 8 + 2 pages: the 2 from the pool, the 8 from the driver
    space.map_pages([30, 31, 33])
    assert space.handles == 4
    view = space.view(torch.int32, (40 * page // 4,))
    per = page // 4
    for p in (*range(10, 20), 30, 31, 33):
        view[p * per:(p + 1) * per].fill_(p)
    space.unmap_pages([12, 13, 14, 31])
    assert space.handles == 4 and pool.in_use == 13  # each of those handles still holds mapped pages
    space.unmap_pages([30])
    assert space.handles == 3 and pool.in_use == 11
    space.map_pages([13, 12, 14])
    view[12 * per:15 * per].fill_(-1)
    torch.cuda.synchronize()
    for p in (10, 11, 15, 19, 33):
        assert int(view[p * per]) == p and int(view[(p + 1) * per - 1]) == p
    assert int(view[13 * per + 5]) == -1
    space.close()
    assert pool.in_use == 0


def _cuda_layer(pool, e, h, i, slots, per_slot):
    from esftctl.runtime.address_space import CudaAddressSpace
    from esftctl.runtime.moe_layer import VirtualMoELayer

    layer = VirtualMoELayer(e, h, i, num_slots=slots, experts_per_slot=per_slot, dtype=torch.bfloat16,
                            make_space=lambda n: CudaAddressSpace(n, pool))
    layer.load_base({x: _expert(i, h, x) for x in range(e)})
    return layer


def test_layer_sharing_cases_on_gpu(pool):
    """Experts of 1.5 pages (sizes not a multiple of the page): neighbours, evict the middle one, reload."""
    from esftctl.runtime.adapters import AdapterSlots

    h, i, e = 1024, 384, 8  # w13 row: 2*384*1024*2 = 1.5 MiB, w2 row 0.75 MiB
    layer = _cuda_layer(pool, e, h, i, slots=4, per_slot=4)
    slots = AdapterSlots({1: layer})
    loads = {"a": [0, 1], "b": [2, 3, 4], "c": [5]}
    weights = {n: {x: _expert(i, h, 100 * k + x) for x in ids} for k, (n, ids) in enumerate(loads.items())}
    for n in loads:
        slots.load(n, {1: weights[n]})
    free0 = torch.cuda.mem_get_info()[0]
    slots.evict("b")
    torch.cuda.synchronize()
    slots.collect()
    pool.trim()
    returned = torch.cuda.mem_get_info()[0] - free0
    assert returned > 0
    slots.load("d", {1: {6: _expert(i, h, 7), 7: _expert(i, h, 8)}})
    torch.cuda.synchronize()
    for n in ("a", "c"):
        for x, row in layer.slot_rows[slots.slot_of(n)].items():
            assert torch.equal(layer.w13.tensor[row, :i], weights[n][x].gate)
            assert torch.equal(layer.w2.tensor[row], weights[n][x].down)
    for t in (layer.w13, layer.w2):
        rows = [r for r in range(t.num_rows) if t.is_mapped(r)]
        touched = {p for r in rows for p in range(r * t.row_bytes // t.pages.page_size,
                                                  ((r + 1) * t.row_bytes - 1) // t.pages.page_size + 1)}
        assert t.stats().mapped_pages == len(touched)
    layer.close()


def test_evict_waits_for_queued_work(pool):
    """Rows of an evicted adapter stay mapped until a kernel queued before the eviction has finished."""
    from esftctl.runtime.adapters import AdapterSlots

    h, i, e = 2048, 1408, 4
    layer = _cuda_layer(pool, e, h, i, slots=2, per_slot=2)
    slots = AdapterSlots({1: layer})
    w = _expert(i, h, 42)
    slots.load("a", {1: {0: w}})
    row = layer.slot_rows[0][0]
    want = (w.gate.float() @ torch.ones(h, device="cuda")).sum()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the read
        got = (layer.w13.tensor[row, :i].float() @ torch.ones(h, device="cuda")).sum()
    slots.evict("a", streams=[side, torch.cuda.current_stream()])
    assert slots.pending_releases == 1 and layer.w13.is_mapped(row)
    assert slots.collect() == 0 and layer.w13.is_mapped(row)
    side.synchronize()
    torch.cuda.synchronize()
    assert slots.collect() == 1 and not layer.w13.is_mapped(row)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
    layer.close()


def test_staged_rows_stay_in_pinned_host_memory(pool):
    """An engine layout that converts on the device (vLLM's own processing does) still stages into pinned host
    memory: staged adapters of the host cache never hold GPU memory outside the adapter budget."""
    from esftctl.runtime.address_space import CudaAddressSpace
    from esftctl.runtime.host_cache import stage
    from esftctl.runtime.moe_layer import ExpertLayout, VirtualMoELayer

    e, h, i = 4, 256, 128
    on_device = ExpertLayout((2 * i, h), (h, i), lambda w13, w2: (w13.cuda() * 1, w2.cuda() * 1))
    layer = VirtualMoELayer(e, h, i, num_slots=2, experts_per_slot=2, dtype=torch.bfloat16,
                            make_space=lambda n: CudaAddressSpace(n, pool), layout=on_device)
    layer.load_base({x: _expert(i, h, x, "cpu") for x in range(e)})
    experts = {1: _expert(i, h, 11, "cpu"), 3: _expert(i, h, 12, "cpu")}
    staged = stage({0: layer}, {0: experts})
    _, (w13, w2), _ = staged.layers[0]
    assert w13.device.type == w2.device.type == "cpu" and w13.is_pinned() and w2.is_pinned()
    rows = layer.load(0, dict.fromkeys(experts), staged.rows()[0])
    torch.cuda.synchronize()
    assert torch.equal(layer.w13.tensor[rows[3]].cpu(), torch.cat([experts[3].gate, experts[3].up]))
    assert torch.equal(layer.w2.tensor[rows[1]].cpu(), experts[1].down)
    layer.close()
