"""Named CPU scopes around the parts of a vLLM engine step, for the torch profiler (benchmarks/scripts/profile_step.py).

A profile of a decode step must say what the scheduler, vLLM's LoRA mapping, esftctl's worker manager and the
sampler cost. vLLM marks some of these only in some versions and runners (VLLM_CUSTOM_SCOPES_FOR_PROFILING), so
the profile wraps the methods themselves, each in a `torch.profiler.record_function` named SCOPE + part; kernels
launched inside a scope are the scope's (esftctl.bench.step_profile). Only a profiling run installs them, in
the process that runs the engine (vLLM's in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0); the names differ
between vLLM 0.25 and 0.32 and between the V1 and V2 model runners, so each is wrapped where it exists and the
ones found are returned.
"""

from __future__ import annotations

import functools
import importlib

SCOPE = "esftctl: "
# (vLLM's module, class, method) -> the part of a step it is.
PARTS = {
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"): "schedule",
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"): "update_from_output",
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model"): "execute_model",
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens"): "sample_tokens",
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "make_lora_inputs"): "lora_inputs",  # V1 runner
    ("vllm.v1.worker.gpu.lora_utils", "LoraState", "make_lora_inputs"): "lora_inputs",  # V2 runner
    ("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin", "_set_active_loras"): "set_active_loras",
    ("esftctl.runtime.vllm.worker", "EsftWorkerManager", "set_active_adapters"): "set_active_adapters",
    ("vllm.v1.sample.sampler", "Sampler", "forward"): "sampler",  # V1 runner
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "__call__"): "sampler",  # V2 runner
}


def scoped(method, name: str):
    from torch.profiler import record_function

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return method(*args, **kwargs)

    wrapper.esftctl_scope = name
    return wrapper


def install_scopes() -> list[str]:
    """Wrap every method of PARTS that this vLLM has; returns "module.Class.method" of those wrapped."""
    wrapped = []
    for (module_name, class_name, method), part in PARTS.items():
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get(method)
        if original is None or hasattr(original, "esftctl_scope"):
            continue
        setattr(cls, method, scoped(original, SCOPE + part))
        wrapped.append(f"{module_name}.{class_name}.{method}")
    return wrapped
