"""Top-k routing with the reroute folded in: softmax over experts, top-k, then each id through the expert map.

    weights, ids = topk_softmax_reroute(logits, k, adapter_ids, table)

is `reroute(topk(softmax(logits)))` in one kernel: the extra work for rerouting is one table load per
(token, slot) pair inside a kernel that runs anyway, which is how ExpertWeave brought its cost to about 0%.
With `table=None` the same kernel routes without rerouting, so benchmarks can isolate the reroute's cost.
Ties between equal scores go to the lower expert id.
"""

from __future__ import annotations

import torch

from esftctl.kernels.reroute import reroute_reference


def topk_softmax_reroute_reference(logits: torch.Tensor, top_k: int, adapter_ids: torch.Tensor | None = None,
                                   table: torch.Tensor | None = None, renormalize: bool = False):
    """Plain PyTorch: (weights float32 [T, k], ids int32 [T, k])."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if table is not None:
        ids = reroute_reference(ids, adapter_ids, table)
    return weights, ids


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _router_kernel(logits_ptr, adapter_ptr, table_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, base_row,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       REROUTE: tl.constexpr, RENORMALIZE: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        slots = tl.arange(0, K_PAD)
        token_ok = tokens < n_tokens
        mask = token_ok[:, None] & (cols[None, :] < n_experts)
        x = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * n_experts + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        p = tl.exp(x)
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(mask, p, -1.0)
        # Pick the k best one by one into [BLOCK_T, K_PAD] tiles; ties go to the lower expert id.
        top_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=1)
            idx = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), axis=1)
            p = tl.where(cols[None, :] == idx[:, None], -1.0, p)
            top_w = tl.where(slots[None, :] == j, best[:, None], top_w)
            top_i = tl.where(slots[None, :] == j, idx[:, None], top_i)
        out_mask = token_ok[:, None] & (slots[None, :] < TOP_K)
        if REROUTE:
            # One gather for all k ids of a token, issued together: the reroute adds a single load latency.
            adapter = tl.load(adapter_ptr + tokens, mask=token_ok, other=-1)
            row = tl.where(adapter < 0, base_row, adapter).to(tl.int64)
            top_i = tl.load(table_ptr + row[:, None] * n_experts + top_i, mask=out_mask, other=0)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        offsets = tokens[:, None] * TOP_K + slots[None, :]
        tl.store(ids_ptr + offsets, top_i.to(tl.int32), mask=out_mask)
        tl.store(weights_ptr + offsets, top_w, mask=out_mask)

except ImportError:
    triton = None


def topk_softmax_reroute(logits: torch.Tensor, top_k: int, adapter_ids: torch.Tensor | None = None,
                         table: torch.Tensor | None = None, *, renormalize: bool = False,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(weights float32 [T, k], ids int32 [T, k]); rerouted through `table` when one is given."""
    if logits.device.type != "cuda" or triton is None:
        return topk_softmax_reroute_reference(logits, top_k, adapter_ids, table, renormalize)
    tokens, experts = logits.shape
    weights, ids = out if out is not None else (
        torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device),
        torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device))
    block_t = 16
    reroute = table is not None
    _router_kernel[(triton.cdiv(max(tokens, 1), block_t),)](
        logits.contiguous(), adapter_ids if reroute else ids, table if reroute else ids, weights, ids, tokens,
        experts, table.shape[0] - 1 if reroute else 0, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(experts),
        BLOCK_T=block_t, REROUTE=reroute, RENORMALIZE=renormalize)
    return weights, ids
