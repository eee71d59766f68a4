"""Serve the tiny world's base and all its ESFT adapters in one vLLM server, and ask each of them.

    python recipes/serve_adapters.py [--root DIR] [--port N] [--keep-serving]

Starts `esftctl serve` (vLLM's OpenAI-compatible server with the esftctl runtime) over the base and the
bundles recipes/esft_adapters.py wrote, prints the server's adapter table, then sends one held-out prompt of
every task to the base and to that task's adapter, all at once, and prints the answers. The request's `model`
field picks the adapter, as with vLLM's multi-LoRA serving.

Each task's prompt is the first held-out example its fine-tuned model answers right offline (transformers,
float32), so a served adapter that answers differently is a serving error, not a miss of the adapter; the recipe
ends with that verdict and exits 1 if an adapter answers wrong. The base is asked the same prompts for contrast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from esftctl.errors import EsftError
from esftctl.jsonl import read_jsonl
from esftctl.serve import plan, serve_and_ask
from esftctl.world.build import World, default_world_dir
from esftctl.world.esft import exact_match
from esftctl.world.models import quiet_transformers


def first_right(model_dir: Path, examples: list[dict]) -> dict:
    """The first example `model_dir` answers right (greedy, transformers), else the first."""
    return next((e for e in examples[:50] if exact_match(model_dir, [e]) == 1.0), examples[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="the tiny world's folder")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep-serving", action="store_true", help="leave the server up until Ctrl-C")
    args = parser.parse_args()
    quiet_transformers()
    console = Console()
    world = World(Path(args.root) if args.root else default_world_dir())
    adapters = {t: world.root / "adapters" / t for t in world.task_names}
    missing = [str(a / "bundle") for a in adapters.values() if not (a / "bundle").exists()]
    if missing:
        raise SystemExit(f"error: no bundle at {missing[0]} (run recipes/esft_adapters.py first)")
    serve_plan = plan(world.base_dir, [f"{t}={a / 'bundle'}" for t, a in adapters.items()], name="tiny-base",
                      port=args.port, vllm_args=["--max-model-len", "256"])
    asks = []
    with console.status("choosing each task's prompt"):
        for task, folder in adapters.items():
            example = {**first_right(folder / "finetuned", list(read_jsonl(world.data_file(task, "test")))),
                       "task": task}
            asks += [("tiny-base", example), (task, example)]
    answers = serve_and_ask(serve_plan, asks, console=console, max_tokens=args.max_tokens,
                            keep_serving=args.keep_serving,
                            title=f"one request per model, sent together to {serve_plan.url}/v1/completions")
    wrong = [model for (model, example), answer in zip(asks, answers)
             if model != "tiny-base" and answer.strip() != example["completion"].strip()]
    if wrong:
        raise SystemExit(f"error: served adapter(s) {', '.join(wrong)} answered otherwise than their fine-tuned "
                         "models do offline")
    console.print(f"[green]every served adapter answered as its fine-tuned model does ({len(adapters)} of "
                  f"{len(adapters)})[/]")


if __name__ == "__main__":
    try:
        main()
    except EsftError as e:
        raise SystemExit(f"error: {e}")
