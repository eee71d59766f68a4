"""Shared fixtures: small models of every architecture, and the tiny world (built once, cached)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def has_gpu() -> bool:
    return torch.cuda.is_available()


def has_vllm() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_vllm = pytest.mark.skip(reason="needs vLLM (install the [cpu] or [cuda] extra)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm():
            item.add_marker(skip_vllm)


@pytest.fixture(scope="session")
def world():
    """The tiny world, from $ESFTCTL_WORLD or the default cache (built on first use, a minute or two)."""
    from esftctl.world.build import build_world

    return build_world()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One small random model per architecture: {architecture: folder}."""
    from esftctl.world.models import make_random_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_random_model(arch, root / arch, seed=7)
            for arch in ("deepseek_v2", "qwen2_moe", "qwen3_moe", "mixtral")}


def plain_vllm(models: dict[str, Path], prompts: list[str], tmp: Path, max_tokens: int, logprobs: int
               ) -> dict[str, list[dict]]:
    """Each model served alone by plain vLLM (esftctl.vllm_generate, one subprocess for all): {name: per prompt
    its token_ids, text and top logprobs}."""
    import json

    req, out = tmp / "plain_vllm_request.json", tmp / "plain_vllm.json"
    req.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs}))
    dirs = [str(d) for d in models.values()]
    proc = subprocess.run([sys.executable, "-m", "esftctl.vllm_generate", ",".join(dirs), str(req), str(out)],
                          capture_output=True, text=True, timeout=1800, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    by_dir = results if len(dirs) > 1 else {dirs[0]: results}  # one model: vllm_generate writes its list
    return {name: by_dir[str(d)] for name, d in models.items()}


def run_cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run `esftctl ARGS` in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "esftctl.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    if check and proc.returncode != 0:
        raise AssertionError(f"esftctl {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc
