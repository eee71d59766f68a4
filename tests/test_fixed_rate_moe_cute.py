"""The fixed-rate expert GEMM in CuTe DSL (esftctl.kernels.fixed_rate_moe_cute): on the CPU, the threads' decode in
PyTorch (the words each MMA register is built from, the K index it lands at) gives the weights; on a GPU with
nvidia-cutlass-dsl, the kernel gives vLLM's fused-MoE kernel's output on the decoded weights, bit for bit, and the
Triton design's."""

from __future__ import annotations

import pytest
import torch
from test_fixed_rate_moe import exact_weights

from esftctl.kernels.fixed_rate_moe import decode_tiled_reference, encode_tiled
from esftctl.kernels.fixed_rate_moe_cute import CuteTiles, decode_cute_reference


@pytest.mark.parametrize("escapes", ["none", "rare", "many"])
def test_the_threads_decode_gives_the_weights(escapes):
    weights = exact_weights(3, 24, 192, escapes, seed=4)
    tiles = encode_tiled(weights)
    assert torch.equal(decode_tiled_reference(tiles).view(torch.int16), weights.view(torch.int16))
    cute_tiles = CuteTiles.of(tiles)
    assert torch.equal(decode_cute_reference(cute_tiles).view(torch.int16), weights.view(torch.int16))
    if escapes != "none":
        assert int((cute_tiles.raw_at >= 0).sum()) > 0


def test_a_broken_exponent_path_decodes_wrong():
    """The reference really takes both exponent paths: with the raw words or the window changed it differs."""
    from dataclasses import replace

    weights = exact_weights(2, 16, 128, "rare", seed=5)
    tiles = CuteTiles.of(encode_tiled(weights))
    for wrong in (replace(tiles, raw=tiles.raw ^ 0x01010101), replace(tiles, base=tiles.base + 1)):
        assert not torch.equal(decode_cute_reference(wrong).view(torch.int16), weights.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["no-escapes", "rare-escapes", "many-escapes", "naive-and-ep", "trained-like"])
def test_kernel_equals_vllms_on_cuda(name):
    """The CuTe DSL kernel against vLLM's on the decoded weights (vLLM's own launch and alignment), the cases of
    the Triton design's test: bit for bit, and the reference too where fp32 sums are exact."""
    pytest.importorskip("cutlass")
    from test_fixed_rate_moe import CASES, CONFIGS, _vllm_on_cuda, check_case

    from esftctl.kernels.fixed_rate_moe_cute import invoke_fused_moe_tiled_cute

    def cute_kernel(a, tiled, c, weights, sorted_ids, expert_ids, post, mul, top_k, config):
        invoke_fused_moe_tiled_cute(a, CuteTiles.of(tiled), c, weights, sorted_ids, expert_ids, post, mul, top_k,
                                    {"BLOCK_SIZE_M": config["BLOCK_SIZE_M"]})

    launch, align = _vllm_on_cuda()
    for case in CASES[name]:
        check_case(**dict(case, config=CONFIGS[case["config"]], device="cuda", launch=launch, align=align,
                          fused_kernel=cute_kernel))
