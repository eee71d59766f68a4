"""Adapter slots across all MoE layers: load, evict (safely under in-flight work), and account memory.

Eviction is two-phase. `evict` points the slot's map rows back at the base at once (stream-ordered, so
every kernel queued afterwards sees the base) and records an event on the given streams; the adapter's
rows stay mapped until those events have completed, and only `collect` (run by every load, or by hand)
unmaps them and returns their rows. A kernel that was queued before the eviction therefore never reads
unmapped memory, and a newly loaded adapter never overwrites rows such a kernel still reads.

An adapter that also replaces the shared experts (esftctl.runtime.vllm.shared_experts) holds one of their copies
beside its slot, released the same way.

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
    shared_copy: int | None = None  # the shared experts' copy the adapter held

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
    shared_layers: int = 0  # MoE layers whose shared experts it replaces (with a copy of its own)


class AdapterSlots:
    def __init__(self, layers: Mapping[int, VirtualMoELayer], budget: int | None = None, shared=None):
        """`budget`: the most adapter experts (summed over layers) loaded at once; None: no limit. `shared`: the
        copies of the shared experts adapters may replace (esftctl.runtime.vllm.shared_experts.SharedExperts)."""
        self.layers = dict(layers)
        self.budget = budget
        self.shared = shared
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
             shared: Mapping[str, torch.Tensor] | None = None) -> int:
        """Load `experts` ({layer: {id: weights}}) into a free slot; `staged` ({layer: rows from the layer's
        `stage`}) gives their contents already in the layout, with None as every weight in `experts`; with
        `checksums` (the staged rows', from `stage`), every row is checked to hold them where the kernel reads
        it (VirtualMoELayer.check_rows) once the copies have run, and a load that fails the check is undone.
        `shared`: the adapter's shared-expert tensors ({checkpoint name: tensor}), put in a copy of its own."""
        if name in self.adapters:
            raise EsftError(f"an adapter named {name!r} is already loaded")
        unknown = sorted(set(experts) - set(self.layers))
        if unknown:
            raise EsftError(f"adapter {name!r} has experts for layers {unknown}, which are not MoE layers")
        self.collect()
        free = self.free_slots()
        if not free:
            raise EsftError(f"no free adapter slot for {name!r} (all {self.num_slots} are taken)")
        if shared:
            self._make_shared_room()
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
            if shared:
                self.shared.load(slot, shared)
                info.shared_layers = self.shared.replaced[slot]
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
            if self.shared is not None and (c := self.shared.detach(slot)) is not None:
                self.shared.release(c)
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

    def _make_shared_room(self) -> None:
        """Wait for pending releases until a shared-expert copy is free; refuse where none is meant for adapters."""
        if self.shared is None or not self.shared.num_copies:
            raise EsftError("it changes shared experts; serve with --shared-expert-copies (at least 1) to load such "
                            "adapters at run time")
        while not self.shared.free_copies() and any(p.shared_copy is not None for p in self._pending):
            next(p for p in self._pending if p.shared_copy is not None).wait()
            self.collect()

    def evict(self, name: str, streams: Sequence | None = None) -> None:
        self.slot_of(name)  # refuses unknown names
        info = self.adapters.pop(name)
        rows = {layer: l.detach(info.slot) for layer, l in self.layers.items() if info.slot in l.slot_rows}
        shared_copy = self.shared.detach(info.slot) if self.shared is not None else None
        if self.device.type == "cuda":
            streams = list(streams) if streams is not None else [torch.cuda.current_stream(self.device)]
            events = []
            for stream in streams:
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            self._pending.append(_PendingRelease(events, rows, shared_copy))
        else:  # the host backend runs synchronously: nothing can still be reading
            self._release(rows, shared_copy)

    def collect(self) -> int:
        """Unmap the rows of evictions whose in-flight work has finished; return how many were released."""
        done, waiting = [], []
        for p in self._pending:
            (done if p.done() else waiting).append(p)
        self._pending = waiting
        for p in done:
            self._release(p.rows, p.shared_copy)
        return len(done)

    def _release(self, rows: dict[int, list[int]], shared_copy: int | None = None) -> None:
        for layer, layer_rows in rows.items():
            self.layers[layer].release_rows(layer_rows)
        if shared_copy is not None:
            self.shared.release(shared_copy)

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
