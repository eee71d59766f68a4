"""Tables about the tiny world: which experts each task prefers, and how far apart the tasks route."""

from __future__ import annotations

import itertools

from rich.table import Table


def routing_distance(usage: dict, a: str, b: str) -> float:
    """Total-variation distance between two tasks' expert-usage distributions, averaged over MoE layers."""
    layers = [str(layer) for layer in usage["moe_layers"]]
    total = 0.0
    for layer in layers:
        pa, pb = usage["usage"][a][layer], usage["usage"][b][layer]
        total += 0.5 * sum(abs(x - y) for x, y in zip(pa, pb))
    return total / len(layers)


def usage_table(usage: dict, top: int = 4) -> Table:
    """Per MoE layer and task, the experts that take the largest share of the task's top-k choices."""
    table = Table(title="Expert usage per task (share of top-k choices)", header_style="bold")
    table.add_column("layer", justify="right")
    tasks = list(usage["usage"])
    for task in tasks:
        table.add_column(task)
    for layer in map(str, usage["moe_layers"]):
        cells = []
        for task in tasks:
            shares = usage["usage"][task][layer]
            best = sorted(range(len(shares)), key=lambda e: -shares[e])[:top]
            cells.append("  ".join(f"e{e}:{shares[e]:.0%}" for e in best))
        table.add_row(layer, *cells)
    return table


def distance_table(usage: dict) -> Table:
    table = Table(title="Routing distance between tasks (total variation, 0 = same experts, 1 = disjoint)",
                  header_style="bold")
    table.add_column("task A")
    table.add_column("task B")
    table.add_column("distance", justify="right")
    for a, b in itertools.combinations(usage["usage"], 2):
        table.add_row(a, b, f"{routing_distance(usage, a, b):.3f}")
    return table
