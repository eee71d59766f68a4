"""Expert rows a decode step reads, base vs ESFT adapters: the model behind `bench serve`'s TPOT ratios.

A decode step's MoE layers are bound by the expert weights they read: every row (expert) that at least
one token is routed to is read once. With adapters, a token of adapter a routed to an expert a replaced
reads a's row instead; the base's row is still read if any other token needs it. So N adapters add rows,
while one adapter (every request of it) only swaps rows. This counts the expected distinct rows per layer
for `bench serve`'s scenarios (64 sequences decoding, top-6 of 64, router ~ uniform as in the generated
model; each adapter replaces Table 1's per-layer count of experts; requests drawn by S-LoRA's power law,
esftctl.bench.traffic) and prints rows / base rows, beside the measured TPOT ratio of the JSON given on the
command line (its rows at inf, median TPOT).

Usage: python benchmarks/scripts/rows_model.py [serve.json]
"""

from __future__ import annotations

import json
import math
import random
import sys

from esftctl.bench.serve_runs import scenario_name
from esftctl.bench.shapes import TABLE1_ADAPTERS, per_layer_counts
from esftctl.bench.traffic import SLORA_ALPHAS, slora_shares

E, TOP_K, SEQS, LAYERS = 64, 6, 64, 26


def distinct_rows(n: int, alpha: float, trials: int = 400, seed: int = 0) -> float:
    """Mean distinct rows per layer and step with requests over n Table 1 adapters (0: the base)."""
    rng = random.Random(seed)
    names = list(range(n))
    pool, weights = (names, slora_shares(n, alpha)) if n else ([None], [1.0])
    counts = {a: per_layer_counts(m, mean, LAYERS, a) for a, (_, m, mean) in
              enumerate(TABLE1_ADAPTERS[i % 10] for i in range(max(n, 1)))}
    total = 0
    for t in range(trials):
        layer = t % LAYERS
        replaced = {a: set(rng.sample(range(E), counts[a][layer])) for a in names}
        rows = set()
        for _ in range(SEQS):
            a = rng.choices(pool, weights)[0]
            for e in rng.sample(range(E), TOP_K):
                rows.add((a, e) if a is not None and e in replaced[a] else (None, e))
        total += len(rows)
    return total / trials


def main() -> None:
    base = distinct_rows(0, 1.0)
    measured = {}
    if len(sys.argv) > 1:
        result = json.loads(open(sys.argv[1]).read())
        for s in result["servers"]:
            if s["server"] == "esftctl":
                measured = {r["scenario"]: r.get("median_tpot_ratio") for r in s["rows"] if r["rate"] == "inf rps"}
    print(f"base: {base:.1f} distinct rows per layer and step (of {E})")
    print(f"{'scenario':36} {'rows':>6} {'rows x':>7} {'TPOT x':>7}")
    for n in (1, 5, 10, 20):
        for alpha in SLORA_ALPHAS if n > 1 else SLORA_ALPHAS[:1]:
            rows = distinct_rows(n, alpha)
            name = scenario_name(n, alpha, math.inf)
            tpot = measured.get(name)
            print(f"{name:36} {rows:6.1f} {rows / base:7.3f} {tpot if tpot is None else f'{tpot:.3f}':>7}")


if __name__ == "__main__":
    main()
