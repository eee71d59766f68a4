"""ESFT expert selection from relevance scores, and the expert-configuration JSON of DeepSeek's ESFT code.

Per layer, experts are sorted by score (descending; equal scores by lower id) and the selected set is the
shortest prefix whose scores sum to at least p. The configuration file is the layout DeepSeek's public
ESFT code reads and writes:

    {"experts": {"1": [8, 26, 55], "2": [...]}, "shared_experts": false, "non_expert_modules": false}

keys are model layer indices (MoE layers only), values expert ids in order of relevance. DeepSeek's code numbers
decoder layers from 0 (`enumerate(model.model.layers)`; DeepSeek-V2-Lite's keys are 1-26, its layer 0 dense).
Other tools number them from 1: a public AWS sample trains ESFT on Qwen3-MoE, whose layer 0 is already MoE, with
1-based keys (for a 48-layer Qwen3-MoE, 1-48). Read 0-based, such a config names every expert one layer off. So a
config read from a file is checked against the model (`ExpertConfig.numbered_from_zero`): keys that fit its MoE
layers only one way (key 48 of 48 layers; key 0, or a dense layer's key under the other numbering) are read that
way. A config that fits both ways (keys 1-47 of an all-MoE model) is read, when a full fine-tune is packed, the
way under which exactly the listed experts changed (decide_reading); where the fine-tune does not decide, and for
an adapter folder, it is refused until `--layer-base 0|1` says which. Whatever esftctl writes is 0-based.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from esftctl.errors import EsftError
from esftctl.jsonfile import read_json, write_json
from esftctl.units import format_ranges

# How other tools number the layers of an expert config: from 0 (DeepSeek's ESFT code) or from 1.
LAYER_BASES = (0, 1)

# Sums of float scores can fall short of p = 1 by rounding; a prefix this close counts as reaching p.
_EPS = 1e-9

# The longest layer key read from a file: far past any model's layer count, far below int()'s 4,300 digits (a
# longer key was a ValueError traceback, not a line naming the file).
LAYER_KEY_DIGITS = 9


def layer_key(key: object) -> int | None:
    """A layer index as a JSON object's key holds it (expert configs, relevance scores): 1-9 ASCII digits, nothing
    else (int() also takes " 1", "1_0", "+1" and digits such as "²" or "١"); None for anything else."""
    if isinstance(key, str) and 0 < len(key) <= LAYER_KEY_DIGITS and key.isascii() and key.isdigit():
        return int(key)
    return None


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
            layer = layer_key(key)
            shown = repr(key) if len(key) <= 40 else f"{key[:40]!r}..."
            # JSON's true and false are Python ints
            if layer is None or not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise EsftError(f"experts[{shown}] must be a list of expert ids under a layer index (at most "
                                f"{LAYER_KEY_DIGITS} digits)", path)
            if len(set(ids)) != len(ids):
                raise EsftError(f"experts[{shown}] lists an expert twice", path)
            experts[layer] = ids
        flags = {k: d.get(k, False) for k in ("shared_experts", "non_expert_modules")}
        for k, v in flags.items():
            if type(v) is not bool:  # "false" would be true to DeepSeek's loader, which tests it as Python does
                raise EsftError(f"{k} must be true or false, not {json.dumps(v)[:40]}", path)
        extra = {k: v for k, v in d.items() if k not in ("experts", *flags)}
        return cls(experts, flags["shared_experts"], flags["non_expert_modules"], extra)

    @classmethod
    def read_for(cls, path: Path, moe_layers: Sequence[int], num_experts: int, *,
                 layer_base: int | None = None) -> tuple["ExpertConfig", int]:
        """The expert config in `path` for a model with these MoE layers and experts, its layer keys read 0- or
        1-based (numbered_from_zero) and its expert ids checked: (the config, 0-based; the base its keys had)."""
        config, used = cls.load(path).numbered_from_zero(moe_layers, layer_base=layer_base, path=path)
        config.validate(moe_layers, num_experts, path)
        return config, used

    def numbered_from_zero(self, moe_layers: Sequence[int], *, layer_base: int | None = None,
                           path: Path | None = None) -> tuple["ExpertConfig", int]:
        """(this config with 0-based layer keys, the base its keys were read with): `layer_base` if given (refused
        if the keys do not fit the model's MoE layers that way), else the one base under which they fit; keys that
        fit both ways are refused, asking for --layer-base (module docstring)."""
        if layer_base is not None and layer_base not in LAYER_BASES:
            raise EsftError(f"--layer-base must be 0 or 1, not {layer_base}", path)
        misfits = {b: _misfit(self.experts, b, moe_layers) for b in LAYER_BASES}
        where = f"MoE layers counted from 0: {format_ranges(moe_layers)}"
        if layer_base is not None:
            if misfits[layer_base]:
                raise EsftError(f"with --layer-base {layer_base} the expert config does not fit the model: "
                                f"{misfits[layer_base]} ({where})", path)
            chosen = layer_base
        else:
            fitting = [b for b in LAYER_BASES if misfits[b] is None]
            if not fitting:
                raise EsftError(f"the expert config's layer keys fit the model neither 0-based ({misfits[0]}) nor "
                                f"1-based ({misfits[1]}); {where}", path)
            if len(fitting) > 1 and self.experts:
                raise EsftError(f"the expert config's layer keys {format_ranges(self.experts)} fit the model both "
                                f"0-based and 1-based ({where}): pass --layer-base 0 or --layer-base 1", path)
            chosen = fitting[0]
        experts = {layer - chosen: ids for layer, ids in self.experts.items()}
        return ExpertConfig(experts, self.shared_experts, self.non_expert_modules, dict(self.extra)), chosen

    def readings(self, moe_layers: Sequence[int], num_experts: int, *, layer_base: int | None = None,
                 path: Path | None = None) -> dict[int, "ExpertConfig"]:
        """{base: this config read with that base, 0-based and checked} for every base its keys fit (only
        `layer_base` if given): where both fit, the caller that has a full fine-tune lets it decide
        (decide_reading); refused where none does."""
        if layer_base is not None or len([b for b in LAYER_BASES if _misfit(self.experts, b, moe_layers) is None]) < 2:
            config, used = self.numbered_from_zero(moe_layers, layer_base=layer_base, path=path)
            found = {used: config}
        else:
            found = {b: ExpertConfig({layer - b: ids for layer, ids in self.experts.items()}, self.shared_experts,
                                     self.non_expert_modules, dict(self.extra)) for b in LAYER_BASES}
        for config in found.values():
            config.validate(moe_layers, num_experts, path)
        return found

    def validate(self, moe_layers: Sequence[int], num_experts: int, path: Path | None = None) -> None:
        for layer, ids in self.experts.items():
            if layer not in moe_layers:
                raise EsftError(f"layer {layer} is not a MoE layer of the model (MoE layers: {list(moe_layers)})", path)
            bad = [i for i in ids if not 0 <= i < num_experts]
            if bad:
                raise EsftError(f"layer {layer}: expert ids {bad} out of range (the model has {num_experts})", path)


def _misfit(experts: Mapping[int, Sequence[int]], base: int, moe_layers: Sequence[int]) -> str | None:
    """Why layer keys counted from `base` do not all name MoE layers (the first key that does not), or None."""
    for key in sorted(experts):
        layer = key - base
        if layer not in moe_layers:
            named = f"layer {layer} is" if base == 0 else f"key {key} would be layer {layer},"
            return f"{named} not a MoE layer"
    return None


def decide_reading(readings: dict[int, ExpertConfig], changed: Mapping[int, Sequence[int]], moe_layers: Sequence[int],
                   path: Path | None = None) -> tuple[ExpertConfig, int, bool]:
    """(the config, its base, whether the fine-tune decided) among `readings` (ExpertConfig.readings) for a full
    fine-tune whose changed experts are `changed` {layer: ids}: one reading is taken as it is; of two, the one under
    which exactly the listed experts changed, else the only one that lists every changed expert; refused where both
    or neither fit, asking for --layer-base."""
    if len(readings) == 1:
        (base, config), = readings.items()
        return config, base, False
    moved = {(layer, e) for layer, ids in changed.items() for e in ids}

    def listed(config: ExpertConfig) -> set[tuple[int, int]]:
        return {(layer, e) for layer, ids in config.experts.items() for e in ids}
    covering = [b for b, c in readings.items() if moved <= listed(c)]
    exact = [b for b in covering if moved == listed(readings[b])]
    chosen = exact if len(exact) == 1 else covering
    where = f"MoE layers counted from 0: {format_ranges(moe_layers)}"
    if len(chosen) == 1:
        return readings[chosen[0]], chosen[0], True
    if not chosen:
        raise EsftError(f"the expert config's layer keys fit the model both 0-based and 1-based ({where}), but under "
                        "neither are all the experts the fine-tune changed listed: check the config, or pass "
                        "--layer-base 0 or --layer-base 1", path)
    raise EsftError(f"the expert config's layer keys fit the model both 0-based and 1-based ({where}), and the "
                    "fine-tune does not decide between them (every changed expert is listed under both): pass "
                    "--layer-base 0 or --layer-base 1", path)
