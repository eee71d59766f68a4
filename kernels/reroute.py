"""Batched rerouting: replace each token's routed expert ids by its adapter's copies, in one launch.

    out[t, j] = table[row(t), topk_ids[t, j]],  row(t) = adapter_ids[t] if adapter_ids[t] >= 0 else base_row

`table` is a layer's ESFT expert map [slots + 1, E] (see esftctl.runtime.moe_layer). The Triton kernel
does one gather per (token, slot) pair with no host synchronization and no data-dependent shapes, so it
runs inside CUDA-graph capture; on the CPU the PyTorch reference is the implementation.
"""

from __future__ import annotations

import torch


def reroute_reference(topk_ids: torch.Tensor, adapter_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the definition the kernel is tested against (and the CPU path)."""
    base_row = table.shape[0] - 1
    rows = torch.where(adapter_ids < 0, torch.full_like(adapter_ids, base_row), adapter_ids)
    return table[rows.long()[:, None], topk_ids.long()].to(topk_ids.dtype)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _reroute_kernel(topk_ptr, adapter_ptr, table_ptr, out_ptr, n_pairs, top_k, num_experts, base_row,
                        BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_pairs
        expert = tl.load(topk_ptr + offsets, mask=mask, other=0)
        adapter = tl.load(adapter_ptr + offsets // top_k, mask=mask, other=-1)
        row = tl.where(adapter < 0, base_row, adapter)
        new_id = tl.load(table_ptr + row.to(tl.int64) * num_experts + expert, mask=mask, other=0)
        tl.store(out_ptr + offsets, new_id.to(out_ptr.dtype.element_ty), mask=mask)

except ImportError:  # the CPU build has no Triton: reroute() uses the reference there
    triton = None


def reroute(topk_ids: torch.Tensor, adapter_ids: torch.Tensor, table: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Rerouted expert ids, shape and dtype of `topk_ids`; `out` may be `topk_ids` itself (in place)."""
    if topk_ids.device.type != "cuda" or triton is None:
        result = reroute_reference(topk_ids, adapter_ids, table)
        return out.copy_(result) if out is not None else result
    assert topk_ids.is_contiguous() and adapter_ids.is_contiguous() and table.is_contiguous()
    if out is None:
        out = torch.empty_like(topk_ids)
    n_pairs = topk_ids.numel()
    block = 1024
    _reroute_kernel[(triton.cdiv(max(n_pairs, 1), block),)](
        topk_ids, adapter_ids, table, out, n_pairs, topk_ids.shape[-1], table.shape[1], table.shape[0] - 1,
        BLOCK=block)
    return out
