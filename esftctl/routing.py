"""Router scores of a transformers MoE model, captured at every MoE layer's gate.

Every supported architecture keeps its router in memory as `model.layers.{l}.mlp.gate` with a weight
[E, H]; its affinity for expert i is softmax(W h)_i (ESFT's "gate score"), and a token's experts are the
top-k of those scores. Capturing the gate's input and recomputing in float32 keeps this independent of
how each architecture post-processes its routing weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def capture_gate_inputs(model, moe_layers: list[int]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, each forward pass appends every MoE layer's gate input [tokens, H] to the dict."""
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe_layers}
    handles = []
    for layer in moe_layers:
        gate = model.model.layers[layer].mlp.gate

        def hook(module, args, layer=layer):
            captured[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]))

        handles.append(gate.register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def gate_scores(model, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Softmax router affinities [tokens, E] of `layer` for gate inputs `hidden` [tokens, H], in float32."""
    weight = model.model.layers[layer].mlp.gate.weight
    return torch.softmax(hidden.float() @ weight.float().T, dim=-1)


@torch.no_grad()
def routing_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   moe_layers: list[int]) -> dict[int, torch.Tensor]:
    """Router affinities [valid tokens, E] for every MoE layer, padding tokens left out."""
    with capture_gate_inputs(model, moe_layers) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask)
    valid = attention_mask.reshape(-1).bool()
    return {layer: gate_scores(model, layer, captured[layer][0])[valid] for layer in moe_layers}
