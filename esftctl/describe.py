"""`esftctl inspect`: what a path holds, as a dict (for --json) and as a rich table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from esftctl.checkpoint import MoECheckpoint, _ranges
from esftctl.errors import EsftError
from esftctl.units import format_bytes


def describe_path(path: Path) -> dict:
    """Describe a model folder (bundles and stores join here as their formats land)."""
    if not path.exists():
        raise EsftError("no such file or folder", path)
    if (path / "config.json").exists():
        return MoECheckpoint(path).describe()
    raise EsftError("not a model folder (no config.json)", path)


def model_table(d: dict) -> Table:
    table = Table(title=f"{d['path']}  ({d['architecture']})", show_header=True, header_style="bold")
    table.add_column("property")
    table.add_column("value", justify="right")
    rows = [
        ("layers", str(d["num_layers"])),
        ("MoE layers", f"{d['num_moe_layers']}  ({_ranges(d['moe_layers'])})"),
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


def render(d: dict) -> Table:
    return {"model": model_table}[d["kind"]](d)
