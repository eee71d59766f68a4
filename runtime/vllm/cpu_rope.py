"""A correct rotary embedding for vLLM's CPU build when queries come as [tokens, heads, dim].

vLLM 0.32's CPU kernel `ops.rotary_embedding` rotates a 2-D query [tokens, heads * dim] correctly but
not a 3-D one [tokens, heads, dim] (checked against its own forward_native: errors of about 5 on unit
inputs, for both rotation styles). DeepSeek-V2's MLA attention passes its rotary query part as a 3-D view,
so on the CPU every DeepSeek-V2 model computed a different function than in transformers. This subclass
flattens such inputs to the 2-D layout the kernel handles and writes the result back in place.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


def _as_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """[tokens, heads, dim] -> contiguous [tokens, heads * dim]: a view where the layout allows, else a copy."""
    return None if t is None else t.reshape(t.shape[0], -1).contiguous()


def _write_back(dst: torch.Tensor | None, rows: torch.Tensor | None) -> None:
    if dst is not None and rows.data_ptr() != dst.data_ptr():  # rows is a copy, not a view of dst
        dst.copy_(rows.view_as(dst))


class CpuRowsRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose CPU path always hands the kernel [tokens, heads * dim] tensors."""

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return super().forward_cpu(positions, query, key)
        q_rows, k_rows = _as_rows(query), _as_rows(key)
        super().forward_cpu(positions, q_rows, k_rows)
        _write_back(query, q_rows)
        _write_back(key, k_rows)
        return query, key


def register() -> None:
    """Make vLLM instantiate CpuRowsRotaryEmbedding wherever it builds a RotaryEmbedding."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    if "RotaryEmbedding" not in op_registry_oot:
        CustomOp.register_oot(CpuRowsRotaryEmbedding, name="RotaryEmbedding")
