"""ESFT expert relevance: run a base model over task data and score every routed expert of every MoE layer.

For MoE layer l and routed expert i over the sample's scored tokens (padding excluded):
- average gate score ("gate"): the mean over tokens of the router's affinity for i (its softmax; for sigmoid
  routers, DeepSeek-V3 and GLM-4.5, the sigmoid scores normalized to sum 1);
- token selection ratio ("token"): the share of (token, top-k slot) pairs that chose i, chosen as vLLM routes
  (correction bias and group-limited top-k included: esftctl/routing.py).
Both sum to 1 over the experts of a layer.

The scored tokens are every token of prompt and completion ("all"), or the positions that predict a
completion token ("completion": the last prompt token up to, not including, the last completion token). On the
tiny world, where a task's prompt words also occur in the general mixture's copying, adapters on experts
selected by "completion" scored far higher than by "all" on most tasks of the design sweeps, and barely lower
on any.

The last completion token is left out because it predicts only the end of the text, which the base already
does well. On the tiny world's one-word answers it is half the scored positions, and the answer words (7 for
tagging) route to a few experts that then dominated the selection. Those experts serve few of the positions
that predict an answer: tagging's adapter could not learn a third of its objects, because their answer
positions routed to no selected expert in any layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.formats.architectures import LAYERS
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonfile import read_json, write_json
from esftctl.jsonl import Example
from esftctl.routing import routing_scores
from esftctl.selection import LAYER_KEY_DIGITS, layer_key

METRICS = ("gate", "token")
SCORED = ("all", "completion")  # which tokens of an example are scored
SCORES_FORMAT = "esftctl-relevance"


@dataclass
class Relevance:
    model: str
    data: str
    examples: int
    tokens: int
    top_k: int
    moe_layers: list[int]
    scores: dict[str, dict[int, list[float]]]  # metric -> layer -> per-expert score
    scored: str = "all"  # one of SCORED

    def to_json(self) -> dict:
        return {"format": SCORES_FORMAT, "version": 1, "model": self.model, "data": self.data,
                "examples": self.examples, "tokens": self.tokens, "scored": self.scored, "top_k": self.top_k,
                "moe_layers": self.moe_layers,
                "scores": {m: {str(l): s for l, s in per.items()} for m, per in self.scores.items()}}

    def save(self, path: Path, *, overwrite: bool = True) -> None:
        write_json(path, self.to_json(), overwrite=overwrite)

    @classmethod
    def load(cls, path: Path) -> "Relevance":
        d = read_json(path)
        if not isinstance(d, dict) or d.get("format") != SCORES_FORMAT:
            raise EsftError(f"not an esftctl relevance scores file (format is not {SCORES_FORMAT!r})", path)
        try:
            scores = {m: {_layer(l): [_score(x) for x in s] for l, s in d["scores"][m].items()} for m in METRICS}
            scored = d.get("scored", "all")
            if scored not in SCORED:
                raise ValueError(f"scored is {scored!r}, not one of {', '.join(SCORED)}")
            moe_layers = d["moe_layers"]
            if not all(type(l) is int and 0 <= l < LAYERS for l in moe_layers):
                raise ValueError(f"moe_layers must be layer indices below {LAYERS}")
            widths = {len(s) for per in scores.values() for s in per.values()}
            if any(sorted(per) != sorted(moe_layers) for per in scores.values()) or len(widths) != 1 or 0 in widths:
                raise ValueError("every metric must score the same experts of every MoE layer in moe_layers")
            return cls(d["model"], d["data"], _count(d["examples"]), _count(d["tokens"]), _count(d["top_k"]),
                       list(moe_layers), scores, scored)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:  # Overflow: a 400-digit number
            raise EsftError(f"malformed scores file ({e.__class__.__name__}: {e})", path) from None


def _layer(key: str) -> int:
    """A layer key of `scores` (esftctl.selection.layer_key: plain digits, at most 9)."""
    layer = layer_key(key)
    if layer is None:
        raise ValueError(f"layer key {key[:40]!r} is not a layer index (at most {LAYER_KEY_DIGITS} digits)")
    return layer


def _count(x) -> int:
    """A count as the file holds it: a non-negative JSON integer (not a string, a float or a boolean)."""
    if type(x) is not int or x < 0:
        raise ValueError(f"a count must be a non-negative integer, not {str(x)[:40]!r}")
    return x


def _score(x) -> float:
    """A score as the file holds it: a finite non-negative JSON number (a string or a boolean is no score)."""
    if type(x) not in (int, float) or not 0 <= x < float("inf"):
        raise ValueError(f"a score must be a finite non-negative number, not {x!r}")
    return float(x)


def scoring_device() -> str:
    """Where relevance is scored: the GPU if present (a reference that must pick the same experts runs there too:
    top-k near-ties fall differently between CPU and GPU float32)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@torch.no_grad()
def open_model(ckpt: MoECheckpoint, dtype: torch.dtype):
    """The transformers model of `ckpt` in `dtype`; an FP8 checkpoint's block-quantized weights dequantized as they
    load (transformers' FineGrainedFP8 with dequantize: Q * S, as DeepSeek's fp8_cast_bf16), so that it runs and
    trains on any device."""
    from transformers import AutoModelForCausalLM

    extra = {}
    if ckpt.fp8 is not None:
        from transformers import FineGrainedFP8Config

        extra["quantization_config"] = FineGrainedFP8Config(weight_block_size=tuple(ckpt.fp8.block), dequantize=True)
    return AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype, **extra)


def compute_relevance(model_dir: Path, examples: Sequence[Example], *, scored: str = "all", batch_size: int = 16,
                      data_name: str = "", on_batch: Callable[[int], None] = lambda n: None) -> Relevance:
    """Score every routed expert on `examples` with both ESFT metrics, over the tokens `scored` names (float32 on
    the CPU, or the GPU if present)."""
    from transformers import AutoTokenizer

    if scored not in SCORED:
        raise EsftError(f"unknown choice of scored tokens {scored!r} (choose {' or '.join(SCORED)})")
    ckpt = MoECheckpoint(model_dir, fp8=True)
    if not examples:
        raise EsftError("no examples to score", data_name or None)
    device = scoring_device()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = open_model(ckpt, torch.float32).to(device).eval()
    experts = ckpt.num_experts
    gate_sum = {l: torch.zeros(experts, dtype=torch.float64) for l in ckpt.moe_layers}
    picks = {l: torch.zeros(experts, dtype=torch.float64) for l in ckpt.moe_layers}
    tokens = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        enc = tokenizer([e["prompt"] + e["completion"] for e in batch], padding=True, return_tensors="pt").to(device)
        mask = (completion_positions(tokenizer, batch, enc["attention_mask"]) if scored == "completion"
                else enc["attention_mask"].clone())
        routed = routing_scores(model, ckpt, enc["input_ids"], enc["attention_mask"])
        keep = mask[enc["attention_mask"].bool()].bool()
        for layer, (affinity, chosen) in routed.items():
            gate_sum[layer] += affinity[keep].sum(dim=0).double().cpu()
            picks[layer] += torch.bincount(chosen[keep].reshape(-1), minlength=experts).double().cpu()
        tokens += int(mask.sum())
        on_batch(len(batch))
    result = {"gate": {l: (gate_sum[l] / tokens).tolist() for l in ckpt.moe_layers},
              "token": {l: (picks[l] / (tokens * ckpt.top_k)).tolist() for l in ckpt.moe_layers}}
    return Relevance(str(model_dir), data_name, len(examples), tokens, ckpt.top_k, ckpt.moe_layers, result, scored)


def completion_positions(tokenizer, examples: Sequence[Example], attention_mask: torch.Tensor) -> torch.Tensor:
    """1 at the positions whose outputs predict `examples`' completion tokens (what fine-tuning trains, and what a
    decode step feeds): the last prompt token up to the last completion token, which predicts nothing here; rows
    right-padded, so a row's tokens come first."""
    mask = attention_mask.clone()
    for row, e in enumerate(examples):
        mask[row, :max(0, len(tokenizer(e["prompt"])["input_ids"]) - 1)] = 0
        mask[row, int(attention_mask[row].sum()) - 1] = 0
    return mask


def concentration(scores: Sequence[float], mass: float) -> int:
    """How many of the best experts it takes to reach `mass` of a layer's score (ESFT's selection size)."""
    from esftctl.selection import select_layer

    return len(select_layer(scores, mass))


def relevance_table(rel: Relevance, metric: str, top: int = 5):
    from rich.table import Table

    t = Table(title=f"Expert relevance ({metric} score) of {rel.data or 'the sample'}: "
                    f"{rel.examples} examples, {rel.tokens} tokens", header_style="bold")
    t.add_column("layer", justify="right")
    t.add_column(f"top {top} experts (score)")
    t.add_column("experts for 50%", justify="right")
    t.add_column("experts for 90%", justify="right")
    for layer in rel.moe_layers:
        s = rel.scores[metric][layer]
        best = sorted(range(len(s)), key=lambda e: (-s[e], e))[:top]
        t.add_row(str(layer), "  ".join(f"e{e}:{s[e]:.3f}" for e in best),
                  str(concentration(s, 0.5)), str(concentration(s, 0.9)))
    return t
