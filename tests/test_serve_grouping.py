"""`esftctl serve --group-adapters` and `--admit-by-adapter` (issue 29, item 3): with steps grouped by adapter, or
queued requests admitted by adapter, adapters served together still give exactly their merged models' greedy
tokens, every request is answered, and the scheduler kept its bounds (its statistics file: at most G adapters
scheduled in a step, no request held past the bound; the admission order moved the queue).

Three adapters and the base, requests of all four at once, one adapter per step (G = 1, the tightest): what a
step runs changes from step to step, which must not change what a request computes. For the admission order, two
batch slots (`--max-num-seqs 2`, the reference's too), so that the requests queue."""

from __future__ import annotations

import json

import pytest
from conftest import engine_settings
from test_serve_adapters import prompts_of, serve_exactly

from esftctl.runtime.adapter_groups import STATS_FILE, AdapterGroups

pytestmark = pytest.mark.vllm

GROUPS, WAIT = 1, 2
ADMIT = 60.0  # seconds: no request of the test waits that long, so the order is the policy's


def _check_grouped(tmp_path) -> None:
    stats = json.loads((tmp_path / "state" / STATS_FILE).read_text())
    assert (stats["most"], stats["wait"]) == (GROUPS, WAIT)
    assert stats["grouped_steps"] > 0  # requests of several adapters were there and were held back
    assert stats["most_groups_scheduled"] == GROUPS
    assert stats["longest_wait"] <= AdapterGroups(most=GROUPS, wait=WAIT).bound(4)  # base + 3 adapters


def test_grouped_steps_keep_adapters_exact(world, tmp_path):
    serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine_settings(), seed=10, group_adapters=GROUPS,
                  group_wait=WAIT)
    _check_grouped(tmp_path)


@pytest.mark.gpu
def test_grouped_steps_keep_adapters_exact_with_cuda_graphs(world, tmp_path):
    serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine_settings(graphs=True), seed=10,
                  group_adapters=GROUPS, group_wait=WAIT)
    _check_grouped(tmp_path)


def _check_admitted(tmp_path) -> None:
    stats = json.loads((tmp_path / "state" / STATS_FILE).read_text())
    assert stats["admit_by_adapter"] == ADMIT and stats["reordered"] > 0  # the queue was put in another order


def test_admitted_by_adapter_keeps_adapters_exact(world, tmp_path):
    serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine_settings() | {"max_num_seqs": 2}, seed=10,
                  admit_by_adapter=ADMIT)
    _check_admitted(tmp_path)


@pytest.mark.gpu
def test_admitted_by_adapter_keeps_adapters_exact_with_cuda_graphs(world, tmp_path):
    serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine_settings(graphs=True) | {"max_num_seqs": 2},
                  seed=10, admit_by_adapter=ADMIT)
    _check_admitted(tmp_path)
