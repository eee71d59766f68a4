"""The fused MoE kernel's path decided by the base's expert count (esftctl.runtime.vllm.moe.assignment): vLLM
takes its low-latency path when tokens x top_k x 4 <= the experts it is handed, and esftctl hands it every row
(base + adapter rows), so without this a batch of up to a quarter of the rows ran the slower path for its size
(H100: 0.810 against 0.581 ms a step at batch 8). It aligns over every row, padded so that the kernel's EM falls
in the base's classes mod 16 (`aligned_count`: Triton compiles a variant per class, on first use). The GPU tests of
the kernel itself are in tests/test_runtime_vllm_triton_moe.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from esftctl.runtime.vllm.moe import (
    ASSIGNMENT_MODULES,
    KERNEL_MAX_ROWS,
    aligned_count,
    assignment,
    base_experts,
    install_assignment,
)

E, ROWS, TOP_K = 64, 244, 6
ALIGNED = 256  # ROWS padded to E's class mod 16


def fakes():
    calls = []

    def original(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs):
        low_latency = expert_map is None and num_tokens * top_k_num * 4 <= global_num_experts
        calls.append(("low-latency" if low_latency else "aligned", global_num_experts))
        return calls[-1]

    def align(topk_ids, block, experts, expert_map, *, ignore_invalid_experts):
        calls.append(("aligned", experts))
        return calls[-1]

    return assignment(original, align), calls


@pytest.mark.parametrize("tokens, path", [(1, "low-latency"), (2, "low-latency"), (3, "aligned"), (8, "aligned"),
                                          (10, "aligned"), (11, "aligned"), (512, "aligned")])
def test_the_base_count_decides_and_every_row_is_aligned(tokens, path):
    prepare, calls = fakes()
    ids = torch.zeros(tokens, TOP_K, dtype=torch.int32)
    experts = ALIGNED if path == "aligned" else ROWS  # what the path was handed
    with base_experts(E):
        assert prepare(ids, {"BLOCK_SIZE_M": 16}, tokens, TOP_K, ROWS, None) == (path, experts)
    assert tokens * TOP_K * 4 <= E or path == "aligned"


def sorted_ids(tokens: int, experts: int, block: int) -> int:
    """The length of vLLM's sorted ids (moe_align_block_size, 0.25 and 0.32): the kernel's EM."""
    pairs = tokens * TOP_K
    padded = pairs + experts * (block - 1)
    return min(pairs * block, padded) if pairs < experts else padded


@pytest.mark.parametrize("base, rows", [(64, 65), (64, 100), (64, 244), (64, 250), (60, 100), (128, 990)])
def test_the_kernel_meets_only_the_bases_classes_mod_16(base, rows):
    """Steps past the CUDA-graph sizes run eagerly at any size; aligned over the padded count, a widened layer's
    EM is divisible by 16 exactly where the base's is, at every such size and block size vLLM picks, while over
    the rows themselves it is not."""
    count = aligned_count(rows, base)
    assert rows <= count < rows + 16 and (count - base) % 16 == 0
    for block in (16, 32, 64, 128):
        same = [(sorted_ids(t, count, block) % 16 == 0) == (sorted_ids(t, base, block) % 16 == 0)
                for t in range(257, 600)]
        unpadded = [(sorted_ids(t, rows, block) % 16 == 0) == (sorted_ids(t, base, block) % 16 == 0)
                    for t in range(257, 600)]
        assert all(same) and not all(unpadded)


def test_no_padding_past_the_kernels_limit():
    assert aligned_count(KERNEL_MAX_ROWS, 60) == KERNEL_MAX_ROWS  # 60 + 944 = 1004 rows would not align
    assert aligned_count(80, 64) == 80 and aligned_count(64, 64) == 64


def test_outside_a_widened_layer_and_under_expert_parallelism_vllm_decides():
    prepare, calls = fakes()
    ids = torch.zeros(8, TOP_K, dtype=torch.int32)
    assert prepare(ids, {"BLOCK_SIZE_M": 16}, 8, TOP_K, ROWS, None) == ("low-latency", ROWS)  # 192 <= 244
    with base_experts(E):
        assert prepare(ids, {"BLOCK_SIZE_M": 16}, 8, TOP_K, ROWS, torch.zeros(ROWS)) == ("aligned", ROWS)
        assert len(calls) == 2  # the second through vLLM's own function: an expert map never takes the shortcut


def test_installed_where_vllms_kernels_look_it_up():
    pytest.importorskip("vllm")
    install_assignment()
    install_assignment()  # once, however often the plugin registers
    for name in ASSIGNMENT_MODULES:
        prepare = importlib.import_module(name)._prepare_expert_assignment
        assert prepare.esft and not getattr(prepare.__wrapped__, "esft", False)
