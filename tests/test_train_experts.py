"""The experts' forward while ESFT trains (esftctl.train_experts): the loss of transformers' grouped forward, and the
selected rows' gradients that transformers' full weight gradient would give them, with no full-size weight
gradient taken, on every architecture of the table (float32, so that the two ways' sums agree to rounding)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_train import random_base

from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.train import TrainedRows, _RowsInto
from esftctl.world.models import ARCHITECTURES


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(5))


def open_model(base: MoECheckpoint, implementation: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32,
                                                 experts_implementation=implementation)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_selected_rows_get_the_gradient_of_the_full_weight_gradient(architecture, world, tmp_path, monkeypatch):
    base_dir = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    base = MoECheckpoint(base_dir)
    layers = base.moe_layers[:1] + base.moe_layers[-1:]
    reference = open_model(base, "grouped_mm")  # transformers' forward, weight gradients of every expert
    ids = batch(reference.config.get_text_config().vocab_size)
    fused = base.arch.in_memory().fused
    for layer in layers:
        for name in fused.tensors(layer):
            reference.get_parameter(name).requires_grad_(True)
    want_loss = reference(input_ids=ids, labels=ids).loss
    want_loss.backward()
    experts = {}  # two experts the batch routes to in the first layer, one in the last, and one it does not
    for layer in layers:
        touched = reference.get_parameter(fused.tensors(layer)[0]).grad.flatten(1).abs().sum(1) > 0
        used, unused = touched.nonzero().flatten().tolist(), (~touched).nonzero().flatten().tolist()
        experts[layer] = sorted(used[:2 if layer == layers[0] else 1] + unused[:1])
    wanted = {name: reference.get_parameter(name).grad[experts[layer]] for layer in layers
              for name in fused.tensors(layer)}

    backwards = []
    original = _RowsInto.backward
    monkeypatch.setattr(_RowsInto, "backward", staticmethod(lambda ctx, g: backwards.append(g.shape)
                                                            or original(ctx, g)))
    model = open_model(base, "grouped_mm")
    rows = TrainedRows(model, base, experts)
    assert model.config.get_text_config()._experts_implementation == "esft_rows"
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    got = dict(zip([n for layer in sorted(experts) for n in fused.tensors(layer)], rows.parameters()))
    for name, grad in wanted.items():
        if name.endswith("_bias"):  # biases keep transformers' path (a row per expert)
            continue
        assert got[name].grad is not None and float(grad.abs().max()) > 0, name
        torch.testing.assert_close(got[name].grad, grad, rtol=1e-4, atol=1e-6, msg=name)
    # No weight gradient of a whole layer's experts was taken: only biases, where there are any, went that way.
    assert all(len(shape) == 2 for shape in backwards), backwards
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_without_selected_rows_or_gradients_transformers_forward_runs(world):
    """Layers without selected experts, and forwards without gradients (evaluation), give what transformers'
    grouped forward gives."""
    base = MoECheckpoint(world.base_dir)
    model = open_model(base, "grouped_mm")
    ids = batch(model.config.get_text_config().vocab_size)
    want = open_model(base, "grouped_mm")(input_ids=ids).logits
    TrainedRows(model, base, {base.moe_layers[0]: [3]})
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)
