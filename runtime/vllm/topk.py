"""The reroute folded into vLLM's compiled grouped top-k, where DeepSeek-style routers compute their routing.

Every MoE layer reroutes its tokens' top-k ids to their adapters' rows. Through vLLM's routed-experts capture
callback (model.py) that is one more kernel after the router, launched once a layer: on an H200 (CUDA graphs, 26
MoE layers) 35 us of a decode step at 3 tokens and 70 us at 262, the one GPU cost of esftctl's own at low load
(benchmarks/RESULTS.md, Rerouting cost).

vLLM routes DeepSeek-V2/V3-style models (GroupedTopKRouter) in `grouped_topk`, a function it compiles with
Inductor, whose last kernel casts the ids to int32. Compiled here with the table lookup after it (the kernel's
own reference, `reroute_reference`), Inductor fuses the lookup into that cast: the step launches the kernels plain
vLLM launches and nothing for the reroute. Exact by construction: the weights come from vLLM's own graph, which
the lookup does not touch (it reads the ids after torch.topk, an extern kernel that Inductor does not fuse
across), and the ids are integers. Routers that compute elsewhere (fused_topk's CUDA kernel: Qwen, Mixtral,
OLMoE; vLLM 0.32's DeepSeek-V2 with one group, which it routes as fused_topk; ROCm's AITER; vLLM's CPU router)
keep the capture callback: `fold_reroute` says which, and a call that did not pass through the compiled top-k is
rerouted after it all the same. Unlike the plugin's patches (PATCHED, refused at start-up when vLLM lacks a name),
a vLLM without `grouped_topk` or `_compute_routing` where this looks for them only loses the fold.

On an H200 (vLLM 0.25.0) the serving exactness tests passed with it for deepseek_v2 (CUDA graphs, and paged with
graphs), deepseek_v3 and glm4_moe (benchmarks/RESULTS.md, Exactness), and a folded step launched no reroute kernel
(tests/test_runtime_vllm_topk.py), so it is on by default; ESFTCTL_FOLD_REROUTE=0 in the server's environment turns it
off (`enabled`). There, on the DeepSeek-V2-Lite-shaped model at batch 2, a decode step took 4.126 ms with it, 4.227
without, and 4.118 in plain vLLM (benchmarks/RESULTS.md, Rerouting cost): the lookup fused into the cast costs about 0.7
us a layer where the reroute kernel cost 1.5-2.6 (benchmarks/lab/profile_step.py's kernel diff). The CPU build routes
with its own router, so there only the unit tests (vLLM's GroupedTopKRouter called directly) run it. On CUDA, vLLM
computes a router with a score-correction bias (DeepSeek-V3's) in its own CUDA op inside the compiled function
(VLLM_USE_FUSED_MOE_GROUPED_TOPK, on by default): its ids are int32 already, so the lookup is an Inductor kernel of its
own there, one kernel for one kernel, exact all the same.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import os
from dataclasses import dataclass

import torch

from esftctl.kernels.reroute import reroute, reroute_reference

ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.grouped_topk_router"
FOLD_ENV = "ESFTCTL_FOLD_REROUTE"


@dataclass
class _Fold:
    """One router call's reroute: the step's adapter slot per token and the layer's table; `done` once applied."""

    adapter_ids: torch.Tensor
    table: torch.Tensor
    done: bool = False


_fold: contextvars.ContextVar[_Fold | None] = contextvars.ContextVar("esft_fold", default=None)


def rerouting(original):
    """vLLM's `grouped_topk` that, inside a router call `fold_reroute` wrapped, returns the rerouted ids from one
    compiled function (vLLM's Python body and the lookup, compiled as vLLM compiles its own); the same outside."""
    body = getattr(original, "_torchdynamo_orig_callable", original)  # what vLLM's torch.compile wraps

    def rerouted_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0, topk_group=0,
                      scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None, *,
                      adapter_ids, table):
        weights, ids = body(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group,
                            scoring_func, routed_scaling_factor, e_score_correction_bias)
        return weights, reroute_reference(ids, adapter_ids[: ids.shape[0]], table)

    compiled = None

    @functools.wraps(original)
    def grouped_topk(*args, **kwargs):
        nonlocal compiled
        fold = _fold.get()
        if fold is None:
            return original(*args, **kwargs)
        if compiled is None:
            compiled = _compile(rerouted_topk)
        fold.done = True
        return compiled(*args, **kwargs, adapter_ids=fold.adapter_ids, table=fold.table)

    grouped_topk.esft = True
    return grouped_topk


def _compile(fn):
    """`fn` compiled with the arguments vLLM gives `grouped_topk`'s torch.compile."""
    from vllm.platforms import current_platform

    backend = current_platform.simple_compile_backend
    try:
        from vllm.model_executor.utils import maybe_disable_graph_partition

        options = maybe_disable_graph_partition(backend)
    except ImportError:  # a vLLM without it compiles with Inductor's defaults
        options = None
    return torch.compile(fn, dynamic=True, backend=backend, options=options)


def install() -> bool:
    """Put `rerouting` where vLLM's GroupedTopKRouter looks `grouped_topk` up (once per process); False where this
    vLLM has no such module (every router then reroutes through the capture callback)."""
    try:
        module = importlib.import_module(ROUTER_MODULE)
    except ImportError:
        return False
    if not hasattr(module, "grouped_topk"):
        return False
    if not getattr(module.grouped_topk, "esft", False):
        module.grouped_topk = rerouting(module.grouped_topk)
    return True


def enabled() -> bool:
    """Whether this server folds the reroute where it can: unless FOLD_ENV=0 (the A/B arms of
    benchmarks/lab/mixed_step.py and profile_step.py set it to measure what the fold removes)."""
    return os.environ.get(FOLD_ENV) != "0"


def folds(router) -> bool:
    """Whether `router` computes its routing in vLLM's compiled `grouped_topk`: a GroupedTopKRouter whose experts
    divide into more than one expert each per group (vLLM's `valid_grouping`), off ROCm's AITER."""
    if (type(router).__name__ != "GroupedTopKRouter" or getattr(router, "capture_fn", None) is not None
            or not hasattr(router, "_compute_routing")):  # a vLLM that renamed it reroutes as before
        return False
    experts, groups = getattr(router, "global_num_experts", 0), getattr(router, "num_expert_group", None) or 0
    if groups <= 0 or experts <= groups or experts % groups:
        return False
    try:
        from vllm._aiter_ops import rocm_aiter_ops

        return not rocm_aiter_ops.is_fused_moe_enabled()
    except ImportError:
        return True


def fold_reroute(router, adapter_ids: torch.Tensor, table: torch.Tensor) -> bool:
    """Reroute inside `router`'s compiled top-k (True), or leave it as it was (False: the caller reroutes after
    it). A call whose routing does not pass through `grouped_topk` after all is rerouted after it, by the kernel."""
    if not folds(router) or not install():
        return False
    compute = getattr(router, "_esft_unfolded", None) or router._compute_routing  # folded again: the table anew
    router._esft_unfolded = compute

    @functools.wraps(compute)
    def compute_rerouted(hidden_states, router_logits, indices_type, **kwargs):
        fold = _Fold(adapter_ids, table)
        token = _fold.set(fold)
        try:
            weights, ids = compute(hidden_states, router_logits, indices_type, **kwargs)
        finally:
            _fold.reset(token)
        if not fold.done:
            reroute(ids, adapter_ids, table, out=ids)
        return weights, ids

    router._compute_routing = compute_rerouted
    return True
