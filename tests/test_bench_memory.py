"""The memory benchmark's inputs and accounting (not its targets: those are read off its results)."""

from __future__ import annotations

import pytest

from esftctl.bench import memory
from esftctl.bench.shapes import TABLE1_ADAPTERS, per_layer_counts, table1_adapters


@pytest.mark.parametrize("name,most,mean", TABLE1_ADAPTERS)
def test_per_layer_counts_match_table1(name, most, mean):
    counts = per_layer_counts(most, mean, 26, seed=3)
    assert len(counts) == 26 and max(counts) == most and min(counts) >= 1
    assert abs(sum(counts) / 26 - mean) < 0.02
    sparsity = 1 - (sum(counts) / 26) / most
    assert abs(sparsity - (1 - mean / most)) < 0.01


def test_ten_adapters_fragment_padding_by_about_two():
    """DESIGN.md: the paper's 10 adapters padded to E_max = 13 waste about half the memory."""
    result = memory.run("accounting", counts=(10,))
    row = result["rows"][0]
    assert row["rows_per_slot"] == 13
    assert 1.9 < row["fragmentation_factor"] < 2.1
    adapters = table1_adapters(26, 64)
    assert row["own_bytes"] == sum(len(ids) for a in adapters.values() for ids in a.values()) * result["expert_bytes"]
    # the allocator maps whole pages: never less than the experts need, and the needed bytes are exact
    assert row["needed_bytes"] == row["own_bytes"]
    assert row["allocator_bytes"] >= row["own_bytes"]
    assert row["allocator_bytes"] % row["page_size"] == 0
