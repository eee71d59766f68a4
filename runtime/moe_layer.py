"""The expert weights of one MoE layer as virtual tensors, with its ESFT expert map.

Rows 0..E-1 of w13 [rows, 2I, H] and w2 [rows, H, I] hold the base experts (w13 = gate stacked over up,
vLLM's layout); rows E..rows-1 are the adapter area, slots x experts_per_slot rows reserved once. Adapter
experts take the lowest free rows, so loaded experts sit densely and share boundary pages, and a row
freed by an eviction is the first to be reused.

The expert map `table` [slots + 1, E] (int32, on the layer's device) says, for adapter slot a and base
expert e, which row a token of adapter a uses where the router chose e; its last row, `base_row`, is the
identity and serves the base model.
"""

from __future__ import annotations

import heapq
from typing import Callable, Mapping

import torch

from esftctl.checkpoint import ExpertWeights
from esftctl.errors import EsftError
from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.virtual_tensor import VirtualExpertTensor


class VirtualMoELayer:
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        num_slots: int,
        experts_per_slot: int,
        dtype: torch.dtype,
        make_space: Callable[[int], AddressSpace],
    ):
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.num_rows = num_experts + num_slots * experts_per_slot
        h, i = hidden_size, intermediate_size
        self.w13 = VirtualExpertTensor(make_space(self.num_rows * 2 * i * h * dtype.itemsize),
                                       self.num_rows, (2 * i, h), dtype)
        self.w2 = VirtualExpertTensor(make_space(self.num_rows * h * i * dtype.itemsize),
                                      self.num_rows, (h, i), dtype)
        self.device = self.w13.space.device
        self.table = torch.arange(num_experts, dtype=torch.int32, device=self.device).repeat(num_slots + 1, 1)
        self._identity = self.table[0].clone()
        self._free_rows = list(range(num_experts, self.num_rows))  # a heap: lowest row first
        self.slot_rows: dict[int, dict[int, int]] = {}

    @property
    def expert_bytes(self) -> int:
        return self.w13.row_bytes + self.w2.row_bytes

    @property
    def base_row(self) -> int:
        return self.num_slots

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def _write(self, row: int, weights: ExpertWeights) -> None:
        inter = weights.gate.shape[0]
        self.w13.tensor[row, :inter].copy_(weights.gate, non_blocking=True)
        self.w13.tensor[row, inter:].copy_(weights.up, non_blocking=True)
        self.w2.tensor[row].copy_(weights.down, non_blocking=True)

    def _map(self, rows: list[int]) -> None:
        self.w13.map_rows(rows)
        self.w2.map_rows(rows)

    def load_base(self, experts: Mapping[int, ExpertWeights]) -> None:
        """Map rows 0..E-1 and copy the base experts in."""
        if sorted(experts) != list(range(self.num_experts)):
            raise ValueError(f"base needs experts 0..{self.num_experts - 1}")
        self._map(list(range(self.num_experts)))
        for e, weights in experts.items():
            self._write(e, weights)

    def load(self, slot: int, experts: Mapping[int, ExpertWeights | None]) -> dict[int, int]:
        """Put an adapter's experts of this layer into free rows and point the slot's map row at them.

        An expert given as None gets its row mapped but not written (benchmarks, and paging, which fills
        rows later).
        """
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        if slot in self.slot_rows:
            raise ValueError(f"slot {slot} is taken")
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad:
            raise EsftError(f"expert ids {bad} out of range (the layer has {self.num_experts} experts)")
        if len(experts) > len(self._free_rows):
            raise EsftError(f"no room: {len(experts)} experts to load, {len(self._free_rows)} free rows in the layer")
        rows = {e: heapq.heappop(self._free_rows) for e in sorted(experts)}
        self._map(list(rows.values()))
        for e, row in rows.items():
            if experts[e] is not None:
                self._write(row, experts[e])
        new_map = self._identity.clone()
        for e, row in rows.items():
            new_map[e] = row
        # Ordered after the weight copies on the same stream: no token sees the row before its weights.
        self.table[slot].copy_(new_map, non_blocking=True)
        self.slot_rows[slot] = rows
        return rows

    def detach(self, slot: int) -> list[int]:
        """Point the slot's map row back at the base; return the rows it held, still mapped.

        Kernels queued before this call may still read those rows: release them with `release_rows`
        only once that work has finished.
        """
        rows = self.slot_rows.pop(slot)
        self.table[slot].copy_(self._identity, non_blocking=True)
        return list(rows.values())

    def release_rows(self, rows: list[int]) -> None:
        self.w13.unmap_rows(rows)
        self.w2.unmap_rows(rows)
        for row in rows:
            heapq.heappush(self._free_rows, row)

    def physical_bytes(self) -> int:
        return self.w13.stats().mapped_bytes + self.w2.stats().mapped_bytes

    def needed_bytes(self) -> int:
        return self.w13.stats().needed_bytes + self.w2.stats().needed_bytes

    def close(self) -> None:
        self.w13.close()
        self.w2.close()
