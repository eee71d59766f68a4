"""Expert rows a decode step reads, base vs ESFT adapters: the model behind `bench serve`'s TPOT ratios.

A decode step's MoE layers are bound by the expert weights they read: every row (expert) that at least
one token is routed to is read once. With adapters, a token of adapter a routed to an expert a replaced
reads a's row instead; the base's row is still read if any other token needs it. So N adapters add rows,
while one adapter (every request of it) only swaps rows. This counts the expected distinct rows per layer
for `bench serve`'s scenarios (64 sequences decoding, top-6 of 64, router ~ uniform as in the generated
model; each adapter replaces Table 1's per-layer count of experts; requests drawn by S-LoRA's power law,
esftctl.bench.traffic) and prints rows / base rows, beside the measured TPOT ratio of the JSON given on the
command line (its rows at inf, median TPOT).

Trained adapters route otherwise: their tasks' tokens prefer the experts they replaced, which adds more rows than
this uniform router does (rows_trained.py measures it on the tiny world's ESFT adapters).

`--groups G` adds the rows of steps that hold at most G adapters' requests (`esftctl serve --group-adapters G`,
or vLLM's `--max-loras G` among the running requests; which G adapters a step holds drawn by their shares, its
sequences among those): the rows issue 29's item 3 expects grouping to save, before its queueing costs.

Usage: python benchmarks/lab/rows_model.py [--groups G] [serve.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random

from esftctl.bench.serve_runs import scenario_name
from esftctl.bench.shapes import TABLE1_ADAPTERS, per_layer_counts
from esftctl.bench.traffic import SLORA_ALPHAS, slora_shares

E, TOP_K, SEQS, LAYERS = 64, 6, 64, 26


def distinct_rows(n: int, alpha: float, trials: int = 400, seed: int = 0, groups: int = 0) -> float:
    """Mean distinct rows per layer and step with requests over n Table 1 adapters (0: the base), at most
    `groups` adapters a step (0: no bound)."""
    rng = random.Random(seed)
    names = list(range(n))
    pool, weights = (names, slora_shares(n, alpha)) if n else ([None], [1.0])
    counts = {a: per_layer_counts(m, mean, LAYERS, a) for a, (_, m, mean) in
              enumerate(TABLE1_ADAPTERS[i % 10] for i in range(max(n, 1)))}
    total = 0
    for t in range(trials):
        layer = t % LAYERS
        replaced = {a: set(rng.sample(range(E), counts[a][layer])) for a in names}
        step_pool, step_weights = pool, weights
        if groups and n > groups:  # the step's adapters, drawn by share without replacement
            chosen: list[int] = []
            while len(chosen) < groups:
                a = rng.choices(pool, weights)[0]
                if a not in chosen:
                    chosen.append(a)
            step_pool, step_weights = chosen, [weights[a] for a in chosen]
        rows = set()
        for _ in range(SEQS):
            a = rng.choices(step_pool, step_weights)[0]
            for e in rng.sample(range(E), TOP_K):
                rows.add((a, e) if a is not None and e in replaced[a] else (None, e))
        total += len(rows)
    return total / trials


def main() -> None:
    parser = argparse.ArgumentParser(description="Expert rows a decode step reads, base vs ESFT adapters.")
    parser.add_argument("serve_json", nargs="?", help="a bench serve report whose measured TPOT ratios to print beside")
    parser.add_argument("--groups", type=int, default=0, help="also the rows with at most this many adapters a step")
    args = parser.parse_args()
    groups = args.groups
    base = distinct_rows(0, 1.0)
    measured = {}
    if args.serve_json:
        result = json.loads(open(args.serve_json).read())
        for s in result["servers"]:
            if s["server"] == "esftctl":
                measured = {r["scenario"]: r.get("median_tpot_ratio") for r in s["rows"] if r["rate"] == "inf rps"}
    print(f"base: {base:.1f} distinct rows per layer and step (of {E})")
    grouped = f" {f'G={groups} rows x':>12}" if groups else ""
    print(f"{'scenario':36} {'rows':>6} {'rows x':>7} {'TPOT x':>7}{grouped}")
    for n in (1, 5, 10, 20):
        for alpha in SLORA_ALPHAS if n > 1 else SLORA_ALPHAS[:1]:
            rows = distinct_rows(n, alpha)
            name = scenario_name(n, alpha, math.inf)
            tpot = measured.get(name)
            bounded = f" {distinct_rows(n, alpha, groups=groups) / base:12.3f}" if groups else ""
            print(f"{name:36} {rows:6.1f} {rows / base:7.3f} {'-' if tpot is None else f'{tpot:.3f}':>7}{bounded}")


if __name__ == "__main__":
    main()
