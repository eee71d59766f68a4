"""vLLM's routed-experts layer as ESFT serving builds it: the engine's own kernels, not its LoRA ones.

`esftctl serve` enables vLLM's LoRA support only for its plumbing (adapter names, per-token adapter ids);
no layer is ever wrapped with LoRA. But a MoE layer built while LoRA is enabled picks a LoRA-capable
expert kernel (the Triton one, which the CPU build cannot run). This out-of-tree RoutedExperts builds the
layer with the kernel vLLM would pick without LoRA, which is also the one the merged model runs on.
"""

from __future__ import annotations

import dataclasses

from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts


class EsftRoutedExperts(RoutedExperts):
    def __init__(self, layer_name, params_dtype, moe_config, *args, **kwargs):
        super().__init__(layer_name, params_dtype, dataclasses.replace(moe_config, is_lora_enabled=False),
                         *args, **kwargs)


def register() -> None:
    if "RoutedExperts" not in op_registry_oot:
        PluggableLayer.register_oot(EsftRoutedExperts, name="RoutedExperts")
