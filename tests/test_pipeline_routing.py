"""Routing as vLLM routes (esftctl/routing.py): softmax, sigmoid with a correction bias, group-limited top-k.

Relevance scoring must pick the experts serving picks. The oracle is vLLM's own grouped_topk (what its
DeepSeek-V2/V3 and GLM-4.5 layers call) and, for the tiny DeepSeek-V3 and GLM-4.5 models, transformers' routers,
which route as vLLM does when the config says sigmoid and noaux_tc.
"""

from __future__ import annotations

import pytest
import torch

from esftctl.formats.architectures import Routing
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.relevance import compute_relevance, scoring_device
from esftctl.routing import route

CASES = {  # name: (routing, with a correction bias)
    "softmax": (Routing(), False),
    "softmax, 4 groups, best 2": (Routing("softmax", 4, 2), False),  # DeepSeek-V2 (group_limited_greedy)
    "sigmoid, bias, 4 groups, best 2": (Routing("sigmoid", 4, 2, True), True),  # DeepSeek-V3
    "sigmoid, bias, 1 group": (Routing("sigmoid", 1, 1, True), True),  # GLM-4.5
}


def _as_sets(ids: torch.Tensor) -> list[frozenset]:
    return [frozenset(row.tolist()) for row in ids]


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CASES))
def test_route_chooses_what_vllm_chooses(case):
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    routing, with_bias = CASES[case]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1 if with_bias else None
    # on the GPU where there is one: vLLM's CUDA build sends grouped_topk to its fused kernel, which has no CPU
    # version (H100, 2026-12-05: NotImplementedError for '_moe_C::grouped_topk' on CPU tensors), and both sides
    # route on one device, so that near-ties fall alike
    device = scoring_device()
    logits, bias = logits.to(device), None if bias is None else bias.to(device)
    affinity, chosen = route(logits, routing, 4, bias)
    torch.testing.assert_close(affinity.sum(-1).cpu(), torch.ones(300))
    _, want = grouped_topk(logits, logits, 4, True, routing.groups, routing.top_groups, routing.scoring, 1.0, bias)
    assert _as_sets(chosen.cpu()) == _as_sets(want.cpu())


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_relevance_counts_the_experts_transformers_routes_to(tiny_models, arch):
    """Token selection ratio = the share of top-k picks transformers' router makes (sigmoid, correction bias and,
    for DeepSeek-V3, 4 groups of which 2), captured at its output; gate score = its sigmoid scores normalized.
    transformers runs where compute_relevance scores (the GPU if present): near-ties fall by device."""
    from transformers import AutoModelForCausalLM

    ckpt = MoECheckpoint(tiny_models[arch])
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).to(scoring_device())
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    picks, scores = {}, {}
    for layer in ckpt.moe_layers:
        gate = model.model.layers[layer].mlp.gate

        def hook(module, args, out, layer=layer):
            logits, _, indices = out
            picks[layer] = torch.bincount(indices.reshape(-1), minlength=ckpt.num_experts).cpu()
            scores[layer] = torch.sigmoid(logits.float()).cpu()

        gate.register_forward_hook(hook)
    with torch.no_grad():
        model(input_ids=ids.to(scoring_device()))
    assert any(ckpt.read_correction_bias(layer).abs().sum() > 0 for layer in ckpt.moe_layers)

    rel = _relevance_of_ids(ckpt, ids)
    for layer in ckpt.moe_layers:
        assert rel["token"][layer] == (picks[layer].double() / (40 * ckpt.top_k)).tolist(), layer
        want = (scores[layer] / scores[layer].sum(-1, keepdim=True)).mean(0)
        torch.testing.assert_close(torch.tensor(rel["gate"][layer]), want, rtol=1e-5, atol=1e-6)


def _relevance_of_ids(ckpt: MoECheckpoint, ids: torch.Tensor) -> dict:
    """compute_relevance's scores over one sequence of token ids (its tokenizer stubbed: the tiny models have none)."""
    from unittest import mock

    class Tokenizer:
        padding_side, pad_token_id, eos_token = "right", 0, None

        def __call__(self, texts, **kwargs):
            if isinstance(texts, str):
                return {"input_ids": ids[0].tolist()}
            return _Encoding(ids)

    with mock.patch("transformers.AutoTokenizer.from_pretrained", return_value=Tokenizer()):
        return compute_relevance(ckpt.path, [{"prompt": "x", "completion": ""}]).scores


class _Encoding(dict):
    def __init__(self, ids: torch.Tensor):
        super().__init__(input_ids=ids, attention_mask=torch.ones_like(ids))

    def to(self, device):  # compute_relevance moves its batch where it scores (the GPU if present)
        return _Encoding(self["input_ids"].to(device))
