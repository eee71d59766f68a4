"""Adapters that train non-expert modules (ESFT's `non_expert_modules: true`: attention projections, norms, routers),
each adapter's weights applied to its own tokens, in one engine step.

The modules such an adapter changes compute each token's row from that token alone (a linear layer, a norm, a
router), so per module this keeps `copies` more instances of vLLM's own module (`copy.deepcopy`, made at start-up
before vLLM sizes its KV cache) and replaces the live module's `forward` on the instance by one that computes the
base's output and every copy's and keeps, for each token, its adapter's (as esftctl.runtime.vllm.shared_experts does
for shared experts, whose module runs inside vLLM's MoE op). Each token's row is the product its merged model computes
(the same module, the same batch); what the attention op itself reads from the step's other tokens (keys and values)
each token wrote with its own adapter's projections. Each copy costs its module's memory and one more product per
step; vLLM's prefix cache keeps adapters apart (its block hashes include the LoRA request).

Which vLLM parameter a checkpoint tensor loads into (q_proj into qkv_proj's "q" shard, ...) is each model's own
`load_weights`: it is run once at start-up with every parameter's loader replaced by one that records where a tensor
would go (on meta tensors, nothing copied). A load then converts an adapter's tensors as vLLM's loader does: a scratch
instance of the module gets fresh parameters, the base's tensors and the adapter's through the recorded loaders, and
its own `process_weights_after_loading` (vLLM's CPU build packs linear weights there), whose state is copied into the
adapter's copy (tensors in place, so CUDA graphs keep their pointers; the CPU build's closures set, which needs an eager
engine there). Checked once per module at start-up: the base's tensors, converted so, must give the live module's
output bit for bit.

The output head is the exception: vLLM computes logits for the sampled rows only (a request's last token), in the
model's `compute_logits`, which is replaced on the instance as the forwards are: the base's head and each copy compute
the rows' logits, and each row keeps its adapter's (`sample_adapters`, filled from vLLM's per-row LoRA mapping). An
embedding's row is its token's, so embeddings are per-token modules like the rest.

MLA's `kv_b_proj` is not a per-token module of its own: vLLM folds it into its attention op's weights, so an
adapter's copy of it is a copy of that op's state (esftctl.runtime.vllm.mla_copies.CopiedAttention). Refused in one line
naming the tensor: tensors of modules that esftctl does not know to be per-token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map_only

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.runtime.vllm.mla_copies import CopiedAttention, mla_layers
from esftctl.runtime.vllm.variant_weights import module_state

# vLLM module classes whose forward computes each token's row from that token alone (names in the class's MRO): an
# embedding's row is its token's. The output head (ParallelLMHead, an embedding too) computes logits for the sampled
# rows only, outside the forward: its copies are applied in the model's `compute_logits`, by each row's adapter.
PER_TOKEN = ("LinearBase", "RMSNorm", "LayerNorm", "GemmaRMSNorm", "VocabParallelEmbedding")
# Of those, the classes whose forward may write its inputs in place: vLLM's CUDA build adds the residual and normalizes
# in place (fused_add_rms_norm's in-place overload), returning its input tensors. Each copy then takes inputs of its
# own, cloned before the base's forward writes them.
WRITES_INPUTS = ("RMSNorm", "LayerNorm", "GemmaRMSNorm")
# Module names whose weights vLLM processes into another module's state, so that a copy of them alone is never read
# (served through a copy of that module: mla_copies, where esftctl finds the MLA attention holding it).
FOLDED = {"kv_b_proj": "MLA folds it into its attention kernel's weights (W_UK, W_UV), and esftctl found no MLA "
                       "attention holding it"}


@dataclass
class Route:
    """Where vLLM's loader puts one checkpoint tensor: a parameter of a module, through that parameter's loader."""

    module: str  # the module's qualified name in the model
    param: str  # the parameter's name in the module
    args: tuple  # the loader's further arguments (a shard id)
    kwargs: dict
    loader: object


def record_routes(model: torch.nn.Module, base: MoECheckpoint, names: list[str]) -> dict[str, list[Route]]:
    """{checkpoint tensor: its routes} for `names`, by running the model's `load_weights` once per tensor (a meta
    tensor of its shape) with every parameter's loader replaced by a recorder."""
    owners = {id(p): (m, n) for m, module in model.named_modules() for n, p in module.named_parameters(recurse=False)}
    holders = {id(p): module for module in model.modules() for p in module.parameters(recurse=False)}
    current: list[str] = []
    found: dict[str, list[Route]] = {}
    saved = {}

    def recorder(loader):
        def record(param, loaded, *args, **kwargs):
            if id(param) in owners:
                found.setdefault(current[0], []).append(Route(*owners[id(param)], args, kwargs, loader))
        return record

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = list({id(p): p for _, p in model.named_parameters(remove_duplicate=False)}.values())  # each once
    for p in params:
        saved[id(p)] = _get_loader(p)
        _set_loader(p, recorder(saved[id(p)] or _fallback_loader(holders.get(id(p)), default_weight_loader)))
    try:
        for name in names:
            current[:] = [name]
            info = base.tensors[name]
            model.load_weights([(name, torch.empty(info.shape, dtype=_dtype(info.dtype), device="meta"))])
    finally:
        for p in params:
            _set_loader(p, saved[id(p)])
    missing = [n for n in names if n not in found]
    if missing:
        raise EsftError(f"vLLM's loader puts the tensor {missing[0]!r} nowhere esftctl can follow", base.path)
    return found


def _fallback_loader(module, default):
    """The loader of a parameter that has none: its linear layer's own (vLLM's CPU build replaces a packed linear
    weight by an empty parameter without one), else vLLM's default (what the model's code takes then)."""
    if module is not None and "LinearBase" in _class_names(module) and callable(getattr(module, "weight_loader", None)):
        return module.weight_loader
    return default


def _get_loader(p):
    return p.__dict__.get("_weight_loader", p.__dict__.get("weight_loader"))


def _set_loader(p, loader) -> None:
    """Set a parameter's loader; None removes one that the parameter did not have."""
    if "_weight_loader" in p.__dict__:  # vLLM's BasevLLMParameter keeps it there (a property reads it)
        p._weight_loader = loader
    elif loader is not None:
        p.weight_loader = loader
    else:
        p.__dict__.pop("weight_loader", None)


def _dtype(name: str) -> torch.dtype:
    from esftctl.formats.checkpoint import TORCH_DTYPES

    return TORCH_DTYPES[name]


def select(mask: torch.Tensor, mine, out):
    """`mine` where `mask` (per token) is set, else `out`: tensors, or tuples of them (a norm's output and residual,
    a linear layer's output and bias) whose first dimension is the tokens'."""
    if isinstance(out, tuple):
        return tuple(select(mask, m, o) for m, o in zip(mine, out))
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != mask.shape[0]:
        return out
    return torch.where(mask.view(-1, *([1] * (out.dim() - 1))), mine, out)


def write_state(target: dict, source_module: torch.nn.Module, where: str) -> None:
    """Copy `source_module`'s state into the copy whose `module_state` is `target`: tensors in place (pointers that
    CUDA graphs captured stay), the CPU build's weight closures set."""
    source = module_state(source_module, set())
    with torch.no_grad():
        for key, (owner, name, kind) in target.items():
            value = getattr(source[key][0], source[key][1])
            if kind == "tensor":
                held = getattr(owner, name)
                if held.shape != value.shape or held.dtype != value.dtype:
                    raise EsftError(f"{where}: {key} converts to {value.dtype} {list(value.shape)}, the served module "
                                    f"holds {held.dtype} {list(held.shape)}")
                held.copy_(value, non_blocking=True)
            else:
                setattr(owner, name, value)


def clone_parameter(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A copy of `p` of its own class with its attributes (a loader, output_dim, ...): torch's Parameter deepcopy
    drops the attributes, and calls the class with arguments vLLM's BasevLLMParameter does not take."""
    new = torch.Tensor._make_subclass(type(p), p.data.clone(), p.requires_grad)
    new.__dict__.update(p.__dict__)
    return new


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` whose parameters are `clone_parameter`s (whatever else held one holds the copy's)."""
    memo = {id(p): clone_parameter(p) for p in module.parameters()}
    return copy.deepcopy(module, memo)


def deep_copies(module: torch.nn.Module, n: int, where: str) -> list[torch.nn.Module]:
    try:
        return [clone_module(module) for _ in range(n)]
    except Exception as e:  # a module holding what cannot be copied (a handle, a lock)
        raise EsftError(f"{where}: vLLM's module ({type(module).__name__}) cannot be copied ({type(e).__name__}: "
                        f"{e}); adapters that change it cannot be served by this engine") from None


def _class_names(module: torch.nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


class CopyPool:
    """Which of `num_copies` copies each loaded adapter holds, in every table of `tables()` (one per copied module,
    `table[slot + 1]`: the copy that slot's tokens take, -1 the base's), and the copies freed but still pending
    (AdapterSlots releases them once work queued before the unload has run)."""

    num_copies: int = 0

    def _start_pool(self, copies: int) -> None:
        self.num_copies = copies
        self.owner: dict[int, int] = {}  # copy -> slot holding it
        self.replaced: dict[int, int] = {}  # slot -> layers or modules its adapter replaces
        self.pending: set[int] = set()

    def tables(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def free_copies(self) -> list[int]:
        return [c for c in range(self.num_copies) if c not in self.owner and c not in self.pending]

    def _take(self, what: str, flag: str) -> int:
        free = self.free_copies()
        if not free:
            raise EsftError(f"it changes {what} and all {self.num_copies} copies of them are taken; unload an adapter "
                            f"that changes them, or serve with more {flag}")
        return free[0]

    def _hold(self, c: int, slot: int, replaced: int) -> int:
        self.owner[c], self.replaced[slot] = slot, replaced
        return c

    def detach(self, slot: int) -> int | None:
        """Point `slot`'s tokens back at the base's modules (stream-ordered); returns the copy it held, kept until
        `release` (in-flight work may still read it)."""
        c = next((c for c, s in self.owner.items() if s == slot), None)
        if c is None:
            return None
        for table in self.tables():
            table[slot + 1] = -1
        del self.owner[c]
        self.replaced.pop(slot, None)
        self.pending.add(c)
        return c

    def release(self, c: int) -> None:
        self.pending.discard(c)


@dataclass
class CopiedModule:
    """One module: the live one (the base's), `copies` for adapters, and which copy each slot's tokens take
    (`table[slot + 1]`, -1: the base's). A norm that writes its inputs in place (WRITES_INPUTS) gives each copy a
    clone of them taken before the base's forward ran: the copies would otherwise add the residual twice, and write
    into the very tensors the base's forward returned."""

    name: str
    module: torch.nn.Module
    copies: list[torch.nn.Module]
    table: torch.Tensor  # int32 [slots + 1], on the device
    token_adapters: torch.Tensor
    base_forward: object = None
    states: list[dict] = field(default_factory=list)
    writes_inputs: bool = field(init=False)  # a norm of WRITES_INPUTS: decided once, not every forward

    def __post_init__(self):
        self.writes_inputs = bool(_class_names(self.module) & set(WRITES_INPUTS))

    def forward(self, *args, **kwargs):
        which = self.table[self.token_adapters[:args[0].shape[0]].long() + 1]
        kept = _cloned((args, kwargs)) if self.copies and self.writes_inputs else None
        out = self.base_forward(*args, **kwargs)
        for c, module in enumerate(self.copies):
            a, k = (args, kwargs) if kept is None else kept if c == len(self.copies) - 1 else _cloned(kept)
            out = select(which == c, module(*a, **k), out)
        return out


def _cloned(value):
    """`value` with every tensor in it (in tuples, lists and dicts) cloned."""
    return tree_map_only(torch.Tensor, torch.Tensor.clone, value)


class ModuleCopies(CopyPool):
    """Copies of every module that the adapters given at start change beside experts (and shared experts), and which
    copy each loaded adapter holds."""

    def __init__(self, model: torch.nn.Module, base: MoECheckpoint, names: list[str], *, copies: int, slots: int,
                 token_adapters: torch.Tensor, sample_adapters: torch.Tensor, device: torch.device):
        """`token_adapters`: each token's slot in the step (the forwards'); `sample_adapters`: each sampled row's
        (the output head's)."""
        self.base, self.device = base, device
        self._start_pool(copies)
        modules = dict(model.named_modules())
        head = getattr(model, "lm_head", None)
        self.routes = record_routes(model, base, names)
        self.modules: dict[str, CopiedModule | CopiedAttention] = {}
        mla = mla_layers(model)
        for name in sorted({r.module for routes in self.routes.values() for r in routes}):
            module = modules[name]
            if id(module) in mla:  # kv_b_proj: a copy of the attention op that folds it
                table = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
                self.modules[name] = CopiedAttention.make(name, mla[id(module)], copies, table, token_adapters)
                continue
            tensor = next(t for t, rs in self.routes.items() if any(r.module == name for r in rs))
            why = not_per_token(name, module)
            if why:
                raise EsftError(f"the tensor {tensor!r} goes to {name}, {why}; an adapter that changes it cannot be "
                                "served per request (merge it into a full model instead)", base.path)
            made = deep_copies(module, copies, name)
            table = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
            self.modules[name] = CopiedModule(name, module, made, table, token_adapters,
                                              states=[module_state(m, set()) for m in made])
        self.head = next((m for m in self.modules.values() if m.module is head), None)
        self.sample_adapters = sample_adapters
        # the base's tensors of each module, by the routes that fill it (every tensor of it, not only the changed)
        self.base_routes = self._module_routes(model)
        self._logits_processor = self._head_logits(model)
        for m in self.modules.values():
            if isinstance(m, CopiedAttention):
                m.check(self.convert(m, {}))
            else:
                self._check(m)
        self._install(model)

    def _head_logits(self, model: torch.nn.Module):
        """The model's logits processor, which the output head's copies compute with; refuses a model without one."""
        processor = getattr(model, "logits_processor", None)
        if self.head is not None and (processor is None or not hasattr(model, "compute_logits")):
            raise EsftError(f"{self.head.name}: this model computes its logits otherwise than vLLM's models do; its "
                            "output head cannot be replaced per request")
        return processor

    def _install(self, model: torch.nn.Module) -> None:
        """Replace the forwards (and the head's logits) on the instances, once the copies are made and checked: the
        copies keep the class's forward."""
        head = getattr(model, "lm_head", None)
        for m in self.modules.values():
            if isinstance(m, CopiedAttention):
                m.install()
            elif m is not self.head or _tied(model, head):  # a tied head embeds the tokens too
                m.base_forward, m.module.forward = m.module.forward, m.forward
        if self.head is not None:
            self._base_logits, model.compute_logits = model.compute_logits, self._compute_logits

    @classmethod
    def for_variants(cls, model: torch.nn.Module, weights, slots_of: dict[int, int], *, slots: int,
                     token_adapters: torch.Tensor, sample_adapters: torch.Tensor,
                     device: torch.device) -> "ModuleCopies":
        """Consolidated variants in one engine step: every module whose state differs between the variants
        (esftctl.runtime.vllm.variant_weights.VariantWeights, each variant's as vLLM's loader made it in a model of
        its own) gets a copy per variant besides the home one, holding that variant's state; variant v's tokens (its
        slot `slots_of[v]`) take copy v - 1. Refuses, naming it, state that is not a per-token module's (an attention
        kernel's own weights, say): such variants run one per step."""
        from esftctl.variants import HOME

        names = {id(m): n for n, m in model.named_modules()}
        grouped: dict[str, list[int]] = {}
        attention: dict[str, tuple[torch.nn.Module, list[int]]] = {}  # kv_b_proj's name: (its MLA layer, entries)
        folding = {id(o): layer for layer in mla_layers(model).values()
                   for o in (layer, layer.impl, *layer.kv_b_proj.modules())}
        for k, entry in enumerate(weights.entries):
            layer = folding.get(id(entry.owner))
            if layer is not None:  # MLA's state, which kv_b_proj decides: copies of the attention op
                attention.setdefault(names[id(layer.kv_b_proj)], (layer, []))[1].append(k)
                continue
            name = names.get(id(entry.owner))
            why = not_per_token(name, entry.owner) if name is not None else \
                f"held by {type(entry.owner).__name__}, not a module of the model"
            if why:
                raise EsftError(f"the variants differ in {name or '?'}.{entry.name}, {why}: serve them one per step "
                                "(without --one-step)")
            grouped.setdefault(name, []).append(k)
        self = cls.__new__(cls)
        others = sorted(v for v in weights.values if v != HOME)
        self.base, self.device, self.routes, self.base_routes = None, device, {}, {}
        self._start_pool(len(others))
        self.modules = {}
        modules = dict(model.named_modules())
        for name, ks in sorted(grouped.items()):
            made = deep_copies(modules[name], len(others), name)
            table = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
            with torch.no_grad():
                for c, v in enumerate(others):
                    for k in ks:
                        entry, value = weights.entries[k], weights.values[v][k]
                        if entry.kind == "tensor":
                            getattr(made[c], entry.name).copy_(value)
                        else:
                            setattr(made[c], entry.name, value)
                    table[slots_of[v] + 1] = c
            self.modules[name] = CopiedModule(name, modules[name], made, table, token_adapters)
        for name, (layer, ks) in sorted(attention.items()):
            table = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
            copied = CopiedAttention.make(name, layer, len(others), table, token_adapters)
            copied.set_impl_keys(weights.entries[k].name for k in ks if weights.entries[k].owner is layer.impl)
            keys = copied.keys_of()
            for c, v in enumerate(others):
                for k in ks:
                    entry = weights.entries[k]
                    copied.put(c, keys[(id(entry.owner), entry.name)], weights.values[v][k])
                table[slots_of[v] + 1] = c
            self.modules[name] = copied
        head = getattr(model, "lm_head", None)
        self.head = next((m for m in self.modules.values() if m.module is head), None)
        self.sample_adapters = sample_adapters
        self._logits_processor = self._head_logits(model)
        self._install(model)
        return self

    def _module_routes(self, model: torch.nn.Module) -> dict[str, dict[str, list[Route]]]:
        """{module: {checkpoint tensor: routes}} of every base tensor whose loader fills a copied module's
        parameters (a module's scratch gets all of them, then an adapter's)."""
        prefixes = {name.rpartition(".")[0] for name in self.modules} | set(self.modules)  # a top one: lm_head.
        candidates = [n for n in self.base.tensors if not self.base.is_routed_expert_tensor(n)
                      and any(n.startswith(p + ".") for p in prefixes if p)]
        routes = record_routes(model, self.base, candidates) if candidates else {}
        out: dict[str, dict[str, list[Route]]] = {name: {} for name in self.modules}
        for tensor, rs in routes.items():
            for r in rs:
                if r.module in out:
                    out[r.module].setdefault(tensor, []).append(r)
        return out

    def convert(self, m: CopiedModule, replaced: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A scratch instance of `m`'s module holding the base's tensors with `replaced` ({checkpoint name:
        tensor}) over them, as vLLM's loader and weight processing leave them."""
        wrapped = m.module.__dict__.pop("forward", None)  # the live instance's wrapper: not part of the copy
        try:
            scratch = deep_copies(m.module, 1, m.name)[0]
        finally:
            if wrapped is not None:
                m.module.forward = wrapped
        for param_name, param in scratch.named_parameters(recurse=False):
            live = getattr(m.module, param_name)
            for attr, value in live.__dict__.items():  # Parameter's deepcopy drops them: output_dim, the loader, ...
                param.__dict__.setdefault(attr, value)
            if param.numel() == 0:  # the CPU build drops a packed linear weight: its loaded shape comes back
                linear = m.module
                rows = sum(getattr(linear, "output_partition_sizes", None) or [linear.output_size])
                columns = getattr(linear, "input_size_per_partition", None) or linear.input_size
                param.data = torch.empty(rows, columns, dtype=live.dtype, device=live.device)
                for attr, dim in (("input_dim", 1), ("output_dim", 0)):  # as UnquantizedLinearMethod made it
                    if getattr(param, attr, None) is None:
                        setattr(param, attr, dim)
        for tensor, routes in self.base_routes[m.name].items():
            value = replaced.get(tensor)
            value = self.base.read_tensor(tensor) if value is None else value
            for r in routes:
                param = getattr(scratch, r.param)
                with torch.no_grad():
                    r.loader(param, value.to(param.device), *r.args, **r.kwargs)
        method = getattr(scratch, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(scratch)
        return scratch

    def _compute_logits(self, hidden_states: torch.Tensor, *args, **kwargs):
        """The model's logits, each sampled row's with its adapter's output head."""
        logits = self._base_logits(hidden_states, *args, **kwargs)
        if logits is None:  # a pipeline rank without the head
            return logits
        which = self.head.table[self.sample_adapters[:hidden_states.shape[0]].long() + 1]
        for c, head in enumerate(self.head.copies):
            logits = select(which == c, self._logits_processor(head, hidden_states), logits)
        return logits

    def _check(self, m: CopiedModule) -> None:
        if not self.base_routes[m.name]:  # a scratch loaded with nothing would pass the check below, and serve the base
            raise EsftError(f"{m.name}: no tensor of the checkpoint is loaded into it that esftctl can follow; "
                            "adapters that change it cannot be served by this engine", self.base.path)
        scratch = self.convert(m, {})
        dtype = next(p for p in m.module.parameters()).dtype
        g = torch.Generator().manual_seed(0)
        if m is self.head:  # logits of five rows
            hidden = torch.randn(5, m.module.embedding_dim, generator=g).to(self.device, dtype)
            with torch.no_grad():
                want, got = self._logits_processor(m.module, hidden), self._logits_processor(scratch, hidden)
        else:
            if "VocabParallelEmbedding" in _class_names(m.module):  # five token ids
                x = torch.randint(0, m.module.org_vocab_size, (5,), generator=g).to(self.device)
            else:
                width = getattr(m.module, "input_size", None) or next(iter(m.module.parameters())).shape[-1]
                x = torch.randn(5, width, generator=g).to(self.device, dtype)
            with torch.no_grad():
                want, got = m.module(x), scratch(x)
        if not _same(want, got):
            raise EsftError(f"{m.name}: vLLM's module ({type(m.module).__name__}) could not be reproduced from the "
                            "checkpoint; adapters that change it cannot be served by this engine")

    def accepts(self, name: str) -> bool:
        """Whether `name` is a tensor of a module this server keeps copies of."""
        return name in self.routes

    def tables(self) -> list[torch.Tensor]:
        return [m.table for m in self.modules.values()]

    def by_module(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            targets = {r.module for r in self.routes.get(name, ())}
            if not targets:
                raise EsftError(f"it changes {name!r}, which no module this server keeps copies of reads; start the "
                                "server with an adapter that changes it (or merge it into a full model)")
            for module in targets:
                out.setdefault(module, {})[name] = tensor
        return out

    def load(self, slot: int, tensors: dict[str, torch.Tensor]) -> int:
        changed = self.by_module(tensors)
        c = self._take("non-expert modules", "--module-copies")
        for name, replaced in changed.items():
            m = self.modules[name]
            if isinstance(m, CopiedAttention):
                m.write(c, self.convert(m, replaced))
            else:
                write_state(m.states[c], self.convert(m, replaced), name)
            m.table[slot + 1] = c
        return self._hold(c, slot, len(changed))

    def nbytes(self) -> int:
        """The copies' memory: every copy of every module, as the checkpoint holds its tensors (an adapter's), or as
        the copies hold them (variants'; vLLM's CPU build keeps packed linear weights outside them); MLA's attention
        copies as they hold theirs (kv_b_proj and the matrices derived from it)."""
        attention = sum(m.nbytes() for m in self.modules.values() if isinstance(m, CopiedAttention))
        if self.base is None:
            return attention + sum(t.numel() * t.element_size() for m in self.modules.values()
                                   if not isinstance(m, CopiedAttention) for c in m.copies
                                   for t in (*c.parameters(), *c.buffers()))
        per_copy = sum(self.base.tensors[t].nbytes for name, routes in self.base_routes.items()
                       if not isinstance(self.modules[name], CopiedAttention) for t in routes)
        return attention + self.num_copies * per_copy


def not_per_token(name: str, module) -> str | None:
    """Why per-token copies of `module` (named `name` in the model) would not serve it, or None where they would."""
    if name.rpartition(".")[2] in FOLDED:
        return f"which {FOLDED[name.rpartition('.')[2]]}"
    if not isinstance(module, torch.nn.Module) or not _class_names(module) & set(PER_TOKEN):
        return f"a {type(module).__name__}, which esftctl does not know to compute each token alone"
    return None


def _tied(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether the output head is also the model's embedding (tie_word_embeddings)."""
    return any(m is head for name, m in model.named_modules() if name.endswith("embed_tokens"))


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a is None and b is None
