"""vLLM's routed-experts layer as ESFT serving builds it: the engine's own kernels, not its LoRA ones.

`esftctl serve` enables vLLM's LoRA support only for its plumbing (adapter names, per-token adapter ids);
no layer is ever wrapped with LoRA. But a MoE layer built while LoRA is enabled picks a LoRA-capable
expert kernel (the Triton one, which the CPU build cannot run). This out-of-tree RoutedExperts builds the
layer with the kernel vLLM would pick without LoRA, which is also the one the merged model runs on.
It runs its kernel with the tile config and the path (aligned or low-latency) vLLM would pick for the base's
expert count (esftctl.runtime.vllm.moe: the widened row count matches no tuned config file, and would send
batches of up to a quarter of it down the low-latency path). When experts are paged, it also brackets its kernel with
the pager's before_kernel (with the step's rerouted ids) and after_kernel.

Models that build their experts with their own subclass (GPT-OSS's GptOssRoutedExperts, vLLM 0.32) are looked up
by that class's name, not RoutedExperts': each such class gets its own replacement (`MODEL_EXPERTS`), the same
ESFT behaviour over the model's own weight loading.
"""

from __future__ import annotations

import dataclasses
import importlib

from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.fused_moe import override_config
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from esftctl.runtime.vllm.moe import base_experts, install_assignment

# vLLM's model-specific RoutedExperts subclasses (module, class): each is replaced by EsftExperts mixed into it.
MODEL_EXPERTS = (("vllm.model_executor.models.gpt_oss", "GptOssRoutedExperts"),)


class EsftExperts:
    """The ESFT behaviour of an experts layer, mixed in before vLLM's RoutedExperts class (or a model's)."""

    # (pager, this layer), set by EsftModel when experts are paged.
    esft_paging = None
    # num_tokens -> the kernel's tile config for the base's expert count (moe.kernel_config), or None.
    esft_kernel_config = None
    esft_base_experts = None  # the base's expert count, where the kernel is handed more rows (moe.base_experts)

    def __init__(self, layer_name, params_dtype, moe_config, *args, **kwargs):
        super().__init__(layer_name, params_dtype, dataclasses.replace(moe_config, is_lora_enabled=False),
                         *args, **kwargs)

    def forward_modular(self, x, topk_weights, topk_ids, *args, **kwargs):
        if self.esft_kernel_config is None:
            return self._forward_paged(x, topk_weights, topk_ids, *args, **kwargs)
        with override_config(self.esft_kernel_config(x.shape[0])), base_experts(self.esft_base_experts):
            return self._forward_paged(x, topk_weights, topk_ids, *args, **kwargs)

    def _forward_paged(self, x, topk_weights, topk_ids, *args, **kwargs):
        if self.esft_paging is None:
            return super().forward_modular(x, topk_weights, topk_ids, *args, **kwargs)
        pager, layer = self.esft_paging
        pager.before_kernel(layer, topk_ids, x.shape[0])  # the rows the kernel reads (ids already rerouted)
        out = super().forward_modular(x, topk_weights, topk_ids, *args, **kwargs)
        pager.after_kernel(layer)
        return out


class EsftRoutedExperts(EsftExperts, RoutedExperts):
    pass


def register() -> None:
    if "RoutedExperts" not in op_registry_oot:
        PluggableLayer.register_oot(EsftRoutedExperts, name="RoutedExperts")
    for module_name, name in MODEL_EXPERTS:
        cls = getattr(importlib.import_module(module_name), name, None)  # absent in vLLM 0.25
        if cls is not None and name not in op_registry_oot:
            PluggableLayer.register_oot(type(f"Esft{name}", (EsftExperts, cls), {}), name=name)
    install_assignment()
