"""MLA's kv_b_proj copies (esftctl.runtime.vllm.mla_copies) without an engine: a stand-in layer of the shape vLLM's
MLAAttention has, whose weight processing sets an attribute of its backend impl from kv_b_proj (as the CPU build's
AMX backend packs its own W_UK / W_UV). A load writes the adapter's derived state into its copy and never into the
live layer's, and the check at start refuses a processing that the base's kv_b_proj does not reproduce."""

from __future__ import annotations

import copy

import pytest
import torch

from esftctl.errors import EsftError
from esftctl.runtime.vllm.mla_copies import CopiedAttention


class Impl:
    """A backend impl holding a derived weight of its own (and a workspace, which stays shared)."""


class MLAAttention(torch.nn.Module):
    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale
        self.kv_b_proj = torch.nn.Linear(4, 6, bias=False)
        self.kv_b_proj.params_dtype = torch.float32
        self.W_UV = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.impl = Impl()
        self.impl.kv_b_proj = self.kv_b_proj
        self.impl.workspace = torch.zeros(8)
        self.process_weights_after_loading(torch.float32)

    def process_weights_after_loading(self, dtype):
        self.impl.packed = self.impl.kv_b_proj.weight.detach() * self.scale  # set anew, as AMX's packing is
        self.W_UV.data.copy_(self.kv_b_proj.weight.detach().to(dtype))  # in place, as vLLM's replace_parameter


def adapter_kv_b_proj(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(4, 6, bias=False)
    linear.params_dtype = torch.float32
    return linear


def test_a_load_writes_its_copy_and_never_the_live_layer():
    layer = MLAAttention()
    live = (layer.impl.packed.clone(), layer.W_UV.detach().clone())
    copied = CopiedAttention.make("kv_b_proj", layer, 2, torch.full((3,), -1), torch.zeros(4, dtype=torch.int32))
    copied.check(copy.deepcopy(layer.kv_b_proj))
    assert copied.impl_keys == {"packed"}
    for c, seed in enumerate((1, 2)):
        kv_b = adapter_kv_b_proj(seed)
        copied.write(c, kv_b)
        assert torch.equal(copied.copies[c].impl.packed, kv_b.weight.detach() * 2)
        assert torch.equal(copied.copies[c].W_UV, kv_b.weight.detach())
    assert torch.equal(layer.impl.packed, live[0]) and torch.equal(layer.W_UV, live[1])  # the base's, untouched
    assert not torch.equal(copied.copies[0].impl.packed, copied.copies[1].impl.packed)
    assert copied.copies[0].impl.workspace is layer.impl.workspace  # what the processing does not set stays shared


def test_a_processing_the_base_does_not_reproduce_is_refused():
    layer = MLAAttention()
    layer.scale = 3.0  # the live state was made with 2.0: the derivation no longer gives it
    copied = CopiedAttention.make("kv_b_proj", layer, 1, torch.full((2,), -1), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(EsftError, match="could not be reproduced from the checkpoint"):
        copied.check(copy.deepcopy(layer.kv_b_proj))
