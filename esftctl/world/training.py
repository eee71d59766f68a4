"""A short causal-LM training loop on prompt/completion pairs (pre-training and fine-tuning recipes)."""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import torch

from esftctl.jsonl import Example


def encode_batch(tokenizer, examples: Sequence[Example], completion_only: bool) -> dict[str, torch.Tensor]:
    """Token ids of prompt + completion + EOS, right-padded; labels -100 on padding (and on the prompt)."""
    texts = [e["prompt"] + e["completion"] for e in examples]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    # Append EOS after the last real token of each row.
    lengths = mask.sum(dim=1)
    ids = torch.cat([ids, torch.full((len(texts), 1), tokenizer.pad_token_id)], dim=1)
    mask = torch.cat([mask, torch.zeros(len(texts), 1, dtype=mask.dtype)], dim=1)
    rows = torch.arange(len(texts))
    ids[rows, lengths] = tokenizer.eos_token_id
    mask[rows, lengths] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if completion_only:
        prompt_lengths = [len(tokenizer(e["prompt"])["input_ids"]) for e in examples]
        for row, n in enumerate(prompt_lengths):
            labels[row, :n] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(
    model,
    tokenizer,
    examples: Sequence[Example],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    completion_only: bool = False,
    parameters: Sequence[torch.nn.Parameter] | None = None,
    after_backward: Callable[[], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW with linear warm-up and cosine decay over `steps`; returns the loss of every step.

    `parameters` restricts what the optimizer updates; `after_backward` may edit gradients before each
    step (ESFT zeroes those of the experts it does not train). Runs with deterministic algorithms, so the
    same seed gives the same weights on every run (without them, two pre-trainings of the tiny world differed).
    """
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(model, tokenizer, examples, steps, batch_size, lr, seed, completion_only, parameters,
                      after_backward, on_step)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(model, tokenizer, examples, steps, batch_size, lr, seed, completion_only, parameters, after_backward,
           on_step) -> list[float]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = list(parameters) if parameters is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    losses = []
    pool = list(examples)
    for step in range(steps):
        batch = encode_batch(tokenizer, rng.sample(pool, batch_size), completion_only)
        loss = model(**batch).loss
        loss.backward()
        if after_backward is not None:
            after_backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
