"""Who sends what when in `esftctl bench serve`: S-LoRA's power-law adapter shares, drawn per request, and Gamma
arrivals of a given coefficient of variation, as ExpertWeave (5.2) and S-LoRA (7.1) evaluate multi-adapter serving.

Shares. S-LoRA (benchmarks/trace.py) draws x ~ numpy's power distribution (density alpha x^(alpha-1) on [0, 1])
per request and sends it to adapter floor(x N): adapter i (0-based) gets ((i+1)/N)^alpha - (i/N)^alpha of the
requests. alpha = 1 is uniform; smaller is more skewed: at N = 20, adapter 0 gets 5% at alpha 1, 16% at 0.6,
41% at 0.3 and 74% at 0.1; at N = 2, 50/50, 66/34, 81/19, 93/7 (ExpertWeave's "about 80%" for two adapters is
alpha 0.3). ExpertWeave runs one Poisson trace per adapter at rate share x total; a Poisson process whose arrivals
are each marked adapter i with probability share_i is the same process, so one aggregate trace with one draw per
request is their workload exactly at cv 1. (Earlier `bench serve` repeated names in vLLM's --lora-modules by
1 / rank^alpha, Zipf's law, where larger alpha is more skewed: another distribution, and a rounded one.)

Draws are ours, seeded by the run, and handed to vLLM's load generator as one model name per request
(`--lora-assignment round-robin` over a list exactly as long as the run: request k gets entry k). So every server
of a run gets the same requests in the same order, each to "its" adapter i, and the drawn shares are checked
against the expected ones (Pearson's chi-square and each share's deviation in standard errors).

Arrivals. vLLM's `--burstiness` k draws gaps from Gamma(shape k, scale 1 / (rate k)) (vLLM 0.25 and 0.32,
benchmarks/serve.py get_request), whose coefficient of variation is 1 / sqrt(k); S-LoRA's shape is 1 / cv^2,
the same. So cv maps to burstiness 1 / cv^2: cv 1 is Poisson, cv 2 burstier (k = 0.25), cv 0.5 smoother (k = 4).
vLLM then rescales all gaps so that the run lasts prompts / rate, which keeps their cv.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

SLORA_ALPHAS = (1.0, 0.6, 0.3, 0.1)  # S-LoRA's (and ExpertWeave's) skews, uniform first


def slora_shares(n: int, alpha: float) -> list[float]:
    """Expected share of each of `n` adapters under S-LoRA's power law: ((i+1)/n)^alpha - (i/n)^alpha."""
    if n < 1 or not alpha > 0:
        raise ValueError(f"need n >= 1 adapters and alpha > 0, not n={n}, alpha={alpha}")
    return [((i + 1) / n) ** alpha - (i / n) ** alpha for i in range(n)]


def draw_adapters(n: int, alpha: float, count: int, seed: int | tuple[int, ...]) -> list[int]:
    """`count` adapter indices in 0..n-1, one per request, as S-LoRA draws them: floor(n x), x ~ power(alpha)."""
    if n < 1:
        raise ValueError(f"need n >= 1 adapters, not {n}")
    x = np.random.default_rng(seed).power(alpha, count)
    return np.minimum((x * n).astype(np.int64), n - 1).tolist()


def run_seed(*, repeat: int, adapters: int, alpha: float, rate: float) -> tuple[int, ...]:
    """The draw's seed: a function of the run only, so that every server of a bench gets the same draw."""
    return (repeat, adapters, round(alpha * 1000), 0 if math.isinf(rate) else 1 + round(rate * 1000))


@dataclass(frozen=True)
class ShareCheck:
    """Drawn against expected shares: Pearson's chi-square over the adapters, its p-value, and the largest
    deviation of one adapter's count in standard errors (sqrt(n p (1 - p)))."""

    expected: list[float]
    counts: list[int]
    chi2: float
    p_value: float
    worst_z: float

    @property
    def drawn(self) -> list[float]:
        total = sum(self.counts)
        return [c / total for c in self.counts]

    def to_json(self) -> dict:
        return {"expected": self.expected, "drawn": self.drawn, "counts": self.counts, "chi2": self.chi2,
                "p_value": self.p_value, "worst_z": self.worst_z}


def check_shares(drawn: list[int], expected: list[float]) -> ShareCheck:
    """How well the draws `drawn` (adapter indices) follow `expected` (shares summing to 1)."""
    total = len(drawn)
    counts = np.bincount(np.asarray(drawn, dtype=np.int64), minlength=len(expected))[:len(expected)]
    mean = total * np.asarray(expected)
    chi2 = float(((counts - mean) ** 2 / mean).sum())
    z = np.abs(counts - mean) / np.sqrt(mean * (1 - np.asarray(expected))).clip(min=1e-12)
    worst = float(z[np.asarray(expected) < 1].max()) if len(expected) > 1 else 0.0
    return ShareCheck(list(expected), counts.tolist(), chi2, chi2_survival(chi2, len(expected) - 1), worst)


def chi2_survival(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with `dof` degrees of freedom (1.0 with none): Q(dof/2, x/2), the regularized
    upper incomplete gamma function, as torch computes it (no SciPy here)."""
    if dof < 1:
        return 1.0
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def burstiness(cv: float) -> float:
    """vLLM's --burstiness (the Gamma shape) for arrivals whose gaps have coefficient of variation `cv`."""
    if not cv > 0 or math.isinf(cv):
        raise ValueError(f"the coefficient of variation must be above 0 and finite, not {cv}")
    return 1.0 / (cv * cv)


def gaps_cv(start_times: list[float]) -> float | None:
    """The coefficient of variation of the gaps between sorted start times (None for fewer than 3 requests)."""
    gaps = np.diff(np.sort(np.asarray(start_times, dtype=np.float64)))
    if len(gaps) < 2 or gaps.mean() <= 0:
        return None
    return float(statistics.pstdev(gaps.tolist()) / gaps.mean())
