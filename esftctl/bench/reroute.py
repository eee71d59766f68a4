"""`esftctl bench reroute`: what batched rerouting costs a DeepSeek-V2-Lite MoE layer on the GPU.

(a) The reroute operation's own cost: the layer (router, reroute, grouped expert products) with the fused
    Triton kernel and with the unfused PyTorch version, against the same layer without rerouting, the table
    mapping every id to itself so the expert work is identical. Ratios of medians measured side by side.
(b) The whole layer serving N adapters (tokens spread evenly over them, Table 1 adapter shapes) against the
    base alone. More adapters make tokens touch more distinct expert rows, so more weight bytes are read:
    the floor of the slowdown is those extra bytes over the measured memory bandwidth, reported beside it.
"""

from __future__ import annotations

from typing import Callable

import torch

from esftctl.bench.moe_layer import moe_layer, route
from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape, table1_adapters
from esftctl.kernels.reroute import reroute, reroute_reference

DECODE_TOKENS = (1, 16, 64, 256)
PREFILL_TOKENS = (1024, 4096, 16384)
ADAPTER_COUNTS = (1, 5, 10, 20)


def _median_ms(fn: Callable[[], object], reps: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median"))


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), reps=100)
    return 2 * src.numel() / (ms / 1e3)


def _tables(shape: MoEShape, slots: int, rows_per_slot: int, device) -> torch.Tensor:
    """Expert map of one layer for `slots` adapters cycling through Table 1's shapes (layer 0 of each)."""
    adapters = list(table1_adapters(shape.moe_layers, shape.experts).values())
    table = torch.arange(shape.experts, dtype=torch.int32).repeat(slots + 1, 1)
    next_row = shape.experts
    for s in range(slots):
        layer_experts = adapters[s % len(adapters)][s // len(adapters) % shape.moe_layers]
        for e in layer_experts[:rows_per_slot]:
            table[s, e] = next_row
            next_row += 1
    return table.to(device)


def run(shape: MoEShape = DEEPSEEK_V2_LITE, decode=DECODE_TOKENS, prefill=PREFILL_TOKENS,
        adapter_counts=ADAPTER_COUNTS, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    if not torch.cuda.is_available():
        from esftctl.errors import EsftError

        raise EsftError("bench reroute needs a CUDA GPU (this machine has none)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    max_slots = max(adapter_counts)
    rows_per_slot = 13
    rows = shape.experts + max_slots * rows_per_slot
    scale = shape.hidden ** -0.5
    w13 = (torch.randn(rows, 2 * shape.intermediate, shape.hidden, device=device) * scale).to(torch.bfloat16)
    w2 = (torch.randn(rows, shape.hidden, shape.intermediate, device=device) * scale).to(torch.bfloat16)
    router = (torch.randn(shape.experts, shape.hidden, device=device) * scale).to(torch.bfloat16)
    identity = torch.arange(shape.experts, dtype=torch.int32, device=device).repeat(max_slots + 1, 1)
    bandwidth = copy_bandwidth(device)
    result = {"benchmark": "reroute", "model": shape.name, "device": torch.cuda.get_device_name(0),
              "copy_bandwidth_GBps": bandwidth / 1e9, "own_cost": [], "adapters": []}

    for tokens in (*decode, *prefill):
        on_step(f"(a) {tokens} tokens")
        x = torch.randn(tokens, shape.hidden, device=device).to(torch.bfloat16)
        adapter_ids = torch.randint(-1, max_slots, (tokens,), dtype=torch.int32, device=device)
        plain = _median_ms(lambda: moe_layer(x, router, w13, w2, shape.top_k))
        fused = _median_ms(lambda: moe_layer(x, router, w13, w2, shape.top_k,
                                             lambda ids: reroute(ids, adapter_ids, identity, out=ids)))
        unfused = _median_ms(lambda: moe_layer(x, router, w13, w2, shape.top_k,
                                               lambda ids: reroute_reference(ids, adapter_ids, identity)))
        _, ids = route(x, router, shape.top_k)
        kernel = _median_ms(lambda: reroute(ids, adapter_ids, identity))
        result["own_cost"].append({"tokens": tokens, "layer_ms": plain, "fused_ms": fused, "unfused_ms": unfused,
                                   "kernel_ms": kernel, "fused_overhead": fused / plain - 1,
                                   "unfused_overhead": unfused / plain - 1, "kernel_share": kernel / plain})

        for n in adapter_counts:
            table = _tables(shape, n, rows_per_slot, device)
            ids_n = torch.randint(0, n, (tokens,), dtype=torch.int32, device=device)
            base_ids = torch.full_like(ids_n, -1)
            t_base = _median_ms(lambda: moe_layer(x, router, w13, w2, shape.top_k,
                                                  lambda ids: reroute(ids, base_ids, table, out=ids)))
            t_n = _median_ms(lambda: moe_layer(x, router, w13, w2, shape.top_k,
                                               lambda ids: reroute(ids, ids_n, table, out=ids)))
            _, routed = route(x, router, shape.top_k)
            rows_base = torch.unique(reroute(routed, base_ids, table)).numel()
            rows_n = torch.unique(reroute(routed, ids_n, table)).numel()
            extra_bytes = max(0, rows_n - rows_base) * shape.expert_bytes
            floor_ms = extra_bytes / bandwidth * 1e3
            result["adapters"].append({"tokens": tokens, "adapters": n, "base_ms": t_base, "adapters_ms": t_n,
                                       "slowdown": t_n / t_base - 1, "rows_base": rows_base, "rows_adapters": rows_n,
                                       "floor_ms": floor_ms, "floor_slowdown": floor_ms / t_base})
    return result


def tables(result: dict):
    from rich.table import Table

    a = Table(title=f"(a) reroute's own cost, {result['model']} MoE layer on {result['device']}", header_style="bold")
    for col in ("tokens", "layer ms", "+fused", "+unfused", "kernel alone / layer"):
        a.add_column(col, justify="right")
    for r in result["own_cost"]:
        a.add_row(str(r["tokens"]), f"{r['layer_ms']:.3f}", f"{r['fused_overhead']:+.2%}",
                  f"{r['unfused_overhead']:+.2%}", f"{r['kernel_share']:.2%}")
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
    left.plot(tokens, [100 * r["fused_overhead"] for r in result["own_cost"]], "o-", label="fused (Triton)")
    left.plot(tokens, [100 * r["unfused_overhead"] for r in result["own_cost"]], "s-", label="unfused (PyTorch)")
    left.axhline(1, color="gray", ls=":", label="1% target")
    left.set_xscale("log")
    left.set_xlabel("tokens")
    left.set_ylabel("overhead vs no reroute (%)")
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
