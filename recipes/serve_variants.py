"""Serve three fully fine-tuned variants of the tiny world's base from one vLLM server, sharing their experts.

    python recipes/serve_variants.py [--root DIR] [--capacity PERCENT] [--port N] [--keep-serving]

1. Fine-tunes every weight of the base on three tasks (translation, arithmetic, tagging; about 20 s each on
   2 cores, cached under the world's `variants/`): three full models, where ESFT adapters change experts only.
2. Runs `esftctl consolidate` on them: the (layer, expert) positions ranked by how alike the three variants'
   experts are, the most alike `--capacity` percent loaded once for all (each from one variant, round-robin),
   the others kept per variant.
3. Runs `esftctl serve --variants MAP`: one server, each variant answering to its task's name with its own
   non-expert weights, the shared experts where the map loaded them and its own elsewhere; prints the table.
4. Sends one held-out prompt of each task to each variant, all at once, and prints the answers: each variant
   should answer its own task right. What a variant answers is exactly what `esftctl materialize MAP --variant
   I` would answer served alone (tests/test_serve_variants.py checks that).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl
from esftctl.serve import plan, serve_and_ask
from esftctl.world.build import build_world
from esftctl.world.esft import fine_tuned_variants
from esftctl.world.models import quiet_transformers

TASKS = ("translation", "arithmetic", "tagging")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="the tiny world's folder")
    parser.add_argument("--capacity", type=int, default=50, help="percent of the expert positions loaded once for "
                                                                 "all variants (100: every one shared)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep-serving", action="store_true", help="leave the server up until Ctrl-C")
    args = parser.parse_args()
    console = Console()
    quiet_transformers()
    world = build_world(Path(args.root) if args.root else None)
    with console.status("fine-tuning the variants") as spinner:
        variants = fine_tuned_variants(world, TASKS, on_step=lambda msg: spinner.update(msg))
    base = MoECheckpoint(world.base_dir)
    capacity = round(args.capacity / 100 * len(base.moe_layers) * base.num_experts)
    with tempfile.TemporaryDirectory(prefix="esftctl-variants-") as tmp:
        map_dir = Path(tmp) / "map"
        command = [sys.executable, "-m", "esftctl.cli", "consolidate", *map(str, variants.values()),
                   "--capacity", str(capacity), "--out", str(map_dir)]
        console.print(f"$ esftctl consolidate {' '.join(TASKS)} --capacity {capacity} --out MAP")
        subprocess.run(command, check=True)
        serve_plan = plan(None, [], variants=map_dir, port=args.port, vllm_args=["--max-model-len", "256"])
        asks = [(variant, {**next(iter(read_jsonl(world.data_file(task, "test")))), "task": task})
                for variant in TASKS for task in TASKS]
        serve_and_ask(serve_plan, asks, console=console, max_tokens=args.max_tokens, keep_serving=args.keep_serving,
                      title=f"each variant asked every task, all at once, at {serve_plan.url}/v1/completions")


if __name__ == "__main__":
    try:
        main()
    except EsftError as e:
        raise SystemExit(f"error: {e}")
