"""The decode-step split (esftctl.bench.step_profile) on a hand-made trace of two steps, times in microseconds.

Each step: the scheduler (CPU 0-100 us), vLLM's LoRA mapping with esftctl's manager inside (100-130, 110-125), the
model's launch (a graph replay at 150 whose kernels run 200-260 MoE, 260-262 reroute, 262-300 attention), the
sampler's launch (a top-k kernel, 300-310: sampling, not the router, by its scope) and a copy (310-312). The
engine steps span 0-1000 and 1000-2000 (a scheduler scope after them must not count); GPU busy is 112 us a step.
"""

from __future__ import annotations

import pytest

from esftctl.bench.step_profile import STEP, kernel_component, step_components


def X(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def one_step(t0: float, c: int) -> list[dict]:
    return [
        X(STEP, "user_annotation", t0, 1000),
        X("esftctl: schedule", "user_annotation", t0, 100),
        X("esftctl: execute_model", "user_annotation", t0 + 100, 500),
        X("esftctl: set_active_loras", "user_annotation", t0 + 100, 30),
        X("esftctl: set_active_adapters", "user_annotation", t0 + 110, 15),
        X("cudaGraphLaunch", "cuda_runtime", t0 + 150, 10, correlation=c),
        X("fused_moe_kernel", "kernel", t0 + 200, 60, tid=7, correlation=c),
        X("_reroute_kernel", "kernel", t0 + 260, 2, tid=7, correlation=c),
        X("flash_fwd_splitkv_mla_kernel", "kernel", t0 + 262, 38, tid=7, correlation=c),
        X("esftctl: sampler", "user_annotation", t0 + 280, 40),
        X("cudaLaunchKernel", "cuda_runtime", t0 + 290, 5, correlation=c + 1),
        X("topk_kernel", "kernel", t0 + 300, 10, tid=7, correlation=c + 1),
        X("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", t0 + 310, 2, tid=7, correlation=c + 2),
    ]


def test_two_steps_split_into_components():
    outside = X("esftctl: schedule", "user_annotation", 5000, 99)
    trace = {"traceEvents": one_step(0, 10) + one_step(1000, 20) + [outside]}
    split = step_components(trace)
    assert split["steps"] == 2 and split["step_ms"] == pytest.approx(1.0)
    assert split["gpu_busy_ms"] == pytest.approx(0.112) and split["host_gap_ms"] == pytest.approx(0.888)
    gpu = split["gpu"]
    assert (gpu["moe_kernel"], gpu["reroute"], gpu["attention"], gpu["sampling"], gpu["memcpy"]) == pytest.approx(
        (0.060, 0.002, 0.038, 0.010, 0.002))
    assert gpu["router"] == gpu["dense_gemm"] == gpu["other_gpu"] == 0
    assert split["cpu"] == pytest.approx({"scheduler": 0.1, "lora_mapping": 0.03, "esftctl_worker": 0.015})
    assert split["graph_kernels_seen"] and split["graph_launches_per_step"] == 1
    assert split["top_kernels"][0]["name"] == "fused_moe_kernel" and split["top_kernels"][0]["per_step"] == 1


def test_a_trace_without_graph_kernels_says_so_and_without_steps_is_refused():
    events = [e for e in one_step(0, 10) if e["cat"] != "kernel"]
    split = step_components({"traceEvents": events})
    assert not split["graph_kernels_seen"] and split["gpu_busy_ms"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match="engine_step"):
        step_components({"traceEvents": [e for e in events if e["name"] != STEP]})


@pytest.mark.parametrize("name, component", [
    ("_reroute_kernel", "reroute"), ("void moe::topkGatingSoftmax<float, 8>", "router"),
    ("fused_moe_kernel", "moe_kernel"), ("void vllm::moe::moe_align_block_size_kernel<int>", "moe_kernel"),
    ("void flash::flash_fwd_splitkv_mla_kernel<>", "attention"), ("vllm::concat_and_cache_mla_kernel", "attention"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", "dense_gemm"), ("triton_red_fused_rms_norm_0", "other_gpu")])
def test_kernel_names_map_to_components(name, component):
    assert kernel_component(name) == component
