"""Adapters staged in host memory, so that loading one again is one copy to the device.

Loading a bundle from disk reads it, verifies its SHA-256 (one sequential pass over the file, about 2 GB/s),
and converts its experts to the engine's rows (vLLM's conversion runs on the GPU; the rows come back to
pinned host memory); only then are they copied into the virtual tensors. Measured
on an H200 before this cache: 4.7 s to load a 3.98 GiB Table 1 adapter whose file was already in the page
cache, 61x its floor (77 ms: bytes over 55 GB/s of pinned host-to-device copy). The cache keeps the staged
rows of recently loaded bundles (least recently used out first, bounded in bytes), keyed by the identity
(device, inode, size, modification time) of the manifest and of the data file it names: unchanged files are
the same verified bytes, so a load that finds them skips reading, verifying and converting, and copies pinned
rows straight into the virtual tensors. A changed file misses and is read and verified again. Pinned blocks
come from torch's caching host allocator, which rounds sizes up and keeps freed blocks: the pinned memory held
can exceed the capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from esftctl.errors import EsftError
from esftctl.formats.bundle import identity_json
from esftctl.formats.checkpoint import ExpertWeights, StoredExpert
from esftctl.runtime.moe_layer import VirtualMoELayer
from esftctl.runtime.serve_config import bundle_identity


@dataclass
class StagedAdapter:
    """A bundle's experts as rows of the engine's layout, with their row checksums: {layer: (sorted ids, rows
    (w13, w2, and for FP8 experts their scales), checksums)}; `non_expert`, its other tensors (shared experts, other
    modules) as the bundle holds them ({checkpoint name: tensor}: their copy pools convert them at load)."""

    layers: dict[int, tuple[list[int], tuple[torch.Tensor, ...], torch.Tensor]]
    non_expert: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return sum(len(ids) for ids, *_ in self.layers.values())

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for _, rows, _ in self.layers.values() for t in rows)
                + sum(t.nbytes for t in self.non_expert.values()))

    def experts(self) -> dict[int, dict[int, None]]:
        """The {layer: {id: None}} that AdapterSlots.load takes beside `rows()` and `checksums()`."""
        return {layer: dict.fromkeys(ids) for layer, (ids, *_) in self.layers.items()}

    def rows(self) -> dict[int, tuple[torch.Tensor, ...]]:
        return {layer: rows for layer, (_, rows, _) in self.layers.items()}

    def checksums(self) -> dict[int, torch.Tensor]:
        return {layer: sums for layer, (_, _, sums) in self.layers.items()}


def stage(layers: Mapping[int, VirtualMoELayer],
          experts: Mapping[int, Mapping[int, ExpertWeights | StoredExpert]],
          non_expert: Mapping[str, torch.Tensor] | None = None) -> StagedAdapter:
    unknown = sorted(set(experts) - set(layers))
    if unknown:
        raise EsftError(f"the bundle has experts for layers {unknown}, which are not MoE layers of this base")
    out = {}
    for layer, per in experts.items():
        ids = sorted(per)
        if ids:
            *rows, sums = layers[layer].stage([per[e] for e in ids])
            out[layer] = (ids, tuple(rows), sums)
    return StagedAdapter(out, dict(non_expert or {}))


class HostAdapterCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, StagedAdapter] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def lookup(self, bundle: str | Path, pinned=None) -> tuple[tuple | None, StagedAdapter | None]:
        """The bundle's identity, taken before anything reads it (the key to `put` its staged rows under), and
        its staged rows if the cache holds them; `pinned`: the folder as opened beneath an adapter root."""
        key = bundle_identity(bundle, pinned)
        if key is None:
            return None, None  # the bundle's own checks will say what is wrong with it
        staged = self._entries.get(key)
        if staged is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        return key, staged

    def identities(self) -> list[list[list[int]]]:
        """The file identities of the bundles held, as JSON lists (EngineStatus.staged_bundles)."""
        return [identity_json(key) for key in self._entries]

    def put(self, key: tuple | None, staged: StagedAdapter) -> None:
        """Keep `staged` (if it fits at all), dropping the least recently used entries to make room."""
        if key is None or staged.nbytes > self.capacity:
            return
        self._entries[key] = staged
        while self.nbytes > self.capacity:
            self._entries.popitem(last=False)
