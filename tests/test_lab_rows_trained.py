"""benchmarks/lab/rows_trained.py's row count: a step reads (adapter, expert) for replaced experts a token
chose and (base, expert) for the rest; plain vLLM reads each chosen expert once."""

from __future__ import annotations

import numpy as np
from conftest import load_script


def _fixed(experts: list[int], tokens: int = 5, layers: int = 3) -> np.ndarray:
    return np.broadcast_to(np.array(experts), (tokens, layers, len(experts))).copy()


def test_adapters_that_replace_nothing_read_the_base_rows():
    rows = load_script("rows_trained").step_rows
    rng = np.random.default_rng(1)
    tokens = {t: (r, r) for t, r in (("a", rng.integers(64, size=(7, 3, 6))), ("b", rng.integers(64, size=(7, 3, 6))))}
    replaced = {t: np.zeros((3, 64), dtype=bool) for t in tokens}
    r = rows(tokens, replaced, seqs=8, n=2, alpha=1.0, trials=200, rng=rng)
    assert r["trained"] == r["plain"] and r["random"] == r["random_plain"]


def test_two_adapters_over_the_same_experts_read_each_their_own_rows():
    rows = load_script("rows_trained").step_rows
    same = _fixed([0, 1, 2, 3, 4, 5])
    tokens = {"a": (same, same), "b": (same, same)}
    replaced = {t: np.ones((3, 64), dtype=bool) for t in tokens}
    alone = rows(tokens, replaced, seqs=1, n=2, alpha=1.0, trials=100, rng=np.random.default_rng(0))
    assert alone["plain"] == alone["trained"] == 6  # one sequence swaps rows, adds none
    busy = rows(tokens, replaced, seqs=64, n=2, alpha=1.0, trials=100, rng=np.random.default_rng(0))
    assert busy["plain"] == 6 and busy["trained"] == 12  # both adapters in every step: each reads its six
    assert busy["random_plain"] < busy["random"] <= 2 * busy["random_plain"]  # every row once per adapter at most
