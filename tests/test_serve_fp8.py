"""`esftctl serve` over an FP8 base (issue 31, item 3): adapters packed from bf16 fine-tunes, quantized at pack time
with the base's block scheme, served together with the base, answer as their merged FP8 models served alone by
plain vLLM with the same quantization (tokens and log-probabilities).

The base is a tiny Qwen3-MoE (hidden 256, experts of intermediate 128: every dimension a multiple of the 128 x 128
blocks) whose projections are all FP8 with block scales, routers and head in bf16, as Qwen's FP8 checkpoints are;
and a tiny DeepSeek-V3 (MLA, sigmoid routing with a correction bias, group-limited top-k; experts widened to 128)
quantized the same way, as DeepSeek-V3's FP8 checkpoint is (its MLA projections FP8 too, partial blocks included).
vLLM's FP8 MoE path needs a GPU (its CPU build runs another FP8 kernel, which esftctl refuses): these are `gpu`
tests, run on an H100 with vLLM 0.25, where vLLM picks its Triton kernel for block FP8 experts.
"""

from __future__ import annotations

import pytest
from conftest import engine_settings, server_args
from test_formats_fp8 import quantize_model
from test_serve_adapters import ADAPTER_SCALE, prompts_of, random_base, reference, serve_concurrently

from esftctl.formats.bundle import Bundle
from esftctl.merge import merge
from esftctl.pack import pack
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import status
from esftctl.world.synthetic import experts_used_by, write_synthetic_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


def fp8_adapters(plain, base, root, prompts):
    """Two adapters of the FP8 `base`, each packed from a bf16 fine-tune of `plain` (the model `base` quantizes),
    and their merged FP8 models: ({name: bundle}, {name: merged dir})."""
    used = experts_used_by(plain, prompts)
    bundles, merged = {}, {}
    for k, count in enumerate((2, 5)):
        name = f"fp8task{k}"
        synthetic = write_synthetic_adapter(plain, root / "synthetic" / name, name, seed=40 + k,
                                            experts_per_layer=count, scale=ADAPTER_SCALE, prefer=used)
        tuned = merge(plain, synthetic, root / "tuned" / name)
        pack(base, tuned, root / "bundles" / name, name)
        bundles[name] = root / "bundles" / name
        assert Bundle.open(bundles[name]).manifest["dtype"] == "F8_E4M3"
        merged[name] = merge(base, bundles[name], root / "merged" / name)
    return bundles, merged


def fp8_ready_base(architecture: str, world, root):
    """A small random bf16 base whose expert widths are whole 128 x 128 blocks (vLLM's block-FP8 MoE refuses
    others): the tiny DeepSeek-V3's experts (64 wide) widened to 128, Qwen3-MoE's as they are."""
    from transformers import AutoTokenizer

    from esftctl.world.models import make_random_model

    if architecture == "qwen3_moe":
        return random_base(architecture, world, root)
    return make_random_model(architecture, root / "base", seed=3, moe_intermediate_size=128,
                             tokenizer=AutoTokenizer.from_pretrained(world.tokenizer_dir))


@pytest.mark.parametrize("architecture, graphs", [("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", True)],
                         ids=["qwen3_moe-eager", "qwen3_moe-cuda_graphs", "deepseek_v3-cuda_graphs"])
def test_fp8_adapters_served_exactly(architecture, graphs, world, tmp_path):
    plain = fp8_ready_base(architecture, world, tmp_path / "plain")
    base = quantize_model(plain, tmp_path / "fp8_base")
    prompts = prompts_of(world)[:4]
    bundles, merged = fp8_adapters(plain, base, tmp_path, prompts)
    engine = engine_settings(graphs=graphs)
    ref = reference({"base": base, **merged}, prompts, tmp_path, engine)
    assert any(ref[n] != ref["base"] for n in merged), "the adapters must change some answer"
    serve_plan = plan(base, [f"{n}={p}" for n, p in bundles.items()], name="base", port=free_port(),
                      state_dir=tmp_path / "state", vllm_args=server_args(engine))
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), prompts, ref)
        served = status(serve_plan.url)
    checked = {a["name"]: a["checked_rows"] for a in served["adapters"]}
    assert all(checked[n] > 0 for n in bundles), checked
