"""Each adapter's shared experts applied to its tokens only (esftctl.runtime.vllm.shared_experts), on a module shaped
as vLLM's DeepseekV2MLP (merged gate_up_proj, down_proj, each with a quant method that processes its weight): the rows
of an adapter's tokens are what the module computes with the adapter's tensors, every other row the base's; a
detached copy leaves the base's to every token; a conversion that does not reproduce the live module is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.runtime.adapters import AdapterSlots
from esftctl.runtime.vllm.shared_experts import SharedExperts, shared_tensor_names


class Method:
    """vLLM's UnquantizedLinearMethod on the GPU: nothing to process."""

    def __init__(self):
        self.calls = 0

    def process_weights_after_loading(self, layer) -> None:
        self.calls += 1


class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = Method()

    def forward(self, x):
        return F.linear(x, self.weight), None


class MLP(torch.nn.Module):
    """DeepseekV2MLP: gate and up stacked in one weight, SiLU of gate times up, then down."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up_proj = Linear(torch.cat([gate, up]))
        self.down_proj = Linear(down)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


def base_mlp(base: MoECheckpoint, layer: int) -> MLP:
    names = {param: name for name, param in shared_tensor_names(base, layer).items()}
    t = {param: base.read_tensor(name).float() for param, name in names.items()}
    return MLP(t["gate_up_proj.0"], t["gate_up_proj.1"], t["down_proj.0"])


@pytest.fixture
def base(tiny_models) -> MoECheckpoint:
    return MoECheckpoint(tiny_models["deepseek_v2"])


def make(base: MoECheckpoint, copies: int = 2, slots: int = 3):
    modules = {layer: base_mlp(base, layer) for layer in base.moe_layers}
    tokens = torch.full((16,), -1, dtype=torch.int32)
    return modules, tokens, SharedExperts(base, modules, copies=copies, slots=slots, token_adapters=tokens,
                                          rank=(0, 1), dtype=torch.float32)


def moved(base: MoECheckpoint, layer: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: base.read_tensor(name) + 0.1 * torch.randn(base.read_tensor(name).shape, generator=g)
            for name in shared_tensor_names(base, layer)}


def test_each_token_gets_its_adapters_shared_experts(base):
    modules, tokens, shared = make(base)
    layer = base.moe_layers[1]
    mine = moved(base, layer, seed=1)
    assert shared.load(slot=1, tensors=mine) == 0
    assert shared.replaced == {1: 1}
    x = torch.randn(6, base.hidden_size)
    tokens[:6] = torch.tensor([-1, 1, 0, 1, 2, -1], dtype=torch.int32)
    got = modules[layer](x)
    names = {param: name for name, param in shared_tensor_names(base, layer).items()}
    adapter = MLP(*(mine[names[p]].float() for p in ("gate_up_proj.0", "gate_up_proj.1", "down_proj.0")))
    want_base, want_adapter = base_mlp(base, layer)(x), adapter(x)
    assert not torch.allclose(want_base, want_adapter)
    for row, slot in enumerate([-1, 1, 0, 1, 2, -1]):
        assert torch.equal(got[row], (want_adapter if slot == 1 else want_base)[row]), row
    # layers the adapter does not change give its tokens the base's shared experts
    other = base.moe_layers[0]
    assert torch.equal(modules[other](x), base_mlp(base, other)(x))
    # detached: every token the base's again; the copy is free once released
    assert shared.detach(1) == 0 and shared.free_copies() == [1]
    assert torch.equal(modules[layer](x), want_base)
    shared.release(0)
    assert shared.free_copies() == [0, 1]


def test_adapter_slots_hold_and_release_a_copy(base):
    modules, tokens, shared = make(base, copies=1)

    class Layer:  # an MoE layer's rows: AdapterSlots asks only for these here
        num_slots, device, slot_rows, expert_bytes = 3, torch.device("cpu"), {}, 1

    slots = AdapterSlots({layer: Layer() for layer in base.moe_layers}, pools={"shared": shared})
    layer = base.moe_layers[0]
    slots.load("a", {}, non_expert=moved(base, layer, seed=2))
    assert slots.adapters["a"].replaced == {"shared": 1}
    with pytest.raises(EsftError, match="changes shared experts and all 1 copies of them are taken"):
        slots.load("b", {}, non_expert=moved(base, layer, seed=3))
    assert "b" not in slots.adapters and shared.owner == {0: 0}
    slots.evict("a")  # on the host: released at once
    slots.load("b", {}, non_expert=moved(base, layer, seed=3))
    assert shared.owner == {0: slots.adapters["b"].slot}
    slots.evict("b")
    with pytest.raises(EsftError, match="keeps no copy of its module"):
        slots.load("c", {}, non_expert={"model.layers.1.self_attn.o_proj.weight": torch.zeros(1)})
    assert not slots.adapters and shared.free_copies() == [0]


def test_a_module_the_conversion_cannot_reproduce_is_refused(base):
    modules = {layer: base_mlp(base, layer) for layer in base.moe_layers}
    first = modules[base.moe_layers[0]]
    first.down_proj.weight.data *= 2  # the live module no longer computes what the checkpoint holds
    with pytest.raises(EsftError, match="could not be reproduced from the checkpoint"):
        SharedExperts(base, modules, copies=1, slots=2, token_adapters=torch.full((4,), -1, dtype=torch.int32),
                      rank=(0, 1), dtype=torch.float32)


def test_vllm_parameters_are_copied_with_their_class_and_attributes():
    """vLLM's CUDA build holds linear weights as BasevLLMParameter subclasses, which torch's Parameter deepcopy cannot
    make (their constructor takes other arguments) and whose attributes the loaders read."""
    from vllm.model_executor.parameter import ModelWeightParameter

    from esftctl.runtime.vllm.module_copies import clone_module

    loader = lambda param, loaded: param.data.copy_(loaded)  # noqa: E731
    linear = torch.nn.Module()
    # as vLLM's __init__ leaves it, made without the tensor-parallel group that __init__ asks for
    weight = torch.Tensor._make_subclass(ModelWeightParameter, torch.randn(4, 3), False)
    weight.__dict__.update(_input_dim=1, _output_dim=0, _weight_loader=loader)
    linear.weight = weight
    copied = clone_module(linear)
    assert type(copied.weight) is ModelWeightParameter and copied.weight is not linear.weight
    assert torch.equal(copied.weight, linear.weight) and copied.weight.data_ptr() != linear.weight.data_ptr()
    assert copied.weight.output_dim == 0 and copied.weight.weight_loader is loader
