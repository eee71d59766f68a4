"""The fused fixed-rate GEMM bench's configuration grid (benchmarks/lab/fixed_rate_moe_bench.py --sweep): what a grid
expands to, and that a grid naming the wrong axes fails before any GPU work."""

from __future__ import annotations

import pytest
from conftest import load_script

bench = load_script("fixed_rate_moe_bench")


def test_the_grid_expands_to_whole_group_k_tiles_with_vllms_group_sizes():
    configs = bench.sweep_configs("M=16,64 N=64 K=32,64,128 warps=4,8 stages=3")
    assert len(configs) == 2 * 1 * 2 * 2 * 1  # K 32 is no whole group of 64: left out
    assert {c["BLOCK_SIZE_K"] for c in configs} == {64, 128}
    assert {(c["BLOCK_SIZE_M"], c["GROUP_SIZE_M"]) for c in configs} == {(16, 16), (64, 1)}
    assert configs[0] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16,
                          "num_warps": 4, "num_stages": 3}


def test_the_default_grid_is_the_documented_one():
    assert len(bench.sweep_configs("M=16,32,64 N=32,64,128 K=64,128 warps=4,8 stages=2,3,4")) == 108


@pytest.mark.parametrize("grid", ["M=16 N=64 K=64 warps=4", "M=16 N=64 K=64 warps=4 stages=2 split=1"])
def test_a_grid_with_other_axes_is_refused(grid):
    with pytest.raises(SystemExit, match="--sweep-grid names"):
        bench.sweep_configs(grid)
