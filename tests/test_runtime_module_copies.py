"""Per-token module copies (esftctl.runtime.vllm.module_copies.CopiedModule) without an engine: each token's row is the
one its adapter's module computes alone, also for a norm that, as vLLM's CUDA build does, adds the residual and
normalizes in place and returns its input tensors."""

from __future__ import annotations

import copy

import torch

from esftctl.runtime.vllm.module_copies import CopiedModule


class RMSNorm(torch.nn.Module):
    """fused_add_rms_norm's in-place overload: `residual += x`, `x = norm(residual) * weight`, both returned."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x, residual=None):
        if residual is None:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        residual.add_(x)
        x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight)
        return x, residual


def copied(base: torch.nn.Module, seeds: list[int], slots: list[int]):
    """The live `base` with copies of other weights, token i taking slot `slots[i]` (-1: the base's)."""
    made = []
    for seed in seeds:
        m = copy.deepcopy(base)
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(seed)))
        made.append(m)
    table = torch.tensor([-1, *range(len(seeds))], dtype=torch.int32)  # slot s takes copy s
    c = CopiedModule("norm", base, made, table, torch.tensor(slots, dtype=torch.int32))
    c.base_forward, base.forward = base.forward, c.forward
    return c, made


def test_a_norm_that_writes_its_inputs_gives_each_token_its_adapters_rows():
    torch.manual_seed(0)
    base = RMSNorm(8)
    c, made = copied(base, [1, 2], [-1, 0, 1, 1, -1])
    x, residual = torch.randn(5, 8), torch.randn(5, 8)
    # each module alone (the class's forward: the live instance's is the copies' wrapper now)
    want = [RMSNorm.forward(copy.deepcopy(m), x.clone(), residual.clone()) for m in (base, *made)]
    got_x, got_residual = base(x.clone(), residual.clone())
    for i, s in enumerate([-1, 0, 1, 1, -1]):
        assert torch.equal(got_x[i], want[s + 1][0][i]), i
        assert torch.equal(got_residual[i], want[s + 1][1][i]), i


def test_a_linear_layers_tokens_take_their_adapters_rows():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 4)
    c, made = copied(base, [1], [0, -1, 0])
    x = torch.randn(3, 8)
    got = base(x)
    assert torch.equal(got[0], made[0](x)[0]) and torch.equal(got[1], torch.nn.functional.linear(x, base.weight,
                                                                                                  base.bias)[1])
