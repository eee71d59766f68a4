"""A short causal-LM training loop on prompt/completion pairs (pre-training and fine-tuning recipes)."""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from esftctl.jsonl import Example

# The tiny world trains on one thread. Its matrices are small: on 2 cores, 2 threads are faster than 1 on a quiet
# machine, but beside one other busy process OpenMP's threads spin waiting for each other: 10.247 s per pre-training
# step against one thread's 0.234 (two pinned cores, benchmarks/RESULTS.md, The quick start), a build of minutes
# taking half an hour. One thread also gives the same arithmetic on a machine of any core count.
THREADS = 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads, then restore the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


class BalanceLoss:
    """DeepSeekMoE's expert-level balance loss, E/K * sum_i f_i * P_i per MoE layer (f_i: share of top-K
    picks, P_i: mean router probability), collected by hooks on the routers during training.

    transformers' DeepSeek-V2 computes none. Without it the tiny base's routers crowd onto a few experts
    that every task uses, and fine-tuning those experts for one task breaks the others."""

    def __init__(self, model):
        config = model.config
        self.experts, self.top_k, self.terms = config.n_routed_experts, config.num_experts_per_tok, []
        self.handles = [layer.mlp.gate.register_forward_hook(self._hook)
                        for layer in model.model.layers if hasattr(layer.mlp, "gate")]

    def _hook(self, module, inputs, output) -> None:
        if module.training:
            probs = output[0].float().softmax(dim=-1)
            picks = probs.topk(self.top_k, dim=-1).indices.reshape(-1)
            share = torch.bincount(picks, minlength=self.experts).float() * self.experts / picks.numel()
            self.terms.append((share * probs.mean(dim=0)).sum())

    def pop(self) -> torch.Tensor:
        total, self.terms = sum(self.terms), []
        return total

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def train(
    model,
    tokenizer,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    completion_only: bool = False,
    parameters: Sequence[torch.nn.Parameter] | None = None,
    after_backward: Callable[[], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    general: Sequence[Example] = (),
    replay: float = 0.0,
    balance: float = 0.0,
    threads: int = THREADS,
) -> list[float]:
    """AdamW with linear warm-up and cosine decay over `steps`; returns the loss of every step.

    `parameters` restricts what the optimizer updates; `after_backward` may edit gradients before each
    step (ESFT zeroes those of the experts it does not train). `replay` is the share of every batch drawn
    from `general` instead of `examples` (fine-tuning recipes mix the general data back in). `balance`
    weighs the expert balance loss (pre-training). Runs with deterministic algorithms on `threads` threads,
    so the same seed gives the same weights on every run (without them, two pre-trainings of the tiny world
    differed).
    """
    with torch_threads(threads), _deterministic_algorithms():
        balance_loss = BalanceLoss(model) if balance else None
        try:
            return _steps(model, tokenizer, list(examples), list(general), steps=steps, batch_size=batch_size, lr=lr,
                          seed=seed, completion_only=completion_only, parameters=parameters,
                          after_backward=after_backward, on_step=on_step, replay=replay, balance=balance,
                          balance_loss=balance_loss)
        finally:
            if balance_loss is not None:
                balance_loss.remove()


@contextmanager
def _deterministic_algorithms() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _steps(model, tokenizer, pool: list[Example], general: list[Example], *, steps: int, batch_size: int, lr: float,
           seed: int, completion_only: bool, parameters, after_backward, on_step, replay: float, balance: float,
           balance_loss: BalanceLoss | None) -> list[float]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = list(parameters) if parameters is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    replayed = round(batch_size * replay) if general else 0
    model.train()
    losses = []
    for step in range(steps):
        batch = rng.sample(pool, batch_size - replayed) + rng.sample(general, replayed)
        loss = model(**encode_batch(tokenizer, batch, completion_only)).loss
        losses.append(loss.item())
        if balance_loss is not None:
            loss = loss + balance * balance_loss.pop()
        loss.backward()
        if after_backward is not None:
            after_backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
