"""Similarity-based expert consolidation of several fine-tuned variants of one MoE architecture.

After "QoS-efficient serving of multiple MoE LLMs" (Algorithm 1), for M variants:

- distance(l, e) = the sum over pairs of variants of the L2 norm of the difference of expert (l, e), all
  its weights flattened (unordered pairs: the paper's ordered sum is exactly twice this, same ranking);
- positions are ranked by distance, most similar first (ties by layer, then expert);
- walking the ranking while fewer than C positions are assigned, rank r goes to variant r mod M: the map
  records whose expert is loaded at each position; positions beyond the capacity are not loaded.

At inference a position that is loaded serves every variant with the loaded expert (a hit); one that is not
loaded serves each variant its own expert (a miss: loaded on demand). `materialize` writes the checkpoint a
variant effectively runs: its own non-expert weights, the mapped experts where loaded, its own elsewhere.
Experts are streamed one at a time: whole models are never held in memory.

The map names each variant by its path (a relative one is taken from the map's folder, wherever the command runs)
and records its fingerprint (structure and router weights), which every reader checks: a map is a file someone may
hand on, and a variant replaced under the same path would otherwise be served or materialized silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from esftctl.errors import EsftError
from esftctl.formats import native
from esftctl.formats.architectures import EXPERTS, LAYERS
from esftctl.formats.bundle import base_identity
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, write_checkpoint
from esftctl.jsonfile import read_json, write_json

MAP_FILE, RANKING_FILE = "expert_map.json", "ranking.json"
MAP_VERSION = 2  # 2: each variant's fingerprint beside its path (version 1 maps had none: refused, made again)
# Variants of one map. A server gives each a slot of its own and consolidation sums M (M - 1) / 2 pair distances per
# position: 64 is far past what anyone consolidates (the paper's are a handful), and a map of 20,000 entries read
# without a bound ran past 120 s.
MAX_VARIANTS = 64
MAP_LIMIT = 16 << 20  # bytes of a map: DeepSeek-V3's 58 MoE layers x 256 experts take about 60 KB
FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")  # esftctl.formats.bundle.base_identity's


def fingerprint(model: MoECheckpoint) -> str:
    """A model's fingerprint (its structure and router weights: esftctl.formats.bundle.base_identity), which a map
    records of each variant, so that a variant replaced by another model under the same path is refused."""
    return base_identity(model)["fingerprint"]


def check_same_architecture(models: Sequence[MoECheckpoint]) -> None:
    if len(models) < 2:
        raise EsftError("consolidation needs at least two model variants")
    first = models[0]
    want = (first.arch.name, first.moe_layers, first.num_experts, first.expert_shapes(), first.expert_dtype)
    for m in models[1:]:
        got = (m.arch.name, m.moe_layers, m.num_experts, m.expert_shapes(), m.expert_dtype)
        if got != want:
            names = ("architecture", "MoE layers", "experts per layer", "expert shapes", "expert dtype")
            differ = [n for n, a, b in zip(names, want, got) if a != b]
            raise EsftError(f"variant differs from {first.path} in {', '.join(differ)}", m.path)


def pair_distances_reference(experts: Sequence[ExpertWeights]) -> float:
    """The sum over unordered pairs of ||expert_i - expert_j||_2, all weights flattened, in float64 with torch:
    the reference of `pair_distances`."""
    flats = [torch.cat([t.reshape(-1).double() for _, t in x.items()]) for x in experts]
    return sum(float(torch.linalg.vector_norm(flats[i] - flats[j]))
               for i in range(len(flats)) for j in range(i + 1, len(flats)))


def pair_distances(experts: Sequence[ExpertWeights]) -> float:
    """`pair_distances_reference`, from one native pass per weight over the variants' bf16 values
    (native/distances.c: every pair's float64 sum of squares at once); the reference for other dtypes or where
    the package was built without its C extension."""
    lib = native.module()
    if lib is None or any(t.dtype != torch.bfloat16 for x in experts for _, t in x.items()):
        return pair_distances_reference(experts)
    squared = 0.0
    for weight, _ in experts[0].items():  # gate, up, down, and biases where experts have them
        bits = [getattr(x, weight).contiguous().view(torch.int16).numpy() for x in experts]
        squared = squared + np.frombuffer(lib.pair_squared_distances(bits, native.threads()), dtype=np.float64)
    return float(np.sqrt(squared).sum())


def expert_distances(models: Sequence[MoECheckpoint], on_layer: Callable[[int], None] = lambda l: None) -> np.ndarray:
    """[MoE layers, experts]: sum over variant pairs of ||expert_i - expert_j||_2 (`pair_distances`)."""
    check_same_architecture(models)
    first = models[0]
    out = np.zeros((len(first.moe_layers), first.num_experts))
    for li, layer in enumerate(first.moe_layers):
        for e in range(first.num_experts):
            out[li, e] = pair_distances([m.read_expert(layer, e) for m in models])
        on_layer(layer)
    return out


def rank_positions(distances: np.ndarray) -> list[tuple[int, int]]:
    """(layer index, expert) pairs, most similar (smallest distance) first; ties in row-major order."""
    order = np.lexsort((np.arange(distances.size), distances.reshape(-1)))
    experts = distances.shape[1]
    return [(int(i) // experts, int(i) % experts) for i in order]


def assign_round_robin(ranking: Sequence[tuple[int, int]], num_models: int, capacity: int
                       ) -> dict[tuple[int, int], int]:
    """Rank r < capacity -> variant r mod M (rank 1 to the first variant, rank 2 to the second, ...)."""
    if num_models < 1 or capacity < 0:
        raise EsftError("need at least one model and a non-negative capacity")
    return {pos: r % num_models for r, pos in enumerate(ranking[:capacity])}


@dataclass
class ExpertMap:
    models: list[str]  # as loaded: absolute, relative ones taken from the map's folder
    moe_layers: list[int]
    num_experts: int
    capacity: int
    owner: np.ndarray  # [MoE layers, experts]: variant index whose expert is loaded, -1 = not loaded
    fingerprints: list[str]  # each variant's (`fingerprint`) when the map was made, checked by open_variants

    def to_json(self) -> dict:
        return {"format": "esftctl-expert-map", "version": MAP_VERSION, "models": self.models,
                "fingerprints": self.fingerprints, "moe_layers": self.moe_layers, "num_experts": self.num_experts,
                "capacity": self.capacity,
                "map": {str(l): self.owner[i].tolist() for i, l in enumerate(self.moe_layers)}}

    @classmethod
    def load(cls, path: Path) -> "ExpertMap":
        """The map in `path`, every field checked (_map_problem) before anything reads it: a map may come from
        someone else, and serving indexes variants by its owners. A variant's relative path is taken from the map's
        folder, not the current one, so the map names the same models wherever a command runs; a map of version 1,
        without its variants' fingerprints, is refused."""
        d = read_json(path, MAP_LIMIT)
        if not isinstance(d, dict) or d.get("format") != "esftctl-expert-map":
            raise EsftError("not an esftctl expert map", path)
        if d.get("version") == 1:
            raise EsftError("an expert map of version 1, made by an older esftctl without its variants' fingerprints, "
                            "which this one checks them against: run `esftctl consolidate` again", path)
        problem = _map_problem(d)
        if problem:
            raise EsftError(f"malformed expert map: {problem}", path)
        layers, experts = d["moe_layers"], d["num_experts"]
        owner = np.array([d["map"][str(l)] for l in layers], dtype=np.int64).reshape(len(layers), experts)
        folder = Path(path).parent.absolute()
        models = [str(folder / m) if not Path(m).is_absolute() else m for m in d["models"]]
        return cls(models, layers, experts, d["capacity"], owner, d["fingerprints"])

    def open_variants(self, path: Path) -> list[MoECheckpoint]:
        """The variants of this map (read from `path`), checked: each present, all of one architecture, and each
        still the model the map was made of (its fingerprint), else one line naming the map and the variant."""
        for i, p in enumerate(self.models):
            if not Path(p).is_dir():
                raise EsftError(f"variant {i} of the map, {p}, is missing", path)
        models = [MoECheckpoint(p) for p in self.models]
        check_same_architecture(models)
        for i, (model, want) in enumerate(zip(models, self.fingerprints)):
            if fingerprint(model) != want:
                raise EsftError(f"variant {i} of the map, {model.path}, is not the model the map was made of (its "
                                "config or router weights changed): run `esftctl consolidate` again", path)
        return models


def _map_problem(d: dict) -> str | None:
    """What is wrong with an expert map's fields (the first thing), or None: at most MAX_VARIANTS variants as paths,
    each with its fingerprint, layers increasing, one owner per expert of each layer, each a variant or -1, and no
    more loaded than the capacity."""
    models, fingerprints, layers, experts, capacity, rows = (
        d.get(k) for k in ("models", "fingerprints", "moe_layers", "num_experts", "capacity", "map"))
    if d.get("version") != MAP_VERSION:
        return f"version must be {MAP_VERSION}"
    if not (isinstance(models, list) and 0 < len(models) <= MAX_VARIANTS
            and all(isinstance(m, str) and m and "\0" not in m for m in models)):
        return f"models must be a non-empty list of at most {MAX_VARIANTS} paths"
    if not (isinstance(fingerprints, list) and len(fingerprints) == len(models)
            and all(isinstance(f, str) and FINGERPRINT.fullmatch(f) for f in fingerprints)):
        return "fingerprints must hold one fingerprint (sha256:...) per model"
    if not (isinstance(layers, list) and all(type(l) is int and 0 <= l < LAYERS for l in layers)
            and layers == sorted(set(layers))):
        return f"moe_layers must be increasing layer indices below {LAYERS}"
    if not (type(experts) is int and 1 <= experts <= EXPERTS):
        return f"num_experts must be an integer in 1-{EXPERTS}"
    if not (type(capacity) is int and capacity >= 0):
        return "capacity must be a non-negative integer"
    if not (isinstance(rows, dict) and set(rows) == {str(l) for l in layers}):
        return "map must hold one list per MoE layer, keyed by its index"
    owners = [rows[str(l)] for l in layers]
    if not all(isinstance(r, list) and len(r) == experts and all(type(o) is int and -1 <= o < len(models) for o in r)
               for r in owners):
        return f"each layer's list must hold {experts} owners, each a variant 0-{len(models) - 1} or -1"
    if sum(o >= 0 for r in owners for o in r) > capacity:
        return f"the map loads more experts than its capacity of {capacity}"
    return None


def consolidate(model_dirs: Sequence[Path], out: Path, capacity: int | None = None, budget_bytes: int | None = None, *,
                overwrite: bool = False, on_layer: Callable[[int], None] = lambda l: None
                ) -> tuple[ExpertMap, np.ndarray]:
    """Write DIR/expert_map.json, DIR/ranking.json and DIR/distances.png; return the map and distances."""
    from esftctl.atomic import atomic_dir

    if len(model_dirs) > MAX_VARIANTS:
        raise EsftError(f"{len(model_dirs)} variants given: a map holds at most {MAX_VARIANTS}")
    models = [MoECheckpoint(p) for p in model_dirs]
    check_same_architecture(models)
    if (capacity is None) == (budget_bytes is None):
        raise EsftError("give exactly one of a capacity in experts or a memory budget in bytes")
    if capacity is None:
        capacity = budget_bytes // models[0].expert_nbytes
    if out.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", out)
    distances = expert_distances(models, on_layer)
    ranking = rank_positions(distances)
    assigned = assign_round_robin(ranking, len(models), capacity)
    owner = np.full(distances.shape, -1, dtype=np.int64)
    for (li, e), m in assigned.items():
        owner[li, e] = m
    emap = ExpertMap([str(Path(p).resolve()) for p in model_dirs], models[0].moe_layers, models[0].num_experts,
                     capacity, owner, [fingerprint(m) for m in models])
    layers = models[0].moe_layers
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_json(tmp / MAP_FILE, emap.to_json())
        write_json(tmp / RANKING_FILE, [
            {"rank": r + 1, "layer": layers[li], "expert": e, "distance": float(distances[li, e]),
             "loaded_from": assigned.get((li, e), -1)} for r, (li, e) in enumerate(ranking)])
        heat_map(distances, layers, tmp / "distances.png")
    return emap, distances


def heat_map(distances: np.ndarray, layers: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, distances.shape[1] / 4), max(3, len(layers) / 3)))
    image = ax.imshow(distances, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [str(l) for l in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("summed pairwise L2 distance of experts")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def materialize(map_dir: Path, variant: int, out: Path, *, overwrite: bool = False,
                on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """The checkpoint variant `variant` runs under the map: mapped experts where loaded, its own elsewhere."""
    emap = ExpertMap.load(map_dir / MAP_FILE)
    if not 0 <= variant < len(emap.models):
        raise EsftError(f"variant {variant} out of range (the map has {len(emap.models)} models)", map_dir)
    models = emap.open_variants(map_dir / MAP_FILE)
    own = models[variant]
    replacements = {}
    for li, layer in enumerate(emap.moe_layers):
        for e in range(emap.num_experts):
            source = int(emap.owner[li, e])
            if source >= 0 and source != variant:
                replacements[(layer, e)] = models[source].read_expert(layer, e)
    return write_checkpoint(own, out, experts=replacements, overwrite=overwrite, on_tensor=on_tensor)


def average(model_dirs: Sequence[Path], out: Path, *, overwrite: bool = False,
            on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """The weight-averaging baseline: every tensor the mean of the variants' (float32, cast back).

    Reads one tensor of each variant at a time; the averaged copy (one model's size) is held until written.
    `on_tensor` after each tensor averaged and again after each written (2 x the tensor count in all).
    """
    models = [MoECheckpoint(p) for p in model_dirs]
    check_same_architecture(models)
    first = models[0]
    mean = {}
    for name, info in first.tensors.items():
        missing = [m.path for m in models[1:] if name not in m.tensors]
        if missing:
            raise EsftError(f"tensor {name!r} is missing from this variant", missing[0])
        mean[name] = (sum(m.read_tensor(name).float() for m in models) / len(models)).to(info.torch_dtype)
        on_tensor(name)
    return write_checkpoint(first, out, mean, overwrite=overwrite, on_tensor=on_tensor)
