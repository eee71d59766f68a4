"""Adapters and consolidated variants that change DeepSeek's MLA `kv_b_proj`, each token attended with its own.

vLLM's MLA never runs kv_b_proj as a layer of its own: its weight processing (`MLAAttention.
process_weights_after_loading`) turns it into the attention op's own matrices (W_UK_T and W_UV on CUDA, the CPU
build's packed _w_uk / _w_uv), which decode folds into the query and the output, while prefill applies kv_b_proj to
the step's new latents and to the cached ones. A copy of kv_b_proj alone would never be read: a per-request kv_b_proj
is a copy of the attention op's weight state.

So per MLA layer whose kv_b_proj the adapters change, this keeps `copies` stand-ins of vLLM's MLAAttention: shallow
copies that share what the engine binds to the layer (its KV cache, the backend's workspaces) and hold their own
kv_b_proj and everything its processing derives from it. A stand-in's state is made by the layer's own
`process_weights_after_loading` run on the stand-in, so whichever backend the engine picked, the copy holds what that
backend reads; it is checked once at start-up (from the base's kv_b_proj it must reproduce the live layer's state
bit for bit). The live layer's `forward_impl` (the op after the KV-cache write; a custom op, run outside compiled
code and replayed outside CUDA graphs) is replaced on the instance by one that runs the base's and every stand-in's
and keeps, for each token, its adapter's output. Exact: the KV cache holds the latent (kv_a_proj's output, copied
per token like any linear layer), not kv_b_proj's product, so each stand-in reads the same cache with its own
up-projections, as its merged model does. Cost: the attention op once more per copy in every step; memory: about
twice kv_b_proj's bytes per copy (its weight and the matrices derived from it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from esftctl.errors import EsftError
from esftctl.runtime.vllm.variant_weights import ENGINE_STATE, module_state

MLA_CLASS = "MLAAttention"


def mla_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{id(kv_b_proj): the MLAAttention that folds it} for every MLA layer of `model`."""
    return {id(m.kv_b_proj): m for m in model.modules()
            if MLA_CLASS in {c.__name__ for c in type(m).__mro__} and isinstance(getattr(m, "kv_b_proj", None),
                                                                                  torch.nn.Module)}


def stand_in(layer: torch.nn.Module, kv_b_proj: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of MLAAttention `layer` with `kv_b_proj` and its own copies of the layer's tensors (the weight
    processing writes some in place), sharing the rest: the KV cache, the backend impl's buffers."""
    from esftctl.runtime.vllm.module_copies import clone_parameter

    s = copy.copy(layer)
    for store in ("_parameters", "_buffers", "_modules"):
        s.__dict__[store] = dict(layer.__dict__[store])
    for name, p in s._parameters.items():
        if p is not None:
            s._parameters[name] = clone_parameter(p)
    for name, b in s._buffers.items():
        if b is not None:
            s._buffers[name] = b.clone()
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor) and name not in ENGINE_STATE:
            s.__dict__[name] = value.clone()
    s.__dict__.pop("forward_impl", None)  # the live instance's wrapper: the stand-in runs the class's
    s.impl = copy.copy(layer.impl)
    s._modules["kv_b_proj"] = kv_b_proj
    s.impl.kv_b_proj = kv_b_proj
    return s


def derive(layer: torch.nn.Module, kv_b_proj: torch.nn.Module) -> torch.nn.Module:
    """A stand-in of `layer` whose state vLLM's own weight processing made from `kv_b_proj` (as its loader left it)."""
    s = stand_in(layer, kv_b_proj)
    s.process_weights_after_loading(kv_b_proj.params_dtype)
    return s


def state(s: torch.nn.Module, impl_keys: frozenset[str]) -> dict[str, tuple[object, str]]:
    """{key: (owner, attribute)} of what a stand-in (or the live layer) holds that kv_b_proj decides: the layer's
    tensors, its kv_b_proj's state, and the impl's attributes named `impl_keys` (those the weight processing sets;
    the impl's other attributes, its workspaces, stay shared). Stand-ins of one layer have the same keys."""
    out = {f"layer.{n}": (s, n) for n, v in (*s._parameters.items(), *s._buffers.items()) if v is not None}
    out |= {f"layer.{n}": (s, n) for n, v in vars(s).items() if isinstance(v, torch.Tensor) and n not in ENGINE_STATE}
    out |= {f"kv_b_proj{k}": (o, n) for k, (o, n, _) in module_state(s.kv_b_proj, set()).items()}
    out |= {f"impl.{n}": (s.impl, n) for n in impl_keys}
    return out


def _put(owner, name: str, value) -> None:
    """Set `owner.name`: a module's parameter or buffer in its own store, anything else as an attribute."""
    if isinstance(owner, torch.nn.Module) and name in owner._parameters:
        owner._parameters[name] = value if isinstance(value, torch.nn.Parameter) or value is None else \
            torch.nn.Parameter(value, requires_grad=False)
    elif isinstance(owner, torch.nn.Module) and name in owner._buffers:
        owner._buffers[name] = value
    else:
        object.__setattr__(owner, name, value)


def put_value(owner, name: str, value) -> None:
    """`owner.name` takes `value`: a tensor of the same shape and dtype in place (pointers a CUDA graph captured
    stay), anything else set (the CPU build's repacked weights, which its eager engine reads)."""
    held = getattr(owner, name, None)
    with torch.no_grad():
        if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and held.shape == value.shape \
                and held.dtype == value.dtype:
            held.copy_(value, non_blocking=True)
        else:
            _put(owner, name, value)


def differing(a: dict[str, tuple[object, str]], b: dict[str, tuple[object, str]]) -> str | None:
    """The first key whose value differs between two `state`s, or None."""
    for key, (owner, name) in a.items():
        x = getattr(owner, name)
        y = getattr(*b[key]) if key in b else None
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                return key
        elif x is not y and not (type(x) is type(y) and _plain(x) and x == y):
            return key
    return None


def _plain(x) -> bool:
    return isinstance(x, (int, float, str, bool, type(None), torch.dtype))


@dataclass
class CopiedAttention:
    """One MLA layer: the live MLAAttention (the base's), `copies` stand-ins for adapters or variants, and which
    stand-in each slot's tokens take (`table[slot + 1]`, -1: the base's). `name` is its kv_b_proj's, where adapters'
    tensors go."""

    name: str
    module: torch.nn.Module  # the live kv_b_proj (what ModuleCopies.convert loads an adapter's tensors into)
    layer: torch.nn.Module
    copies: list[torch.nn.Module]
    table: torch.Tensor
    token_adapters: torch.Tensor
    impl_keys: frozenset[str] = frozenset()
    base_forward_impl: object = None

    @classmethod
    def make(cls, name: str, layer: torch.nn.Module, copies: int, table: torch.Tensor,
             token_adapters: torch.Tensor) -> "CopiedAttention":
        """`copies` stand-ins of `layer`, each holding the base's state until `write` or `put` gives it another."""
        from esftctl.runtime.vllm.module_copies import clone_module

        made = [stand_in(layer, clone_module(layer.kv_b_proj)) for _ in range(copies)]
        return cls(name, layer.kv_b_proj, layer, made, table, token_adapters)

    def check(self, scratch_kv_b_proj: torch.nn.Module) -> None:
        """The base's kv_b_proj, as vLLM's loader leaves it, must give the live layer's state through `derive`; the
        impl attributes that processing sets are learnt here."""
        derived = derive(self.layer, scratch_kv_b_proj)
        self.set_impl_keys(n for n, v in vars(derived.impl).items()
                           if n != "kv_b_proj" and v is not getattr(self.layer.impl, n, None))
        key = differing(state(derived, self.impl_keys), state(self.layer, self.impl_keys))
        if key is not None:
            raise EsftError(f"{self.name}: vLLM's MLA attention ({type(self.layer.impl).__name__}) could not be "
                            f"reproduced from the checkpoint ({key} differs); adapters that change kv_b_proj cannot be "
                            "served by this engine")

    def set_impl_keys(self, names) -> None:
        """The impl attributes that the weight processing sets, each stand-in given its own copy of them: a stand-in's
        impl is a shallow copy of the live one, so until now they were the live layer's objects, which a load must
        never write into."""
        self.impl_keys = frozenset(names)
        for s in self.copies:
            for n in self.impl_keys:
                value = getattr(s.impl, n)
                if isinstance(value, torch.Tensor):
                    setattr(s.impl, n, value.clone())

    def write(self, c: int, scratch_kv_b_proj: torch.nn.Module) -> None:
        """Stand-in `c` takes the state derived from `scratch_kv_b_proj` (an adapter's kv_b_proj, loaded)."""
        source = state(derive(self.layer, scratch_kv_b_proj), self.impl_keys)
        target = state(self.copies[c], self.impl_keys)
        for key, (owner, name) in source.items():
            if key not in target:
                raise EsftError(f"{self.name}: vLLM's MLA weight processing made {key} for one adapter only")
            put_value(*target[key], getattr(owner, name))

    def keys_of(self) -> dict[tuple[int, str], str]:
        """{(id(owner), attribute): key} of the live layer's state, for state held elsewhere (VariantWeights')."""
        return {(id(o), n): k for k, (o, n) in state(self.layer, self.impl_keys).items()}

    def put(self, c: int, key: str, value) -> None:
        """Stand-in `c`'s `key` takes `value` (a consolidated variant's, as vLLM's loader made it)."""
        put_value(*state(self.copies[c], self.impl_keys)[key], value)

    def install(self) -> None:
        self.base_forward_impl, self.layer.forward_impl = self.layer.forward_impl, self.forward_impl

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output=None, **kwargs):
        """The base's attention, then each stand-in's into a buffer of its own, each token keeping its adapter's
        rows (the live layer has written the KV cache before, once)."""
        result = self.base_forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, output=output, **kwargs)
        if attn_metadata is None or not self.copies:  # the profile run: nothing attended
            return result
        if kwargs.get("output_scale") is not None or kwargs.get("output_block_scale") is not None:
            raise EsftError(f"{self.name}: the engine quantizes MLA's output inside the attention op, which "
                            "per-request kv_b_proj copies do not support; serve without that fusion")
        from esftctl.runtime.vllm.module_copies import select

        which = self.table[self.token_adapters[:output.shape[0]].long() + 1]
        for c, s in enumerate(self.copies):
            mine = torch.empty_like(output)
            type(self.layer).forward_impl(s, q, k_c_normed, k_pe, kv_cache, attn_metadata, output=mine, **kwargs)
            output.copy_(select(which == c, mine, output))
        return result

    def nbytes(self) -> int:
        """What the stand-ins hold of their own."""
        seen, total = set(), 0
        for s in self.copies:
            for owner, name in state(s, self.impl_keys).values():
                value = getattr(owner, name)
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
        return total
