"""Expert paging on the CPU (host address spaces) and CUDA (driver remapping, load stream, events).

A stack of small MoE layers whose experts come from host memory and, for some experts, from a Huffman
store; the outputs with paging must equal, bit for bit, the outputs with every layer resident, for any
window, any residency and random layer orders, while the window never holds more blocks than it has.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_store import _store_of

from esftctl.errors import EsftError
from esftctl.runtime.paging.blocks import OwnBlocks
from esftctl.runtime.paging.pager import PagedExperts, run_stack
from esftctl.runtime.paging.planner import AdaptiveResidency, ResidencyPlanner
from esftctl.runtime.paging.tiers import LayerSource, store_decoder

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
E, H, I, TOP_K, LAYERS = 8, 64, 32, 2, 6


def make_layers(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"router": torch.randn(E, H, generator=g) * 0.5,
             "w13": (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16),
             "w2": (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)} for _ in range(LAYERS)]


def moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    weights, ids = torch.topk(torch.softmax(x.float() @ router.T, -1), TOP_K)
    gate, up = (w13[ids].float() @ x.float()[:, None, :, None]).squeeze(-1).chunk(2, -1)
    out = (w2[ids].float() @ (torch.nn.functional.silu(gate) * up)[..., None]).squeeze(-1)
    return x + (weights[..., None] * out).sum(1).to(x.dtype)


def resident_outputs(layers, x, order, device):
    """Every layer's experts in ordinary tensors on `device` (the same kernels, so bits can be compared)."""
    on_device = [{k: t.to(device) for k, t in layer.items()} for layer in layers]
    x = x.to(device)
    for l in order:
        x = moe(x, on_device[l]["router"], on_device[l]["w13"], on_device[l]["w2"])
    return x.cpu()


def sources(layers, device, store=None, store_experts=0) -> list[LayerSource]:
    out = []
    for l, layer in enumerate(layers):
        w13, w2 = layer["w13"], layer["w2"]
        if device == "cuda":
            w13, w2 = w13.pin_memory(), w2.pin_memory()
        names = [{w: f"{l}.{e}.{w}" for w in ("gate", "up", "down")} for e in range(E)]
        out.append(LayerSource(w13, w2, store_experts, store_decoder(store, names) if store else None))
    return out


def own_pager(layer_sources, *, device, **options) -> PagedExperts:
    """A pager over bare layers, each with a block of its own (OwnBlocks, as the paging benchmark's stack)."""
    blocks = OwnBlocks(dict(enumerate(layer_sources)), torch.device(device))
    return PagedExperts(layer_sources, blocks=blocks, device=device, **options)


def expert_store(layers, path):
    tensors = {}
    for l, layer in enumerate(layers):
        for e in range(E):
            tensors[f"{l}.{e}.gate"] = layer["w13"][e, :I]
            tensors[f"{l}.{e}.up"] = layer["w13"][e, I:]
            tensors[f"{l}.{e}.down"] = layer["w2"][e]
    return _store_of(tensors, path, chunk=256, table_scope="layer")


def paged_outputs(pager, layers, x, order, device):
    state = {"x": x.to(device)}
    routers = [l["router"].to(device) for l in layers]

    def layer_fn(l, w13, w2):
        state["x"] = moe(state["x"], routers[l], w13, w2)

    run_stack(pager, order, layer_fn, then=order[0])
    return state["x"].cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,resident,store_experts", [(2, (), 0), (3, (0, 4), 3), (1, (), 0), (2, (5,), 8)])
def test_paging_equals_resident(device, window, resident, store_experts, tmp_path):
    layers = make_layers(window * 10 + store_experts)
    store = expert_store(layers, tmp_path / "store") if store_experts else None
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    order = list(range(LAYERS)) * 2  # two forward passes: blocks are reused across passes
    want = resident_outputs(layers, x, order, device)
    pager = own_pager(sources(layers, device, store, store_experts), window=window, resident=resident,
                         device=device)
    got = paged_outputs(pager, layers, x, order, device)
    assert torch.equal(got, want)
    assert 1 <= pager.stats.max_blocks_in_use <= window
    paged_layers = LAYERS - len(resident)
    assert pager.stats.loads >= paged_layers
    assert pager.stats.decoded_experts == store_experts * (pager.stats.loads + len(resident))
    if device == "cuda":
        assert pager.blocks.pool.in_use <= window + len(resident)
    pager.close()


@pytest.mark.parametrize("device", DEVICES)
def test_random_layer_orders_stress(device):
    layers = make_layers(99)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rng = random.Random(0)
    pager = own_pager(sources(layers, device), window=2, device=device)
    for trial in range(6):
        order = [rng.randrange(LAYERS) for _ in range(rng.randint(1, 12))]  # repeats and jumps included
        paged = paged_outputs(pager, layers, x, order, device)
        assert torch.equal(paged, resident_outputs(layers, x, order, device)), order
        assert pager.stats.max_blocks_in_use <= 2
    pager.set_resident([1, 3])
    order = [3, 1, 0, 5, 1, 2]
    assert torch.equal(paged_outputs(pager, layers, x, order, device), resident_outputs(layers, x, order, device))
    pager.set_resident([])
    assert torch.equal(paged_outputs(pager, layers, x, order, device), resident_outputs(layers, x, order, device))
    pager.close()


@pytest.mark.gpu
def test_paging_refuses_cuda_graph_capture():
    layers = make_layers(5)
    pager = own_pager(sources(layers, "cuda"), window=2, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(EsftError, match="CUDA-graph capture"):
        with torch.cuda.graph(graph):
            pager.ensure(0)
    pager.close()


def test_planner_shrinks_grows_and_holds_in_the_dead_zone():
    planner = ResidencyPlanner(num_layers=26, max_resident=4, resident=2)
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 1  # rho 2.5: compute hides loads, give memory back
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 0
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 0  # nothing left to give
    assert planner.update(compute_ms=1.9, load_ms=2.0) == 0  # rho 0.95: dead zone
    for expected in (1, 2, 3, 4, 4):  # rho 0.5: loads show, keep more resident, up to the memory cap
        assert planner.update(compute_ms=1.0, load_ms=2.0) == expected
    assert [round(d["rho"], 2) for d in planner.decisions[:2]] == [2.5, 2.5]


def test_planner_uses_the_store_only_while_host_copies_would_show():
    assert ResidencyPlanner.store_experts(compute_ms=30.0, host_load_ms=20.0, split=55) == 0
    assert ResidencyPlanner.store_experts(compute_ms=10.0, host_load_ms=20.0, split=55) == 55


@pytest.mark.parametrize("device", DEVICES)
def test_changing_the_tier_split_keeps_outputs(device, tmp_path):
    layers = make_layers(7)
    store = expert_store(layers, tmp_path / "store")
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pager = own_pager(sources(layers, device, store, 0), window=2, device=device)
    order = list(range(LAYERS))
    want = resident_outputs(layers, x, order, device)
    for count in (0, 3, E, 1):
        pager.set_store_experts(count)
        assert torch.equal(paged_outputs(pager, layers, x, order, device), want), count
    pager.close()


@pytest.mark.parametrize("device", DEVICES)
def test_pager_times_loads_and_computes(device):
    """What the serving planner reads: one load span per load, one compute span per paged layer run."""
    layers = make_layers(9)
    pager = own_pager(sources(layers, device), window=2, resident=(2,), device=device)
    pager.times.enabled = True  # a planner turns it on
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    paged_outputs(pager, layers, x, list(range(LAYERS)), device)
    if device == "cuda":
        torch.cuda.synchronize()
    compute, load = pager.times.take()
    assert len(compute) == LAYERS - 1 and len(load) == pager.stats.loads  # resident layer 2: neither
    assert all(ms >= 0 for ms in compute + load) and sum(load) > 0
    assert pager.times.take() == ([], [])  # each span is handed out once
    pager.close()


def test_adaptive_residency_follows_rho_within_spare_memory():
    """Fed timings: loads that show make layers resident (spread over the stack, never more than the spare
    memory or the layers outside the window allow); compute that hides the loads gives them back."""
    layers = make_layers(11)
    pager = own_pager(sources(layers, "cpu"), window=1, device="cpu")
    timings, spare = [], {"layers": 3}
    residency = AdaptiveResidency(pager, list(range(LAYERS)), layer_bytes=lambda: 1, every=2,
                                  measure=lambda: timings.pop(0), spare=lambda: spare["layers"])
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = resident_outputs(layers, x, list(range(LAYERS)), "cpu")

    def passes(compute_ms, load_ms, count=2):
        for _ in range(count):
            timings.append(([compute_ms], [load_ms]))
        for _ in range(count):  # the planner runs on every second pass, at the first layer's ensure
            assert torch.equal(paged_outputs(pager, layers, x, list(range(LAYERS)), "cpu"), want)
        timings.clear()
        return sorted(pager.resident)

    assert passes(1.0, 4.0) == [0]  # rho 0.25: one layer more
    assert passes(1.0, 4.0) == [0, 3]
    spare["layers"] = 0  # memory taken meanwhile: no further growth
    assert passes(1.0, 4.0) == [0, 3]
    spare["layers"] = 10
    assert passes(1.0, 4.0, count=8) == [0, 1, 2, 3, 4]  # at most the 5 layers outside the window of 1
    assert passes(0.95, 1.0) == [0, 1, 2, 3, 4]  # rho 0.95: the dead zone, nothing changes
    assert passes(8.0, 1.0) == [0, 1, 3, 4]  # rho 8: compute hides loads, one layer fewer
    assert [d["resident"] for d in residency.decisions] == [1, 2, 2, 3, 4, 5, 5, 5, 4]
    pager.close()
