"""`esftctl bench paging` (GPU): a stack of DeepSeek-V2-Lite-sized MoE layers, resident against paged.

Per batch size, decode (one token per sequence) and prefill (`prompt_len` tokens per sequence) throughput
of `layers` MoE layers (router, top-6 routing, grouped expert products; esftctl.bench.moe_layer) run
- resident: every layer's experts in GPU memory;
- paged from host: a window of 2 blocks, experts copied from pinned host memory (esftctl.runtime.paging);
- paged from host + store: the first experts of each layer decoded from a Huffman store in GPU memory,
  the rest copied, split by the two tiers' measured bandwidths;
- paged with the planner: both tiers, residency set by ResidencyPlanner from rho = compute / load (both
  tiers at once), measured per batch, within a memory budget of half the layers outside the window.
The expert memory each case holds is reported, and the memory paging frees for the whole model (26 MoE
layers) as KV-cache tokens (MLA: 576 values per token and layer, 27 layers, bf16).
All layers share one host copy and one store of the same trained-like experts (the copies and decodes
still run per layer; only the source bytes repeat), so the bench fits any machine with an H100.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from esftctl.bench.moe_layer import experts as moe_experts
from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape
from esftctl.bench.synthetic_model import trained_like
from esftctl.errors import EsftError
from esftctl.runtime.paging.blocks import OwnBlocks
from esftctl.runtime.paging.pager import PagedExperts, run_stack
from esftctl.runtime.paging.planner import ResidencyPlanner
from esftctl.runtime.paging.tiers import LayerSource, store_decoder, tier_split

KV_BYTES_PER_TOKEN = 27 * 576 * 2  # DeepSeek-V2-Lite MLA cache, bf16


def _layer_weights(shape: MoEShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole layer of trained-like experts, made on the GPU: w13 [E, 2I, H], w2 [E, H, I]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    return trained_like((e, 2 * i, h), g), trained_like((e, h, i), g)


def _store(w13: torch.Tensor, w2: torch.Tensor, folder: Path):
    from esftctl.formats.store import ExpertStore, SourceTensor, write_store

    inter = w2.shape[-1]
    cpu13, cpu2 = w13.cpu(), w2.cpu()
    tensors = []
    for e in range(w13.shape[0]):
        for w, t in (("gate", cpu13[e, :inter]), ("up", cpu13[e, inter:]), ("down", cpu2[e])):
            tensors.append(SourceTensor(f"{e}.{w}", 0, e, w, lambda t=t: t))
    write_store({"kind": "synthetic", "path": "paging bench"}, tensors, folder)
    return ExpertStore(folder)


def _timed(fn: Callable[[], None], reps: int = 3) -> float:
    """Median wall seconds of fn, synchronized (paging waits on the host, so wall time is the measure)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _both_tiers(host13, host2, dev13, dev2, decode, split) -> Callable[[], None]:
    """One layer's load from both tiers at once: decoder on a side stream, host copies on this one."""
    side = torch.cuda.Stream()

    def fn() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode()
        dev13[split:].copy_(host13[split:], non_blocking=True)
        dev2[split:].copy_(host2[split:], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    return fn


def run(shape: MoEShape = DEEPSEEK_V2_LITE, layers: int = 8, *, batches=(1, 4, 16, 64, 256), prompt_len: int = 512,
        window: int = 2, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    if not torch.cuda.is_available():
        raise EsftError("bench paging needs a CUDA GPU")
    torch.manual_seed(0)
    on_step("generating experts")
    w13, w2 = _layer_weights(shape, 0)
    resident_w = [(w13.clone(), w2.clone()) for _ in range(layers)]
    host13, host2 = w13.cpu().pin_memory(), w2.cpu().pin_memory()
    router = torch.randn(shape.experts, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    block_bytes = (w13.numel() + w2.numel()) * 2

    def routing(logits):
        weights, ids = torch.topk(torch.softmax(logits.float(), -1), shape.top_k)
        return weights, ids.to(torch.int32)

    def layer(x, a, b):
        weights, ids = routing(x @ router.T)
        return x + moe_experts(x, a, b, ids, weights)

    on_step("measuring tier bandwidths")
    dev13, dev2 = torch.empty_like(w13), torch.empty_like(w2)
    host_s = _timed(lambda: (dev13.copy_(host13, non_blocking=True), dev2.copy_(host2, non_blocking=True)))
    with tempfile.TemporaryDirectory() as tmp:
        on_step("encoding a Huffman store of one layer")
        store = _store(w13, w2, Path(tmp) / "store")
        names = [{w: f"{e}.{w}" for w in ("gate", "up", "down")} for e in range(shape.experts)]
        plan = store_decoder(store, names)(dev13, dev2)
        store_s = _timed(plan)
        exact = torch.equal(dev13, w13) and torch.equal(dev2, w2)
        split = tier_split(shape.experts, block_bytes / host_s, block_bytes / store_s)
        store_bytes = store.header["data_bytes"]
        decode = store_decoder(store, names)(dev13[:split], dev2[:split])
        both_s = _timed(_both_tiers(host13, host2, dev13, dev2, decode, split))

        def pager(store_experts: int) -> PagedExperts:
            make = store_decoder(store, names) if store_experts else None
            sources = [LayerSource(host13, host2, store_experts, make) for _ in range(layers)]
            return PagedExperts(sources, blocks=OwnBlocks(dict(enumerate(sources)), torch.device("cuda")),
                                window=window, device="cuda")

        paged_host, paged_both, planned = pager(0), pager(split), pager(split)
        rows = []
        for mode, per_seq in (("decode", 1), ("prefill", prompt_len)):
            for batch in batches:
                tokens = batch * per_seq
                on_step(f"{mode}, batch {batch} ({tokens} tokens)")
                x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)

                def resident() -> None:
                    h = x
                    for a, b in resident_w:
                        h = layer(h, a, b)

                def paged(p: PagedExperts) -> Callable[[], None]:
                    def fn() -> None:
                        state = {"h": x}
                        run_stack(p, list(range(layers)), lambda l, a, b: state.update(h=layer(state["h"], a, b)),
                                  then=0)  # forwards follow each other: the next one's first layer loads now
                    return fn

                t_res = _timed(resident)
                compute_ms = 1e3 * t_res / layers
                store_experts = ResidencyPlanner.store_experts(compute_ms, 1e3 * host_s, split)
                load_ms = 1e3 * (both_s if store_experts else host_s)
                # Memory budget: half of the layers outside the window may stay resident (the rest is the KV
                # cache's), so the planner has a real choice to make.
                planner = ResidencyPlanner(layers, max_resident=(layers - window) // 2)
                for _ in range(layers):  # settle: one step per measurement, as a server would between batches
                    planner.update(compute_ms, load_ms)
                planned.set_resident(range(planner.resident))
                planned.set_store_experts(store_experts)
                row = {"mode": mode, "batch": batch, "tokens": tokens, "resident_s": t_res,
                       "paged_host_s": _timed(paged(paged_host)), "paged_host_store_s": _timed(paged(paged_both)),
                       "planned_s": _timed(paged(planned)), "planned_resident_layers": planner.resident,
                       "planned_store_experts": store_experts, "rho": compute_ms / load_ms,
                       "rho_host": compute_ms / (1e3 * host_s), "planner_decisions": planner.decisions}
                for key in ("resident", "paged_host", "paged_host_store", "planned"):
                    row[f"{key}_tokens_per_s"] = tokens / row[f"{key}_s"]
                    row[f"{key}_over_resident"] = row["resident_s"] / row[f"{key}_s"]
                row["planned_expert_bytes"] = (planner.resident + window) * block_bytes
                rows.append(row)
        for p in (paged_host, paged_both, planned):
            p.close()
    freed = (shape.moe_layers - window) * block_bytes
    return {"benchmark": "paging", "model": shape.name, "device": torch.cuda.get_device_name(0), "layers": layers,
            "window": window, "block_bytes": block_bytes, "host_copy_ms_per_layer": 1e3 * host_s,
            "store_decode_ms_per_layer": 1e3 * store_s, "store_decode_bit_exact": exact,
            "both_tiers_ms_per_layer": 1e3 * both_s,
            "store_experts_per_layer": split, "store_bytes_per_layer": store_bytes,
            "expert_bytes_held": {"resident": layers * block_bytes, "paged_host": window * block_bytes,
                                  "paged_host_store": window * block_bytes + layers * store_bytes},
            "whole_model_freed_bytes": freed, "whole_model_freed_kv_tokens": freed // KV_BYTES_PER_TOKEN,
            "rows": rows}


def table(result: dict):
    from rich.table import Table

    from esftctl.units import format_bytes

    t = Table(title=f"{result['layers']} {result['model']} MoE layers on {result['device']}: throughput relative to "
                    f"resident (window {result['window']}; a layer: {format_bytes(result['block_bytes'])}, host copy "
                    f"{result['host_copy_ms_per_layer']:.1f} ms, store decode {result['store_decode_ms_per_layer']:.1f}"
                    f" ms; store tier {result['store_experts_per_layer']} experts/layer)", title_justify="left")
    for col in ("mode", "batch", "tokens", "resident tok/s", "rho host", "paged host", "host+store", "planner",
                "planner: resident layers, store experts"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(r["mode"], str(r["batch"]), str(r["tokens"]), f"{r['resident_tokens_per_s']:,.0f}",
                  f"{r['rho_host']:.2f}", f"{r['paged_host_over_resident']:.3f}",
                  f"{r['paged_host_store_over_resident']:.3f}", f"{r['planned_over_resident']:.3f}",
                  f"{r['planned_resident_layers']}, {r['planned_store_experts']}")
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, style in (("decode", "-"), ("prefill", "--")):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        for key in ("paged_host", "paged_host_store", "planned"):
            ax.plot([r["tokens"] for r in rows], [r[f"{key}_over_resident"] for r in rows], style, marker="o",
                    label=f"{mode}: {key.replace('_', ' ')}")
    ax.axhline(0.97, color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("throughput / resident")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
