"""`esftctl bench paging` (GPU): a stack of DeepSeek-V2-Lite-sized MoE layers, resident against paged.

The layers are esftctl's own (VirtualMoELayer, as serving builds them) and the pager is serving's
(esftctl.runtime.paging); each layer routes (top-6 of 64), lets the pager fetch, and computes grouped expert
products (esftctl.bench.moe_layer). Per batch, decode steps (one token per sequence, replayed from CUDA graphs
on both sides unless --eager) and prefill (`prompt_len` tokens per sequence, eager) are timed for:
- resident: every layer's experts in GPU memory, no pager in the path;
- machinery: every layer resident with the pager in the path (its launches find nothing to do): its cost alone;
- host: every layer paged from pinned host memory (a window of `window` blocks);
- compressed: every base expert decoded from a Huffman store kept in GPU memory (68% of bf16): no bus traffic;
- fixed: every base expert decoded from the fixed-rate code (esftctl.kernels.fixed_rate, 75% of bf16, decoded
  about 1.4x faster than the Huffman store on an H100), encoded at start-up from the layers' own rows: a stack of
  its own, timed after the others with the same protocol against its own resident time;
- split: the store for the first experts of a layer, host copies for the rest, in proportion to the two tiers'
  measured speeds;
- planned: the residency planner's choice (rho = compute / load) within a budget of half the layers outside the
  window, with the tiers it picks.
One CUDA graph per batch serves every paged case: residency and tier split change between replays, which the
pager's design allows (esftctl.runtime.paging.pager). Reported per case: throughput relative to resident, the
expert memory each holds, and the rows fetched per layer and step against all (batch 1 touches 6 of 64). The
memory paging frees for a whole model (26 MoE layers) is given as KV-cache tokens (MLA: 576 values per token
and layer, 27 layers, bf16). All layers hold the same trained-like experts (their host copies and the store's
streams repeat), so the bench fits any H100.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

import torch

from esftctl.bench.moe_layer import experts as moe_experts
from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape
from esftctl.bench.synthetic_model import trained_like
from esftctl.errors import EsftError
from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import VirtualMoELayer
from esftctl.runtime.paging.pager import PagedExperts
from esftctl.runtime.paging.planner import ResidencyPlanner, resident_choice
from esftctl.runtime.paging.tiers import FixedTier, StoreTier, tier_split

KV_BYTES_PER_TOKEN = 27 * 576 * 2  # DeepSeek-V2-Lite MLA cache, bf16
CASES = ("machinery", "host", "compressed", "fixed", "split", "planned")


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


def _timed(fn: Callable[[], None], reps: int = 5) -> float:
    """Median seconds of fn over `reps` runs, each between two device events, after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class _Stack:
    """`layers` MoE layers of one shape, paged by serving's pager; `forward(x, paged)` runs them all."""

    def __init__(self, shape: MoEShape, layers: int, window: int, w13, w2, store):
        """`store`: an ExpertStore of one layer (every layer decodes the same streams), or None: a FixedTier."""
        self.pool = PhysicalPagePool(torch.device("cuda"))
        make_space = lambda n: CudaAddressSpace(n, self.pool)  # noqa: E731
        self.layers = {}
        for l in range(layers):
            layer = VirtualMoELayer(shape.experts, shape.hidden, shape.intermediate, num_slots=0, experts_per_slot=0,
                                    dtype=torch.bfloat16, make_space=make_space)
            layer.load_base_rows(w13, w2)
            layer.keep_host_copy()
            self.layers[l] = layer
        torch.cuda.synchronize()
        names = [{w: f"{e}.{w}" for w in ("gate", "up", "down")} for e in range(shape.experts)]
        self.tier = StoreTier(store, {l: names for l in self.layers}) if store is not None else FixedTier()
        self.pager = PagedExperts(self.layers, window=window, make_space=make_space, top_k=shape.top_k,
                                  store=self.tier)
        self.router = torch.randn(shape.experts, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        self.top_k = shape.top_k

    def forward(self, x: torch.Tensor, paged: bool) -> torch.Tensor:
        for l, layer in self.layers.items():
            weights, ids = torch.topk(torch.softmax((x @ self.router.T).float(), -1), self.top_k)
            ids = ids.to(torch.int32)
            if paged:
                self.pager.before_kernel(l, ids, x.shape[0])
            x = x + moe_experts(x, layer.w13.tensor, layer.w2.tensor, ids, weights)
            if paged:
                self.pager.after_kernel(l)
        return x

    def close(self) -> None:
        self.pager.close()
        for layer in self.layers.values():
            layer.close()
        self.pool.trim()


def _runner(stack: _Stack, x: torch.Tensor, paged: bool, graph: bool) -> Callable[[], None]:
    """A forward on x: captured once into a CUDA graph and replayed, or run eagerly."""
    if not graph:
        return lambda: stack.forward(x, paged)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture: kernels compile, the allocator settles
            stack.forward(x, paged)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stack.forward(x, paged)
    return g.replay


def run(shape: MoEShape = DEEPSEEK_V2_LITE, layers: int = 8, *, batches=(1, 4, 32, 256), prompt_len: int = 512,
        window: int = 2, eager: bool = False, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    if not torch.cuda.is_available():
        raise EsftError("bench paging needs a CUDA GPU")
    torch.manual_seed(0)
    on_step("generating experts")
    w13, w2 = _layer_weights(shape, 0)
    with tempfile.TemporaryDirectory() as tmp:
        on_step("encoding a Huffman store of one layer")
        store = _store(w13, w2, Path(tmp) / "store")
        on_step(f"building {layers} layers with host copies")
        stack = _Stack(shape, layers, window, w13, w2, store)
        del w13, w2
        pager, e = stack.pager, shape.experts
        layer_bytes = stack.layers[0].held_bytes()
        first = next(iter(stack.layers))
        pager.timed_fetch(first, e)  # warm-up: the mark, fetch and decode kernels compile
        host_s, store_s = pager.timed_fetch(first, 0), pager.timed_fetch(first, e)
        split = tier_split(e, layer_bytes / host_s, layer_bytes / store_s)
        budget = (layers - window) // 2  # half the layers outside the window may stay resident
        rows = []
        for mode, per_seq in (("decode", 1), ("prefill", prompt_len)):
            for batch in batches:
                tokens = batch * per_seq
                graph = mode == "decode" and not eager
                on_step(f"{mode}, batch {batch} ({tokens} tokens{', CUDA graphs' if graph else ''})")
                x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
                pager.set_resident(list(stack.layers))
                resident_s = _timed(_runner(stack, x, False, graph))
                paged = _runner(stack, x, True, graph)
                compute_ms = 1e3 * resident_s / layers
                store_rows = ResidencyPlanner.store_experts(compute_ms, 1e3 * host_s, split)
                planner = ResidencyPlanner(layers, max_resident=budget)
                load_ms = 1e3 * max(store_s * store_rows, host_s * (e - store_rows)) / e  # the tiers run at once
                for _ in range(layers):  # settle, as a server would over its first steps
                    planner.update(compute_ms, load_ms)
                row = {"mode": mode, "batch": batch, "tokens": tokens, "graphs": graph, "resident_s": resident_s,
                       "planned_resident_layers": planner.resident, "planned_store_experts": store_rows}
                planned = resident_choice(list(stack.layers), planner.resident, window)
                for case, resident, rows_from_store in (
                        ("machinery", list(stack.layers), 0), ("host", [], 0), ("compressed", [], e),
                        ("split", [], split), ("planned", planned, store_rows)):
                    pager.set_resident(resident)
                    pager.set_store_rows(rows_from_store)
                    before = pager.counters()
                    row[f"{case}_s"] = _timed(paged)
                    after = pager.counters()
                    fetches = after["fetches"] - before["fetches"]
                    row[f"{case}_rows_per_fetch"] = (after["fetched_rows"] - before["fetched_rows"]) / max(1, fetches)
                    row[f"{case}_over_resident"] = resident_s / row[f"{case}_s"]
                    row[f"{case}_device_bytes"] = sum(pager.device_bytes().values())
                row["resident_tokens_per_s"] = tokens / resident_s
                rows.append(row)
        stack.close()
    fixed = _fixed_case(shape, layers, window, batches=batches, prompt_len=prompt_len, eager=eager, on_step=on_step)
    for row in rows:
        row.update(fixed["rows"][(row["mode"], row["batch"])])
    freed = (shape.moe_layers - window) * layer_bytes
    store_bytes = stack.tier.nbytes * shape.moe_layers
    fixed_bytes = fixed["layer_bytes"] * shape.moe_layers
    return {"benchmark": "paging", "model": shape.name, "device": torch.cuda.get_device_name(0), "layers": layers,
            "window": window, "layer_bytes": layer_bytes, "host_fetch_ms_per_layer": 1e3 * host_s,
            "store_decode_ms_per_layer": 1e3 * store_s, "store_experts_split": split,
            "store_bytes_per_layer": stack.tier.nbytes, "experts_per_layer": e,
            "fixed_decode_ms_per_layer": 1e3 * fixed["decode_s"], "fixed_bytes_per_layer": fixed["layer_bytes"],
            "whole_model_freed_bytes": {"host": freed, "compressed": freed - store_bytes,
                                        "fixed": freed - fixed_bytes},
            "whole_model_freed_kv_tokens": {"host": freed // KV_BYTES_PER_TOKEN,
                                            "compressed": (freed - store_bytes) // KV_BYTES_PER_TOKEN,
                                            "fixed": (freed - fixed_bytes) // KV_BYTES_PER_TOKEN},
            "rows": rows}


def _fixed_case(shape: MoEShape, layers: int, window: int, *, batches, prompt_len: int, eager: bool,
                on_step: Callable[[str], None]) -> dict:
    """The `fixed` case: the same layers with the fixed-rate tier, every base expert from it, timed as the others
    (resident first, then the paged graph, per batch)."""
    on_step(f"building {layers} layers with fixed-rate codes (encoded on the GPU)")
    w13, w2 = _layer_weights(shape, 0)  # the same experts as the other cases
    stack = _Stack(shape, layers, window, w13, w2, None)
    del w13, w2
    pager, e, first = stack.pager, shape.experts, next(iter(stack.layers))
    pager.timed_fetch(first, e)  # warm-up
    decode_s = pager.timed_fetch(first, e)
    out = {}
    for mode, per_seq in (("decode", 1), ("prefill", prompt_len)):
        for batch in batches:
            graph = mode == "decode" and not eager
            on_step(f"fixed: {mode}, batch {batch}")
            x = torch.randn(batch * per_seq, shape.hidden, device="cuda", dtype=torch.bfloat16)
            pager.set_resident(list(stack.layers))
            resident_s = _timed(_runner(stack, x, False, graph))
            paged = _runner(stack, x, True, graph)
            pager.set_resident([])
            pager.set_store_rows(e)
            before = pager.counters()
            paged_s = _timed(paged)
            after = pager.counters()
            fetches = max(1, after["fetches"] - before["fetches"])
            out[(mode, batch)] = {"fixed_s": paged_s, "fixed_over_resident": resident_s / paged_s,
                                  "fixed_resident_s": resident_s,
                                  "fixed_rows_per_fetch": (after["fetched_rows"] - before["fetched_rows"]) / fetches,
                                  "fixed_device_bytes": sum(pager.device_bytes().values())}
    layer_bytes = stack.tier.nbytes // layers
    stack.close()
    return {"rows": out, "decode_s": decode_s, "layer_bytes": layer_bytes}


def table(result: dict):
    from rich.table import Table

    from esftctl.units import format_bytes

    t = Table(title=f"{result['layers']} {result['model']} MoE layers on {result['device']}: throughput relative to "
                    f"resident (window {result['window']}; a layer: {format_bytes(result['layer_bytes'])}, host fetch "
                    f"{result['host_fetch_ms_per_layer']:.1f} ms, store decode "
                    f"{result['store_decode_ms_per_layer']:.1f} ms, fixed-rate decode "
                    f"{result['fixed_decode_ms_per_layer']:.2f} ms; split {result['store_experts_split']} experts from "
                    "the store)", title_justify="left")
    for col in ("mode", "batch", "tokens", "resident tok/s", "machinery", "host", "compressed", "fixed", "split",
                "planned",
                "rows fetched / layer", "planned: resident, store"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(r["mode"] + (" (graphs)" if r["graphs"] else ""), str(r["batch"]), str(r["tokens"]),
                  f"{r['resident_tokens_per_s']:,.0f}", *(f"{r[f'{c}_over_resident']:.3f}" for c in CASES),
                  f"{r['host_rows_per_fetch']:.1f} of {result['experts_per_layer']}",
                  f"{r['planned_resident_layers']}, {r['planned_store_experts']}")
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, style in (("decode", "-"), ("prefill", "--")):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        for case in CASES:
            ax.plot([r["tokens"] for r in rows], [r[f"{case}_over_resident"] for r in rows], style, marker="o",
                    label=f"{mode}: {case}")
    ax.axhline(0.97, color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("throughput / resident")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
