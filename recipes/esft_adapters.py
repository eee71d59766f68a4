"""ESFT on the tiny world: one adapter per task, from expert relevance to a packed bundle.

    python recipes/esft_adapters.py [--root DIR] [--threshold P] [--metric token|gate] [--steps N]

Per task, what the CLI's offline commands do (run here in one process, saving a Python start-up per step):

    esftctl relevance BASE TASK/train.jsonl --out scores.json --scored-tokens completion  # which experts answer
    esftctl select scores.json --out experts.json -p 0.25 --metric token
    (ESFT fine-tuning of the selected experts only: everything else frozen, the router included)
    esftctl pack BASE finetuned --out bundle --name TASK --config experts.json

then exact match on held-out task data and, for retention, loss and exact match on the held-out general
mixture, base against adapter. Cached per task: a second run reuses what exists. Ends with
`esftctl inspect` of all the bundles together.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from esftctl.describe import describe_bundle_set, describe_path, render
from esftctl.jsonl import read_jsonl
from esftctl.pack import pack
from esftctl.relevance import Relevance, compute_relevance
from esftctl.selection import ExpertConfig, select_experts
from esftctl.world.build import build_world, default_world_dir
from esftctl.world.esft import FINETUNE, RELEVANCE, SELECTION, esft_finetune, evaluate
from esftctl.world.models import quiet_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="the tiny world's folder")
    parser.add_argument("--threshold", type=float, default=SELECTION["p"], help="expert selection threshold p")
    parser.add_argument("--metric", choices=("token", "gate"), default=SELECTION["metric"],
                        help="relevance metric: token selection ratio (ESFT-Token) or average gate score (ESFT-Gate)")
    parser.add_argument("--steps", type=int, default=FINETUNE["steps"], help="fine-tuning steps per task")
    parser.add_argument("--lr", type=float, default=FINETUNE["lr"], help="fine-tuning learning rate")
    args = parser.parse_args()
    quiet_transformers()
    console = Console()
    world = build_world(args.root or default_world_dir())
    general_train = list(read_jsonl(world.general_file("train")))
    general_test = list(read_jsonl(world.general_file("test")))
    results = [("base", None, *evaluate(world.base_dir, general_test))]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    for task in world.task_names:
        folder = world.root / "adapters" / task
        folder.mkdir(parents=True, exist_ok=True)
        scores, config, tuned, bundle = (folder / "scores.json", folder / "experts.json", folder / "finetuned",
                                         folder / "bundle")
        train = list(read_jsonl(world.data_file(task, "train")))
        if not config.exists():
            if not scores.exists():
                compute_relevance(world.base_dir, train[:RELEVANCE["examples"]], scored=RELEVANCE["scored"],
                                  batch_size=100).save(scores)
            ExpertConfig(select_experts(Relevance.load(scores).scores[args.metric], args.threshold)).save(config)
        experts = ExpertConfig.load(config)
        console.print(f"[bold]{task}[/]: relevance on {RELEVANCE['examples']} training examples' completions, "
                      f"{args.metric} p={args.threshold} "
                      f"selects {' '.join(str(len(ids)) for ids in experts.experts.values())} experts per MoE layer")
        if not tuned.exists():
            with Progress(*columns, console=console, transient=True) as progress:
                bar = progress.add_task(f"{task}: ESFT fine-tuning", total=args.steps, info="")
                start = time.time()
                losses = esft_finetune(
                    world.base_dir, experts, train, tuned, general=general_train, seed=0,
                    **(FINETUNE | {"steps": args.steps, "lr": args.lr}),
                    on_step=lambda step, loss: progress.update(bar, completed=step + 1, info=f"loss {loss:.3f}"))
            console.print(f"{task}: fine-tuned in {time.time() - start:.0f}s, loss {losses[0]:.3f} -> "
                          f"{sum(losses[-10:]) / 10:.3f} (last 10 steps)")
        if not bundle.exists():
            pack(world.base_dir, tuned, bundle, task, config)
        held_out = list(read_jsonl(world.data_file(task, "test")))
        results.append((task, (evaluate(world.base_dir, held_out)[0], evaluate(tuned, held_out)[0]),
                        *evaluate(tuned, general_test)))

    _, _, base_exact, base_loss = results[0]
    table = Table(title=f"held-out task exact match, and retention on the held-out general mixture "
                        f"({len(general_test)} examples)", header_style="bold")
    for col in ("adapter", "task exact: base", "ESFT", "general exact", "general loss (nats/token)", "vs base"):
        table.add_column(col, justify="right")
    table.add_row("base", "", "", f"{base_exact:.0%}", f"{base_loss:.4f}", "")
    for task, (before, after), exact, loss in results[1:]:
        table.add_row(task, f"{before:.0%}", f"[green]{after:.0%}[/]", f"{exact:.0%}", f"{loss:.4f}",
                      f"{loss / base_loss - 1:+.1%}")
    console.print(table)
    console.print(render(describe_bundle_set([describe_path(world.root / "adapters" / t / "bundle")
                                              for t in world.task_names])))


if __name__ == "__main__":
    main()
