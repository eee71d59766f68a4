"""The expert weights of one MoE layer as virtual tensors, with its ESFT expert map.

Rows 0..E-1 of w13 [rows, 2I, H] and w2 [rows, H, I] hold the base experts (w13 = gate stacked over up,
vLLM's layout); rows E..rows-1 are the adapter area, slots x experts_per_slot rows reserved once. Adapter
experts take the lowest free rows, so loaded experts sit densely and share boundary pages, and a row
freed by an eviction is the first to be reused.

The expert map `table` [slots + 1, E] (int32, on the layer's device) says, for adapter slot a and base
expert e, which row a token of adapter a uses where the router chose e; its last row, `base_row`, is the
identity and serves the base model.

An engine may keep experts in its own layout (vLLM's CPU kernels prepack and pad them): an `ExpertLayout`
turns checkpoint weights into that layout's rows, and the rows' shapes follow from it.

FP8 experts (block-quantized: esftctl.formats.fp8) come with a float32 scale tensor beside each weight, w13's
[rows, 2 ceil(I / bn), ceil(H / bk)] and w2's [rows, ceil(H / bn), ceil(I / bk)], which the kernel indexes by the
same expert row as the weights. The layout then names their row shapes too (`scale_rows`), and the layer keeps
them as two more virtual tensors (`scales`) whose rows are mapped, written, checksummed and released with the
weights' rows: every row a token is rerouted to holds both an expert's weights and its scales.

Experts with biases (GPT-OSS: w13's [rows, 2I], w2's [rows, H], in the weights' dtype) are the same idea: the layout
names their row shapes (`bias_rows`), the layer keeps them as two more virtual tensors (`biases`), and they are
mapped, written, staged, checksummed and released with the weights' rows.

Under expert parallelism a rank holds only its own experts (vLLM's `expert_map`: global expert -> this rank's
row, -1 where another rank holds it). Row numbers stay global (the table's, the ones tokens are rerouted to),
and the layer keeps its tensors in local rows: the rank's base experts, then the adapter area. Every rank
allocates every adapter row (same loads in the same order, so the same rows), but gives local rows (the lowest
free ones, densely, so runs of rows share pages) only to rows that replace experts it holds, and extends the map
to them (`expert_map`, [rows]: adapter row -> its local row here, -1 on the other ranks). So each rerouted
token-expert pair is computed on exactly one rank, the one that holds the base expert it replaces.
"""

from __future__ import annotations

import functools
import heapq
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights, StoredExpert, StoredTensor
from esftctl.kernels.row_checksum import row_checksums
from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.virtual_tensor import VirtualExpertTensor

STAGE_THREADS = 8  # experts read into place at once (each read releases the GIL), at most the CPUs
STAGE_THREADED_BYTES = 16 << 20  # below this a layer's reads go one by one (threads cost more than they save)


def stack_experts(experts: Sequence[ExpertWeights | StoredExpert], pin: bool = False) -> tuple[torch.Tensor, ...]:
    """Checkpoint experts as fused host tensors: w13 [n, 2I, H] (gate over up) and w2 [n, H, I], then for FP8
    experts their scales stacked alike (gate's over up's, then down's), and for experts with biases those (w13's
    [n, 2I], w2's [n, H]), each part copied once; `pin`: in pinned memory, from which copies to a GPU run at full
    speed and asynchronously. Experts still in their file (StoredExpert) are read straight into their rows, several
    at a time: one pass over the bytes instead of a read and a copy."""
    first = experts[0]
    pairs = [("gate", "up", "down")]
    pairs += [("gate_scale", "up_scale", "down_scale")] if first.part("gate_scale") is not None else []
    pairs += [("gate_bias", "up_bias", "down_bias")] if first.part("gate_bias") is not None else []
    out: list[torch.Tensor] = []
    fills: list[Callable[[], None]] = []
    for gate, up, down in pairs:
        g, d = first.part(gate), first.part(down)
        rows = g.shape[0]
        w13 = torch.empty(len(experts), 2 * rows, *g.shape[1:], dtype=g.dtype, pin_memory=pin)
        w2 = torch.empty(len(experts), *d.shape, dtype=d.dtype, pin_memory=pin)
        for k, w in enumerate(experts):
            fills += [functools.partial(_fill, w13[k, :rows], w.part(gate)),
                      functools.partial(_fill, w13[k, rows:], w.part(up)),
                      functools.partial(_fill, w2[k], w.part(down))]
        out += [w13, w2]
    threads = min(STAGE_THREADS, len(os.sched_getaffinity(0)), len(fills))
    if threads > 1 and isinstance(first, StoredExpert) and sum(t.nbytes for t in out) >= STAGE_THREADED_BYTES:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda fill: fill(), fills))  # list(): the first failed read raises here
    else:
        for fill in fills:
            fill()
    return tuple(out)


def _fill(dst: torch.Tensor, src: torch.Tensor | StoredTensor) -> None:
    if isinstance(src, StoredTensor):
        src.read_into(dst)
    else:
        dst.copy_(src)


@dataclass(frozen=True)
class ExpertLayout:
    """How an engine stores experts: row shapes of w13 and w2 (and, for FP8 experts, of their float32 scales:
    `scale_rows`; for experts with biases, of those: `bias_rows`), and the conversion from stacked checkpoint parts
    (`stack_experts`) to such rows. The default is the checkpoint layout itself."""

    w13_row: tuple[int, ...]
    w2_row: tuple[int, ...]
    convert: Callable[..., tuple[torch.Tensor, ...]] = lambda *parts: parts
    scale_rows: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    bias_rows: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @classmethod
    def plain(cls, hidden_size: int, intermediate_size: int, block: tuple[int, int] | None = None,
              biases: bool = False) -> "ExpertLayout":
        """The checkpoint's layout; `block`: FP8 experts with scales per block of that many values; `biases`:
        experts with biases."""
        scales = None
        if block is not None:
            (bn, bk), h, i = block, hidden_size, intermediate_size
            scales = ((2 * -(-i // bn), -(-h // bk)), (-(-h // bn), -(-i // bk)))
        bias_rows = ((2 * intermediate_size,), (hidden_size,)) if biases else None
        return cls((2 * intermediate_size, hidden_size), (hidden_size, intermediate_size), scale_rows=scales,
                   bias_rows=bias_rows)


class VirtualMoELayer:
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_slots: int,
        experts_per_slot: int,
        dtype: torch.dtype,
        make_space: Callable[[int], AddressSpace],
        layout: ExpertLayout | None = None,
        expert_map: torch.Tensor | None = None,
    ):
        """`expert_map` (expert parallelism): the engine's map of the `num_experts` global experts to this rank's
        base rows, -1 where another rank holds them; None: this rank holds every expert."""
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.num_rows = num_experts + num_slots * experts_per_slot  # global rows: what tokens are rerouted to
        self._owned = None if expert_map is None else [int(r) for r in expert_map.tolist()]
        # The base experts this rank computes, in the order of its rows.
        self.own_experts = sorted((e for e in range(num_experts) if self.holds(e)), key=self.local_row)
        self.base_rows = len(self.own_experts)
        local_rows = self.base_rows + num_slots * experts_per_slot
        self.layout = layout or ExpertLayout.plain(hidden_size, intermediate_size)
        # split at the adapter area: a paged layer shares the pages below it and keeps those above
        self.w13 = VirtualExpertTensor(make_space(local_rows * math.prod(self.layout.w13_row) * dtype.itemsize),
                                       local_rows, self.layout.w13_row, dtype, split_row=self.base_rows)
        self.w2 = VirtualExpertTensor(make_space(local_rows * math.prod(self.layout.w2_row) * dtype.itemsize),
                                      local_rows, self.layout.w2_row, dtype, split_row=self.base_rows)
        # FP8 experts: their scales' rows, beside the weights' rows of the same numbers.
        self.scales = tuple(VirtualExpertTensor(make_space(local_rows * math.prod(shape) * 4), local_rows, shape,
                                                torch.float32) for shape in self.layout.scale_rows or ())
        # Experts with biases: their bias rows, in the weights' dtype.
        self.biases = tuple(VirtualExpertTensor(make_space(local_rows * math.prod(shape) * dtype.itemsize), local_rows,
                                                shape, dtype) for shape in self.layout.bias_rows or ())
        self.device = self.w13.space.device
        self.expert_map = None if expert_map is None else torch.cat([
            expert_map.to(self.device, torch.int32),
            torch.full((self.num_rows - num_experts,), -1, dtype=torch.int32, device=self.device)])
        self.table = torch.arange(num_experts, dtype=torch.int32, device=self.device).repeat(num_slots + 1, 1)
        self._identity = self.table[0].clone()
        self._free_rows = list(range(num_experts, self.num_rows))  # a heap: lowest row first
        # Expert parallelism: this rank's local rows of the adapter rows it computes, and its free local rows.
        self._adapter_local: dict[int, int] = {}
        self._free_local = list(range(self.base_rows, local_rows))  # a heap
        self.slot_rows: dict[int, dict[int, int]] = {}
        # Paging (esftctl.runtime.paging): host copies of the base rows once `keeps_host` (one pair of tensors,
        # `host`, unless a compressed tier serves every base row: then None), and whether the base rows are on the
        # device. Adapter rows never page: they stay in the layer's own pages.
        self.keeps_host = False
        self.host: tuple[torch.Tensor, torch.Tensor] | None = None
        self.paged_out = False

    @property
    def parts(self) -> tuple[VirtualExpertTensor, ...]:
        """The virtual tensors whose rows are experts: w13, w2, their scales for FP8 experts, their biases for
        experts with biases."""
        return (self.w13, self.w2, *self.scales, *self.biases)

    @property
    def expert_bytes(self) -> int:
        return sum(p.row_bytes for p in self.parts)

    @property
    def base_row(self) -> int:
        return self.num_slots

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def holds(self, expert: int) -> bool:
        """Whether this rank computes base expert `expert` (and the adapter rows that replace it)."""
        return self._owned is None or self._owned[expert] >= 0

    def holds_row(self, row: int) -> bool:
        """Whether this rank computes global row `row`: its base expert's, or an adapter row replacing one."""
        if row < self.num_experts:
            return self.holds(row)
        return self._owned is None or row in self._adapter_local

    def local_row(self, row: int) -> int:
        """The tensors' row of global row `row` (the same number without expert parallelism)."""
        if self._owned is None:
            return row
        return self._owned[row] if row < self.num_experts else self._adapter_local[row]

    def _write(self, rows: Sequence[int], experts: Sequence[ExpertWeights]) -> None:
        held = [k for k, row in enumerate(rows) if self.holds_row(row)]
        if not held:
            return
        self.write_rows([rows[k] for k in held], *self.layout.convert(*stack_experts([experts[k] for k in held])))

    def write_rows(self, rows: Sequence[int], *parts: torch.Tensor) -> None:
        """Copy experts already in the layout's rows (w13 [n, *w13_row], w2 [n, *w2_row], then for FP8 experts
        their scales, for experts with biases those) into their (global) rows: the device rows (a paged-out layer's
        adapter rows, not its base rows), and a base row's host copy if the layer keeps them. Rows another rank
        computes are left out."""
        if len(parts) != len(self.parts):
            raise ValueError(f"{len(parts)} parts given for experts of {len(self.parts)}")
        for k, row in enumerate(rows):
            if not self.holds_row(row):
                continue
            base = row < self.num_experts
            if self.keeps_host and base:
                self._host_copy(row, parts[0][k], parts[1][k])
            if not (self.paged_out and base):
                for dst, src in zip(self.parts, parts):
                    dst.tensor[self.local_row(row)].copy_(src[k], non_blocking=True)

    # ---- paging: the base rows leave and return together; adapter rows stay ----------------------
    # An adapter's rows are a small share of a layer (4 adapters on the Qwen3-30B-A3B shape: 471 rows of 6,144, 4.44
    # GB) read by every step that serves it: fetched with the base rows, they crossed the bus whole every step (0.20x
    # of plain vLLM where memory binds). Kept on the device, counted in the memory set aside before the KV cache,
    # they cost their bytes once.
    def _host_empty(self, *shape: int) -> torch.Tensor:
        """Host memory for rows: pinned beside a GPU, so copies to the device run asynchronously."""
        return torch.empty(shape, dtype=self.w13.dtype, pin_memory=self.device.type == "cuda")

    def keep_host_copy(self, *, base_rows: bool = True) -> None:
        """From now on the layer may page out: keep its base rows in host memory too, unless `base_rows` is False
        (a compressed tier on the device delivers every one of them, so copies would never be read: for
        Qwen3-30B-A3B's shape, 38.6 GB of pinned memory). The caller decides (esftctl.runtime.paging.tiers.
        base_copies_needed)."""
        if self.scales:
            raise EsftError("paging FP8 experts is not supported yet (their scale rows are not paged)")
        if self.biases:
            raise EsftError("paging experts with biases is not supported yet (their bias rows are not paged)")
        self.keeps_host = True
        if base_rows:
            self.host = (self._host_empty(self.num_experts, *self.layout.w13_row),
                         self._host_empty(self.num_experts, *self.layout.w2_row))
            for row in self.own_experts:
                self._host_copy(row, self.w13.tensor[row], self.w2.tensor[row])

    def _host_copy(self, row: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        if self.host is None:
            raise EsftError(f"base expert {row} cannot change while paged: the compressed tier serves the base "
                            "experts as it encoded them, and no host copy is kept")
        self.host[0][row].copy_(w13)
        self.host[1][row].copy_(w2)

    @property
    def base_copies(self) -> bool:
        """Whether the host keeps copies of the base rows (else a compressed tier delivers them)."""
        return self.host is not None

    def host_row(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The host copies of base row `row` (w13, w2); (None, None) without copies."""
        return (self.host[0][row], self.host[1][row]) if self.host is not None else (None, None)

    def host_bytes(self) -> int:
        """Host memory of the base rows' copies (pinned beside a GPU), if kept."""
        return sum(t.nbytes for t in self.host or ())

    def held_rows(self) -> list[int]:
        """The rows with experts in use: the base's and those of attached adapters."""
        attached = (r for rows in self.slot_rows.values() for r in rows.values())
        return sorted({*self.own_experts, *filter(self.holds_row, attached)})

    def held_bytes(self) -> int:
        """Bytes of the held rows' experts (what the layer takes on the device when it is paged in)."""
        return len(self.held_rows()) * self.expert_bytes

    def base_bytes(self) -> int:
        """Bytes of the base rows' experts: what paging a layer in or out maps or gives back."""
        return self.base_rows * self.expert_bytes

    def adapter_device_bytes(self) -> int:
        """Device memory of a paged-out layer (its adapter rows, and the page they may share with the last base
        row); 0 while it is paged in (then physical_bytes holds everything)."""
        return self.physical_bytes() if self.paged_out else 0

    def copy_in(self, skip: int = 0) -> int:
        """Queue copies of the base rows from `skip` on from the host copies into the (mapped) rows (the others
        come from elsewhere: all of them without base copies); returns the bytes."""
        e = self.num_experts
        if skip < e and self.host is None:
            raise EsftError(f"base rows {skip}..{e - 1} have no host copies (the compressed tier serves them)")
        if skip < e:
            self.w13.tensor[skip:e].copy_(self.host[0][skip:], non_blocking=True)
            self.w2.tensor[skip:e].copy_(self.host[1][skip:], non_blocking=True)
        return max(0, e - skip) * self.expert_bytes

    def page_out(self) -> None:
        """Unmap the base rows (the caller made sure no queued kernel reads them); the host copy stays, and so do
        the adapter rows, with the page the last base row shares with them."""
        if not self.keeps_host:
            raise EsftError("a layer pages out only once it keeps a host copy of its rows")
        for t in (self.w13, self.w2):
            t.hold_pages(t.boundary_page(self.base_rows))
        rows = [r for r in self.own_experts if self.w13.is_mapped(r)]
        self.w13.unmap_rows(rows)
        self.w2.unmap_rows(rows)
        self.paged_out = True

    def page_in(self) -> None:
        """Map the base rows again; their contents are the caller's to bring in (the pager's: LayerTiers.fill)."""
        self._map([r for r in self.own_experts if not self.w13.is_mapped(r)])
        for t in (self.w13, self.w2):
            t.let_go(t.boundary_page(self.base_rows))
        self.paged_out = False

    def _map(self, rows: list[int]) -> None:
        local = [self.local_row(r) for r in rows]
        for part in self.parts:
            part.map_rows(local)

    def load_base(self, experts: Mapping[int, ExpertWeights]) -> None:
        """Map rows 0..E-1 and copy the base experts in."""
        if sorted(experts) != list(range(self.num_experts)):
            raise ValueError(f"base needs experts 0..{self.num_experts - 1}")
        self._map(list(range(self.num_experts)))
        self._write(list(range(self.num_experts)), [experts[e] for e in range(self.num_experts)])

    def load_base_rows(self, *parts: torch.Tensor) -> None:
        """Map the base rows and copy in base experts that are already in the layout (an engine's own tensors,
        w13, w2, then for FP8 experts their scales, for experts with biases those: under expert parallelism, this
        rank's experts in its row order)."""
        self._map(self.own_experts)
        self.write_rows(self.own_experts, *parts)

    def replace_base(self, experts: Mapping[int, ExpertWeights]) -> None:
        """Write other experts into some base rows (the base rows must be loaded)."""
        self._write(sorted(experts), [experts[e] for e in sorted(experts)])

    def stage(self, experts: Sequence[ExpertWeights | StoredExpert]) -> tuple[torch.Tensor, ...]:
        """Experts as this layer's rows in host memory (pinned beside a GPU): what `load(..., staged=)` copies,
        and their row checksums (`row_checksums`, taken by the layer's device) for `check_rows`. An engine's
        conversion may run on its device (vLLM's processing of the kernel layout): the checksums are taken
        there, and the rows come back to host memory, so that staged adapters never hold device memory outside
        the budget. Returns the rows (w13, w2, then FP8 experts' scales, experts' biases), then the checksums."""
        pin = self.device.type == "cuda"
        stacked = stack_experts(experts, pin=pin)
        rows = self.layout.convert(*stacked)
        sums = row_checksums(*rows, device=self.device).cpu()  # on a GPU: pinned rows read over the bus
        if all(t.device.type == "cpu" for t in rows):
            return (*rows, sums)
        # back into the pinned rows they were converted from where the layout kept shape and dtype: pinning 2.7 GB
        # anew took 1.2-1.3 s on the H100 (stage_cost.py), as long as the rest of the staging
        host = tuple(src if src.shape == t.shape and src.dtype == t.dtype and src.is_pinned() == pin
                     else torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                     for src, t in zip(stacked, rows, strict=True))
        for dst, src in zip(host, rows):
            dst.copy_(src)
        return (*host, sums)

    def check_rows(self, slot: int, checksums: torch.Tensor) -> int:
        """That slot's experts reach the kernel as staged: the map sends each of its expert ids to the row it was
        given, and the device rows the engine reads for it (paged or not: adapter rows stay there) have the staged
        rows' checksums (in expert id order). Returns the rows checked; EsftError if one differs."""
        rows = self.slot_rows[slot]
        ids = sorted(rows)
        mapped = self.table[slot].cpu()
        wrong = [e for e in ids if int(mapped[e]) != rows[e]]
        if wrong:
            raise EsftError(f"the expert map sends experts {wrong} elsewhere than their rows")
        held = [k for k, e in enumerate(ids) if self.holds_row(rows[e])]
        got = row_checksums(*(p.tensor for p in self.parts), rows=[self.local_row(rows[ids[k]]) for k in held]) \
            .cpu().tolist() if held else []  # every part the kernel reads, FP8 scales and biases too: one pass
        differ = [ids[k] for k, c in zip(held, got) if c != int(checksums[k])]
        if differ:
            raise EsftError(f"the rows of experts {differ} do not hold the adapter's weights")
        return len(held)

    def load(self, slot: int, experts: Mapping[int, ExpertWeights | None],
             staged: tuple[torch.Tensor, ...] | None = None) -> dict[int, int]:
        """Put an adapter's experts of this layer into free rows and point the slot's map row at them.

        An expert given as None gets its row mapped but not written (benchmarks, and paging, which fills
        rows later); `staged` (from `stage`, experts in id order) gives every row's contents instead.
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
        if staged is not None and len(staged[0]) != len(experts):
            raise ValueError(f"{len(staged[0])} staged rows for {len(experts)} experts")
        rows = {e: heapq.heappop(self._free_rows) for e in sorted(experts)}
        held = [row for e, row in rows.items() if self.holds(e)]
        if self._owned is not None:
            self._adapter_local.update((row, heapq.heappop(self._free_local)) for row in held)
        self._map(held)  # adapter rows stay on the device, paged or not
        if staged is not None:
            self.write_rows(list(rows.values()), *staged)
        else:
            written = [e for e in rows if experts[e] is not None]
            self._write([rows[e] for e in written], [experts[e] for e in written])
        self._set_expert_map(held, [self.local_row(r) for r in held])
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
        held = [r for r in rows if self.holds_row(r)]
        self._set_expert_map(held, [-1] * len(held))
        for part in self.parts:
            part.unmap_rows([self.local_row(r) for r in held])
        for row in rows:
            if row in self._adapter_local:
                heapq.heappush(self._free_local, self._adapter_local.pop(row))
            heapq.heappush(self._free_rows, row)

    def _set_expert_map(self, rows: list[int], local: list[int]) -> None:
        """Under expert parallelism, point the extended expert map's entries for global `rows` at `local`."""
        if self.expert_map is not None and rows:
            values = torch.tensor(local, dtype=torch.int32).to(self.device, non_blocking=True)
            self.expert_map[torch.tensor(rows).to(self.device, non_blocking=True)] = values

    def physical_bytes(self) -> int:
        return sum(p.stats().mapped_bytes for p in self.parts)

    def needed_bytes(self) -> int:
        return sum(p.stats().needed_bytes for p in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()
