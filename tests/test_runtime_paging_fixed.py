"""Paging with the fixed-rate compressed GPU tier (`serve --paging-codec fixed`, esftctl.runtime.paging.tiers.
FixedTier) on the CPU (the reference decoder) and CUDA (the masked kernel, CUDA graphs): encoded from the layers'
own rows at start-up, no store file; outputs equal resident ones, bit for bit, for any window, residency and split,
and its memory is about three quarters of the base rows it holds."""

from __future__ import annotations

import random

import pytest
import torch
from test_runtime_paging import (
    DEVICES,
    LAYERS,
    E,
    Stack,
    make_weights,
    replays_follow_changes,
    resident_forward,
    tokens,
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fetch", ["routed", "layer"])
@pytest.mark.parametrize("window,resident,store_rows", [(2, (), E), (3, (0, 4), 3), (1, (), 5)])
def test_fixed_tier_paging_equals_resident(device, fetch, window, resident, store_rows):
    weights = make_weights(window * 7 + store_rows)
    stack = Stack(weights, device, window=window, store="fixed", fetch=fetch, resident=resident)
    stack.pager.set_store_rows(store_rows)
    for n, seed in ((1, 1), (24, 2)):
        x = tokens(n, seed)
        assert torch.equal(stack.run(x), resident_forward(weights, x, device)), (n, seed)
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_tier_split_and_residency_changes_between_steps(device):
    weights = make_weights(17)
    stack = Stack(weights, device, window=2, store="fixed")
    rng = random.Random(1)
    for step in range(5):
        stack.pager.set_resident(rng.sample(range(LAYERS), rng.randint(0, LAYERS - 2)))
        stack.pager.set_store_rows(rng.choice([0, 3, E]))
        x = tokens(rng.choice([1, 16]), 50 + step)
        assert torch.equal(stack.run(x), resident_forward(weights, x, device)), step
    stack.close()


def test_fixed_tier_memory_is_counted_and_about_three_quarters_of_bf16():
    weights = make_weights(19)
    stack = Stack(weights, "cpu", window=2, store="fixed")
    base = sum(w["w13"].numel() + w["w2"].numel() for w in weights) * 2
    assert stack.pager.device_bytes()["store"] == 0  # no rows from it yet
    stack.pager.set_store_rows(E)
    held = stack.pager.device_bytes()["store"]
    assert held == stack.pager.store.nbytes and 0.75 * base < held < 0.80 * base  # tables and counts on small rows
    t = stack.pager.timed_fetch(0, E)
    assert t > 0 and stack.pager.store_rows == E
    stack.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fixed_tier_paged_forward_replays_from_a_cuda_graph():
    weights = make_weights(23)
    stack = Stack(weights, "cuda", window=2, store="fixed", fetch="routed", resident=(2,))
    replays_follow_changes(stack, weights)
    stack.close()
