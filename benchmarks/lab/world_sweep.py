"""How far the quick start's results move: tiny worlds of several seeds and thread counts, ESFT adapters of
several recipes and fine-tuning seeds, every one checked against the quick start's promise (issue 33).

    python benchmarks/lab/world_sweep.py --out DIR [--seeds 0,1,2,3,4] [--threads 1] [--ft-seeds 0,1,2]
        [--pretrain batch_size=64 ...] [--recipe p=0.25 --recipe p=0.35,lr=0.02 ...] [--jobs N] [--tasks a,b]
        [--worlds-only]

Every world and every adapter is made by its own process on one thread (`--jobs` at a time), so a machine with
many cores (the device machine's 16) runs the sweep in minutes. First the worlds (every seed, thread count and
`--pretrain` variant) with the base's scores (DIR/worlds.jsonl); then, on the first pre-training variant whose
every world keeps the base's side of the promise, the adapters of every recipe and fine-tuning seed
(DIR/results.jsonl, one row per adapter); prints per recipe and task the minimum and spread of each promised
quantity and the count of missed targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _world(root: str, seed: int, threads: int, pretrain: dict) -> dict:
    from esftctl.world.adapters import PROMISE, base_scores
    from esftctl.world.build import build_world
    from esftctl.world.models import quiet_transformers
    from esftctl.world.training import torch_threads

    quiet_transformers()
    start = time.time()
    world = build_world(Path(root), seed=seed, threads=threads, pretrain=pretrain)
    seconds = time.time() - start
    with torch_threads(threads):
        scores = base_scores(world, world.task_names)
    general = next(iter(scores.values()))
    kept = (general.general_exact >= PROMISE.base_general_at_least
            and all(s.task_exact <= PROMISE.base_task_at_most for s in scores.values()))
    return {"world": root, "seed": seed, "threads": threads, "pretrain": pretrain, "seconds": seconds,
            "general_exact": general.general_exact, "general_loss": general.general_loss,
            "task_exact": {t: s.task_exact for t, s in scores.items()}, "kept": kept}


def _adapter(root: str, threads: int, task: str, recipe: dict, folder: str) -> dict:
    from esftctl.world.adapters import PROMISE, Recipe, perplexity_rise, prepare_adapter, verdict
    from esftctl.world.build import World
    from esftctl.world.models import quiet_transformers

    quiet_transformers()
    start = time.time()
    adapter = prepare_adapter(World(Path(root)), task, Recipe(**recipe), folder=Path(folder), threads=threads)
    missed = [c.what for c in verdict([adapter], PROMISE) if not c.met]
    return {"world": root, "task": task, "recipe": recipe, "experts": adapter.experts_per_layer,
            "base": asdict(adapter.base), "tuned": asdict(adapter.tuned),
            "general_perplexity_rise": perplexity_rise(adapter),
            "missed": missed, "seconds": time.time() - start}


def _recipe(text: str) -> dict:
    from esftctl.world.adapters import Recipe

    fields = dict(item.split("=", 1) for item in text.split(",") if item)
    base = Recipe()
    return asdict(replace(base, **{k: type(getattr(base, k))(v) for k, v in fields.items()}))


def _pretrain(text: str) -> dict:
    from esftctl.world.build import PRETRAIN

    fields = dict(item.split("=", 1) for item in text.split(",") if item)
    return PRETRAIN | {k: type(PRETRAIN[k])(v) for k, v in fields.items()}


def _summary(rows: list[dict]) -> str:
    lines = []
    recipes = {json.dumps({k: v for k, v in r["recipe"].items() if k != "seed"}, sort_keys=True) for r in rows}
    for key in sorted(recipes):
        group = [r for r in rows if json.dumps({k: v for k, v in r["recipe"].items() if k != "seed"},
                                               sort_keys=True) == key]
        lines.append(f"recipe {key}: {len(group)} adapters, {sum(bool(r['missed']) for r in group)} miss a target")
        lines.append(f"  {'task':12s} {'base exact min-max':>20s} {'ESFT exact min / median / max':>32s} "
                     f"{'perplexity rise max':>22s} {'experts/layer':>14s}")
        for task in sorted({r["task"] for r in group}):
            mine = [r for r in group if r["task"] == task]
            base = [r["base"]["task_exact"] for r in mine]
            tuned = [r["tuned"]["task_exact"] for r in mine]
            rise = [r["general_perplexity_rise"] for r in mine]
            experts = [sum(r["experts"]) / len(r["experts"]) for r in mine]
            lines.append(f"  {task:12s} {min(base):9.1%} - {max(base):6.1%} {min(tuned):12.1%} / "
                         f"{statistics.median(tuned):6.1%} / {max(tuned):6.1%} {max(rise):+21.1%} "
                         f"{min(experts):6.1f}-{max(experts):.1f}")
    return "\n".join(lines)


def _world_dir(out: Path, variant: int, seed: int, threads: int) -> Path:
    return out / f"world-v{variant}-s{seed}-t{threads}"


def _collect(futures: list, log_file: Path, describe) -> list[dict]:
    """Each finished job's row, as it finishes: appended to `log_file` (JSON lines) and printed as `describe` says."""
    rows = []
    with open(log_file, "a") as log:
        for done in as_completed(futures):
            rows.append(done.result())
            log.write(json.dumps(rows[-1]) + "\n")
            log.flush()
            print(describe(rows[-1]), flush=True)
    return rows


def _describe_world(row: dict) -> str:
    return (f"{Path(row['world']).name}: {row['seconds']:.0f} s, general exact {row['general_exact']:.1%} "
            f"loss {row['general_loss']:.4f}, tasks {' '.join(f'{t} {e:.1%}' for t, e in row['task_exact'].items())}"
            f"{'' if row['kept'] else '  MISSED'}")


def _describe_adapter(row: dict) -> str:
    return (f"{Path(row['world']).name} {row['task']:12s} seed {row['recipe']['seed']} p {row['recipe']['p']}"
            f" experts {row['experts']} base {row['base']['task_exact']:.1%} ESFT {row['tuned']['task_exact']:.1%}"
            f" perplexity {row['general_perplexity_rise']:+.2%} ({row['seconds']:.0f} s)"
            f"{' MISSED ' + '; '.join(row['missed']) if row['missed'] else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="worlds, adapters and results.jsonl go here")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="world seeds")
    parser.add_argument("--threads", default="1", help="thread counts to build and fine-tune with (e.g. 1,2)")
    parser.add_argument("--ft-seeds", default="0,1,2", help="fine-tuning seeds")
    parser.add_argument("--recipe", action="append", default=None,
                        help="recipe overrides, e.g. p=0.35,lr=0.02 (repeatable; default: the quick start's)")
    parser.add_argument("--pretrain", action="append", default=None,
                        help="pre-training overrides, e.g. batch_size=64 (repeatable; default: the world's)")
    parser.add_argument("--worlds-only", action="store_true", help="build and score the worlds, no adapters")
    parser.add_argument("--tasks", default=None, help="tasks (default: all four)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time, one thread each")
    args = parser.parse_args()
    from esftctl.world.tasks import TASKS

    tasks = args.tasks.split(",") if args.tasks else [t.name for t in TASKS]
    recipes = [_recipe(r) for r in (args.recipe or [""])]
    variants = [_pretrain(p) for p in (args.pretrain or [""])]
    worlds = [(v, int(s), int(t)) for v in range(len(variants)) for s in args.seeds.split(",")
              for t in args.threads.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        built = [pool.submit(_world, str(_world_dir(args.out, v, s, t)), s, t, variants[v]) for v, s, t in worlds]
        made = _collect(built, args.out / "worlds.jsonl", _describe_world)
        good = [v for v in range(len(variants)) if all(r["kept"] for r in made if r["pretrain"] == variants[v])]
        if args.worlds_only or not good:
            print("no pre-training variant keeps the base's side of the promise on every world" if not good else "")
            return
        print(f"adapters on pre-training variant {good[0]}: {variants[good[0]]}", flush=True)
        jobs = []
        for v, s, t in worlds:
            if v != good[0]:
                continue
            root = _world_dir(args.out, v, s, t)
            for r, recipe in enumerate(recipes):
                for ft in map(int, args.ft_seeds.split(",")):
                    for task in tasks:
                        folder = root / f"adapters-r{r}-f{ft}" / task
                        jobs.append(pool.submit(_adapter, str(root), t, task, {**recipe, "seed": ft}, str(folder)))
        rows = _collect(jobs, args.out / "results.jsonl", _describe_adapter)
    print(f"\n{len(rows)} adapters in {time.time() - start:.0f} s\n{_summary(rows)}")


if __name__ == "__main__":
    main()
