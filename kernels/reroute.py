"""Batched rerouting: replace each token's routed expert ids by its adapter's copies, in one launch.

    out[t, j] = table[row(t), topk_ids[t, j]],  row(t) = adapter_ids[t] if adapter_ids[t] >= 0 else base_row

`table` is a layer's ESFT expert map [slots + 1, E] (see esftctl.runtime.moe_layer). The Triton kernel
does one gather per (token, slot) pair with no host synchronization and no data-dependent shapes, so it
runs inside CUDA-graph capture; on the CPU the PyTorch reference is the implementation.

Its launch is on the host's critical path wherever a step runs without a CUDA graph (`--enforce-eager`, and a
prompt prefilled beside decodes past the 256 tokens vLLM captures), one launch per MoE layer, and such steps
are bound by the host: on an H100 a 256-token prompt beside six decodes took several times more host time than
its kernels took on the GPU. Triton's own launch path (binding and specializing every argument, a cache lookup,
launch metadata) took 18.18 us a call in serving (benchmarks/RESULTS.md, Rerouting cost). So the integer
arguments are not specialized and the pointers not on their alignment, which leaves one compiled kernel per
device and dtypes, and after the first call `reroute` launches that kernel through Triton's launcher directly
(`_launch`): 9.21 us a call, about 0.2 ms less per eager step of 26 MoE layers.
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
    from triton import knobs

    @triton.jit(do_not_specialize=["n_pairs", "top_k", "num_experts", "base_row"],
                do_not_specialize_on_alignment=["topk_ptr", "adapter_ptr", "table_ptr", "out_ptr"])
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


BLOCK = 1024
# (device, the four tensors' dtypes) -> (Triton's launcher, the kernel's function handle, its packed metadata,
# the current-stream getter), or None where this Triton's compiled kernel lacks them (its own launch path then)
_launchers: dict[tuple, tuple | None] = {}


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's, such as Triton's proton): Triton's own launch calls it."""
    hook = knobs.runtime.launch_enter_hook  # None, or since Triton 3.4 a chain of hooks, usually empty
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch(grid: int, *args) -> None:
    """The kernel launched as Triton's JITFunction.run launches it once compiled, without binding and
    specializing the arguments again: they cannot change which kernel runs (the module docstring says why)."""
    key = (args[0].get_device(), args[0].dtype, args[1].dtype, args[2].dtype, args[3].dtype)
    launcher = _launchers.get(key)
    if launcher is None or _hooked():
        kernel = _reroute_kernel[(grid,)](*args, BLOCK=BLOCK)
        if key not in _launchers:
            try:
                from triton.runtime import driver

                _launchers[key] = (kernel.run, kernel.function, kernel.packed_metadata,
                                   driver.active.get_current_stream)
            except AttributeError:  # another Triton's internals: keep its own launch path
                _launchers[key] = None
        return
    run, function, metadata, stream = launcher
    run(grid, 1, 1, stream(key[0]), function, metadata, None, None, None, *args, BLOCK)


def reroute(topk_ids: torch.Tensor, adapter_ids: torch.Tensor, table: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Rerouted expert ids, shape and dtype of `topk_ids`; `out` may be `topk_ids` itself (in place).
    `adapter_ids` may be longer than the tokens (a buffer planned for the largest step): its first
    `topk_ids.shape[0]` entries are the tokens' adapters."""
    if topk_ids.device.type != "cuda" or triton is None:
        result = reroute_reference(topk_ids, adapter_ids[: topk_ids.shape[0]], table)
        return out.copy_(result) if out is not None else result
    assert topk_ids.is_contiguous() and adapter_ids.is_contiguous() and table.is_contiguous()
    assert adapter_ids.shape[0] >= topk_ids.shape[0], "fewer adapter ids than tokens"
    if out is None:
        out = torch.empty_like(topk_ids)
    n_pairs = topk_ids.numel()
    _launch(max(1, -(-n_pairs // BLOCK)), topk_ids, adapter_ids, table, out, n_pairs, topk_ids.shape[-1],
            table.shape[1], table.shape[0] - 1)
    return out
