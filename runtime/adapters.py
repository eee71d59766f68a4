"""Adapter slots across all MoE layers: load, evict (safely under in-flight work), and account memory.

Eviction is two-phase. `evict` points the slot's map rows back at the base at once (stream-ordered, so
every kernel queued afterwards sees the base) and records an event on the given streams; the adapter's
rows stay mapped until those events have completed, and only `collect` (run by every load, or by hand)
unmaps them and returns their rows. A kernel that was queued before the eviction therefore never reads
unmapped memory, and a newly loaded adapter never overwrites rows such a kernel still reads.

An adapter that also replaces shared experts or other non-expert modules holds a copy of them beside its slot
(esftctl.runtime.vllm.shared_experts, esftctl.runtime.vllm.module_copies: the copy pools), released the same way.

`budget` caps the adapter experts loaded at once (counted in experts of all layers): a load past it is
refused before anything is mapped. The engine reserves the budget's memory before vLLM sizes its KV cache
(esftctl.runtime.vllm.model), so a load within it never fails for lack of device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights
from esftctl.runtime.moe_layer import VirtualMoELayer
from esftctl.units import format_bytes

# Experts of one adapter: {MoE layer index: {base expert id: fine-tuned weights, or None to map only}}.
AdapterExperts = Mapping[int, Mapping[int, ExpertWeights | None]]


@dataclass
class _PendingRelease:
    events: list
    rows: dict[int, list[int]]  # layer -> rows
    copies: dict[str, int] = field(default_factory=dict)  # pool -> the copy the adapter held there

    def done(self) -> bool:
        return all(e.query() for e in self.events)

    def wait(self) -> None:
        for e in self.events:
            e.synchronize()


@dataclass
class AdapterInfo:
    name: str
    slot: int
    experts_per_layer: dict[int, int] = field(default_factory=dict)
    nbytes: int = 0
    checked_rows: int = 0  # rows found, after loading, to hold the adapter's weights where the kernel reads them
    replaced: dict[str, int] = field(default_factory=dict)  # pool -> layers or modules it replaces in its copy


class AdapterSlots:
    def __init__(self, layers: Mapping[int, VirtualMoELayer], budget: int | None = None,
                 pools: Mapping[str, object] | None = None):
        """`budget`: the most adapter experts (summed over layers) loaded at once; None: no limit. `pools`: {name:
        copies of the non-expert modules adapters may replace} (SharedExperts as "shared", ModuleCopies as
        "modules"), each with accepts, load, detach, release, free_copies, num_copies and replaced."""
        self.layers = dict(layers)
        self.budget = budget
        self.pools = dict(pools or {})
        first = next(iter(self.layers.values()))
        self.num_slots = first.num_slots
        self.device = first.device
        self.adapters: dict[str, AdapterInfo] = {}
        self._pending: list[_PendingRelease] = []

    # ---- queries -------------------------------------------------------------------------------
    def slot_of(self, name: str | None) -> int:
        """The adapter id tokens of `name` carry: its slot, or -1 for the base model (None)."""
        if name is None:
            return -1
        if name not in self.adapters:
            raise EsftError(f"no adapter named {name!r} is loaded")
        return self.adapters[name].slot

    def free_slots(self) -> list[int]:
        taken = {a.slot for a in self.adapters.values()}
        return [s for s in range(self.num_slots) if s not in taken]

    @property
    def pending_releases(self) -> int:
        return len(self._pending)

    # ---- load / evict ----------------------------------------------------------------------------
    def load(self, name: str, experts: AdapterExperts,
             staged: Mapping[int, tuple[torch.Tensor, ...]] | None = None,
             checksums: Mapping[int, torch.Tensor] | None = None,
             non_expert: Mapping[str, torch.Tensor] | None = None) -> int:
        """Load `experts` ({layer: {id: weights}}) into a free slot; `staged` ({layer: rows from the layer's
        `stage`}) gives their contents already in the layout, with None as every weight in `experts`; with
        `checksums` (the staged rows', from `stage`), every row is checked to hold them where the kernel reads
        it (VirtualMoELayer.check_rows) once the copies have run, and a load that fails the check is undone.
        `non_expert`: the adapter's other tensors ({checkpoint name: tensor}), each put in a copy of its own in the
        pool that accepts it."""
        if name in self.adapters:
            raise EsftError(f"an adapter named {name!r} is already loaded")
        unknown = sorted(set(experts) - set(self.layers))
        if unknown:
            raise EsftError(f"adapter {name!r} has experts for layers {unknown}, which are not MoE layers")
        self.collect()
        free = self.free_slots()
        if not free:
            raise EsftError(f"no free adapter slot for {name!r} (all {self.num_slots} are taken)")
        by_pool = self._by_pool(non_expert or {})
        for pool in by_pool:
            self._make_pool_room(pool)
        count = sum(len(e) for e in experts.values())
        if self.budget is not None and self.loaded_experts() + count > self.budget:
            size = self.expert_bytes
            raise EsftError(f"adapter memory budget exceeded: {name!r} needs {format_bytes(count * size)} ({count} "
                            f"experts), {format_bytes(self.loaded_experts() * size)} of the "
                            f"{format_bytes(self.budget * size)} budget are in use; unload an adapter, or serve with a "
                            "larger --adapter-memory")
        self._make_room(experts)
        slot = free[0]
        info = AdapterInfo(name, slot)
        loaded: list[int] = []
        try:
            for pool, tensors in by_pool.items():
                self.pools[pool].load(slot, tensors)
                info.replaced[pool] = self.pools[pool].replaced[slot]
            for layer, layer_experts in experts.items():
                if layer_experts:
                    self.layers[layer].load(slot, layer_experts, staged[layer] if staged is not None else None)
                    loaded.append(layer)
                info.experts_per_layer[layer] = len(layer_experts)
                info.nbytes += len(layer_experts) * self.layers[layer].expert_bytes
            if checksums is not None:
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the copies have landed
                for layer in loaded:
                    try:
                        info.checked_rows += self.layers[layer].check_rows(slot, checksums[layer])
                    except EsftError as e:
                        raise EsftError(f"adapter {name!r} did not reach the kernel in layer {layer}: {e}; the load "
                                        "is undone") from None
        except BaseException:
            for layer in loaded:  # nothing has run with this slot yet: release at once
                self.layers[layer].release_rows(self.layers[layer].detach(slot))
            for pool in self.pools.values():
                if (c := pool.detach(slot)) is not None:
                    pool.release(c)
            raise
        self.adapters[name] = info
        return slot

    def _make_room(self, experts: AdapterExperts) -> None:
        """Wait for pending releases (oldest first) until every layer has rows for the new experts."""
        def short() -> bool:
            return any(len(e) > self.layers[l].free_rows for l, e in experts.items())

        while short() and self._pending:
            self._pending[0].wait()
            self.collect()

    def copies_free(self, names) -> bool:
        """Whether every pool that takes one of these non-expert tensors has a copy free now."""
        return all(self.pools[p].free_copies() for p in self._by_pool(dict.fromkeys(names)))

    def _by_pool(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The adapter's non-expert tensors by the pool that takes them; refuses one that none takes."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            pool = next((p for p, copies in self.pools.items() if copies.num_copies and copies.accepts(name)), None)
            if pool is None:
                raise EsftError(f"it changes {name!r}, and this server keeps no copy of its module (serve with "
                                "--shared-expert-copies for shared experts; other modules need an adapter given at "
                                "start that changes them)")
            out.setdefault(pool, {})[name] = tensor
        return out

    def _make_pool_room(self, pool: str) -> None:
        """Wait for pending releases until a copy of `pool` is free."""
        copies = self.pools[pool]
        while not copies.free_copies() and any(pool in p.copies for p in self._pending):
            next(p for p in self._pending if pool in p.copies).wait()
            self.collect()

    def evict(self, name: str, streams: Sequence | None = None) -> None:
        self.slot_of(name)  # refuses unknown names
        info = self.adapters.pop(name)
        rows = {layer: l.detach(info.slot) for layer, l in self.layers.items() if info.slot in l.slot_rows}
        copies = {name: c for name, pool in self.pools.items() if (c := pool.detach(info.slot)) is not None}
        if self.device.type == "cuda":
            streams = list(streams) if streams is not None else [torch.cuda.current_stream(self.device)]
            events = []
            for stream in streams:
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            self._pending.append(_PendingRelease(events, rows, copies))
        else:  # the host backend runs synchronously: nothing can still be reading
            self._release(rows, copies)

    def collect(self) -> int:
        """Unmap the rows of evictions whose in-flight work has finished; return how many were released."""
        done, waiting = [], []
        for p in self._pending:
            (done if p.done() else waiting).append(p)
        self._pending = waiting
        for p in done:
            self._release(p.rows, p.copies)
        return len(done)

    def _release(self, rows: dict[int, list[int]], copies: Mapping[str, int] | None = None) -> None:
        for layer, layer_rows in rows.items():
            self.layers[layer].release_rows(layer_rows)
        for pool, c in (copies or {}).items():
            self.pools[pool].release(c)

    # ---- memory ----------------------------------------------------------------------------------
    def adapter_bytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes in a layer (every MoE layer's experts have one shape)."""
        return next(iter(self.layers.values())).expert_bytes

    def loaded_experts(self) -> int:
        return sum(sum(a.experts_per_layer.values()) for a in self.adapters.values())

    def physical_bytes(self) -> int:
        return sum(l.physical_bytes() for l in self.layers.values())

    def needed_bytes(self) -> int:
        return sum(l.needed_bytes() for l in self.layers.values())
