"""The decode-step split (benchmarks/lab/step_profile.py) on a hand-made trace of two steps, times in microseconds.

Each step: the scheduler (CPU 0-100 us), vLLM's LoRA mapping with esftctl's manager inside (100-130, 110-125), the
model's launch (a graph replay at 150 whose kernels run 200-260 MoE, 260-262 reroute, 262-300 attention), the
sampler's launch (a top-k kernel, 300-310: sampling, not the router, by its scope) and a copy (310-312). The
engine steps span 0-1000 and 1000-2000 (a scheduler scope after them must not count); GPU busy is 112 us a step.
"""

from __future__ import annotations

import pytest
from conftest import load_script

step_profile = load_script("step_profile")
STEP, kernel_component, kernel_diff, step_components = (
    step_profile.STEP, step_profile.kernel_component, step_profile.kernel_diff, step_profile.step_components)


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
    first, record = next(iter(split["kernels"].items()))  # the kernels by time, most first
    assert first == "fused_moe_kernel" and record["per_step"] == 1 and record["component"] == "moe_kernel"


def test_a_trace_without_graph_kernels_says_so_and_without_steps_is_refused():
    events = [e for e in one_step(0, 10) if e["cat"] != "kernel"]
    split = step_components({"traceEvents": events})
    assert not split["graph_kernels_seen"] and split["gpu_busy_ms"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match="engine_step"):
        step_components({"traceEvents": [e for e in events if e["name"] != STEP]})


def shaped(events: list[dict], name: str, dur: float, regs: int, block: list[int]) -> list[dict]:
    """The steps' events with kernel `name` lasting `dur` us and launched with `regs` registers and `block`."""
    out = []
    for e in events:
        if e["name"] == name:
            e = {**e, "dur": dur, "args": {**e["args"], "registers per thread": regs, "block": block}}
        out.append(e)
    return out


def test_kernel_diff_lines_two_splits_up_by_name_with_their_launch_shapes():
    """Plain vLLM's steps (no reroute; attention 38 us with 28 registers x 256 threads) against esftctl's (the
    reroute's 2 us; attention 41 us with 52 x 128: the same kernel compiled with another tile)."""
    steps = one_step(0, 10) + one_step(1000, 20)
    plain = step_components({"traceEvents": shaped([e for e in steps if e["name"] != "_reroute_kernel"],
                                                   "flash_fwd_splitkv_mla_kernel", 38, 28, [256, 1, 1])})
    esft = step_components({"traceEvents": shaped(steps, "flash_fwd_splitkv_mla_kernel", 41, 52, [128, 1, 1])})
    rows = kernel_diff(plain, esft)
    assert [r["name"] for r in rows[:2]] == ["flash_fwd_splitkv_mla_kernel", "_reroute_kernel"]
    attention, reroute = rows[0], rows[1]
    assert attention["delta_ms"] == pytest.approx(0.003) and attention["shapes_differ"]
    assert (attention["base_shape"], attention["other_shape"]) == ("28 regs x 256 threads", "52 regs x 128 threads")
    assert reroute["base_ms"] == 0 and reroute["other_ms"] == pytest.approx(0.002) and not reroute["shapes_differ"]
    assert all(r["delta_ms"] == 0 for r in rows[2:]) and len(kernel_diff(plain, esft, limit=1)) == 1


@pytest.mark.parametrize("name, component", [
    ("_reroute_kernel", "reroute"), ("void moe::topkGatingSoftmax<float, 8>", "router"),
    ("fused_moe_kernel", "moe_kernel"), ("void vllm::moe::moe_align_block_size_kernel<int>", "moe_kernel"),
    ("void flash::flash_fwd_splitkv_mla_kernel<>", "attention"), ("vllm::concat_and_cache_mla_kernel", "attention"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", "dense_gemm"), ("triton_red_fused_rms_norm_0", "other_gpu"),
    ("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>", "router"),
    ("triton_red_fused__softmax_exp_max_prepare_softmax_online_sub_view_0", "router")])
def test_kernel_names_map_to_components(name, component):
    assert kernel_component(name) == component
