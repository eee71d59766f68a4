"""Declarative descriptions of the MoE architectures esftctl understands.

Each architecture is data: which config keys hold the expert counts and sizes, how its tensors are named
in the Hugging Face hub layout (the one `save_pretrained` writes: one tensor per expert and projection),
and which decoder layers are MoE layers. Adding an architecture means adding one entry to ARCHITECTURES.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# The three weights of one routed expert, in the order every bundle and store uses.
EXPERT_WEIGHTS = ("gate", "up", "down")


def _every_layer_from(first_key: str, step_key: str) -> Callable[[dict], list[int]]:
    """MoE layers are every `step`-th layer starting at `first` (DeepSeek-V2's rule)."""

    def moe_layers(config: dict) -> list[int]:
        first = config.get(first_key) or 0
        step = config.get(step_key) or 1
        return [i for i in range(config["num_hidden_layers"]) if i >= first and i % step == 0]

    return moe_layers


def _sparse_step_layers(config: dict) -> list[int]:
    """Qwen-MoE's rule: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(config["num_hidden_layers"]) if (i + 1) % step == 0 and i not in dense]


def _all_layers(config: dict) -> list[int]:
    return list(range(config["num_hidden_layers"]))


@dataclass(frozen=True)
class Architecture:
    """How one MoE architecture names its experts, router and shared experts."""

    name: str
    model_types: tuple[str, ...]
    # Config keys of the routed-expert count, first present wins (transformers renames some on save).
    num_experts_keys: tuple[str, ...]
    top_k_key: str
    intermediate_key: str
    moe_layers: Callable[[dict], list[int]]
    # Tensor name of one routed expert's weight; {layer}, {expert} filled in, one suffix per EXPERT_WEIGHTS.
    expert_prefix: str
    expert_suffixes: tuple[str, str, str]
    router: str
    # Tensor-name prefixes of the always-active shared experts of a MoE layer ({layer} filled in).
    shared_prefixes: tuple[str, ...] = ()
    num_shared: Callable[[dict], int] = lambda config: 0

    def expert_tensor(self, layer: int, expert: int, weight: str) -> str:
        suffix = self.expert_suffixes[EXPERT_WEIGHTS.index(weight)]
        return f"{self.expert_prefix.format(layer=layer, expert=expert)}.{suffix}.weight"

    def experts_prefix(self, layer: int) -> str:
        """The name prefix of every tensor of a MoE layer's routed experts, whatever their layout or quantization."""
        return self.expert_prefix.split("{expert}")[0].format(layer=layer)

    def router_tensor(self, layer: int) -> str:
        return self.router.format(layer=layer)

    def num_experts_key(self, config: dict) -> str:
        return next((k for k in self.num_experts_keys if k in config), self.num_experts_keys[0])

    def num_shared_experts(self, config: dict) -> int:
        return int(self.num_shared(config))

    def is_shared_expert_tensor(self, name: str, layer: int) -> bool:
        return any(name.startswith(p.format(layer=layer) + ".") for p in self.shared_prefixes)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="deepseek_v2",
        model_types=("deepseek_v2", "deepseek_v3"),
        num_experts_keys=("n_routed_experts",),
        top_k_key="num_experts_per_tok",
        intermediate_key="moe_intermediate_size",
        moe_layers=_every_layer_from("first_k_dense_replace", "moe_layer_freq"),
        expert_prefix="model.layers.{layer}.mlp.experts.{expert}",
        expert_suffixes=("gate_proj", "up_proj", "down_proj"),
        router="model.layers.{layer}.mlp.gate.weight",
        shared_prefixes=("model.layers.{layer}.mlp.shared_experts",),
        num_shared=lambda config: config.get("n_shared_experts") or 0,
    ),
    Architecture(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        num_experts_keys=("num_experts", "num_local_experts"),
        top_k_key="num_experts_per_tok",
        intermediate_key="moe_intermediate_size",
        moe_layers=_sparse_step_layers,
        expert_prefix="model.layers.{layer}.mlp.experts.{expert}",
        expert_suffixes=("gate_proj", "up_proj", "down_proj"),
        router="model.layers.{layer}.mlp.gate.weight",
        shared_prefixes=("model.layers.{layer}.mlp.shared_expert", "model.layers.{layer}.mlp.shared_expert_gate"),
        num_shared=lambda config: 1 if config.get("shared_expert_intermediate_size") else 0,
    ),
    Architecture(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        num_experts_keys=("num_experts", "num_local_experts"),
        top_k_key="num_experts_per_tok",
        intermediate_key="moe_intermediate_size",
        moe_layers=_sparse_step_layers,
        expert_prefix="model.layers.{layer}.mlp.experts.{expert}",
        expert_suffixes=("gate_proj", "up_proj", "down_proj"),
        router="model.layers.{layer}.mlp.gate.weight",
    ),
    Architecture(
        name="mixtral",
        model_types=("mixtral",),
        num_experts_keys=("num_local_experts",),
        top_k_key="num_experts_per_tok",
        intermediate_key="intermediate_size",
        moe_layers=_all_layers,
        expert_prefix="model.layers.{layer}.block_sparse_moe.experts.{expert}",
        expert_suffixes=("w1", "w3", "w2"),
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
    ),
)


def architecture_for(model_type: str) -> Architecture | None:
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    return None


def supported_model_types() -> list[str]:
    return [t for arch in ARCHITECTURES for t in arch.model_types]
