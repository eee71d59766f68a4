"""Router scores of a transformers MoE model, captured at every MoE layer's router and recomputed as vLLM routes.

Relevance scoring (ESFT) needs, per token and MoE layer, the router's affinity for every expert and the experts
the token is routed to. Both are recomputed in float32 from the router's input, captured by a hook on its module,
and the checkpoint's router tensors, following the architecture's declared routing (esftctl/formats/
architectures.py: what vLLM does, since adapters are served there), not whatever each transformers class does:
transformers' DeepSeek-V3 always scores with sigmoid and a correction bias, where vLLM reads `scoring_func` and
`topk_method` from the config.

- Affinity: softmax(W h) (ESFT's "gate score"; W h + b for GPT-OSS's router, whose top-k vLLM takes the
  same way); with sigmoid scoring sigmoid(W h) divided by its sum over the
  layer's experts, so that it too sums to 1 per token (the correction bias, which only balances the load, is not
  part of it, as it is not part of vLLM's routing weights).
- Chosen experts: the top-k of the scores plus the correction bias where there is one, among the experts of
  the `topk_group` best of `n_group` groups (a group scored by its best expert, or with the bias by its two best
  experts' sum), exactly as vLLM's grouped_topk; ties go to the lower expert id.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from esftctl.formats.architectures import Routing
from esftctl.formats.checkpoint import MoECheckpoint


@contextlib.contextmanager
def capture_router_inputs(model, ckpt: MoECheckpoint) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, each forward pass appends every MoE layer's router input [tokens, H] to the dict."""
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in ckpt.moe_layers}
    handles = []
    for layer in ckpt.moe_layers:
        router = model.model.layers[layer].get_submodule(ckpt.arch.router_module)

        def hook(module, args, layer=layer):
            captured[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]))

        handles.append(router.register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def route(logits: torch.Tensor, routing: Routing, top_k: int, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(affinities [T, E] float32 summing to 1 per token, chosen experts [T, top_k]) from router logits [T, E]
    (module docstring)."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    affinity = scores / scores.sum(dim=-1, keepdim=True) if routing.scoring == "sigmoid" else scores
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.groups > 1:
        grouped = choice.view(len(choice), routing.groups, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if correction_bias is not None else grouped.amax(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, _top(group_score, routing.top_groups), True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    return affinity, _top(choice, top_k)


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index (a stable sort, unlike torch.topk)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


@torch.no_grad()
def routing_scores(model, ckpt: MoECheckpoint, input_ids: torch.Tensor, attention_mask: torch.Tensor
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer (affinities [valid tokens, E], chosen experts [valid tokens, top_k]), padding left out."""
    with capture_router_inputs(model, ckpt) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask)
    valid = attention_mask.reshape(-1).bool()
    out = {}
    for layer in ckpt.moe_layers:
        hidden = captured[layer][0][valid.to(captured[layer][0].device)].float()
        logits = hidden @ ckpt.read_router(layer).float().to(hidden.device).T
        router_bias = ckpt.read_router_bias(layer)
        if router_bias is not None:  # GPT-OSS: logits W h + b
            logits = logits + router_bias.float().to(hidden.device)
        bias = ckpt.read_correction_bias(layer)
        out[layer] = route(logits, ckpt.routing, ckpt.top_k, None if bias is None else bias.to(hidden.device))
    return out
