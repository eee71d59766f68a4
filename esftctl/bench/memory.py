"""`esftctl bench memory`: physical bytes of adapter experts under padding, virtual tensors and merged models.

For 1, 2, 3, 5 and 10 of ExpertWeave's Table 1 adapters on DeepSeek-V2-Lite dimensions, the adapter
experts are loaded into one virtual MoE layer per MoE layer (slots = adapters, rows per slot = the largest
per-layer count among them, as padding would reserve). Measured: the allocator's mapped bytes and, on CUDA,
the GPU's own free-memory counter; computed: the experts' own bytes, padding and merged models.
"""

from __future__ import annotations

from typing import Callable

import torch

from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape, table1_adapters
from esftctl.formats.checkpoint import ExpertWeights
from esftctl.runtime.adapters import AdapterSlots
from esftctl.runtime.address_space import AccountingAddressSpace, CudaAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import VirtualMoELayer

ADAPTER_COUNTS = (1, 2, 3, 5, 10)


def _measure(shape: MoEShape, adapters: dict[str, dict[int, list[int]]], backend: str,
             pool: PhysicalPagePool | None) -> dict:
    rows_per_slot = max(len(ids) for a in adapters.values() for ids in a.values())
    if backend == "cuda":
        def make_space(n):
            return CudaAddressSpace(n, pool)
        g = torch.Generator(device=pool.device).manual_seed(0)
        one = ExpertWeights(*(torch.randn(s, generator=g, device=pool.device).to(torch.bfloat16) for s in
                              ((shape.intermediate, shape.hidden),) * 2 + ((shape.hidden, shape.intermediate),)))
        torch.cuda.synchronize()
        pool.trim()
        free_before = torch.cuda.mem_get_info(pool.device)[0]
    else:
        def make_space(n):
            return AccountingAddressSpace(n)
        one = None
    layers = {l: VirtualMoELayer(shape.experts, shape.hidden, shape.intermediate, num_slots=len(adapters),
                                 experts_per_slot=rows_per_slot, dtype=torch.bfloat16, make_space=make_space)
              for l in range(shape.moe_layers)}
    slots = AdapterSlots(layers)
    for name, per_layer in adapters.items():
        slots.load(name, {l: {e: one for e in ids} for l, ids in per_layer.items()})
    result = {"rows_per_slot": rows_per_slot, "allocator_bytes": slots.physical_bytes(),
              "needed_bytes": slots.needed_bytes(), "page_size": next(iter(layers.values())).w13.pages.page_size}
    if backend == "cuda":
        torch.cuda.synchronize()
        result["gpu_counter_bytes"] = free_before - torch.cuda.mem_get_info(pool.device)[0]
    for layer in layers.values():
        layer.close()
    if pool is not None:
        pool.trim()
    return result


def run(backend: str = "auto", counts=ADAPTER_COUNTS, shape: MoEShape = DEEPSEEK_V2_LITE,
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "accounting"
    pool = PhysicalPagePool(0) if backend == "cuda" else None
    all_adapters = table1_adapters(shape.moe_layers, shape.experts)
    rows = []
    for n in counts:
        on_step(f"{n} adapter(s)")
        adapters = dict(list(all_adapters.items())[:n])
        own = sum(len(ids) for a in adapters.values() for ids in a.values()) * shape.expert_bytes
        m = _measure(shape, adapters, backend, pool)
        padding = n * shape.moe_layers * m["rows_per_slot"] * shape.expert_bytes
        rows.append({
            "adapters": n, "own_bytes": own, "padding_bytes": padding, **m,
            "fragmentation_factor": padding / own,
            "virtual_over_own": m["allocator_bytes"] / own,
            "merged_models_bytes": n * shape.model_bytes,
            "base_plus_virtual_bytes": shape.model_bytes + m["allocator_bytes"],
        })
    return {"benchmark": "memory", "backend": backend, "model": shape.name, "expert_bytes": shape.expert_bytes,
            "device": torch.cuda.get_device_name(0) if backend == "cuda" else "none (allocator accounting)",
            "rows": rows}


def table(result: dict):
    from rich.table import Table

    from esftctl.units import format_bytes

    t = Table(title=f"Adapter expert memory, {result['model']} ({result['backend']}: {result['device']})",
              header_style="bold")
    for col in ("adapters", "own experts", "padding", "frag. factor", "virtual (allocator)", "virtual / own",
                "GPU counter", "base + virtual", "merged models"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(str(r["adapters"]), format_bytes(r["own_bytes"]), format_bytes(r["padding_bytes"]),
                  f"{r['fragmentation_factor']:.2f}", format_bytes(r["allocator_bytes"]),
                  f"{r['virtual_over_own']:.4f}",
                  format_bytes(r["gpu_counter_bytes"]) if "gpu_counter_bytes" in r else "-",
                  format_bytes(r["base_plus_virtual_bytes"]), format_bytes(r["merged_models_bytes"]))
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["adapters"] for r in result["rows"]]
    gib = 1 << 30
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n, [r["padding_bytes"] / gib for r in result["rows"]], "o-", label="padding")
    ax.plot(n, [r["allocator_bytes"] / gib for r in result["rows"]], "s-", label="virtual tensors")
    ax.plot(n, [r["own_bytes"] / gib for r in result["rows"]], "k--", label="adapters' own experts")
    if "gpu_counter_bytes" in result["rows"][0]:
        ax.plot(n, [r["gpu_counter_bytes"] / gib for r in result["rows"]], "x", label="GPU counter")
    ax.set_xlabel("adapters")
    ax.set_ylabel("GiB of adapter experts")
    ax.set_title(f"{result['model']}: adapter memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
