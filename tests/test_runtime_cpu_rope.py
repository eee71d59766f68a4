"""The CPU rotary-embedding fix computes what vLLM's own reference path computes, for every layout."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.vllm
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("layout", ["rows", "heads", "strided-heads"])
def test_cpu_rope_matches_native(neox, layout):
    from vllm.config import VllmConfig, set_current_vllm_config

    from esftctl.runtime.vllm.cpu_rope import CpuRowsRotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rope = CpuRowsRotaryEmbedding(64, 64, 256, 10000.0, neox, torch.float32)
    tokens, heads = 9, 4
    positions = torch.randint(0, 256, (tokens,))
    if layout == "rows":
        query = torch.randn(tokens, heads * 64)
    elif layout == "heads":
        query = torch.randn(tokens, heads, 64)
    else:  # a view into a wider tensor, as DeepSeek-V2's MLA passes its rotary part
        query = torch.randn(tokens, heads, 96)[..., 32:]
    key = torch.randn(tokens, 1, 64) if layout != "rows" else torch.randn(tokens, 64)
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = rope.forward_cpu(positions, query, key)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(query, want_q, atol=1e-5, rtol=1e-5)  # in place, like the kernel
