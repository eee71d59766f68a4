"""Where a decode step's time goes, from a torch profiler trace (chrome JSON): issue 29's per-component table.

At 4 requests/s the served TPOT was 1.15x the base's with 1 adapter and 1.29x with 20 (H200), while the bytes
model predicts almost no extra expert rows at such batches. This splits a step into what could explain it:
- GPU time per component, summed over kernels (one stream: kernels do not overlap): the MoE kernel (fused
  experts, alignment, sum), the reroute, the router's top-k, attention (and KV-cache writes, rotary), dense
  matrix products, sampling, copies, other kernels (norms, activations, compiled elementwise). A kernel
  launched inside a sampling scope is sampling's; every other by its name (GPU_RULES).
- CPU time per component, from the named scopes esftctl.runtime.vllm.profiling puts around vLLM's methods: the
  scheduler, vLLM's LoRA mapping (its per-token lists and `_set_active_loras`, which calls esftctl's worker
  manager), esftctl's `set_active_adapters` alone.
- The step itself: the window from the first engine step's start to the last one's end over the model steps
  in it (execute_model scopes); the GPU's busy time (the union of kernels and copies) and the host gap, the
  window's time with the GPU idle.
Under CUDA graphs the kernels of a replay are correlated with `cudaGraphLaunch`; if the trace holds none of
them (a profiler that does not trace graph nodes), `graph_kernels_seen` is False and only the step, the busy
time and the host gap stand: an eager run gives the split.

Components hide what changed inside them, so each kernel name's time and launch shape (registers a thread and
threads a block) is kept too, and `kernel_diff` lines two splits up by name. On an H200 (2026-11-29) that showed
that, besides the reroute, the kernels where esftctl's decode step differed from plain vLLM's were ones Inductor
compiled from the same source in both processes and launched with another shape, some faster, some slower: e.g.
the `int32` cast at the end of vLLM's compiled `grouped_topk`, 1.15 us with 28 registers and 256 threads in plain
vLLM and 2.9 us with 52 and 128 in esftctl. Inductor autotunes such kernels on their first call and each process
keeps its own pick, so a pick is luck, made once for a kernel that may run once a layer.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

SCOPE = "esftctl: "  # esftctl.runtime.vllm.profiling.SCOPE (this module imports no engine)
STEP, MODEL_STEP = SCOPE + "engine_step", SCOPE + "execute_model"
GPU_RULES = (  # (component, kernel name pattern): the first that matches
    ("reroute", r"reroute"),
    ("router", r"topk_softmax|topkGating|grouped_topk|moeSoftmax|moeTopK|topk_sigmoid|gatherTopK|sbtopk|"
               r"triton_\w*_softmax"),  # vLLM's compiled grouped_topk: Inductor's softmax, then torch.topk
    ("moe_kernel", r"fused_moe|moe_align|moe_sum|sort_expert|count_and_sort|moe_lora"),
    ("attention", r"flash|mla|attn|attention|fmha|concat_and_cache|reshape_and_cache|rotary|rope"),
    ("dense_gemm", r"gemm|gemv|nvjet|cutlass|xmma|matmul|splitk|cublas"),
)
SAMPLING_SCOPES = (SCOPE + "sampler",)
CPU_PARTS = {  # component -> its scopes (the union of their intervals counts)
    "scheduler": ("schedule", "update_from_output"),
    "lora_mapping": ("lora_inputs", "set_active_loras"),  # vLLM's, with esftctl's worker manager inside
    "esftctl_worker": ("set_active_adapters",),
}
GPU_COMPONENTS = ("moe_kernel", "reroute", "router", "attention", "dense_gemm", "sampling", "memcpy", "other_gpu")
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memcpy"}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _clip(a: float, b: float, lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(a, lo), min(b, hi)
    return (a, b) if b > a else None


def kernel_component(name: str) -> str:
    for component, pattern in GPU_RULES:
        if re.search(pattern, name, re.IGNORECASE):
            return component
    return "other_gpu"


def step_components(trace: dict) -> dict:
    """The per-step split of a trace (see the module docstring); times in ms per model step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    scopes = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(SCOPE)]
    steps = [e for e in scopes if e["name"] == STEP]
    if not steps:
        raise ValueError(f"the trace has no {STEP!r} scopes")
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    n = sum(1 for e in scopes if e["name"] == MODEL_STEP and lo <= e["ts"] <= hi) or len(steps)

    launches = {}  # correlation id -> the launch (runtime call) on the CPU
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    sampling = [e for e in scopes if e["name"] in SAMPLING_SCOPES]

    def in_sampling(launch) -> bool:
        return any(s["tid"] == launch["tid"] and s["ts"] <= launch["ts"] <= s["ts"] + s["dur"] for s in sampling)

    gpu = defaultdict(float)
    kernels = defaultdict(lambda: [0.0, 0, "", ""])  # name -> time, count, component, launch shape
    busy, graph_kernels = [], 0
    for e in events:
        kind = GPU_CATEGORIES.get(e.get("cat"))
        span = _clip(e["ts"], e["ts"] + e["dur"], lo, hi) if kind else None
        if span is None:
            continue
        busy.append(span)
        launch = launches.get(e.get("args", {}).get("correlation"))
        graph_kernels += bool(launch and "GraphLaunch" in launch["name"])
        if kind == "memcpy":
            component = "memcpy"
        elif launch is not None and in_sampling(launch):
            component = "sampling"
        else:
            component = kernel_component(e["name"])
        gpu[component] += span[1] - span[0]
        k = kernels[e["name"]]
        k[0], k[1], k[2] = k[0] + span[1] - span[0], k[1] + 1, component
        if kind == "kernel":
            k[3] = launch_shape(e.get("args", {}))
    cpu = {}
    for component, parts in CPU_PARTS.items():
        names = {SCOPE + p for p in parts}
        cpu[component] = _union([s for e in scopes if e["name"] in names
                                 if (s := _clip(e["ts"], e["ts"] + e["dur"], lo, hi))]) / n / 1e3
    graph_launches = sum(1 for e in launches.values() if "GraphLaunch" in e["name"] and lo <= e["ts"] <= hi)
    step_ms, busy_ms = (hi - lo) / n / 1e3, _union(busy) / n / 1e3
    return {
        "steps": n, "step_ms": step_ms, "gpu_busy_ms": busy_ms, "host_gap_ms": step_ms - busy_ms,
        "gpu": {c: gpu.get(c, 0.0) / n / 1e3 for c in GPU_COMPONENTS}, "cpu": cpu,
        "graph_launches_per_step": graph_launches / n, "graph_kernels_seen": graph_kernels > 0,
        "kernels": {name[:90]: {"ms": t / n / 1e3, "per_step": c / n, "component": comp, "shape": shape}
                    for name, (t, c, comp, shape) in sorted(kernels.items(), key=lambda kv: -kv[1][0])},
    }


def launch_shape(args: dict) -> str:
    """A kernel's launch as the profiler records it: "R regs x T threads" (the same source compiled with another
    tile shows here), or "" where the trace does not say."""
    regs, block = args.get("registers per thread"), args.get("block")
    if regs is None or not block:
        return ""
    return f"{regs} regs x {math.prod(block)} threads"


def kernel_diff(base: dict, other: dict, limit: int = 10) -> list[dict]:
    """The kernels whose time per step differs most between two splits (`other` minus `base`, ms), by name; a
    kernel in one split only counts 0 in the other. `shapes_differ`: both ran it, with different launch shapes."""
    a, b = base.get("kernels", {}), other.get("kernels", {})
    rows = []
    for name in a.keys() | b.keys():
        x, y = a.get(name, {}), b.get(name, {})
        rows.append({"name": name, "base_ms": x.get("ms", 0.0), "other_ms": y.get("ms", 0.0),
                     "delta_ms": y.get("ms", 0.0) - x.get("ms", 0.0), "base_shape": x.get("shape", ""),
                     "other_shape": y.get("shape", ""),
                     "shapes_differ": bool(x.get("shape") and y.get("shape") and x["shape"] != y["shape"])})
    return sorted(rows, key=lambda r: (-abs(r["delta_ms"]), r["name"]))[:limit]


ROWS = (("step (profiled)", "step_ms"), ("GPU busy", "gpu_busy_ms"), ("host gap (GPU idle)", "host_gap_ms"),
        *((f"GPU {c}", ("gpu", c)) for c in GPU_COMPONENTS), *((f"CPU {c}", ("cpu", c)) for c in CPU_PARTS))


def row_value(split: dict, key) -> float | None:
    if isinstance(key, tuple):
        return split.get(key[0], {}).get(key[1])
    return split.get(key)
