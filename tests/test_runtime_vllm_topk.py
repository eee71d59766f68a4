"""The reroute folded into vLLM's compiled grouped top-k (esftctl.runtime.vllm.topk), on vLLM's own router.

A GroupedTopKRouter as DeepSeek-V2 builds it (softmax, one group) and as DeepSeek-V3 does (sigmoid, 4 groups of
which 2 are kept, a score-correction bias, routed scaling), each called once as vLLM leaves it and once folded:
the weights must be bit for bit vLLM's, and the ids the kernel's reference applied to vLLM's ids, also after the
table changes in place (an adapter loaded) and for fewer tokens than the adapter buffer holds. Where the routing
does not pass through `grouped_topk` after all, the ids are rerouted after it. On the GPU the folded step
launches no reroute kernel, and a CUDA graph of it replays as the tokens' adapters change.
"""

from __future__ import annotations

import pytest
import torch
from conftest import has_gpu

from esftctl.kernels.reroute import reroute_reference
from esftctl.runtime.vllm import topk
from esftctl.runtime.vllm.topk import fold_reroute, folds

E, K, TOKENS = 16, 4, 5  # and an adapter buffer of 8 (table_and_adapters)
ROUTERS = {  # name -> GroupedTopKRouter's arguments past top_k and global_num_experts
    "deepseek_v2": dict(num_expert_group=1, topk_group=1, renormalize=False),
    "deepseek_v3": dict(num_expert_group=4, topk_group=2, renormalize=True, scoring_func="sigmoid",
                        routed_scaling_factor=2.5),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def router(name: str, device: str):
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    args = dict(ROUTERS[name])
    if name == "deepseek_v3":
        args["e_score_correction_bias"] = torch.linspace(-0.1, 0.1, E, device=device)
    return GroupedTopKRouter(top_k=K, global_num_experts=E, **args)


def table_and_adapters(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two adapter slots and the base row: slot 0 replaces experts 0-7 (rows 16-23), slot 1 experts 8-15 (rows
    32-39); the tokens on slot 0, the base, slot 1, slot 0, slot 1, then padding."""
    table = torch.arange(E, dtype=torch.int32, device=device).repeat(3, 1)
    table[0, :8] += E
    table[1, 8:] += 2 * E
    adapters = torch.tensor([0, -1, 1, 0, 1, -1, -1, -1], dtype=torch.int32, device=device)
    return table, adapters


def routed(r, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, E, generator=g).to(device, torch.bfloat16)
    return r._compute_routing(torch.zeros(TOKENS, 8, device=device, dtype=torch.bfloat16), logits, torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_folded_routing_gives_vllms_weights_and_the_rerouted_ids(name, device):
    if device == "cpu" and name == "deepseek_v3" and has_gpu():
        pytest.skip("vLLM's CUDA build computes a biased grouped top-k in its CUDA op only, even for CPU tensors")
    table, adapters = table_and_adapters(device)
    plain, folded = router(name, device), router(name, device)
    assert folds(folded) and fold_reroute(folded, adapters, table)
    for seed in range(3):
        weights, ids = routed(plain, device, seed)
        weights_f, ids_f = routed(folded, device, seed)
        assert torch.equal(weights_f, weights), "the weights must be vLLM's, bit for bit"
        assert ids_f.dtype == ids.dtype and torch.equal(ids_f, reroute_reference(ids, adapters[:TOKENS], table))
    assert (ids_f >= E).any(), "some token must reach an adapter row"
    table[0] = torch.arange(E)  # slot 0 unloaded in place: its tokens route to the base rows
    weights, ids = routed(plain, device, 7)
    assert torch.equal(routed(folded, device, 7)[1], reroute_reference(ids, adapters[:TOKENS], table))
    other = table.clone()
    other[2, 0] = 1  # the base row changed, so the fold below must read this table, and only it, once
    assert fold_reroute(folded, adapters, other)
    assert torch.equal(routed(folded, device, 7)[1], reroute_reference(ids, adapters[:TOKENS], other))


def test_routing_that_bypasses_the_compiled_top_k_is_rerouted_after_it(monkeypatch):
    import importlib

    table, adapters = table_and_adapters("cpu")
    plain, folded = router("deepseek_v2", "cpu"), router("deepseek_v2", "cpu")
    assert fold_reroute(folded, adapters, table)
    module = importlib.import_module(topk.ROUTER_MODULE)
    monkeypatch.setattr(module, "grouped_topk", module.grouped_topk.__wrapped__)  # vLLM's own, as another path
    _, ids = routed(plain, "cpu")
    assert torch.equal(routed(folded, "cpu")[1], reroute_reference(ids, adapters[:TOKENS], table))


def test_routers_that_route_elsewhere_are_not_folded(monkeypatch):
    table, adapters = table_and_adapters("cpu")
    invalid = router("deepseek_v2", "cpu")
    invalid.num_expert_group = E
    captured = router("deepseek_v2", "cpu")
    captured.set_capture_fn(lambda ids: None)  # a capture callback already set: it wants vLLM's ids
    assert not folds(invalid) and not folds(captured) and not folds(object())
    assert not fold_reroute(invalid, adapters, table) and invalid._compute_routing.__name__ == "_compute_routing"
    monkeypatch.delenv(topk.FOLD_ENV, raising=False)
    assert topk.enabled(), "on by default since the GPU served with it exactly"
    monkeypatch.setenv(topk.FOLD_ENV, "0")
    assert not topk.enabled()


@pytest.mark.gpu
def test_a_folded_step_launches_no_reroute_kernel_and_replays_in_a_cuda_graph():
    table, adapters = table_and_adapters("cuda")
    plain, folded = router("deepseek_v2", "cuda"), router("deepseek_v2", "cuda")
    fold_reroute(folded, adapters, table)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, E, generator=g).to("cuda", torch.bfloat16)
    hidden = torch.zeros(TOKENS, 8, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # compiled and warm
        folded._compute_routing(hidden, logits, torch.int32)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        folded._compute_routing(hidden, logits, torch.int32)
        torch.cuda.synchronize()
    assert not [e for e in prof.events() if "reroute" in e.name], "the reroute must be folded into the top-k"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ids_out = folded._compute_routing(hidden, logits, torch.int32)
    _, ids = plain._compute_routing(hidden, logits, torch.int32)
    for step in ([0, -1, 1, 0, 1], [1, 1, -1, -1, 0]):
        adapters[:TOKENS] = torch.tensor(step, dtype=torch.int32)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids_out, reroute_reference(ids, adapters[:TOKENS], table))
