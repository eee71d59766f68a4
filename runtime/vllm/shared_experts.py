"""Adapters that train a layer's shared experts, each adapter's copy applied to its own tokens.

ESFT's `shared_experts: true` fine-tunes the experts every token passes through (DeepSeek's `mlp.shared_experts`,
Qwen2-MoE's `mlp.shared_expert` with its `shared_expert_gate`). Served beside other adapters and the base, such an
adapter's tokens must see its shared experts and every other token the base's. vLLM computes a layer's shared
experts with one module of the model (its MoE runner calls it beside the routed experts, on an auxiliary CUDA stream
where it can), so per MoE layer this keeps `copies` more instances of that very module (`copy.deepcopy`, made at
start-up before vLLM sizes its KV cache, so their memory is planned), and replaces the live module's `forward` on the
instance by one that computes the base's output and every copy's over the step's tokens and keeps, for each token,
its adapter's (`torch.where` over `token_adapters`, the per-token slots the reroute reads). Each token's row is the
product the merged model computes (the same module, the same batch), the shapes are static and nothing waits on the
host: CUDA graphs capture every copy, and a load writes into a copy's tensors in place. The cost: each copy is one
more shared-expert product per MoE layer and step, whether or not its adapter has tokens in it (measured in
benchmarks/RESULTS.md once run on a GPU).

A load converts the adapter's tensors as vLLM's loader would: each linear layer's tensor-parallel part (gate and up
stacked into `gate_up_proj`, columns of `down_proj`, the gate whole), then the layer's own
`process_weights_after_loading` on a scratch instance (vLLM's CPU build packs every linear weight into a oneDNN or
sgl-kernel handle there), whose state is then copied into the copy (esftctl.runtime.vllm.variant_weights.module_state:
tensors in place, the CPU build's weight closures set, which needs an eager engine there). The conversion is checked
once at start-up: the base's own tensors, converted, must give the live module's output bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.runtime.vllm.module_copies import CopyPool, deep_copies, select, write_state
from esftctl.runtime.vllm.variant_weights import module_state

# vLLM's shared-expert module (DeepseekV2MLP, Qwen2MoeMLP): its linear layers, each from the checkpoint tensors under
# the architecture's first shared prefix, and how tensor parallelism splits them: "column" (each rank a block of
# rows of every tensor, the blocks stacked: MergedColumnParallelLinear) or "row" (a block of columns).
LINEARS = {"gate_up_proj": (("gate_proj.weight", "up_proj.weight"), "column"),
           "down_proj": (("down_proj.weight",), "row")}
# Qwen2-MoE's gate of its shared expert: the module's `expert_gate` (replicated on every rank), the checkpoint's
# tensor under the second shared prefix.
GATE = ("expert_gate", "weight")


def shared_tensor_names(base: MoECheckpoint, layer: int) -> dict[str, str]:
    """{checkpoint tensor name: the module's parameter it goes to, as `LINEARS`/`GATE` name it ("gate_up_proj.0",
    "down_proj.0", "expert_gate.0")} for one MoE layer's shared experts."""
    prefixes = [p.format(layer=layer) for p in base.arch.shared_prefixes]
    out = {}
    for attr, (suffixes, _) in LINEARS.items():
        for k, suffix in enumerate(suffixes):
            out[f"{prefixes[0]}.{suffix}"] = f"{attr}.{k}"
    if len(prefixes) > 1:
        out[f"{prefixes[1]}.{GATE[1]}"] = f"{GATE[0]}.0"
    missing = sorted(n for n in out if n not in base.tensors)
    if missing:
        raise EsftError(f"the checkpoint lacks the shared-expert tensor {missing[0]!r} that vLLM's module of layer "
                        f"{layer} reads", base.path)
    return out


def rank_part(tensor: torch.Tensor, split: str, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a linear weight [out, in], as vLLM's loader takes it: rows for "column", columns for
    "row", all of it for a replicated layer (None)."""
    if size == 1 or split is None:
        return tensor
    dim = 0 if split == "column" else 1
    n = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * n, n)


@dataclass
class SharedCopies:
    """One MoE layer's shared experts: the live module (the base's), `copies` instances for adapters, and which copy
    each slot's tokens take (`table[slot + 1]`, -1: the base's)."""

    index: int
    module: torch.nn.Module
    copies: list[torch.nn.Module]
    table: torch.Tensor  # int32 [slots + 1] on the device
    token_adapters: torch.Tensor  # the per-token slots (EsftModel.token_adapters)
    rank: tuple[int, int]  # (this rank, tensor-parallel size)
    dtype: torch.dtype  # the model's weights'
    base_forward: object = None
    states: list[dict] = field(default_factory=list)  # per copy: module_state, the entries a load writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        which = self.table[self.token_adapters[:x.shape[0]].long() + 1]
        for c, module in enumerate(self.copies):
            out = select(which == c, module(x), out)
        return out

    def convert(self, scratch: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """`scratch` (an instance of the module) holding `tensors` ({"gate_up_proj.0": gate, ...}, the checkpoint's
        whole tensors) as vLLM's loader and weight processing leave them on this rank."""
        rank, size = self.rank
        splits = {attr: split for attr, (_, split) in LINEARS.items()} | {GATE[0]: None}
        for attr, split in splits.items():
            parts = [tensors[k] for k in sorted(n for n in tensors if n.rpartition(".")[0] == attr)]
            if not parts:
                continue
            linear = getattr(scratch, attr)
            weight = torch.cat([rank_part(p, split, rank, size) for p in parts])
            weight = weight.to(device=self.table.device, dtype=self.dtype).contiguous()
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            linear.quant_method.process_weights_after_loading(linear)
        return scratch

    def write(self, c: int, scratch: torch.nn.Module) -> None:
        """Copy `scratch`'s state into copy `c` (module_copies.write_state)."""
        write_state(self.states[c], scratch, f"layer {self.index}'s shared experts")


class SharedExperts(CopyPool):
    """Every MoE layer's `SharedCopies`, and which copy each loaded adapter holds."""

    def __init__(self, base: MoECheckpoint, modules: dict[int, torch.nn.Module], *, copies: int, slots: int,
                 token_adapters: torch.Tensor, rank: tuple[int, int], dtype: torch.dtype):
        self.base = base
        self.layers: dict[int, SharedCopies] = {}
        self._start_pool(copies)
        device = token_adapters.device
        for index, module in modules.items():
            made = _copies(module, copies, index)
            table = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
            layer = SharedCopies(index, module, made, table, token_adapters, rank, dtype)
            layer.states = [module_state(m, set()) for m in made]
            self.layers[index] = layer
        self._scratch = _copies(next(iter(modules.values())), 1, next(iter(modules)))[0]
        self._check_conversion()
        for layer in self.layers.values():  # after the copies: they must keep the class's forward
            layer.base_forward = layer.module.forward
            layer.module.forward = layer.forward

    def _check_conversion(self) -> None:
        """The base's own shared experts, converted as an adapter's are, must compute what the live module computes."""
        index, layer = next(iter(self.layers.items()))
        converted = layer.convert(self._scratch, self.base_tensors(index))
        hidden = self.base.hidden_size
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, hidden, generator=g).to(device=layer.table.device, dtype=layer.dtype)
        with torch.no_grad():
            want, got = layer.module(x), converted(x)
        if not torch.equal(want, got):
            raise EsftError(f"layer {index}: vLLM's shared-expert module ({type(layer.module).__name__}) could not be "
                            "reproduced from the checkpoint; adapters that change shared experts cannot be served "
                            "by this engine")

    def base_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        return {param: self.base.read_tensor(name) for name, param in shared_tensor_names(self.base, layer).items()}

    def accepts(self, name: str) -> bool:
        """Whether `name` is a shared-expert tensor of one of the layers."""
        return any(self.base.arch.is_shared_expert_tensor(name, layer) for layer in self.layers)

    def tables(self) -> list[torch.Tensor]:
        return [layer.table for layer in self.layers.values()]

    def layer_bytes(self) -> int:
        """One copy's bytes in one layer, as the checkpoint holds them (this rank's part under tensor parallelism)."""
        index = next(iter(self.layers))
        total = sum(t.numel() * t.element_size() for t in self.base_tensors(index).values())
        return total // self.layers[index].rank[1]

    def nbytes(self) -> int:
        return self.num_copies * len(self.layers) * self.layer_bytes()

    def load(self, slot: int, tensors: dict[str, torch.Tensor]) -> int:
        """Put an adapter's shared-expert tensors ({checkpoint name: tensor}, any MoE layer's) into a free copy and
        point `slot`'s tokens at it in the layers they change; returns the copy."""
        changed = self.by_layer(tensors)
        c = self._take("shared experts", "--shared-expert-copies")
        for index, replaced in changed.items():
            layer = self.layers[index]
            layer.write(c, layer.convert(self._scratch, self.base_tensors(index) | replaced))
            layer.table[slot + 1] = c
        return self._hold(c, slot, len(changed))

    def by_layer(self, tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        """{MoE layer: {module parameter: tensor}} of an adapter's shared-expert tensors; refuses any other name."""
        names = {n: (index, param) for index in self.layers for n, param in
                 shared_tensor_names(self.base, index).items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name not in names:
                raise EsftError(f"{name!r} is not a shared-expert tensor of a MoE layer")
            index, param = names[name]
            out.setdefault(index, {})[param] = tensor
        return out


def _copies(module: torch.nn.Module, n: int, index: int) -> list[torch.nn.Module]:
    return deep_copies(module, n, f"layer {index}'s shared experts")
