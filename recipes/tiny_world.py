"""Build the tiny MoE world (task data, tokenizer, pre-trained DeepSeek-V2 base) and show how tasks route.

    python recipes/tiny_world.py [--root DIR]

Offline, seeded, cached: a second run returns at once. The world lands in $ESFTCTL_WORLD or
~/.cache/esftctl/tiny-world-v{WORLD_VERSION} unless --root says otherwise.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from esftctl.world.build import PRETRAIN, build_world, default_world_dir
from esftctl.world.models import quiet_transformers
from esftctl.world.report import distance_table, usage_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="where the world lives (default: %(default)s)")
    args = parser.parse_args()
    quiet_transformers()
    console = Console()
    start = time.time()
    root = args.root or default_world_dir()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task(f"building the tiny world in {root}", total=PRETRAIN["steps"], info="")
        world = build_world(root, log=lambda msg: progress.update(bar, description=msg),
                            on_step=lambda step, loss: progress.update(bar, completed=step + 1,
                                                                       info=f"loss {loss:.3f}"))
    console.print(f"tiny world ready in {world.root} ({time.time() - start:.1f}s)")
    for task in world.task_names:
        console.print(f"  {task:12s} {world.data_file(task, 'train')}")
    usage = world.expert_usage()
    console.print(usage_table(usage))
    console.print(distance_table(usage))


if __name__ == "__main__":
    main()
