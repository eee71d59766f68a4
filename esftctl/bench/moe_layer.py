"""A plain PyTorch MoE layer (router, routing with or without reroute, grouped expert products), for benchmarks.

Tokens' (token, slot) pairs are sorted by expert row, counted per row without a host synchronization,
and computed with torch._grouped_mm over all rows of the (virtual) expert tensors, as a fused MoE kernel
would; weights [rows, 2I, H] and [rows, H, I] are used through transposed views, never copied.
"""

from __future__ import annotations

from typing import Callable

import torch

# A routing function: router logits [T, E] -> (weights float32 [T, k], expert rows int32 [T, k]).
Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


def moe_layer(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              routing: Routing) -> torch.Tensor:
    weights, ids = routing(x @ router.T)
    return experts(x, w13, w2, ids, weights)
