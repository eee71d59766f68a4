"""`esftctl inspect`: what a path holds (model folder or adapter bundle), as a dict (--json) and a rich table."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich import box
from rich.table import Table

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.formats.quantization import label
from esftctl.units import format_bytes, format_ranges


def describe_path(path: Path) -> dict:
    from esftctl.formats.bundle import MANIFEST, Bundle
    from esftctl.formats.store import HEADER, ExpertStore

    if not path.exists():
        raise EsftError("no such file or folder", path)
    if (path / HEADER).exists():
        return ExpertStore(path).describe()
    if (path / MANIFEST).exists():
        return Bundle.open(path).describe()
    if (path / "config.json").exists():
        return MoECheckpoint(path, quantized=True).describe()
    raise EsftError("not a model folder (config.json), adapter bundle (manifest.json) or expert store "
                    "(store.json)", path)


def describe_bundle_set(descriptions: Sequence[dict]) -> dict:
    """Several bundles served together: the padding that one reservation E_max per adapter would cost.

    Fragmentation factor = (adapters x MoE layers x E_max) / (total adapter experts), E_max the largest
    per-layer expert count among the adapters (ExpertWeave, Table 1).
    """
    bases = {d["base_fingerprint"] for d in descriptions}
    if len(bases) > 1:
        raise EsftError("these bundles were packed for different base models; a set must share one base")
    layers = len(descriptions[0]["moe_layers"])
    e_max = max(d["max_experts_per_layer"] for d in descriptions)
    total = sum(d["total_experts"] for d in descriptions)
    return {
        "kind": "bundle_set", "adapters": descriptions, "moe_layers": layers, "e_max": e_max,
        "total_experts": total, "padded_experts": len(descriptions) * layers * e_max,
        "fragmentation_factor": len(descriptions) * layers * e_max / total if total else 0.0,
        "expert_bytes": descriptions[0]["expert_bytes"],
    }


def model_table(d: dict) -> Table:
    table = Table(title=f"{d['path']}  ({d['architecture']})", header_style="bold")
    table.add_column("property")
    table.add_column("value", justify="right")
    rows = [
        ("architecture", f"{d['architecture']} (model_type {d['model_type']})"),
        ("quantization", label(d.get("quantization"))),
        ("layers", str(d["num_layers"])),
        ("MoE layers", f"{d['num_moe_layers']}  ({format_ranges(d['moe_layers'])})"),
        ("routed experts per layer", str(d["routed_experts_per_layer"])),
        ("top-k", str(d["top_k"])),
        ("shared experts per layer", str(d["shared_experts_per_layer"])),
        ("hidden size", str(d["hidden_size"])),
        ("expert intermediate size", str(d["moe_intermediate_size"])),
        ("expert dtype", d["expert_dtype"]),
        ("one expert", format_bytes(d["expert_bytes"])),
        ("all routed experts", format_bytes(d["routed_expert_bytes"])),
        ("whole checkpoint", format_bytes(d["total_bytes"])),
        ("tensors / files", f"{d['num_tensors']} / {d['num_files']}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def bundle_table(d: dict) -> Table:
    return bundle_set_table(describe_bundle_set([d]))


def bundle_set_table(s: dict) -> Table:
    ads = s["adapters"]
    title = (f"{len(ads)} adapter(s): E_max {s['e_max']}, padding would hold {s['padded_experts']} experts for "
             f"{s['total_experts']} (fragmentation factor {s['fragmentation_factor']:.2f})")
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("adapter", overflow="fold", min_width=10)  # folded, never cut: names are what requests use
    table.add_column("experts per MoE layer", overflow="fold", min_width=10)  # every layer's count, folded
    for col in ("total", "max", "mean", "sparsity", "expert\nbytes", "bundle\nfile"):
        table.add_column(col, justify="right", no_wrap=True)
    for d in ads:
        table.add_row(d["name"], " ".join(map(str, d["experts_per_layer"])), str(d["total_experts"]),
                      str(d["max_experts_per_layer"]), f"{d['mean_experts_per_layer']:.2f}",
                      f"{d['sparsity_factor']:.2f}", format_bytes(d["total_experts"] * d["expert_bytes"]),
                      format_bytes(d["bundle_bytes"]))
    return table


def store_table(d: dict) -> Table:
    table = Table(title=f"{d['path']}  (expert store of a {d['source']}: {d['source_path']})", header_style="bold")
    table.add_column("property")
    table.add_column("value", justify="right")
    for name, value in (
        ("tensors / values", f"{d['tensors']} / {d['values']:,}"),
        ("code tables", f"{d['tables']} (per {d['table_scope']}), chunks of {d['chunk']} values"),
        ("original (bf16)", format_bytes(d["original_bytes"])),
        ("stored", f"{format_bytes(d['stored_bytes'])}  ({d['stored_over_original']:.2%} of bf16)"),
        ("bits per weight", f"{d['bits_per_weight']:.3f}"),
        ("exponent-entropy bound", f"{format_bytes(d['entropy_bound_bytes'])}  (stored = "
                                   f"{d['stored_over_bound']:.4f} x bound)"),
        ("header checksum", "yes" if d.get("header_checksum") else
         f"none (store version {d.get('version')}): {d.get('warning', '')}"),
    ):
        table.add_row(name, value)
    return table


def render(d: dict) -> Table:
    return {"model": model_table, "bundle": bundle_table, "bundle_set": bundle_set_table,
            "store": store_table}[d["kind"]](d)
