"""A plain PyTorch MoE layer (router, optional reroute, grouped expert products) for benchmarks on the GPU.

Tokens' (token, slot) pairs are sorted by expert row, counted per row without a host synchronization,
and computed with torch._grouped_mm over all rows of the (virtual) expert tensors, as a fused MoE kernel
would; weights [rows, 2I, H] and [rows, H, I] are used through transposed views, never copied.
"""

from __future__ import annotations

from typing import Callable

import torch


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(x @ router.T, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights, ids.to(torch.int32)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    tokens, top_k = ids.shape
    rows = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    token_of = (order // top_k)
    counts = torch.zeros(rows, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[token_of]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)
    inter = w2.shape[-1]
    h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, down.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def moe_layer(x, router, w13, w2, top_k: int,
              reroute: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    weights, ids = route(x, router, top_k)
    if reroute is not None:
        ids = reroute(ids)
    return experts(x, w13, w2, ids, weights)
