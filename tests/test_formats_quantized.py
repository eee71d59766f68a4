"""Quantized checkpoints: `esftctl inspect` names the method it found (from the config and from the expert tensors'
dtypes), and every command that reads expert weights refuses them in one line naming it, writing nothing; pack,
merge, relevance and train take FP8 bases with block scales (tests/test_formats_fp8.py, tests/test_pipeline_train.py)
and pack refuses FP8 experts whose config was lost."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from test_formats_esft_adapter import cli

from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.world.synthetic import write_synthetic_adapter

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, F32 weight_scale_inv) with one scale per block x block tile, as DeepSeek-V3 stores them."""
    rows, cols = math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block)
    scale = torch.zeros(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block:(r + 1) * block, c * block:(c + 1) * block].float()
            scale[r, c] = tile.abs().max().clamp(min=1e-12) / 448
            q[r * block:(r + 1) * block, c * block:(c + 1) * block] = (tile / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def quantized_copy(base: Path, out: Path, *, config: dict | None) -> Path:
    """`base` with its routed experts in FP8 with 128 x 128 block scales; `config` as its quantization_config
    (None: left out, as when a config lost it on the way)."""
    ckpt = MoECheckpoint(base)
    tensors = {n: ckpt.read_tensor(n) for n in ckpt.tensors}
    for name in [n for n in tensors if ckpt.is_routed_expert_tensor(n)]:
        tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(tensors[name])
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    model_config = json.loads((base / "config.json").read_text())
    if config is not None:
        model_config["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(model_config))
    return out


@pytest.fixture(scope="module")
def fp8(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    base = tiny_models["deepseek_v2"]
    return {"config": quantized_copy(base, root / "config", config=FP8_CONFIG),
            "tensors": quantized_copy(base, root / "tensors", config=None)}


def test_inspect_names_architecture_and_quantization(fp8, tiny_models):
    plain = json.loads(run_cli("inspect", tiny_models["deepseek_v2"], "--json", check=True).stdout)
    assert plain["quantization"] is None and plain["architecture"] == "deepseek_v2"
    d = json.loads(run_cli("inspect", fp8["config"], "--json", check=True).stdout)
    assert d["quantization"] == {"method": "fp8", "source": "config", "fmt": "e4m3", "weight_block_size": [128, 128],
                                 "activation_scheme": "dynamic", "expert_dtypes": ["F32", "F8_E4M3"],
                                 "scale_tensors": 3 * 16 * 3}
    assert d["expert_dtype"] == "F8_E4M3" and d["architecture"] == "deepseek_v2"
    # an expert: 3 x 64 x 256 one-byte values and 3 scales of 4 bytes (one 128 x 128 block covers 64 x 128)
    assert d["expert_bytes"] == 3 * 64 * 256 + 3 * 2 * 4
    table = run_cli("inspect", fp8["config"], check=True).stdout
    assert "deepseek_v2 (model_type deepseek_v2)" in table
    assert ("fp8 (fmt e4m3, weight_block_size [128, 128], activation_scheme dynamic; expert tensors F32, "
            "F8_E4M3)") in table
    assert "quantization" in run_cli("inspect", tiny_models["deepseek_v2"], check=True).stdout
    d = json.loads(run_cli("inspect", fp8["tensors"], "--json", check=True).stdout)
    assert d["quantization"]["method"] == "fp8" and d["quantization"]["source"] == "tensors"


def _refusals(fp8: dict[str, Path], plain: Path, tmp: Path) -> list[tuple[str, list]]:
    bundle = write_synthetic_adapter(plain, tmp / "bundle", "b", seed=1)
    q = fp8["config"]
    out = tmp / "out"
    return [("compress", ["compress", q, "--out", out]),
            ("consolidate", ["consolidate", q, plain, "--out", out, "--capacity", "1"]),
            ("average", ["average", q, plain, "--out", out]),
            ("export", ["export", bundle, "--format", "esft", "--base", q, "--out", out]),
            ("pack (dtypes only)", ["pack", fp8["tensors"], plain, "--out", out, "--name", "x"])]


def test_commands_that_read_experts_refuse_quantized_ones(fp8, tiny_models, tmp_path, capsys):
    for what, args in _refusals(fp8, tiny_models["deepseek_v2"], tmp_path):
        code, err = cli(capsys, *args)
        assert code == 1 and err.count("\n") == 1, (what, err)
        line = " ".join(err.split())
        assert "config.json: experts quantized with fp8 (" in line, (what, err)
        assert "are not supported" in line and "esftctl reads bf16, fp16 or fp32 experts" in line, what
        assert not (tmp_path / "out").exists(), what
