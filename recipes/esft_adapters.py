"""ESFT on the tiny world: one adapter per task, from expert relevance to a packed bundle, and the verdict.

    python recipes/esft_adapters.py [--root DIR] [--threshold P] [--metric token|gate] [--steps N] [--lr LR]

Per task (esftctl.world.adapters): relevance on the task's training data, selection at threshold p, ESFT
fine-tuning of the selected experts only (everything else frozen, the router included), packing into a bundle;
then exact match on held-out task data and, for retention, exact match and loss on the held-out general mixture,
base against adapter. Cached per task with its recipe: a second run reuses what exists. Ends with `esftctl
inspect` of all the bundles together and the quick start's verdict, target by target; exits 1 if one is missed.
"""

from __future__ import annotations

import argparse
import time

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from esftctl.describe import describe_bundle_set, describe_path, render
from esftctl.world.adapters import Adapter, Check, Recipe, perplexity_rise, prepare_adapter, verdict
from esftctl.world.build import GENERAL_SPLITS, build_world, default_world_dir
from esftctl.world.models import quiet_transformers


def scores_table(adapters: list[Adapter], general_examples: int) -> Table:
    table = Table(title=f"held-out task exact match, and retention on the held-out general mixture "
                        f"({general_examples} examples; loss in nats a token)", header_style="bold",
                  box=box.SIMPLE_HEAD, pad_edge=False)  # fits 80 columns
    table.add_column("adapter", overflow="fold", min_width=11)
    for col in ("experts\nper layer", "task exact\nbase", "\nESFT", "general\nexact", "general\nloss",
                "perplexity\nvs base"):
        table.add_column(col, justify="right", no_wrap=True)
    base = adapters[0].base
    table.add_row("base", "", "", "", f"{base.general_exact:.0%}", f"{base.general_loss:.4f}", "")
    for a in adapters:
        table.add_row(a.task, " ".join(map(str, a.experts_per_layer)), f"{a.base.task_exact:.0%}",
                      f"{a.tuned.task_exact:.0%}", f"{a.tuned.general_exact:.0%}", f"{a.tuned.general_loss:.4f}",
                      f"{perplexity_rise(a):+.2%}")
    return table


def verdict_table(checks: list[Check]) -> Table:
    table = Table(title="the quick start's promise", header_style="bold")
    for col, justify in (("target", "left"), ("wanted", "right"), ("measured", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    for c in checks:
        table.add_row(c.what, c.target, c.measured, "[green]met[/]" if c.met else "[bold red]MISSED[/]")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Recipe()
    parser.add_argument("--root", default=None, help="the tiny world's folder")
    parser.add_argument("--threshold", type=float, default=defaults.p, help="expert selection threshold p")
    parser.add_argument("--metric", choices=("token", "gate"), default=defaults.metric,
                        help="relevance metric: token selection ratio (ESFT-Token) or average gate score (ESFT-Gate)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="fine-tuning steps per task")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="fine-tuning learning rate")
    args = parser.parse_args()
    quiet_transformers()
    console = Console()
    world = build_world(args.root or default_world_dir())
    recipe = Recipe(metric=args.metric, p=args.threshold, steps=args.steps, lr=args.lr)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    adapters = []
    for task in world.task_names:
        start = time.time()
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task(f"{task}: starting", total=recipe.steps, info="")
            adapter = prepare_adapter(
                world, task, recipe, log=lambda msg: progress.update(bar, description=msg),
                on_step=lambda step, loss: progress.update(bar, completed=step + 1, info=f"loss {loss:.3f}"))
        adapters.append(adapter)
        made = "reused" if adapter.train_seconds is None else f"fine-tuned in {adapter.train_seconds:.0f}s"
        console.print(f"[bold]{task}[/]: {recipe.metric} p={recipe.p} selects "
                      f"{' '.join(map(str, adapter.experts_per_layer))} experts per MoE layer; {made}; "
                      f"task exact {adapter.base.task_exact:.0%} -> {adapter.tuned.task_exact:.0%} "
                      f"({time.time() - start:.0f}s)")
    console.print(scores_table(adapters, GENERAL_SPLITS["test"]))
    console.print(render(describe_bundle_set([describe_path(a.bundle) for a in adapters])))
    checks = verdict(adapters)
    console.print(verdict_table(checks))
    missed = [c for c in checks if not c.met]
    if missed:
        raise SystemExit(f"error: {len(missed)} of {len(checks)} targets missed (see the table above)")
    console.print(f"[green]all {len(checks)} targets met[/]")


if __name__ == "__main__":
    main()
