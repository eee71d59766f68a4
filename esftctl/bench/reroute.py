"""`esftctl bench reroute`: what batched rerouting costs a DeepSeek-V2-Lite MoE layer on the GPU.

Every layer runs as a captured CUDA graph (as vLLM runs decode), so launch gaps do not blur the numbers;
times are medians of graph replays.

(a) The reroute's own cost, with the expert work held equal (the map sends every id to itself):
    the layer with rerouting folded into the top-k kernel (esftctl.kernels.router), with a separate reroute
    kernel after it, and with the unfused PyTorch reroute, each against the same layer routing without
    rerouting (the same top-k kernel with rerouting compiled out).
(b) The whole layer serving N adapters (tokens spread evenly over them, Table 1 adapter shapes) against the
    base alone. More adapters make tokens touch more distinct expert rows, so more weight bytes are read:
    the floor of the slowdown is those extra bytes over the measured copy bandwidth, reported beside it.
"""

from __future__ import annotations

from typing import Callable

import torch

from esftctl.bench.moe_layer import moe_layer
from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape, table1_adapters
from esftctl.kernels.reroute import reroute, reroute_reference
from esftctl.kernels.router import topk_softmax_reroute

DECODE_TOKENS = (1, 16, 64, 256)
PREFILL_TOKENS = (1024, 4096, 16384)
ADAPTER_COUNTS = (1, 5, 10, 20)
ROWS_PER_SLOT = 13  # the largest per-layer count of Table 1


def _median_ms(fn: Callable[[], object], rep_ms: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def captured(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """`fn` captured as a CUDA graph, after three warm-up calls on a side stream (as torch's docs capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_ms(fn: Callable[[], object]) -> float:
    """Median time of replaying `fn` captured as a CUDA graph."""
    return _median_ms(captured(fn).replay)


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def _table(shape: MoEShape, slots: int, device) -> torch.Tensor:
    """Expert map of one layer for `slots` adapters cycling through Table 1's shapes."""
    adapters = list(table1_adapters(shape.moe_layers, shape.experts).values())
    table = torch.arange(shape.experts, dtype=torch.int32).repeat(slots + 1, 1)
    next_row = shape.experts
    for s in range(slots):
        for e in adapters[s % len(adapters)][s // len(adapters) % shape.moe_layers][:ROWS_PER_SLOT]:
            table[s, e] = next_row
            next_row += 1
    return table.to(device)


def _own_cost(x, router, w13, w2, k, adapter_ids, identity) -> dict:
    def plain(logits):
        return topk_softmax_reroute(logits, k)

    def fused(logits):
        return topk_softmax_reroute(logits, k, adapter_ids, identity)

    def separate(logits):
        weights, ids = topk_softmax_reroute(logits, k)
        return weights, reroute(ids, adapter_ids, identity, out=ids)

    def unfused(logits):
        weights, ids = topk_softmax_reroute(logits, k)
        return weights, reroute_reference(ids, adapter_ids, identity)

    ms = {name: _graph_ms(lambda r=r: moe_layer(x, router, w13, w2, r))
          for name, r in (("plain", plain), ("fused", fused), ("separate", separate), ("unfused", unfused))}
    logits = x @ router.T
    ids = topk_softmax_reroute(logits, k)[1]
    kernel = _graph_ms(lambda: reroute(ids, adapter_ids, identity))
    return {"layer_ms": ms["plain"], **{f"{n}_ms": v for n, v in ms.items() if n != "plain"},
            **{f"{n}_overhead": ms[n] / ms["plain"] - 1 for n in ("fused", "separate", "unfused")},
            "reroute_kernel_ms": kernel, "reroute_kernel_share": kernel / ms["plain"]}


def run(shape: MoEShape = DEEPSEEK_V2_LITE, decode=DECODE_TOKENS, prefill=PREFILL_TOKENS,
        adapter_counts=ADAPTER_COUNTS, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    if not torch.cuda.is_available():
        from esftctl.errors import EsftError

        raise EsftError("bench reroute needs a CUDA GPU (this machine has none)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    k = shape.top_k
    rows = shape.experts + max(adapter_counts) * ROWS_PER_SLOT
    scale = shape.hidden ** -0.5
    w13 = (torch.randn(rows, 2 * shape.intermediate, shape.hidden, device=device) * scale).to(torch.bfloat16)
    w2 = (torch.randn(rows, shape.hidden, shape.intermediate, device=device) * scale).to(torch.bfloat16)
    router = (torch.randn(shape.experts, shape.hidden, device=device) * scale).to(torch.bfloat16)
    identity = torch.arange(shape.experts, dtype=torch.int32, device=device).repeat(max(adapter_counts) + 1, 1)
    bandwidth = copy_bandwidth(device)
    result = {"benchmark": "reroute", "model": shape.name, "device": torch.cuda.get_device_name(0),
              "timing": "median of CUDA-graph replays", "copy_bandwidth_GBps": bandwidth / 1e9,
              "own_cost": [], "adapters": []}

    for tokens in (*decode, *prefill):
        on_step(f"{tokens} tokens")
        x = torch.randn(tokens, shape.hidden, device=device).to(torch.bfloat16)
        adapter_ids = torch.randint(-1, max(adapter_counts), (tokens,), dtype=torch.int32, device=device)
        result["own_cost"].append({"tokens": tokens, **_own_cost(x, router, w13, w2, k, adapter_ids, identity)})

        logits = x @ router.T
        for n in adapter_counts:
            table = _table(shape, n, device)
            spread = torch.randint(0, n, (tokens,), dtype=torch.int32, device=device)
            base = torch.full_like(spread, -1)
            t_base = _graph_ms(lambda: moe_layer(x, router, w13, w2,
                                                 lambda lg: topk_softmax_reroute(lg, k, base, table)))
            t_n = _graph_ms(lambda: moe_layer(x, router, w13, w2,
                                              lambda lg: topk_softmax_reroute(lg, k, spread, table)))
            rows_base = torch.unique(topk_softmax_reroute(logits, k, base, table)[1]).numel()
            rows_n = torch.unique(topk_softmax_reroute(logits, k, spread, table)[1]).numel()
            floor_ms = max(0, rows_n - rows_base) * shape.expert_bytes / bandwidth * 1e3
            result["adapters"].append({"tokens": tokens, "adapters": n, "base_ms": t_base, "adapters_ms": t_n,
                                       "slowdown": t_n / t_base - 1, "rows_base": rows_base,
                                       "rows_adapters": rows_n, "floor_ms": floor_ms,
                                       "floor_slowdown": floor_ms / t_base})
    return result


def tables(result: dict):
    from rich.table import Table

    a = Table(title=f"(a) reroute's own cost, {result['model']} MoE layer on {result['device']} "
                    f"({result['timing']})", header_style="bold")
    for col in ("tokens", "layer ms", "fused in top-k", "separate kernel", "unfused PyTorch", "kernel alone"):
        a.add_column(col, justify="right")
    for r in result["own_cost"]:
        a.add_row(str(r["tokens"]), f"{r['layer_ms']:.3f}", f"{r['fused_overhead']:+.2%}",
                  f"{r['separate_overhead']:+.2%}", f"{r['unfused_overhead']:+.2%}",
                  f"{r['reroute_kernel_share']:.2%}")
    b = Table(title="(b) layer serving N adapters vs base alone; floor = extra expert bytes / copy bandwidth",
              header_style="bold")
    for col in ("tokens", "adapters", "base ms", "adapters ms", "slowdown", "floor", "rows base/adapters"):
        b.add_column(col, justify="right")
    for r in result["adapters"]:
        b.add_row(str(r["tokens"]), str(r["adapters"]), f"{r['base_ms']:.3f}", f"{r['adapters_ms']:.3f}",
                  f"{r['slowdown']:+.1%}", f"{r['floor_slowdown']:+.1%}", f"{r['rows_base']}/{r['rows_adapters']}")
    return a, b


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [r["tokens"] for r in result["own_cost"]]
    for key, label, style in (("fused", "fused in top-k", "o-"), ("separate", "separate kernel", "s-"),
                              ("unfused", "unfused PyTorch", "^-")):
        left.plot(tokens, [100 * r[f"{key}_overhead"] for r in result["own_cost"]], style, label=label)
    left.axhline(1, color="gray", ls=":", label="1% target")
    left.set_xscale("log")
    left.set_xlabel("tokens")
    left.set_ylabel("layer time vs no reroute (%)")
    left.legend()
    for n in sorted({r["adapters"] for r in result["adapters"]}):
        rs = [r for r in result["adapters"] if r["adapters"] == n]
        line, = right.plot([r["tokens"] for r in rs], [100 * r["slowdown"] for r in rs], "o-", label=f"{n} adapters")
        right.plot([r["tokens"] for r in rs], [100 * r["floor_slowdown"] for r in rs], ":", color=line.get_color())
    right.set_xscale("log")
    right.set_xlabel("tokens")
    right.set_ylabel("slowdown vs base (%); dotted: bytes floor")
    right.legend()
    fig.suptitle(f"{result['model']} MoE layer on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
