"""Consolidated variants as one server holds them: which expert each row holds, and what each variant adds.

`esftctl consolidate` ranks the (layer, expert) positions of M fine-tuned variants of one architecture and
loads C of them, each from one variant (expert_map.json). Served together (`esftctl serve --variants`), the
first variant is the *home* one, the checkpoint vLLM loads, and
- a base row (expert e of a layer) holds the loaded expert where the map loaded position (l, e) (a hit: every
  variant uses it) and the home variant's own expert elsewhere;
- every other variant is an adapter slot holding its own experts at the positions that were not loaded (its
  misses), except where its expert is bit-identical to the home one (an ESFT-style variant shares most);
- every variant brings its own non-expert weights (esftctl.runtime.vllm.variant_weights).
So variant v runs exactly `esftctl materialize MAP_DIR --variant v`: its own non-expert weights, the mapped
expert where loaded, its own elsewhere. Memory: L x E base rows plus each variant's distinct misses; with
C = every position, no variant adds a single expert.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from esftctl.consolidate import MAP_FILE, ExpertMap
from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint
from esftctl.names import check_name

HOME = 0  # the variant vLLM loads (the server's --model), in the base rows: the one definition


@dataclass
class VariantSet:
    map_dir: Path
    emap: ExpertMap
    names: list[str]
    checkpoints: list[MoECheckpoint]

    @classmethod
    def open(cls, map_dir: str | Path, names: Sequence[str] | None = None) -> "VariantSet":
        """The map and its variants' checkpoints, checked: every variant present, of one architecture, and of
        the map's layers and experts; `names` (default: the folders' names) unique."""
        map_dir = Path(map_dir)
        if not (map_dir / MAP_FILE).is_file():
            raise EsftError(f"no {MAP_FILE} here: not a folder written by `esftctl consolidate`", map_dir)
        emap = ExpertMap.load(map_dir / MAP_FILE)  # variants' paths relative to the map's folder, at most 64
        checkpoints = emap.open_variants(map_dir / MAP_FILE)  # present, of one architecture, as fingerprinted
        paths = [c.path for c in checkpoints]
        first = checkpoints[0]
        if first.moe_layers != emap.moe_layers or first.num_experts != emap.num_experts:
            raise EsftError(f"the map is of {len(emap.moe_layers)} MoE layers x {emap.num_experts} experts, its "
                            f"variants have {len(first.moe_layers)} x {first.num_experts}", map_dir / MAP_FILE)
        names = list(names) if names else [p.resolve().name for p in paths]
        if len(names) != len(paths):
            raise EsftError(f"{len(names)} variant names given for the map's {len(paths)} variants", map_dir)
        for name in names:
            check_name(name, "variant")
        clash = sorted(n for n, count in Counter(names).items() if count > 1)
        if clash:
            raise EsftError(f"variants share the name {clash[0]!r}; name them with --variant-names", map_dir)
        return cls(map_dir, emap, names, checkpoints)

    @property
    def paths(self) -> list[Path]:
        return [c.path.resolve() for c in self.checkpoints]

    @property
    def home(self) -> MoECheckpoint:
        return self.checkpoints[HOME]

    def base_rows(self) -> dict[int, dict[int, ExpertWeights]]:
        """{layer: {expert: weights}}: the base rows that hold another variant's expert than the home one's
        (loaded positions whose owner's expert differs from the home expert)."""
        rows: dict[int, dict[int, ExpertWeights]] = {}
        for li, layer in enumerate(self.emap.moe_layers):
            for e, owner in enumerate(self.emap.owner[li].tolist()):
                if owner > HOME:
                    weights = self.checkpoints[owner].read_expert(layer, e)
                    if not weights.equal(self._home_expert(layer, e)):
                        rows.setdefault(layer, {})[e] = weights
        return rows

    def own_experts(self, variant: int) -> dict[int, dict[int, ExpertWeights]]:
        """{layer: {expert: weights}} variant `variant` holds in its slot: its experts at the positions the map
        did not load, where they differ from the home variant's (every layer present, maybe empty)."""
        if variant == HOME:
            return {layer: {} for layer in self.emap.moe_layers}
        rows: dict[int, dict[int, ExpertWeights]] = {}
        for li, layer in enumerate(self.emap.moe_layers):
            rows[layer] = {}
            for e, owner in enumerate(self.emap.owner[li].tolist()):
                if owner < 0:
                    weights = self.checkpoints[variant].read_expert(layer, e)
                    if not weights.equal(self._home_expert(layer, e)):
                        rows[layer][e] = weights
        return rows

    def miss_counts(self) -> list[list[int]]:
        """Per variant, per MoE layer, the experts its slot holds (reads every unloaded position of every variant)."""
        return [[len(experts) for experts in self.own_experts(v).values()] for v in range(len(self.names))]

    def _home_expert(self, layer: int, expert: int) -> ExpertWeights:
        return self.home.read_expert(layer, expert)  # memory-mapped: nothing is kept

