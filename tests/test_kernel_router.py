"""Top-k routing with the reroute folded in (esftctl.kernels.router): the reference on the CPU; on a GPU the Triton
kernel against it and its ties broken by the lower id (those skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch


def test_router_reference_on_cpu():
    from esftctl.kernels.router import topk_softmax_reroute

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 8, generator=g)
    table = torch.arange(8, dtype=torch.int32).repeat(3, 1)
    table[1, 3] = 42
    adapter_ids = torch.tensor([1] * 10, dtype=torch.int32)
    weights, ids = topk_softmax_reroute(logits, 2, adapter_ids, table, renormalize=True)
    top = torch.softmax(logits, -1).topk(2)
    assert torch.equal(ids, torch.where(top.indices == 3, 42, top.indices).to(torch.int32))
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 16, 333, 4096])
@pytest.mark.parametrize("experts,top_k", [(64, 6), (16, 4), (160, 8), (8, 2)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router_kernel_matches_reference(tokens, experts, top_k, renormalize):
    from esftctl.kernels.router import topk_softmax_reroute, topk_softmax_reroute_reference

    logits = torch.randn(tokens, experts, device="cuda") * 3  # float32: ties have probability zero
    slots = 7
    table = torch.randint(0, 1 << 16, (slots + 1, experts), dtype=torch.int32, device="cuda")
    adapter_ids = torch.randint(-1, slots, (tokens,), dtype=torch.int32, device="cuda")
    for args in ((), (adapter_ids, table)):
        want_w, want_ids = topk_softmax_reroute_reference(logits, top_k, *args, renormalize=renormalize)
        out = (torch.full_like(want_w, float("nan")), torch.full_like(want_ids, -7))  # poisoned
        got_w, got_ids = topk_softmax_reroute(logits, top_k, *args, renormalize=renormalize, out=out)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_router_kernel_breaks_ties_by_lower_id():
    from esftctl.kernels.router import topk_softmax_reroute

    logits = torch.zeros(3, 16, dtype=torch.bfloat16, device="cuda")
    logits[1, 9] = 1.0
    weights, ids = topk_softmax_reroute(logits, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [9, 0, 1, 2], [0, 1, 2, 3]]
    torch.testing.assert_close(weights[0], torch.full((4,), 1 / 16, device="cuda"))
