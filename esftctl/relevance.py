"""ESFT expert relevance: run a base model over task data and score every routed expert of every MoE layer.

For MoE layer l and routed expert i over the sample's tokens (prompt and completion, padding excluded):
- average gate score ("gate"): the mean over tokens of the router's softmax affinity for i;
- token selection ratio ("token"): the share of (token, top-k slot) pairs that chose i.
Both sum to 1 over the experts of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from esftctl.checkpoint import MoECheckpoint
from esftctl.errors import EsftError
from esftctl.jsonfile import read_json, write_json
from esftctl.routing import routing_scores

METRICS = ("gate", "token")
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

    def to_json(self) -> dict:
        return {"format": SCORES_FORMAT, "version": 1, "model": self.model, "data": self.data,
                "examples": self.examples, "tokens": self.tokens, "top_k": self.top_k, "moe_layers": self.moe_layers,
                "scores": {m: {str(l): s for l, s in per.items()} for m, per in self.scores.items()}}

    def save(self, path: Path, overwrite: bool = True) -> None:
        write_json(path, self.to_json(), overwrite=overwrite)

    @classmethod
    def load(cls, path: Path) -> "Relevance":
        d = read_json(path)
        if not isinstance(d, dict) or d.get("format") != SCORES_FORMAT:
            raise EsftError(f"not an esftctl relevance scores file (format is not {SCORES_FORMAT!r})", path)
        try:
            scores = {m: {int(l): [float(x) for x in s] for l, s in d["scores"][m].items()} for m in METRICS}
            return cls(d["model"], d["data"], int(d["examples"]), int(d["tokens"]), int(d["top_k"]),
                       [int(l) for l in d["moe_layers"]], scores)
        except (KeyError, TypeError, ValueError) as e:
            raise EsftError(f"malformed scores file ({e.__class__.__name__}: {e})", path) from None


@torch.no_grad()
def compute_relevance(model_dir: Path, texts: Sequence[str], batch_size: int = 16, data_name: str = "",
                      on_batch: Callable[[int], None] = lambda n: None) -> Relevance:
    """Score every routed expert on `texts` with both ESFT metrics (float32 on the CPU, or the GPU if present)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = MoECheckpoint(model_dir)
    if not texts:
        raise EsftError("no examples to score", data_name or None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    experts = ckpt.num_experts
    gate_sum = {l: torch.zeros(experts, dtype=torch.float64) for l in ckpt.moe_layers}
    picks = {l: torch.zeros(experts, dtype=torch.float64) for l in ckpt.moe_layers}
    tokens = 0
    for start in range(0, len(texts), batch_size):
        batch = list(texts[start:start + batch_size])
        enc = tokenizer(batch, padding=True, return_tensors="pt").to(device)
        scores = routing_scores(model, enc["input_ids"], enc["attention_mask"], ckpt.moe_layers)
        for layer, s in scores.items():
            gate_sum[layer] += s.sum(dim=0).double().cpu()
            picks[layer] += torch.bincount(s.topk(ckpt.top_k, dim=-1).indices.reshape(-1),
                                           minlength=experts).double().cpu()
        tokens += int(enc["attention_mask"].sum())
        on_batch(len(batch))
    result = {"gate": {l: (gate_sum[l] / tokens).tolist() for l in ckpt.moe_layers},
              "token": {l: (picks[l] / (tokens * ckpt.top_k)).tolist() for l in ckpt.moe_layers}}
    return Relevance(str(model_dir), data_name, len(texts), tokens, ckpt.top_k, ckpt.moe_layers, result)


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
