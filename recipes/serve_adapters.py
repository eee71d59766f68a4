"""Serve the tiny world's base and all its ESFT adapters in one vLLM server, and ask each of them.

    python recipes/serve_adapters.py [--root DIR] [--port N] [--keep-serving]

Starts `esftctl serve` (vLLM's OpenAI-compatible server with the esftctl runtime) over the base and the
bundles recipes/esft_adapters.py wrote, prints the server's adapter table, then sends one held-out
prompt of every task to the base and to that task's adapter, all at once, and prints the answers. The
request's `model` field picks the adapter, as with vLLM's multi-LoRA serving.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from esftctl.errors import EsftError
from esftctl.jsonl import read_jsonl
from esftctl.serve import plan, serve_and_ask
from esftctl.world.build import World, default_world_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="the tiny world's folder")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep-serving", action="store_true", help="leave the server up until Ctrl-C")
    args = parser.parse_args()
    console = Console()
    world = World(Path(args.root) if args.root else default_world_dir())
    bundles = {t: world.root / "adapters" / t / "bundle" for t in world.task_names}
    missing = [str(b) for b in bundles.values() if not b.exists()]
    if missing:
        raise SystemExit(f"error: no bundle at {missing[0]} (run recipes/esft_adapters.py first)")
    serve_plan = plan(world.base_dir, [f"{t}={b}" for t, b in bundles.items()], name="tiny-base", port=args.port,
                      vllm_args=["--max-model-len", "256"])
    asks = []
    for task in world.task_names:
        example = {**next(iter(read_jsonl(world.data_file(task, "test")))), "task": task}
        asks += [("tiny-base", example), (task, example)]
    serve_and_ask(serve_plan, asks, console=console, max_tokens=args.max_tokens, keep_serving=args.keep_serving,
                  title=f"one request per model, sent together to {serve_plan.url}/v1/completions")


if __name__ == "__main__":
    try:
        main()
    except EsftError as e:
        raise SystemExit(f"error: {e}")
