"""The reroute (esftctl.kernels.reroute): each token's top-k expert ids mapped through its adapter's row of the
layer's expert map. The PyTorch reference's semantics on the CPU; on a GPU the Triton kernel against it, its direct
launch after the first call, and its replay in a CUDA graph (those skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from esftctl.kernels.reroute import reroute, reroute_reference


@pytest.mark.parametrize("tokens,top_k,experts,slots", [(1, 1, 4, 1), (7, 6, 64, 3), (300, 4, 16, 20)])
def test_reroute_reference_semantics(tokens, top_k, experts, slots):
    g = torch.Generator().manual_seed(tokens)
    table = torch.randint(0, 10_000, (slots + 1, experts), generator=g, dtype=torch.int32)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
    adapter_ids = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32)
    out = reroute_reference(ids, adapter_ids, table)
    for t in range(tokens):
        row = slots if adapter_ids[t] < 0 else int(adapter_ids[t])
        assert out[t].tolist() == [int(table[row, int(e)]) for e in ids[t]]
    assert out.dtype == ids.dtype
    in_place = ids.clone()
    reroute(in_place, adapter_ids, table, out=in_place)
    assert torch.equal(in_place, out)
    # the engine passes its whole per-token buffer, planned for the largest step: the first `tokens` entries count
    buffer = torch.cat([adapter_ids, torch.full((50,), slots - 1, dtype=torch.int32)])
    assert torch.equal(reroute(ids, buffer, table), out)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 255, 1024, 16384])
@pytest.mark.parametrize("top_k,experts,slots", [(1, 8, 1), (6, 64, 20), (8, 160, 5)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reroute_kernel_matches_reference(tokens, top_k, experts, slots, dtype):
    from esftctl.kernels.reroute import reroute, reroute_reference

    table = torch.randint(0, 1 << 20, (slots + 1, experts), dtype=torch.int32, device="cuda")
    ids = torch.randint(0, experts, (tokens, top_k), dtype=dtype, device="cuda")
    adapter_ids = torch.randint(-1, slots, (tokens,), dtype=torch.int32, device="cuda")
    want = reroute_reference(ids, adapter_ids, table)
    out = torch.full_like(ids, -7)  # poisoned: every element must be written
    assert torch.equal(reroute(ids, adapter_ids, table, out=out), want)
    in_place = ids.clone()
    reroute(in_place, adapter_ids, table, out=in_place)
    assert torch.equal(in_place, want)


@pytest.mark.gpu
def test_reroute_launches_its_kernel_directly_after_the_first_call():
    """After one call per device and dtypes, `reroute` calls Triton's launcher itself (kernels/reroute.py says
    why): every later call, at any token count and with an adapter buffer longer than the tokens, still writes
    exactly the reference's ids."""
    from esftctl.kernels import reroute as module

    table = torch.randint(0, 1 << 20, (21, 217), dtype=torch.int32, device="cuda")
    buffer = torch.randint(-1, 20, (20000,), dtype=torch.int32, device="cuda")
    for tokens in (5, 262, 1, 16384, 17, 262):
        ids = torch.randint(0, 217, (tokens, 6), dtype=torch.int32, device="cuda")
        out = torch.full_like(ids, -7)
        assert torch.equal(module.reroute(ids, buffer, table, out=out),
                           module.reroute_reference(ids, buffer[:tokens], table))
    key = (ids.get_device(), torch.int32, torch.int32, torch.int32, torch.int32)
    assert module._launchers[key] is not None  # the direct launch is what ran after the first call
    with pytest.raises(AssertionError, match="fewer adapter ids"):
        module.reroute(ids, buffer[:10], table)


@pytest.mark.gpu
def test_reroute_in_cuda_graph():
    from esftctl.kernels.reroute import reroute, reroute_reference

    tokens, top_k, experts, slots = 256, 6, 64, 10
    ids = torch.zeros(tokens, top_k, dtype=torch.int32, device="cuda")
    adapter_ids = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    table = torch.zeros(slots + 1, experts, dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)
    reroute(ids, adapter_ids, table, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reroute(ids, adapter_ids, table, out=out)
    for seed in range(3):
        torch.manual_seed(seed)
        ids.copy_(torch.randint(0, experts, ids.shape, device="cuda"))
        adapter_ids.copy_(torch.randint(-1, slots, adapter_ids.shape, device="cuda"))
        table.copy_(torch.randint(0, 1000, table.shape, device="cuda"))
        graph.replay()
        assert torch.equal(out, reroute_reference(ids, adapter_ids, table))
