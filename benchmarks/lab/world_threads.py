"""The tiny world's pre-training speed on two cores, quiet and beside one busy process, at 1 and 2 threads
(issue 33: with one other process on a 2-core machine, OpenMP's waiting threads turned a 1.5-minute build into
half an hour).

    python benchmarks/lab/world_threads.py [--steps 60] [--cores 0,1]

Each run is a child pinned to `--cores` (taskset) that pre-trains the world's base for `--steps` steps; "busy" runs
it beside a child that spins on the last of those cores. Prints seconds per step and the build's projected time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from transformers import AutoTokenizer
from esftctl.jsonl import read_jsonl
from esftctl.world.build import MODEL, PRETRAIN, World, _build_data, _build_tokenizer
from esftctl.world.models import build_model, quiet_transformers, tiny_config
from esftctl.world.training import train
quiet_transformers()
w = World(Path({data!r})); w.root.mkdir(parents=True, exist_ok=True)
_build_data(w, 0); _build_tokenizer(w)
tok = AutoTokenizer.from_pretrained(w.tokenizer_dir)
model = build_model(tiny_config("deepseek_v2", vocab_size=len(tok), **MODEL), seed=0)
examples = list(read_jsonl(w.general_file("train")))
start = time.time()
train(model, tok, examples, steps={steps}, batch_size=PRETRAIN["batch_size"], lr=PRETRAIN["lr"], seed=0,
      completion_only=True, balance=PRETRAIN["balance"], threads={threads})
print((time.time() - start) / {steps})
"""


def run(threads: int, busy: bool, *, steps: int, cores: str, data: str) -> float:
    spinner = None
    if busy:
        spinner = subprocess.Popen(["taskset", "-c", cores.split(",")[-1], sys.executable, "-c", "while True: pass"])
        time.sleep(1)
    try:
        code = CHILD.format(root=str(ROOT), data=data, steps=steps, threads=threads)
        out = subprocess.run(["taskset", "-c", cores, sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cores", default="0,1", help="the cores every run is pinned to (taskset -c)")
    parser.add_argument("--data", default="/tmp/world-threads", help="where the world's data and tokenizer go")
    args = parser.parse_args()
    from esftctl.world.build import PRETRAIN

    print(f"{'threads':>7s} {'beside':>10s} {'s/step':>7s} {'600-step build':>15s}")
    for threads in (1, 2):
        for busy in (False, True):
            per_step = run(threads, busy, steps=args.steps, cores=args.cores, data=args.data)
            print(f"{threads:7d} {'busy core' if busy else 'nothing':>10s} {per_step:7.3f} "
                  f"{per_step * PRETRAIN['steps']:13.0f} s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
