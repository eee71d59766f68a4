"""ESFT expert selection from relevance scores, and the expert-configuration JSON of DeepSeek's ESFT code.

Per layer, experts are sorted by score (descending; equal scores by lower id) and the selected set is the
shortest prefix whose scores sum to at least p. The configuration file is the layout DeepSeek's public
ESFT code reads and writes:

    {"experts": {"1": [8, 26, 55], "2": [...]}, "shared_experts": false, "non_expert_modules": false}

keys are model layer indices (MoE layers only), values expert ids in order of relevance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from esftctl.errors import EsftError
from esftctl.jsonfile import read_json, write_json

# Sums of float scores can fall short of p = 1 by rounding; a prefix this close counts as reaching p.
_EPS = 1e-9


def select_layer(scores: Sequence[float], p: float) -> list[int]:
    """The shortest prefix of experts, best first, whose scores sum to at least p."""
    if not 0 < p <= 1:
        raise EsftError(f"threshold p must be in (0, 1], got {p}")
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    chosen, total = [], 0.0
    for e in order:
        chosen.append(e)
        total += scores[e]
        if total >= p - _EPS:
            break
    return chosen


def select_experts(scores: Mapping[int, Sequence[float]], p: float) -> dict[int, list[int]]:
    return {layer: select_layer(s, p) for layer, s in sorted(scores.items())}


@dataclass
class ExpertConfig:
    experts: dict[int, list[int]]
    shared_experts: bool = False
    non_expert_modules: bool = False
    extra: dict = field(default_factory=dict)  # keys other tools wrote: kept on a round trip

    def to_json(self) -> dict:
        return {**self.extra, "experts": {str(l): ids for l, ids in sorted(self.experts.items())},
                "shared_experts": self.shared_experts, "non_expert_modules": self.non_expert_modules}

    def save(self, path: Path, *, overwrite: bool = True) -> None:
        write_json(path, self.to_json(), indent=2, overwrite=overwrite)

    @classmethod
    def load(cls, path: Path) -> "ExpertConfig":
        d = read_json(path)
        if not isinstance(d, dict) or not isinstance(d.get("experts"), dict):
            raise EsftError("expert config needs an 'experts' object keyed by layer index", path)
        experts: dict[int, list[int]] = {}
        for key, ids in d["experts"].items():
            if not str(key).isdigit() or not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise EsftError(f"experts[{key!r}] must be a list of expert ids under a layer index", path)
            if len(set(ids)) != len(ids):
                raise EsftError(f"experts[{key!r}] lists an expert twice", path)
            experts[int(key)] = ids
        extra = {k: v for k, v in d.items() if k not in ("experts", "shared_experts", "non_expert_modules")}
        return cls(experts, bool(d.get("shared_experts", False)), bool(d.get("non_expert_modules", False)), extra)

    def validate(self, moe_layers: Sequence[int], num_experts: int, path: Path | None = None) -> None:
        for layer, ids in self.experts.items():
            if layer not in moe_layers:
                raise EsftError(f"layer {layer} is not a MoE layer of the model (MoE layers: {list(moe_layers)})", path)
            bad = [i for i in ids if not 0 <= i < num_experts]
            if bad:
                raise EsftError(f"layer {layer}: expert ids {bad} out of range (the model has {num_experts})", path)
