"""Named CPU scopes around the parts of a vLLM engine step, for the torch profiler (benchmarks/lab/profile_step.py);
and each step's times without a profiler (ESFTCTL_STEP_TIMES, benchmarks/lab/mixed_step.py).

A profile of a decode step must say what the scheduler, vLLM's LoRA mapping, esftctl's worker manager and the
sampler cost. vLLM marks some of these only in some versions and runners (VLLM_CUSTOM_SCOPES_FOR_PROFILING), so
the profile wraps the methods themselves, each in a `torch.profiler.record_function` named SCOPE + part; kernels
launched inside a scope are the scope's (benchmarks/lab/step_profile.py). Only a profiling run installs them, in
the process that runs the engine (vLLM's in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0); the names differ
between vLLM 0.25 and 0.32 and between the V1 and V2 model runners, so each is wrapped where it exists and the
ones found are returned.

The torch profiler costs the host a few microseconds per recorded op and launch, so it cannot compare two servers'
host-bound steps to the millisecond: on an H100 it made esftctl's extra 54 ops in a mixed step look like 4-5 ms, where
the reroute's launch takes 9-18 us a call unprofiled (benchmarks/RESULTS.md, Rerouting cost). With ESFTCTL_STEP_TIMES
set to a folder, every process that runs a scheduler or a worker (vLLM loads this plugin in each, plain vLLM's too)
records each call of `STEP_PARTS` as one line "part start end tokens" (time.perf_counter seconds, which on Linux is the
machine's monotonic clock, the one a client on the same machine reads; tokens: the step's scheduled tokens, else 0) into
FOLDER/steps-PID.tsv. Lines are written in batches: at the first call after a pause of `FLUSH_AFTER_IDLE_S` (so a client
that sends one request after its timed ones finds their lines) and every `FLUSH_ROWS` lines.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from pathlib import Path

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


def wrap_methods(parts: dict[tuple[str, str, str], str], wrap, marker: str) -> list[str]:
    """Replace every method of `parts` that this vLLM has by `wrap(method, part)`, unless already wrapped (its
    attribute `marker`); returns "module.Class.method" of those wrapped."""
    wrapped = []
    for (module_name, class_name, method), part in parts.items():
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get(method)
        if original is None or hasattr(original, marker):
            continue
        setattr(cls, method, wrap(original, part))
        wrapped.append(f"{module_name}.{class_name}.{method}")
    return wrapped


def install_scopes() -> list[str]:
    """Wrap every method of PARTS that this vLLM has in its profiler scope."""
    return wrap_methods(PARTS, lambda method, part: scoped(method, SCOPE + part), "esftctl_scope")


STEP_TIMES_ENV = "ESFTCTL_STEP_TIMES"
STEP_PARTS = {  # (vLLM's module, class, method) -> the part of a step it is
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"): "schedule",
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model"): "execute",
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens"): "sample",
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"): "output",
}
FLUSH_ROWS, FLUSH_AFTER_IDLE_S = 65536, 0.2  # 65,536 rows: about two minutes of steady decoding


class StepTimes:
    """Each call's (part, start, end, tokens), kept in memory and appended to `path` in batches."""

    def __init__(self, path: Path):
        self.path, self.rows, self.last_end = path, [], 0.0

    def timed(self, method, part: str):
        @functools.wraps(method)
        def wrapper(owner, *args, **kwargs):
            start = time.perf_counter()
            if start - self.last_end > FLUSH_AFTER_IDLE_S or len(self.rows) >= FLUSH_ROWS:
                self.flush()
            result = method(owner, *args, **kwargs)
            self.last_end = end = time.perf_counter()
            batch = args[0] if part == "execute" and args else result if part == "schedule" else None
            self.rows.append((part, start, end, getattr(batch, "total_num_scheduled_tokens", 0)))
            return result

        wrapper.esftctl_step_times = part
        return wrapper

    def flush(self) -> None:
        if self.rows:
            with self.path.open("a") as f:
                f.writelines(f"{part} {start:.6f} {end:.6f} {tokens}\n" for part, start, end, tokens in self.rows)
            self.rows = []


def install_step_times() -> list[str]:
    """With ESFTCTL_STEP_TIMES set, time every method of STEP_PARTS this vLLM has; returns those wrapped."""
    folder = os.environ.get(STEP_TIMES_ENV)
    if not folder:
        return []
    recorder = StepTimes(Path(folder) / f"steps-{os.getpid()}.tsv")
    return wrap_methods(STEP_PARTS, recorder.timed, "esftctl_step_times")
