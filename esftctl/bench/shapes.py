"""Model and adapter shapes the benchmarks use: DeepSeek-V2-Lite and the ten ESFT adapters of ExpertWeave.

ExpertWeave's Table 1 gives, per adapter, the most and the mean experts per layer over the 26 MoE layers;
`per_layer_counts` draws seeded per-layer counts that match both exactly (mean to two decimals).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    moe_layers: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    total_params: float  # the whole model, for merged-model memory
    dtype_bytes: int = 2

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * self.dtype_bytes

    @property
    def model_bytes(self) -> int:
        return int(self.total_params * self.dtype_bytes)


DEEPSEEK_V2_LITE = MoEShape("DeepSeek-V2-Lite", moe_layers=26, experts=64, top_k=6, hidden=2048,
                            intermediate=1408, total_params=15.706e9)

# (adapter, max experts per layer, mean experts per layer), ExpertWeave Table 1.
TABLE1_ADAPTERS = (
    ("gate-math", 12, 7.04), ("token-math", 9, 6.12), ("gate-intent", 12, 9.50), ("token-intent", 8, 7.12),
    ("gate-summary", 11, 7.73), ("token-summary", 8, 5.15), ("gate-law", 12, 7.35), ("token-law", 10, 6.58),
    ("gate-translation", 13, 4.69), ("token-translation", 6, 3.85),
)


def per_layer_counts(max_experts: int, mean_experts: float, layers: int, seed: int) -> list[int]:
    """Counts in [1, max] with one layer at max and sum round(mean * layers)."""
    rng = random.Random(seed)
    target = round(mean_experts * layers)
    counts = [max_experts] + [rng.randint(1, max_experts) for _ in range(layers - 1)]
    while sum(counts) != target:
        i = rng.randrange(1, layers)
        step = 1 if sum(counts) < target else -1
        if 1 <= counts[i] + step <= max_experts:
            counts[i] += step
    rng.shuffle(counts)
    return counts


def table1_adapters(layers: int, experts: int, seed: int = 0) -> dict[str, dict[int, list[int]]]:
    """Each Table 1 adapter as {layer: chosen expert ids}, ids drawn at random per layer."""
    rng = random.Random(seed)
    out = {}
    for k, (name, most, mean) in enumerate(TABLE1_ADAPTERS):
        counts = per_layer_counts(most, mean, layers, seed + k)
        out[name] = {layer: sorted(rng.sample(range(experts), n)) for layer, n in enumerate(counts)}
    return out
