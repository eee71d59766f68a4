"""The Triton Huffman decoder against the CPU decoder, on fresh random inputs (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from test_store import _heavy_tailed, _special_values, _store_of

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk", [64, 1024])
def test_gpu_decode_matches_cpu(tmp_path, chunk):
    torch.manual_seed(chunk)
    rows = torch.exp(torch.randn(1408, 1) * 0.5)  # trained-like: a scale per row
    tensors = {"specials": _special_values(100_003, chunk), "heavy": _heavy_tailed(65_537, chunk),
               "expert": (torch.randn(1408, 2048) * rows * 0.02).to(torch.bfloat16),
               "one": torch.tensor([-0.5], dtype=torch.bfloat16),
               "constant": torch.full((4099,), 0.25, dtype=torch.bfloat16)}  # a one-symbol code
    store = _store_of(tensors, tmp_path / "s", chunk=chunk, table_scope="tensor")
    for name, t in tensors.items():
        poisoned = torch.full((t.numel() + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
        # At the allocation's start the plan uses vector loads and stores; one value in, it cannot.
        for out in (poisoned[:-1].view(t.shape), poisoned[1:].view(t.shape)):
            plan = store.plan([(name, out)])
            assert plan.aligned == (out.data_ptr() % 32 == 0)  # chunks are whole groups in every store
            plan.run()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu().view(torch.int16), store.decode_tensor(name).view(torch.int16)), name
            assert torch.equal(out.cpu().view(torch.int16), t.view(torch.int16)), name


def test_one_launch_into_virtual_tensor_rows_and_graph_replay(tmp_path):
    """A layer's experts decoded straight into mapped rows of its virtual w13/w2 tensors, in one launch."""
    from esftctl.checkpoint import ExpertWeights
    from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool
    from esftctl.runtime.moe_layer import VirtualMoELayer

    h, i, e = 512, 384, 6
    torch.manual_seed(0)
    experts = {x: ExpertWeights(*((torch.randn(s) * 0.02).to(torch.bfloat16) for s in ((i, h), (i, h), (h, i))))
               for x in range(e)}
    tensors = {f"{x}.{w}": t for x, ew in experts.items() for w, t in ew.items()}
    store = _store_of(tensors, tmp_path / "s", chunk=256, table_scope="layer")
    pool = PhysicalPagePool(0)
    layer = VirtualMoELayer(e, h, i, 2, 2, torch.bfloat16, lambda n: CudaAddressSpace(n, pool))
    layer.w13.map_rows(range(e))
    layer.w2.map_rows(range(e))
    targets = []
    for x in range(e):
        targets += [(f"{x}.gate", layer.w13.tensor[x, :i]), (f"{x}.up", layer.w13.tensor[x, i:]),
                    (f"{x}.down", layer.w2.tensor[x])]
    plan = store.plan(targets)
    layer.w13.tensor[:e].fill_(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run()
    graph.replay()
    torch.cuda.synchronize()
    for x, ew in experts.items():
        assert torch.equal(layer.w13.tensor[x, :i].cpu(), ew.gate)
        assert torch.equal(layer.w13.tensor[x, i:].cpu(), ew.up)
        assert torch.equal(layer.w2.tensor[x].cpu(), ew.down)
    layer.close()
    pool.trim()
