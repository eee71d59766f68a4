"""Synthetic ESFT adapters: a bundle that replaces a few random experts per MoE layer with perturbed copies.

Serving tests and `esftctl bench serve` need many adapters of any base quickly; what matters there is that
each one changes the model's outputs in its own way, not that it learned a task (recipes/esft_adapters.py
makes real ones for the tiny world). A replaced expert is base + `scale` x (the expert's own std) x noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from esftctl.formats.bundle import write_bundle
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint


def synthetic_experts(base: MoECheckpoint, *, seed: int, experts_per_layer: int | list[int],
                      scale: float = 1.0, prefer: dict[int, list[int]] | None = None
                      ) -> dict[int, dict[int, ExpertWeights]]:
    """`experts_per_layer` perturbed experts per MoE layer: random ones, or the first of `prefer[layer]` (for
    example the experts some prompts route to most, so that a test's adapter surely changes their answers)."""
    g = torch.Generator().manual_seed(seed)
    layers = base.moe_layers
    counts = experts_per_layer if isinstance(experts_per_layer, list) else [experts_per_layer] * len(layers)
    experts: dict[int, dict[int, ExpertWeights]] = {}
    for layer, count in zip(layers, counts):
        ranked = prefer[layer] if prefer else torch.randperm(base.num_experts, generator=g).tolist()
        ids = sorted(ranked[:count])
        experts[layer] = {}
        for e in ids:
            w = base.read_expert(layer, e)
            experts[layer][e] = ExpertWeights(*(
                (t.float() + scale * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
                for _, t in w.items()))
    return experts


def write_synthetic_adapter(base_dir: str | Path, out: str | Path, name: str, *, seed: int,
                            experts_per_layer: int | list[int] = 4, scale: float = 1.0,
                            prefer: dict[int, list[int]] | None = None) -> Path:
    base = MoECheckpoint(base_dir)
    experts = synthetic_experts(base, seed=seed, experts_per_layer=experts_per_layer, scale=scale, prefer=prefer)
    return write_bundle(Path(out), name, base, experts)


def experts_used_by(base_dir: str | Path, texts: list[str]) -> dict[int, list[int]]:
    """Per MoE layer, every routed expert ranked by how often `texts` select it (most used first)."""
    from esftctl.relevance import compute_relevance

    scores = compute_relevance(Path(base_dir), [{"prompt": t, "completion": ""} for t in texts]).scores["token"]
    return {layer: sorted(range(len(s)), key=lambda e: -s[e]) for layer, s in scores.items()}


def write_synthetic_variant(base_dir: str | Path, out: str | Path, *, seed: int, experts_per_layer: int = 4,
                            scale: float = 1.0, non_expert_scale: float = 0.1,
                            prefer: dict[int, list[int]] | None = None) -> Path:
    """A stand-in for a full fine-tune of `base_dir`: every non-expert tensor (attention, norms, embeddings,
    routers, shared experts) perturbed by `non_expert_scale` x its std, and `experts_per_layer` routed experts
    per layer by `scale`, as `synthetic_experts` does. What `consolidate` and `serve --variants` take."""
    base = MoECheckpoint(base_dir)
    g = torch.Generator().manual_seed(seed + 1_000_003)
    experts = synthetic_experts(base, seed=seed, experts_per_layer=experts_per_layer, scale=scale, prefer=prefer)
    replacements = expert_replacements(base, {(l, e): w for l, ws in experts.items() for e, w in ws.items()})
    for name, info in base.tensors.items():
        if base.is_routed_expert_tensor(name):
            continue
        t = base.read_tensor(name).float()
        spread = t.std() if t.numel() > 1 and t.std() > 0 else t.abs().mean()  # norms start as all ones
        noise = non_expert_scale * spread * torch.randn(t.shape, generator=g)
        replacements[name] = (t + noise).to(info.torch_dtype)
    return write_checkpoint(base, out, replacements)
