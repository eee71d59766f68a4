"""The Triton Huffman decoder (esftctl.kernels.huffman_decode): its logic under Triton's CPU interpreter, and on a
GPU against the CPU decoder on fresh random inputs (those skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_interpreted
from test_formats_store import _heavy_tailed, _special_values, _store_of

INTERPRETED_DECODE = """
import sys, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_formats_store import _store_of, _special_values, _heavy_tailed
tensors = {{"specials": _special_values(3001, 1), "normal": (torch.randn(70, 50) * 0.02).to(torch.bfloat16),
           "heavy": _heavy_tailed(999, 2), "one": torch.tensor([1.5], dtype=torch.bfloat16),
           "constant": torch.full((333,), 0.25, dtype=torch.bfloat16)}}
for chunk, scope in ((16, "layer"), (64, "tensor"), (48, "layer")):  # "tensor": a one-symbol code
    store = _store_of(tensors, Path({tmp!r}) / f"s{{chunk}}", chunk=chunk, table_scope=scope)
    outs = [(n, torch.full(t.shape, float("nan"), dtype=torch.bfloat16)) for n, t in tensors.items()]
    store.plan(outs).run()
    for n, out in outs:
        assert torch.equal(out.view(torch.int16), tensors[n].view(torch.int16)), (chunk, n)
    # Paging's masked run: tensor k is row k; only rows needed and below the first host row are decoded.
    outs = [(n, torch.full(t.shape, float("nan"), dtype=torch.bfloat16)) for n, t in tensors.items()]
    needed, first_host = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    store.plan(outs, rows=list(range(len(outs)))).run(needed, first_host)
    for k, (n, out) in enumerate(outs):
        decoded = k in (0, 2)
        assert torch.equal(out.view(torch.int16), tensors[n].view(torch.int16)) if decoded else out.isnan().all()
print("ok")
"""


def test_triton_decoder_in_the_interpreter(tmp_path):
    """The GPU kernel's logic, run by Triton's CPU interpreter, so machines without a GPU check it too."""
    pytest.importorskip("triton")
    code = INTERPRETED_DECODE.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    run_interpreted(code)


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_one_launch_into_virtual_tensor_rows_and_graph_replay(tmp_path):
    """A layer's experts decoded straight into mapped rows of its virtual w13/w2 tensors, in one launch."""
    from esftctl.formats.checkpoint import ExpertWeights
    from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool
    from esftctl.runtime.moe_layer import VirtualMoELayer

    h, i, e = 512, 384, 6
    torch.manual_seed(0)
    experts = {x: ExpertWeights(*((torch.randn(s) * 0.02).to(torch.bfloat16) for s in ((i, h), (i, h), (h, i))))
               for x in range(e)}
    tensors = {f"{x}.{w}": t for x, ew in experts.items() for w, t in ew.items()}
    store = _store_of(tensors, tmp_path / "s", chunk=256, table_scope="layer")
    pool = PhysicalPagePool(0)
    layer = VirtualMoELayer(e, h, i, num_slots=2, experts_per_slot=2, dtype=torch.bfloat16,
                            make_space=lambda n: CudaAddressSpace(n, pool))
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


@pytest.mark.gpu
def test_gpu_decoder_stays_inside_its_buffers(tmp_path):
    """Issue 32: a crafted store made the kernel write 512 values past its destination. On the device: segments
    that would read or write outside their buffers are refused before a launch; chunks that start at the data's very
    end (their loads masked) write the tensor's values and not one past them; the issue's store (count 2112 for a
    [40, 40] tensor, checksums recomputed) is refused on opening."""
    import numpy as np
    from test_formats_untrusted_stores import TENSORS, _segment, _write

    from esftctl.errors import EsftError
    from esftctl.formats.store import ExpertStore
    from esftctl.kernels.huffman_decode import DecodePlan

    store = ExpertStore(_write(tmp_path / "s"))
    data, tables = store.to_device(torch.device("cuda"))
    guard = 64
    for case in ("exact", "chunks at the data's end", "chunks at the stream's end"):
        buffer = torch.full((1600 + 2 * guard,), 7.0, dtype=torch.bfloat16, device="cuda")
        out = buffer[guard:guard + 1600].view(40, 40)
        segment = _segment(store, "c", out=out)
        if case != "exact":
            end = 8 * data.numel() if case == "chunks at the data's end" else int(segment.bits[-1]) + 1
            segment = _segment(store, "c", out=out, bits=np.full(len(segment.bits), end, dtype=np.int64))
        DecodePlan.build(data, tables, store.chunk, [segment]).run()
        torch.cuda.synchronize()
        assert (buffer[:guard] == 7.0).all() and (buffer[-guard:] == 7.0).all(), case
        if case == "exact":
            assert torch.equal(out.cpu().view(torch.int16), TENSORS["c"].view(torch.int16))
    good = _segment(store, "c", out=torch.empty(40, 40, dtype=torch.bfloat16, device="cuda"))
    for bad in (_segment(store, "c", out=good.out, count=2112),
                _segment(store, "c", out=good.out, bits=good.bits + 8 * data.numel()),
                _segment(store, "c", out=good.out, sm_offset=data.numel() - 1000),
                _segment(store, "c", out=torch.empty(40, 40, dtype=torch.bfloat16))):  # on the host
        with pytest.raises(ValueError):
            DecodePlan.build(data, tables, store.chunk, [good, bad])
    store.tensors["c"] = {**store.tensors["c"], "count": 2112}
    with pytest.raises(EsftError, match="a destination of 1600 values for a tensor of 2112"):
        store.plan([("c", good.out)])
