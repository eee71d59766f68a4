"""Declarative descriptions of the MoE architectures esftctl understands.

Each architecture is data: which config keys hold the expert counts and sizes, how its tensors are named
in the Hugging Face hub layout (the one `save_pretrained` writes: one tensor per expert and projection),
which decoder layers are MoE layers, and how its router picks experts. Adding an architecture means adding one
entry to ARCHITECTURES.

Routing is declared as vLLM computes it for the model type (the engine adapters are served in), since
relevance scoring recomputes it (esftctl/routing.py) and must pick the experts serving picks. In vLLM 0.25 and
0.32: Qwen2/3-MoE, Qwen3-Next, Mixtral and OLMoE take the top-k of softmax(W h); DeepSeek-V2 and -V3 (one class,
deepseek_v2.py) score with `scoring_func` from the config (softmax when absent: DeepSeek-V3's published config
says sigmoid) and always route group-limited over `n_group` / `topk_group` groups, adding the per-expert
`e_score_correction_bias` to the scores that choose (not to the routing weights) when `topk_method` is
"noaux_tc"; GLM-4.5 (glm4_moe.py) always scores with sigmoid, routes group-limited and adds the bias.
A group's score is its best expert's, or with the bias its two best experts' sum. GPT-OSS's router has a bias
of its own (logits W h + b), and vLLM takes the top-k of their softmax.

Experts are stored one tensor per expert and projection, except GPT-OSS's (FusedExperts, "gpt_oss"): one tensor per
MoE layer and projection, expert first, gate and up interleaved by column, with biases. esftctl reads an expert out
of them as three weights in the usual orientation plus three biases (EXPERT_BIASES), and writes it back in place.
transformers 5 holds every other architecture's experts stacked in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
gate's rows then up's, and `mlp.experts.down_proj` [E, H, I]), and tools that save a state dict as it is write that
layout: Architecture.in_memory describes it (FusedExperts "stacked"), and a checkpoint holding it is read as such
(esftctl.formats.checkpoint.MoECheckpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

# The three weights of one routed expert, in the order every bundle and store uses: gate [I, H], up [I, H],
# down [H, I]; and the biases of experts that have them (GPT-OSS): gate [I], up [I], down [H].
EXPERT_WEIGHTS = ("gate", "up", "down")
EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")
# The float32 block scales of FP8 experts (`weight_scale_inv` beside each weight: esftctl.formats.fp8).
EXPERT_SCALES = ("gate_scale", "up_scale", "down_scale")


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
class Routing:
    """How a MoE layer's router turns logits into a token's experts (module docstring)."""

    scoring: str = "softmax"  # softmax or sigmoid of the router logits
    groups: int = 1  # group-limited top-k: experts in `groups` equal groups, the best `top_groups` kept
    top_groups: int = 1
    correction_bias: bool = False  # e_score_correction_bias added to the scores that choose


SOFTMAX = Routing()


MODULE_RENAMES = ((".block_sparse_moe.", ".mlp."),)  # hub name part -> transformers 5's module name (Mixtral)


def memory_name(name: str) -> str:
    """A tensor name of the hub layout as transformers 5 names it in memory (the same for most tensors)."""
    for hub, memory in MODULE_RENAMES:
        name = name.replace(hub, memory)
    return name


@dataclass(frozen=True)
class FusedExperts:
    """A MoE layer's routed experts in one tensor per projection ({layer} filled in), in one of two layouts:

    - "gpt_oss" (GPT-OSS's checkpoints): gate_up [E, H, 2I], which multiplies from the right (x @ gate_up[e]) and
      interleaves gate and up by column (gate the even columns, up the odd ones), its bias [E, 2I] interleaved
      alike, down [E, I, H] (x @ down[e]) and its bias [E, H];
    - "stacked" (transformers 5's in memory, every other architecture): gate_up [E, 2I, H], gate's rows then up's,
      and down [E, H, I], each expert in the usual (out, in) orientation; no biases.
    """

    gate_up: str
    gate_up_bias: str | None
    down: str
    down_bias: str | None
    kind: str = "gpt_oss"

    def tensors(self, layer: int) -> tuple[str, ...]:
        names = (self.gate_up, self.gate_up_bias, self.down, self.down_bias)
        return tuple(t.format(layer=layer) for t in names if t is not None)

    @property
    def has_biases(self) -> bool:
        return self.gate_up_bias is not None

    def shapes(self, experts: int, hidden: int, intermediate: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of a layer's tensors, in `tensors`' order."""
        e, h, i = experts, hidden, intermediate
        if self.kind == "stacked":
            return (e, 2 * i, h), (e, h, i)
        return (e, h, 2 * i), (e, 2 * i), (e, i, h), (e, h)


def _deepseek_routing(config: dict) -> Routing:
    return Routing(config.get("scoring_func") or "softmax", config.get("n_group") or 1, config.get("topk_group") or 1,
                   config.get("topk_method") == "noaux_tc")


def _glm4_moe_routing(config: dict) -> Routing:
    return Routing("sigmoid", config.get("n_group") or 1, config.get("topk_group") or 1, True)


@dataclass(frozen=True)
class Architecture:
    """How one MoE architecture names its experts, router and shared experts."""

    name: str
    model_types: tuple[str, ...]
    # Config keys of the routed-expert count, first present wins (transformers renames some on save).
    num_experts_keys: tuple[str, ...]
    intermediate_key: str
    moe_layers: Callable[[dict], list[int]]
    # Tensor name of one routed expert's weight; {layer}, {expert} filled in, one suffix per EXPERT_WEIGHTS.
    expert_prefix: str
    expert_suffixes: tuple[str, str, str]
    router: str
    top_k_key: str = "num_experts_per_tok"
    # Tensor-name prefixes of the always-active shared experts of a MoE layer ({layer} filled in).
    shared_prefixes: tuple[str, ...] = ()
    num_shared: Callable[[dict], int] = lambda config: 0
    routing: Callable[[dict], Routing] = lambda config: SOFTMAX
    # Tensor of the router's per-expert correction bias ({layer} filled in), where `routing` uses one.
    correction_bias: str | None = None
    # The router's module in transformers' model, under a decoder layer (relevance captures its input).
    router_module: str = "mlp.gate"
    # The router's own bias ({layer} filled in), added to its logits (GPT-OSS).
    router_bias: str | None = None
    # Experts stored fused per layer (GPT-OSS; any architecture in_memory), not one tensor per expert and weight.
    fused: FusedExperts | None = None

    @property
    def expert_weights(self) -> tuple[str, ...]:
        """What one routed expert consists of: EXPERT_WEIGHTS, and EXPERT_BIASES where it has biases."""
        return EXPERT_WEIGHTS + (EXPERT_BIASES if self.fused is not None and self.fused.has_biases else ())

    def in_memory(self) -> "Architecture":
        """This architecture as transformers 5 holds it in memory, and as a state dict saved as it is holds it: each
        MoE layer's experts stacked (FusedExperts "stacked"), under transformers' module names (Mixtral's
        `block_sparse_moe` is `mlp` there, its router too). GPT-OSS is held as it is stored."""
        if self.fused is not None:
            return self

        def named(template: str | None) -> str | None:
            return memory_name(template) if template else template
        prefix = named(self.expert_prefix).split("{expert}")[0]
        return replace(self, expert_prefix=named(self.expert_prefix), router=named(self.router),
                       shared_prefixes=tuple(map(named, self.shared_prefixes)),
                       correction_bias=named(self.correction_bias),
                       fused=FusedExperts(prefix + "gate_up_proj", None, prefix + "down_proj", None, kind="stacked"))

    def expert_tensor(self, layer: int, expert: int, weight: str) -> str:
        if self.fused is not None:
            raise ValueError(f"{self.name} stores experts fused: no tensor holds one expert's {weight}")
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


PROJ = ("gate_proj", "up_proj", "down_proj")
MLP_EXPERT = "model.layers.{layer}.mlp.experts.{expert}"
MLP_GATE = "model.layers.{layer}.mlp.gate.weight"
MLP_GATE_BIAS = "model.layers.{layer}.mlp.gate.e_score_correction_bias"
SHARED_EXPERTS = ("model.layers.{layer}.mlp.shared_experts",)
QWEN_SHARED_EXPERT = ("model.layers.{layer}.mlp.shared_expert", "model.layers.{layer}.mlp.shared_expert_gate")


def _deepseek_shared(config: dict) -> int:
    return config.get("n_shared_experts") or 0


def _qwen_shared(config: dict) -> int:
    return 1 if config.get("shared_expert_intermediate_size") else 0


def _deepseek_family(name: str, routing: Callable[[dict], Routing]) -> Architecture:
    """DeepSeek-V2's layout, which DeepSeek-V3 and GLM-4.5 keep: dense first layers, shared experts, a router
    with a correction bias; they differ in how they route."""
    return Architecture(
        name=name,
        model_types=(name,),
        num_experts_keys=("n_routed_experts",),
        intermediate_key="moe_intermediate_size",
        moe_layers=_every_layer_from("first_k_dense_replace", "moe_layer_freq"),
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router=MLP_GATE,
        shared_prefixes=SHARED_EXPERTS,
        num_shared=_deepseek_shared,
        routing=routing,
        correction_bias=MLP_GATE_BIAS,
    )


ARCHITECTURES: tuple[Architecture, ...] = (
    _deepseek_family("deepseek_v2", _deepseek_routing),
    _deepseek_family("deepseek_v3", _deepseek_routing),
    _deepseek_family("glm4_moe", _glm4_moe_routing),
    Architecture(
        name="gpt_oss",
        model_types=("gpt_oss",),
        num_experts_keys=("num_local_experts",),
        intermediate_key="intermediate_size",
        moe_layers=_all_layers,
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router="model.layers.{layer}.mlp.router.weight",
        router_module="mlp.router",
        router_bias="model.layers.{layer}.mlp.router.bias",
        fused=FusedExperts("model.layers.{layer}.mlp.experts.gate_up_proj",
                           "model.layers.{layer}.mlp.experts.gate_up_proj_bias",
                           "model.layers.{layer}.mlp.experts.down_proj",
                           "model.layers.{layer}.mlp.experts.down_proj_bias"),
    ),
    Architecture(
        name="olmoe",
        model_types=("olmoe",),
        num_experts_keys=("num_experts",),
        intermediate_key="intermediate_size",
        moe_layers=_all_layers,
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router=MLP_GATE,
    ),
    Architecture(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        num_experts_keys=("num_experts", "num_local_experts"),
        intermediate_key="moe_intermediate_size",
        moe_layers=_sparse_step_layers,
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router=MLP_GATE,
        shared_prefixes=QWEN_SHARED_EXPERT,
        num_shared=_qwen_shared,
    ),
    Architecture(
        name="qwen3_next",  # Qwen2-MoE's expert and shared-expert layout, beside linear-attention layers
        model_types=("qwen3_next",),
        num_experts_keys=("num_experts",),
        intermediate_key="moe_intermediate_size",
        moe_layers=_sparse_step_layers,
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router=MLP_GATE,
        shared_prefixes=QWEN_SHARED_EXPERT,
        num_shared=_qwen_shared,
    ),
    Architecture(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        num_experts_keys=("num_experts", "num_local_experts"),
        intermediate_key="moe_intermediate_size",
        moe_layers=_sparse_step_layers,
        expert_prefix=MLP_EXPERT,
        expert_suffixes=PROJ,
        router=MLP_GATE,
    ),
    Architecture(
        name="mixtral",
        model_types=("mixtral",),
        num_experts_keys=("num_local_experts",),
        intermediate_key="intermediate_size",
        moe_layers=_all_layers,
        expert_prefix="model.layers.{layer}.block_sparse_moe.experts.{expert}",
        expert_suffixes=("w1", "w3", "w2"),
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
    ),
)


# What the rules above read from a config.json, as the JSON types and ranges each must have, checked before any rule
# runs (config_problem): a model folder may come from anywhere. Without them a fuzz of tiny models' configs found a
# string n_group a TypeError, a string n_shared_experts a ValueError, and num_hidden_layers 2**31 a hang in
# moe_layers. The bounds are far past any released model (DeepSeek-V3: 61 layers, 256 experts, hidden size 7168).
LAYERS, EXPERTS, WIDTH = 1 << 12, 1 << 16, 1 << 20
# Read where present; null or absent reads as the rule's default. 0 is each rule's default too (`or`).
OPTIONAL_INTS = {
    "first_k_dense_replace": (0, LAYERS), "moe_layer_freq": (0, LAYERS), "decoder_sparse_step": (0, LAYERS),
    "n_group": (0, EXPERTS), "topk_group": (0, EXPERTS), "n_shared_experts": (0, EXPERTS),
    "shared_expert_intermediate_size": (0, WIDTH),
}
OPTIONAL_STRINGS = ("scoring_func", "topk_method")
OPTIONAL_LAYER_LISTS = ("mlp_only_layers",)


def config_problem(arch: Architecture, config: dict) -> str | None:
    """What is wrong with the fields of `config` that `arch`'s rules read (the first thing), or None."""
    def bad_int(value, low: int, high: int) -> bool:
        return type(value) is not int or not low <= value <= high

    required = {"num_hidden_layers": (1, LAYERS), "hidden_size": (1, WIDTH), arch.num_experts_key(config): (1, EXPERTS),
                arch.top_k_key: (1, EXPERTS), arch.intermediate_key: (1, WIDTH)}  # each architecture's counts
    for key, (low, high) in required.items():
        if bad_int(config.get(key), low, high):
            return f"config's {key!r} must be an integer in {low}-{high}, not {_shown(config.get(key))}"
    for key, (low, high) in OPTIONAL_INTS.items():
        if config.get(key) is not None and bad_int(config[key], low, high):
            return f"config's {key!r} must be an integer in {low}-{high} or null, not {_shown(config[key])}"
    for key in OPTIONAL_STRINGS:
        if config.get(key) is not None and not isinstance(config[key], str):
            return f"config's {key!r} must be a string or null, not {_shown(config[key])}"
    for key in OPTIONAL_LAYER_LISTS:
        value = config.get(key)
        if value is not None and not (isinstance(value, list) and all(not bad_int(v, 0, LAYERS) for v in value)):
            return f"config's {key!r} must be a list of layer indices or null, not {_shown(value)}"
    return None


def _shown(value) -> str:
    """A config value as its JSON, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def architecture_for(model_type: str) -> Architecture | None:
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    return None


def supported_model_types() -> list[str]:
    return [t for arch in ARCHITECTURES for t in arch.model_types]
