"""LoRA adapters for the peer a user would pick instead of ESFT: vLLM's multi-LoRA on the same MoE base.

PEFT's folder layout (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.{module}.lora_{A,B}.weight`, A [r, in], B [out, r]), as vLLM 0.25 loads it for
DeepSeek-V2: rank-16 LoRA on every routed expert's gate, up and down projections (vLLM's fused-MoE LoRA
asserts that every expert of an adapted layer has all three), on the shared experts and the dense MLP, and
on attention's q_proj, kv_a_proj_with_mqa and o_proj. Not on kv_b_proj or the router: vLLM accepts LoRA
there and silently ignores it (MLA absorbs kv_b_proj into its decode matrices; the MoE runner keeps its own
unwrapped router), so they would be bytes without compute. One DeepSeek-V2-Lite adapter is about 0.57 GB,
of which the experts are 0.55 GB. Weights are random: speed does not depend on what a LoRA learned.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from esftctl.atomic import atomic_dir
from esftctl.formats.checkpoint import MoECheckpoint

RANK = 16
# Projections vLLM applies LoRA to (see above); experts, shared experts and dense MLP share the names.
TARGETS = ("gate_proj", "up_proj", "down_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj")
_TARGET = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\..*\b(?:%s))\.weight$" % "|".join(TARGETS))


def lora_modules(base: MoECheckpoint) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every linear the peer adapts."""
    modules = {}
    for name, info in base.tensors.items():
        m = _TARGET.match(name)
        if m and len(info.shape) == 2:
            modules[m.group(1)] = tuple(info.shape)
    return modules


def write_lora(base: MoECheckpoint, out: str | Path, *, seed: int, rank: int = RANK, device: str = "cpu") -> Path:
    """A rank-`rank` LoRA adapter over `base` in PEFT's layout; nonzero A and B, so it changes every output."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for module, (rows, cols) in lora_modules(base).items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, cols, generator=g, device=device) / cols ** 0.5).to(
            torch.bfloat16).cpu()
        tensors[f"{key}.lora_B.weight"] = (torch.randn(rows, rank, generator=g, device=device) * 0.01).to(
            torch.bfloat16).cpu()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
              "base_model_name_or_path": str(base.path)}
    with atomic_dir(Path(out), overwrite=True) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return Path(out)
