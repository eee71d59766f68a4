"""Fine-tuning recipes of the tiny world, and their evaluation.

ESFT fine-tuning of a transformers MoE model: only the selected routed experts learn.

Everything else (attention, norms, embeddings, shared experts, the router, every other expert) is frozen.
transformers keeps a layer's experts fused ([E, 2I, H] and [E, H, I]), so the unselected experts' rows
get their gradients zeroed before each step; AdamW without weight decay then leaves them bit-identical.

The recipe (`FINETUNE`) mixes the general mixture back into every batch (`replay`, 75% of it: 24 of 32 examples),
for ESFT and full fine-tuning alike. In trials on earlier bases, ESFT trained on task data alone kept only 10-70%
of the base's general exact match (the selected experts also serve the general data). On world v9, replaying 90%
left too little task data for some bases (78-84% where 75% replay reached 87-98% on the same base and experts);
50% raised the general perplexity more than the 5% the quick start allows on a trial world; 75% keeps it within
+1.0% over world v10's 60 adapters of 5 world seeds (benchmarks/RESULTS.md, The quick start).

The quick start selects experts by token selection ratio at p=0.5 (`SELECTION`; `esftctl bench esft` keeps the
paper's 0.2). At world v10's answer positions that is 4-14 of 64 experts per layer (6-22%; the paper's published
configs choose 2-9 of 64). Across 5 world seeds at p=0.25 some tasks got 2 experts per layer and missed 80% on
some bases; the bases that defeat a recipe defeat it whatever the threshold (p=0.7, 500 steps, lr 2e-2: 58-74%),
so the threshold buys margin, and the world's design buys the rest (every adapter of those 5 seeds meets its
targets: benchmarks/RESULTS.md, The quick start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from esftctl.atomic import atomic_dir
from esftctl.jsonl import Example
from esftctl.selection import ExpertConfig
from esftctl.world.models import save_model
from esftctl.world.training import THREADS, train

FINETUNE = dict(steps=300, batch_size=32, lr=1e-2, replay=0.75)
# Expert relevance for selection: the first 200 training examples, scored where they predict the completion.
RELEVANCE = dict(examples=200, scored="completion")
SELECTION = dict(metric="token", p=0.5)  # the quick start's ESFT-Token threshold (see above)


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def esft_finetune(base_dir: Path, config: ExpertConfig, examples: Sequence[Example], out_dir: Path, *,
                  general: Sequence[Example] = (), steps: int, batch_size: int, lr: float, replay: float = 0.0,
                  seed: int = 0, threads: int = THREADS,
                  on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train the experts `config` selects on `examples` (plus `replay` of each batch from `general`) and
    save the whole model, as DeepSeek's ESFT code does, to `out_dir` (bf16 safetensors)."""
    tokenizer, model = _load(base_dir)
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
                   completion_only=True, parameters=trainable, after_backward=zero_unselected, on_step=on_step,
                   general=general, replay=replay, threads=threads)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, tokenizer)
    return losses


def full_finetune(base_dir: Path, examples: Sequence[Example], out_dir: Path, *, general: Sequence[Example] = (),
                  steps: int, batch_size: int, lr: float, replay: float = 0.0, seed: int = 0,
                  frozen: Sequence[str] = (), on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Fine-tune every weight (FFT; the consolidation experiment's variants), saved as a full bf16 checkpoint; a
    weight whose name ends with one of `frozen` keeps the base's values."""
    tokenizer, model = _load(base_dir)
    params = [p for n, p in model.named_parameters() if not n.endswith(tuple(f"{f}.weight" for f in frozen))]
    losses = train(model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                   completion_only=True, on_step=on_step, general=general, replay=replay,
                   parameters=params if frozen else None)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, tokenizer)
    return losses


VARIANT_RECIPE = dict(steps=200, batch_size=16, lr=3e-3)  # the consolidation experiment's full fine-tunes


def fine_tuned_variants(world, tasks: Sequence[str], *, steps: int = VARIANT_RECIPE["steps"],
                        lr: float = VARIANT_RECIPE["lr"], frozen: Sequence[str] = (),
                        on_step: Callable[[str], None] = lambda msg: None) -> dict[str, Path]:
    """{task: folder} of a fully fine-tuned variant of the world's base per task, made once (about 20 s each on
    2 cores) and cached under the world's `variants/` folder (the recipe of the default steps and lr; others, and
    variants with `frozen` modules, get their own folder)."""
    from esftctl.jsonl import read_jsonl

    default = steps == VARIANT_RECIPE["steps"] and lr == VARIANT_RECIPE["lr"]
    folder = world.root / ("variants" if default else f"variants-s{steps}-lr{lr:g}")
    if frozen:
        folder = folder.with_name(folder.name + "-frozen-" + "-".join(sorted(frozen)))
    out = {}
    for task in tasks:
        out[task] = folder / task
        if not out[task].exists():
            on_step(f"fully fine-tuning a variant on {task}")
            full_finetune(world.base_dir, list(read_jsonl(world.data_file(task, "train"))), out[task], steps=steps,
                          batch_size=VARIANT_RECIPE["batch_size"], lr=lr, frozen=frozen)
    return out


@torch.no_grad()
def _completion_scores(model_dir: Path, examples: Sequence[Example], batch_size: int = 256) -> tuple[float, float]:
    """(exact match, mean NLL per completion token), in one teacher-forced pass per batch.

    A greedy completion equals the reference exactly when, fed the reference's own prefix, the model's
    argmax is the reference's next token at every completion position (EOS included): the first position
    where it is not is where greedy decoding would leave the reference. So exact match needs no decoding
    loop: one forward pass scores a whole batch (float32, transformers).
    """
    from esftctl.world.training import encode_batch

    tokenizer, model = _load(model_dir)
    model.eval()
    hits, nll, count = 0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = encode_batch(tokenizer, examples[start:start + batch_size], completion_only=True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        target = batch["labels"][:, 1:]
        scored = target != -100
        hits += int(((logits.argmax(dim=-1) == target) | ~scored).all(dim=1).sum())
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        nll -= float((logp * scored).sum())
        count += int(scored.sum())
    return hits / len(examples), nll / count


def exact_match(model_dir: Path, examples: Sequence[Example]) -> float:
    """Share of examples whose greedy completion (transformers, float32) equals the reference exactly."""
    return _completion_scores(model_dir, examples)[0]


def completion_loss(model_dir: Path, examples: Sequence[Example]) -> float:
    """Mean negative log-likelihood per completion token (EOS included), transformers in float32."""
    return _completion_scores(model_dir, examples)[1]


def evaluate(model_dir: Path, examples: Sequence[Example]) -> tuple[float, float]:
    """(exact match, completion loss) in one pass."""
    return _completion_scores(model_dir, examples)
