"""ESFT on the tiny world: one adapter per task, from expert relevance to a packed bundle.

    python recipes/esft_adapters.py [--root DIR] [--threshold P] [--steps N]

Per task: `esftctl relevance` on its training data, `esftctl select` at threshold p, ESFT fine-tuning of
the selected experts only (everything else frozen, the router included), a full checkpoint saved as ESFT
does, `esftctl pack` into a bundle, and exact match on held-out data before and after. Cached per task:
a second run reuses what exists. Ends with `esftctl inspect` of all the bundles together.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from esftctl.bundle import Bundle
from esftctl.selection import ExpertConfig
from esftctl.world.build import build_world, default_world_dir
from esftctl.world.esft import completion_loss, esft_finetune, exact_match
from esftctl.jsonl import read_jsonl


def esftctl(*args) -> None:
    subprocess.run([sys.executable, "-m", "esftctl.cli", *map(str, args)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="the tiny world's folder")
    parser.add_argument("--threshold", type=float, default=0.5, help="expert selection threshold p (gate score)")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per task")
    parser.add_argument("--lr", type=float, default=1e-2, help="fine-tuning learning rate")
    parser.add_argument("--eval", type=int, default=40, help="held-out examples for exact match")
    args = parser.parse_args()
    console = Console()
    world = build_world(args.root or default_world_dir())
    results = []
    for task in world.task_names:
        folder = world.root / "adapters" / task
        folder.mkdir(parents=True, exist_ok=True)
        scores, config, tuned, bundle = (folder / "scores.json", folder / "experts.json", folder / "finetuned",
                                         folder / "bundle")
        if not scores.exists():
            console.rule(f"{task}: relevance")
            esftctl("relevance", world.base_dir, world.data_file(task, "train"), "--out", scores,
                    "--max-examples", 300)
        if not config.exists():
            esftctl("select", scores, "--out", config, "--threshold", args.threshold)
        if not tuned.exists():
            console.rule(f"{task}: ESFT fine-tuning")
            start = time.time()
            losses = esft_finetune(world.base_dir, ExpertConfig.load(config),
                                   list(read_jsonl(world.data_file(task, "train"))), tuned, steps=args.steps,
                                   lr=args.lr)
            console.print(f"{task}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - start:.0f}s")
        if not bundle.exists():
            esftctl("pack", world.base_dir, tuned, "--out", bundle, "--name", task, "--config", config)
        held_out = list(read_jsonl(world.data_file(task, "test")))[:args.eval]
        results.append((task, completion_loss(world.base_dir, held_out), completion_loss(tuned, held_out),
                        exact_match(world.base_dir, held_out), exact_match(tuned, held_out)))

    table = Table(title=f"{args.eval} held-out examples per task: completion loss (nats/token) and exact match",
                  header_style="bold")
    for col in ("task", "base loss", "ESFT loss", "base exact", "ESFT exact"):
        table.add_column(col, justify="right")
    for task, loss_before, loss_after, before, after in results:
        table.add_row(task, f"{loss_before:.3f}", f"{loss_after:.3f}", f"{before:.0%}", f"{after:.0%}")
    console.print(table)
    bundles = [world.root / "adapters" / t / "bundle" for t in world.task_names]
    esftctl("inspect", *bundles)
    console.print("bundles: " + " ".join(f"{Bundle.open(b).name}={b}" for b in bundles))


if __name__ == "__main__":
    main()
