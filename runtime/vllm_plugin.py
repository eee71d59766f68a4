"""esftctl's vLLM plugin, loaded by vLLM in every process through the `vllm.general_plugins` entry point.

- In the process esftctl started, it asks for SIGTERM when esftctl dies (esftctl.runtime.launcher).
- On the CPU build it installs a fix for vLLM's CPU rotary embedding (esftctl.runtime.cpu_rope).
- Under `esftctl serve` (the ESFTCTL_SERVE environment variable, see esftctl.runtime.serve_config) it
  makes the model runner build esftctl's worker adapter manager instead of vLLM's LoRA one: the model
  runner looks the class up in its module when it loads the model, so replacing that one name is the whole
  hook; and it builds MoE layers with the kernels vLLM picks without LoRA (esftctl.runtime.vllm_layers).
  Everything else (server, scheduler, model code, kernels) is vLLM's own.
"""

from __future__ import annotations


def register() -> None:
    from vllm.platforms import current_platform

    from esftctl.runtime.launcher import follow_launcher

    follow_launcher()

    if current_platform.is_cpu():
        from esftctl.runtime import cpu_rope

        cpu_rope.register()

    from esftctl.runtime.serve_config import ServeConfig

    if ServeConfig.from_env() is not None:
        from vllm.v1.worker import lora_model_runner_mixin

        from esftctl.runtime import vllm_layers
        from esftctl.runtime.vllm_worker import EsftWorkerManager

        lora_model_runner_mixin.LRUCacheWorkerLoRAManager = EsftWorkerManager
        vllm_layers.register()
