"""The experts' forward while ESFT trains: weight gradients for the selected experts only.

transformers 5 runs a layer's experts with `grouped_mm` over the fused tensors ([E, 2I, H] and [E, H, I]); its
backward computes the weight gradient of every expert of the layer, full size, before esftctl keeps the selected
rows (esftctl.train's _RowsInto). That is about a third of the experts' compute (forward, input gradient, weight
gradient) spent on rows nobody trains, and a transient gradient the size of the layer's experts (Qwen3-30B-A3B: 1.2
GB a layer, in bf16).

This forward is transformers' grouped one (tokens sorted by expert, one grouped product per projection) with a
product whose backward gives the input gradient through every expert, as before, and the weight gradient of the
selected experts only, one product each over the rows of the tokens routed to it, straight to their float32
masters. It is registered in transformers' experts interface (`esft_rows`), so every architecture whose experts
class takes an experts implementation uses it; a layer without selected rows, and a forward without gradients,
run transformers' own.
"""

from __future__ import annotations

import torch

IMPLEMENTATION = "esft_rows"


class _SelectedRowsLinear(torch.autograd.Function):
    """y = x @ W[e]^T (W[e] with `transposed`) for each expert's group of sorted rows; the backward returns the input
    gradient, and the gradient of `master` (the selected experts' rows of W, float32) for those experts alone.
    `bounds` is shared by a layer's two products: the groups' ends on the host, read from the device once."""

    @staticmethod
    def forward(ctx, x, weight, offsets, master, ids: list[int], transposed: bool, bounds: list):
        from transformers.integrations.moe import _grouped_linear

        ctx.save_for_backward(x, weight, offsets)
        ctx.ids, ctx.transposed, ctx.bounds = ids, transposed, bounds
        return _grouped_linear(x, weight, offsets, is_transposed=transposed)

    @staticmethod
    def backward(ctx, dy):
        from transformers.integrations.moe import _grouped_mm

        x, weight, offsets = ctx.saved_tensors
        dx = _grouped_mm(dy, weight.transpose(-2, -1) if ctx.transposed else weight, offs=offsets)
        if not ctx.bounds:
            ctx.bounds.extend([0, *offsets.tolist()])
        d_master = torch.zeros((len(ctx.ids), *weight.shape[1:]), dtype=torch.float32, device=weight.device)
        for k, e in enumerate(ctx.ids):
            start, end = ctx.bounds[e], ctx.bounds[e + 1]
            if end > start:
                xs, dys = x[start:end].to(dy.dtype), dy[start:end]
                d_master[k] = (xs.T @ dys if ctx.transposed else dys.T @ xs).float()
        return dx.to(x.dtype), None, None, d_master, None, None, None


def selected_rows_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward, its two products taking weight gradients for `self.esft_ids` alone
    (esftctl.train.TrainedRows sets them, with the masters in `self.esft_rows`)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    ids = getattr(self, "esft_ids", None)
    if ids is None or not torch.is_grad_enabled() or getattr(self, "_is_expert_parallel", False):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_top_k, num_tokens, hidden = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[order // num_top_k]
    weights = top_k_weights.reshape(-1)[order]
    counts = torch.histc(expert_ids.float() if x.device.type == "cpu" else expert_ids.int(), bins=self.num_experts,
                         min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    bounds: list[int] = []
    first, second = ("gate_up_proj", "down_proj") if self.has_gate else ("up_proj", "down_proj")

    def product(inputs: torch.Tensor, name: str) -> torch.Tensor:
        out = _SelectedRowsLinear.apply(inputs, getattr(self, name).detach(), offsets, getattr(self.esft_rows, name),
                                        ids, self.is_transposed, bounds)
        if self.has_bias:  # biases keep transformers' path: their gradient is a row per expert, small
            out = out + getattr(self, name + "_bias")[expert_ids]
        return out

    out = product(x, first)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = product(out, second) * weights.unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.size(0), device=order.device)
    return out[inverse].view(num_tokens, num_top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def use_selected_rows(model: torch.nn.Module) -> bool:
    """Run `model`'s experts through selected_rows_forward (registered once in transformers' experts interface);
    False where its config takes no experts implementation (then transformers' own forward runs)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, selected_rows_forward)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "is_transposed") and hasattr(m, "config")}
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
    return bool(configs)
