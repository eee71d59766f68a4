"""Fine-tuning recipes of the tiny world, and their evaluation.

ESFT fine-tuning of a transformers MoE model: only the selected routed experts learn.

Everything else (attention, norms, embeddings, shared experts, the router, every other expert) is frozen.
transformers keeps a layer's experts fused ([E, 2I, H] and [E, H, I]), so the unselected experts' rows
get their gradients zeroed before each step; AdamW without weight decay then leaves them bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from esftctl.atomic import atomic_dir
from esftctl.selection import ExpertConfig
from esftctl.world.models import save_model
from esftctl.jsonl import Example
from esftctl.world.training import train


def esft_finetune(base_dir: Path, config: ExpertConfig, examples: Sequence[Example], out_dir: Path,
                  steps: int, batch_size: int = 16, lr: float = 1e-3, seed: int = 0,
                  on_step: Callable[[int, float], None] | None = None) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable, masks = [], []
    for layer, ids in config.experts.items():
        experts = model.model.layers[layer].mlp.experts
        keep = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.bool)
        keep[ids] = True
        for p in (experts.gate_up_proj, experts.down_proj):
            p.requires_grad_(True)
            trainable.append(p)
            masks.append(keep)

    def zero_unselected() -> None:
        for p, keep in zip(trainable, masks):
            p.grad[~keep] = 0

    losses = train(model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                   completion_only=True, parameters=trainable, after_backward=zero_unselected, on_step=on_step)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, tokenizer)
    return losses


def full_finetune(base_dir: Path, examples: Sequence[Example], out_dir: Path, steps: int, batch_size: int = 16,
                  lr: float = 1e-3, seed: int = 0) -> list[float]:
    """Fine-tune every weight (the consolidation experiment's variants), saved as a full bf16 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    losses = train(model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                   completion_only=True)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, tokenizer)
    return losses


@torch.no_grad()
def exact_match(model_dir: Path, examples: Sequence[Example], max_new_tokens: int = 16) -> float:
    """Share of examples whose greedy completion (transformers, float32) equals the reference exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hits = 0
    for e in examples:
        ids = tokenizer(e["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        hits += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == e["completion"]
    return hits / len(examples)


@torch.no_grad()
def completion_loss(model_dir: Path, examples: Sequence[Example], batch_size: int = 32) -> float:
    """Mean negative log-likelihood per completion token (EOS included), transformers in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esftctl.world.training import encode_batch

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = encode_batch(tokenizer, examples[start:start + batch_size], completion_only=True)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n
        count += n
    return total / count
