"""Each variant's non-expert weights, put in place in the live vLLM model for the steps that run that variant.

Fine-tuned variants of one base differ in every non-expert tensor (attention, norms, embeddings, routers,
shared experts, lm_head), and vLLM's kernels do not read those tensors as the checkpoint holds them: its
loader converts them once (`process_weights_after_loading`: MLA splits kv_b_proj into W_UK_T and W_UV, the
CPU build prepacks every linear weight into a oneDNN or sgl-kernel handle and drops the weight). So a variant
is loaded by vLLM's own loader into a model of its own (a "shadow": same config, its own checkpoint, the
same processing), and its non-expert state is taken from there: for every module except the routed experts,
its parameters, buffers and tensor attributes (one level into helper objects such as attention impls), and
the closures vLLM's processing made (the CPU build's `cpu_linear`, which holds the packed weight). The
shadow is then dropped; only what some variant holds differently from the served checkpoint is kept (a
rotary cache, say, is the same everywhere).

`activate(variant)` copies a variant's tensors into the live tensors in place, so every pointer a CUDA graph
or compiled code captured stays valid, and sets its closures (the CPU build's; these need an eager engine,
which `esftctl serve --variants` asks for on the CPU). The copy is the cost of a switch: the non-expert bytes
that differ, e.g. DeepSeek-V2-Lite's 1.3 B non-expert parameters = 2.6 GB, about 1.3 ms at an H100's 2 TB/s
for a device-resident copy, against 20-30 ms per decode step; the scheduler (esftctl.runtime.vllm.variant_turns)
switches at most once per `quantum` steps. Memory: one copy per variant of what differs, resident beside
the model; loading a variant's shadow takes one more model's memory for a moment at start-up, before vLLM
sizes its KV cache.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from esftctl.errors import EsftError
from esftctl.variants import HOME

ENGINE_STATE = frozenset({"kv_cache"})  # bound by the engine to the live layers, not weights


@dataclass
class _Entry:
    """One piece of state: `owner.<name>` (an attribute, or a parameter or buffer of a module)."""

    owner: object
    name: str
    kind: str  # "tensor" (copied in place) or "closure" (set)

    def get(self):
        return getattr(self.owner, self.name)


@dataclass
class VariantWeights:
    """Per variant, the values of the entries that differ between variants; `active` is the variant in place."""

    entries: list[_Entry]
    values: dict[int, list] = field(default_factory=dict)  # variant -> one value per entry
    active: int = HOME
    swapped_closures: list[str] = field(default_factory=list)  # set by reference: valid only in an eager engine

    def activate(self, variant: int) -> bool:
        """Put `variant`'s state in place; returns whether anything changed."""
        if variant == self.active:
            return False
        with torch.no_grad():
            for entry, value in zip(self.entries, self.values[variant]):
                if entry.kind == "tensor":
                    entry.get().copy_(value, non_blocking=True)
                else:
                    setattr(entry.owner, entry.name, value)
        self.active = variant
        return True

    def nbytes(self) -> int:
        """Bytes held for switching: every variant's copies of the tensors that differ."""
        return sum(v.numel() * v.element_size() for values in self.values.values() for v in values
                   if isinstance(v, torch.Tensor))


def module_state(module: torch.nn.Module, skip: set[int]) -> dict[str, tuple[object, str, str]]:
    """{key: (owner, attribute, kind)} for the state of `module` and its submodules the forward may read."""
    out = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        if id(mod) in skip:
            continue
        for name, value in list(mod._parameters.items()) + list(mod._buffers.items()):
            if value is not None:
                out[f"{prefix}.{name}"] = (mod, name, "tensor")
        for name, value in vars(mod).items():
            if name in ENGINE_STATE:
                continue
            key = f"{prefix}.{name}"
            if isinstance(value, torch.Tensor):
                out[key] = (mod, name, "tensor")
            elif _is_weight_closure(name, value):
                out[key] = (mod, name, "closure")
            elif _is_helper(value):  # e.g. an attention impl holding processed weights
                for inner, v in vars(value).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{key}.{inner}"] = (value, inner, "tensor")
    return out


def _is_helper(value) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type, types.ModuleType))
            and type(value).__module__.startswith("vllm."))


# The attribute vLLM's CPU build keeps a linear layer's prepacked weight in (a closure over a oneDNN or
# sgl-kernel handle: vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm).
WEIGHT_CLOSURES = frozenset({"cpu_linear"})


def _is_weight_closure(name: str, value) -> bool:
    """A function made by weight processing around what it computes with: vLLM's `cpu_linear`, or any closure
    over a tensor. Other closures (compiled callables, custom ops' dispatch) are the engine's, not weights."""
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return False
    cells = [c.cell_contents for c in value.__closure__]
    if any(isinstance(c, torch.nn.Module) for c in cells):
        return False
    return name in WEIGHT_CLOSURES or any(isinstance(c, torch.Tensor) for c in cells)


def _same(a, b) -> bool:
    """Equal tensors, or closures of one code over equal values (a packed weight's closure differs wherever
    the weight does: different tensors, or different handles of the engine's library)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if a.__code__ is not b.__code__:
        return False
    return all(_same_value(x.cell_contents, y.cell_contents) for x, y in zip(a.__closure__, b.__closure__))


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (int, float, str, bytes, bool, type(None), tuple, list, dict, frozenset, torch.dtype)):
        try:
            return bool(a == b)
        except Exception:
            return False
    return a is b


def _excluded(model: torch.nn.Module) -> set[int]:
    """The routed experts' modules (their rows are the runtime's: esftctl.runtime.vllm.model)."""
    from esftctl.runtime.vllm.moe import find_moe_layers

    skip = set()
    for layer in find_moe_layers(model).values():
        skip.update(id(m) for m in layer.experts.modules())
    return skip


def load_shadow(vllm_config, path: Path) -> torch.nn.Module:
    """`path` loaded by vLLM's own loader into a model of its own, converted as the live model was. Its layers
    register under a copy of the compilation config, so the engine never sees them (no KV cache for them)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    shadow_config = copy.copy(vllm_config)
    shadow_config.compilation_config = copy.copy(vllm_config.compilation_config)
    shadow_config.compilation_config.static_forward_context = {}
    shadow_config.compilation_config.static_all_moe_layers = []
    shadow_config.model_config = copy.copy(vllm_config.model_config)
    shadow_config.model_config.model = str(path)
    with set_current_vllm_config(shadow_config):
        loader = get_model_loader(shadow_config.load_config)
        return loader.load_model(vllm_config=shadow_config, model_config=shadow_config.model_config)


def collect(model: torch.nn.Module, vllm_config, variants: dict[int, Path]) -> VariantWeights:
    """The switchable state of the live `model` (holding variant HOME) and of every other variant in
    `variants` ({index: checkpoint folder}), each loaded once through `load_shadow`."""
    live = module_state(model, _excluded(model))
    home = {k: (getattr(o, n).detach().clone() if kind == "tensor" else getattr(o, n)) for k, (o, n, kind) in
            live.items()}
    others: dict[int, dict] = {}
    for index, path in variants.items():
        if index == HOME:
            continue
        shadow = load_shadow(vllm_config, path)
        state = module_state(shadow, _excluded(shadow))
        missing = sorted(set(live) ^ set(state))
        if missing:
            raise EsftError(f"vLLM builds this variant's model differently from the served one ({missing[0]!r})",
                            path)
        others[index] = {}
        for key, (owner, name, kind) in state.items():
            value, mine = getattr(owner, name), home[key]
            if kind == "tensor" and (value.shape != mine.shape or value.dtype != mine.dtype):
                raise EsftError(f"{key}: {value.dtype} {list(value.shape)} here, {mine.dtype} {list(mine.shape)} in "
                                "the served model", path)
            others[index][key] = value.detach() if kind == "tensor" else value
        del shadow, state  # the modules (and the shadow's experts) go; the values stay
    differ = [k for k in live if any(not _same(v[k], home[k]) for v in others.values())]
    weights = VariantWeights([_Entry(*live[k]) for k in differ])
    weights.values[HOME] = [home[k] for k in differ]
    for index, state in others.items():
        weights.values[index] = [state[k] for k in differ]
    weights.swapped_closures = [k for k in differ if live[k][2] == "closure"]
    return weights
