"""vLLM's own Triton fused-MoE kernel over esftctl's virtual expert tensors, with rerouted ids >= E.

This is the kernel that served adapters wrongly on the H100 (vLLM 0.25): it aligns token-expert pairs over
`global_num_experts`, so pairs rerouted to adapter rows were never computed once a batch was large enough
to be aligned (prefill). Here the kernel runs on CUDA virtual tensors (driver-mapped pages, adapters loaded
into rows past the base's) at decode and prefill sizes, with ids rerouted by esftctl's Triton reroute, and
must give what a plain PyTorch MoE gives on the same rows; the test also shows that the base's expert count
drops rows, so it fails where the fix is missing. Needs vLLM's CUDA build: skipped elsewhere (CI).
"""

from __future__ import annotations

import pytest
import torch

from esftctl.runtime.vllm.moe import KERNEL_MAX_ROWS

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

E, HIDDEN, INTERMEDIATE, TOP_K, SLOTS, PER_SLOT = 16, 256, 128, 4, 3, 6


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down(silu(gate(x)) * up(x)) of the rows ids[t, k], in float32."""
    rows13, rows2 = w13[ids.long()].float(), w2[ids.long()].float()  # [T, k, 2I, H], [T, k, H, I]
    gate, up = (rows13 @ x.float()[:, None, :, None]).squeeze(-1).chunk(2, -1)
    out = (rows2 @ (torch.nn.functional.silu(gate) * up)[..., None]).squeeze(-1)
    return (weights[..., None] * out).sum(1)


def experts():
    """E base experts and three adapters' experts (2, 4 and 6 of them), random."""
    from esftctl.formats.checkpoint import ExpertWeights

    g = torch.Generator().manual_seed(0)

    def expert() -> ExpertWeights:
        gate, up = (torch.randn(INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(2))
        down = torch.randn(HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
        return ExpertWeights(gate.bfloat16(), up.bfloat16(), down.bfloat16())

    base = {e: expert() for e in range(E)}
    return base, [{e: expert() for e in torch.randperm(E, generator=g)[: 2 + 2 * slot].tolist()}
                  for slot in range(SLOTS)]


def virtual_layer(expert_map: torch.Tensor | None = None):
    """A virtual MoE layer on the GPU with the base and the adapters (in the rows after the base's) loaded; with
    `expert_map`, one expert-parallel rank's part."""
    from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool
    from esftctl.runtime.moe_layer import VirtualMoELayer, stack_experts

    pool = PhysicalPagePool("cuda")
    virtual = VirtualMoELayer(E, HIDDEN, INTERMEDIATE, num_slots=SLOTS, experts_per_slot=PER_SLOT, dtype=torch.bfloat16,
                              make_space=lambda nbytes: CudaAddressSpace(nbytes, pool), expert_map=expert_map)
    base, adapters = experts()
    virtual.load_base_rows(*stack_experts([base[e] for e in virtual.own_experts]))
    for slot, adapter in enumerate(adapters):
        virtual.load(slot, adapter)
    return virtual


@pytest.fixture(scope="module")
def layer():
    """A virtual MoE layer on the GPU: E base experts and three adapters in the rows after them."""
    pytest.importorskip("vllm")
    virtual = virtual_layer()
    yield virtual
    virtual.close()


def routed(tokens: int, seed: int):
    """Inputs, top-k weights and ids over the base's E, and each token's adapter slot (-1: base)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K)
    adapters = torch.randint(-1, SLOTS, (tokens,), generator=g, dtype=torch.int32)
    return x, weights.cuda(), ids.to(torch.int32).cuda(), adapters.cuda()


@pytest.mark.parametrize("tokens", [1, 3, 64, 512, 2048])
def test_triton_kernel_computes_adapter_rows(layer, tokens):
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    from esftctl.kernels.reroute import reroute

    x, weights, ids, adapters = routed(tokens, seed=tokens)
    rerouted = reroute(ids, adapters, layer.table)
    assert (rerouted >= E).any() or tokens < 8  # adapter rows are really in play
    w13, w2 = layer.w13.tensor, layer.w2.tensor
    want = reference_moe(x, w13, w2, weights, rerouted)
    got = fused_experts(x, w13, w2, weights, rerouted, global_num_experts=layer.num_rows).float()
    error = (got - want).norm() / want.norm()
    assert error < 1e-2, f"{tokens} tokens: relative error {error:.2e}"
    if tokens * TOP_K * 4 > layer.num_rows:  # aligned over the base's experts, vLLM drops the adapter rows
        dropped = fused_experts(x, w13, w2, weights, rerouted, global_num_experts=E).float()
        assert not (dropped - want).norm() / want.norm() < 0.1  # wrong, or NaN where nothing was written


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_the_base_count_picks_the_path_and_every_row_is_still_computed(layer, tokens):
    """With the base's E set (esftctl.runtime.vllm.moe.base_experts), a batch past E / (4 top_k) is aligned over
    every row, as plain vLLM aligns it over E, where the widened count alone would take the low-latency path; the
    rows rerouted past E are computed on either path, bit for bit alike."""
    from vllm.model_executor.layers.fused_moe import fused_moe as module
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    from esftctl.kernels.reroute import reroute
    from esftctl.runtime.vllm.moe import base_experts, install_assignment

    install_assignment()
    x, weights, ids, adapters = routed(tokens, seed=200 + tokens)
    adapters.fill_(0)  # every token on the first adapter, so its rows are in play
    rerouted = reroute(ids, adapters, layer.table)
    w13, w2 = layer.w13.tensor, layer.w2.tensor
    want = reference_moe(x, w13, w2, weights, rerouted)
    paths = []  # True: aligned (sorted ids), False: the low-latency path
    installed = module._prepare_expert_assignment
    module._prepare_expert_assignment = lambda *a, **k: paths.append(installed(*a, **k)[0] is not None) or \
        installed(*a, **k)
    try:
        with base_experts(E):
            got = fused_experts(x, w13, w2, weights, rerouted, global_num_experts=layer.num_rows).float()
        plain = fused_experts(x, w13, w2, weights, rerouted, global_num_experts=layer.num_rows).float()
    finally:
        module._prepare_expert_assignment = installed
    assert (rerouted >= E).any() or tokens == 1  # one token's 4 experts may miss the adapter's 2
    assert paths == [tokens * TOP_K * 4 > E, tokens * TOP_K * 4 > layer.num_rows]
    assert (got - want).norm() / want.norm() < 1e-2 and (plain - want).norm() / want.norm() < 1e-2


def test_a_widened_step_compiles_no_kernel_variant_the_bases_did_not(layer):
    """A step past the CUDA-graph sizes runs eagerly, and a variant of vLLM's kernel that Triton has not compiled
    costs a compile in that step. The widened layer's steps at 256 to 263 tokens (every size mod 8, the sizes
    where the kernel's EM changes class mod 16) compile no variant of `fused_moe_kernel` that the base's steps at
    those sizes did not; aligned over the rows themselves (34 here, 18 past E) they would."""
    import triton
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts, fused_moe_kernel

    from esftctl.kernels.reroute import reroute
    from esftctl.runtime.vllm.moe import base_experts, install_assignment

    install_assignment()
    w13, w2 = layer.w13.tensor, layer.w2.tensor
    fused_moe_kernel.device_caches.clear()  # forget the variants the tests before compiled
    steps = [routed(tokens, seed=300 + tokens) for tokens in range(256, 264)]
    for x, weights, ids, _ in steps:
        fused_experts(x, w13, w2, weights, ids, global_num_experts=E)  # the base's steps
    rerouted = [reroute(ids, adapters, layer.table) for _, _, ids, adapters in steps]
    compiled: list[str] = []

    def record(*, fn, **_):
        compiled.append(fn.name)

    def widened() -> list[str]:
        compiled.clear()
        triton.knobs.runtime.jit_cache_hook = record  # called before every compile
        try:
            for (x, weights, _, _), ids in zip(steps, rerouted):
                fused_experts(x, w13, w2, weights, ids, global_num_experts=layer.num_rows)
        finally:
            triton.knobs.runtime.jit_cache_hook = None
        return compiled

    with base_experts(E):
        assert "fused_moe_kernel" not in widened(), compiled
    assert "fused_moe_kernel" in widened()  # vLLM's own alignment, over the 34 rows


@pytest.mark.parametrize("tokens", [3, 512])
def test_expert_parallel_ranks_compute_each_adapter_row_once(layer, tokens):
    """Expert parallelism over two ranks, both on this GPU: each rank's layer holds its half of the experts
    (vLLM's linear placement) and the adapter rows that replace them, and vLLM's kernel, handed the rank's
    expert map extended to the adapter rows, computes that rank's pairs. The ranks' outputs summed (vLLM's
    all-reduce) must be the one-rank output; with the map not extended, the adapter pairs are lost."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    from esftctl.kernels.reroute import reroute

    half = E // 2
    maps = [torch.tensor([e - r * half if e // half == r else -1 for e in range(E)], dtype=torch.int32)
            for r in range(2)]
    ranks = [virtual_layer(m) for m in maps]
    x, weights, ids, adapters = routed(tokens, seed=100 + tokens)
    rerouted = reroute(ids, adapters, layer.table)
    for rank in ranks:
        assert torch.equal(rank.table, layer.table) and rank.base_rows == half
        assert torch.equal(reroute(ids, adapters, rank.table), rerouted)
    want = reference_moe(x, layer.w13.tensor, layer.w2.tensor, weights, rerouted)

    def summed(expert_maps) -> torch.Tensor:
        return sum(fused_experts(x, rank.w13.tensor, rank.w2.tensor, weights, rerouted,
                                 global_num_experts=rank.num_rows, expert_map=m).float()
                   for rank, m in zip(ranks, expert_maps))

    error = (summed([rank.expert_map for rank in ranks]) - want).norm() / want.norm()
    assert error < 1e-2, f"{tokens} tokens: relative error {error:.2e}"
    base_only = [torch.cat([rank.expert_map[:E], torch.full_like(rank.expert_map[E:], -1)]) for rank in ranks]
    if (rerouted >= E).any():
        assert not (summed(base_only) - want).norm() / want.norm() < 0.1
    for rank in ranks:
        rank.close()


def test_alignment_limit_is_the_one_esftctl_enforces():
    """moe_align_block_size takes KERNEL_MAX_ROWS experts and refuses the next warp's worth."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    ids = torch.randint(0, KERNEL_MAX_ROWS, (4096, TOP_K), dtype=torch.int32, device="cuda")
    sorted_ids, expert_ids, padded = moe_align_block_size(ids, 64, KERNEL_MAX_ROWS)
    torch.cuda.synchronize()
    assert int(padded) >= ids.numel()
    with pytest.raises(RuntimeError):
        moe_align_block_size(ids, 64, KERNEL_MAX_ROWS + 32)
        torch.cuda.synchronize()
