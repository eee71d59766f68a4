"""The pager: which rows of a paged layer come in before its kernel, when, and on which stream.

Each MoE layer's experts layer calls `before_kernel(layer, ids, num_tokens)` once the router's ids (after the
reroute) are on the device, and `after_kernel(layer)` once its kernel is queued. Only base rows are fetched: an
adapter's rows stay on the device in the layer's own pages (esftctl.runtime.paging.window). Two ways to fetch:

- routed: the base rows this step's ids name, just before the kernel, on the compute stream. A decode step of a
  DeepSeek-V2-Lite-sized model at batch 1 touches 6 of a layer's 64 experts: 104 MB instead of 1.1 GB.
- layer: every base row of the next layer, fetched while this layer's kernel runs, on the load stream with a
  bounded number of programs (the rest of the SMs stay the kernel's); the forward's first layer fetches itself.
  Needs a window of two blocks or more (with one, each layer fetches itself whole, before its kernel).

`auto` (the default) fetches routed while a step's tokens x top-k are at most the layer's expert count (past
that, nearly every expert is touched anyway, and fetching ahead hides the copies under the kernel), else layer.

A block that only one paged layer computes from keeps that layer's rows from step to step: the layer is parked
there (filled once, its fetches off, as a resident layer's), and fetches again once another layer shares its block.
The adaptive planner with memory to spare keeps every layer resident but the window's (H100, DeepSeek-V2-Lite,
before parking: those 2 of 26 layers fetched a whole layer each step, 16.2 ms TPOT at batch 32 against resident's
11.3, 0.72x).

Nothing here waits on the host or maps memory while a step runs: every fetch is two or three launches that read
their settings on the device (esftctl.runtime.paging.tiers), and each layer's fork to the load stream is joined
after its own kernel, inside the same experts call, so the whole step can be captured as CUDA graphs, in one
piece or split at attention (vLLM's piecewise graphs: a fork may not cross a piece). Between steps the host may
change what is resident (`set_resident`: the window swaps the memory under a layer's addresses, its fetches turn
off through its active flag) or the tiers' split (`set_store_rows`): captured graphs stay valid, since they hold
addresses and launches, not decisions.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.paging.tiers import FixedTier, LayerTiers, StoreTier
from esftctl.runtime.paging.timing import LayerTimes
from esftctl.runtime.paging.window import Window

FETCH_MODES = ("auto", "routed", "layer")
# Programs of a fetch, measured on an H100 (benchmarks/lab/row_fetch_bench.py): 16 read a whole layer at 47 GB/s
# (the copy engine: 54) and let a matrix product beside them run as fast as alone; 64 reach 49 GB/s; 528 (four per
# SM) no faster, but they stall the product beside them to a third of its speed.
OVERLAP_PROGRAMS = 16  # beside another layer's kernel
ALONE_PROGRAMS = 64  # before this layer's kernel, nothing to share the SMs with


class PagedExperts:
    def __init__(self, layers: Mapping[int, object], *, window: int, make_space: Callable[[int], AddressSpace],
                 top_k: int, order: Sequence[int] | None = None, store: StoreTier | FixedTier | None = None,
                 fetch: str = "auto", resident: Sequence[int] = (), make_room: Callable[[], None] = lambda: None):
        """`layers`: index -> VirtualMoELayer with host copies (keep_host_copy); `order`: the forward's order of
        the layers (default: by index); `make_space` reserves ranges for the window's blocks; `top_k`: experts
        per token (for `auto`); `resident` layers keep memory of their own; `store` the compressed GPU tier (a
        FixedTier encodes each layer's base rows here, just before the layer pages out); `make_room` hands what
        a layer paged out gave back to the driver (the page pool's trim), for the tier's memory to take.

        The tier takes its memory as the layers give theirs back, so that a card that held the resident model
        holds the paged one with its tier (built all at once, the Qwen3-30B-A3B shape's 28 GiB of fixed-rate
        codes did not fit beside its 38 GiB of resident experts on an 80 GB H100): fixed-rate codes are made one
        layer at a time, each before its layer pages out; a Huffman store goes to the device once every layer
        has."""
        if window < 1:
            raise EsftError("the paging window needs at least one block")
        if fetch not in FETCH_MODES:
            raise EsftError(f"fetch {fetch!r}: choose one of {', '.join(FETCH_MODES)}")
        self.layers, self.order = dict(layers), list(order or sorted(layers))
        self.position = {layer: p for p, layer in enumerate(self.order)}
        first = self.layers[self.order[0]]
        self.device, self.num_experts, self.top_k, self.fetch_mode = first.device, first.num_experts, top_k, fetch
        self.cuda = self.device.type == "cuda"
        self.window = Window(self.layers, self.order, window, make_space)
        decode_stream = torch.cuda.Stream(self.device) if self.cuda and store is not None else None
        self.store = store
        self.resident: set[int] = set(resident)  # they keep their own pages from the start: never paged out first
        self.tiers: dict[int, LayerTiers] = {}
        encodes = isinstance(store, FixedTier)
        for i in self.order:
            if encodes:
                self.tiers[i] = LayerTiers(i, self.layers[i], store=store, decode_stream=decode_stream)
            if i not in self.resident:
                if encodes and self.cuda:
                    torch.cuda.synchronize(self.device)  # the encoder's kernels read the rows unmapped now
                self.window.page_out(i)
                make_room()
        for i in self.order:
            if i not in self.tiers:
                self.tiers[i] = LayerTiers(i, self.layers[i], store=store, decode_stream=decode_stream)
            if i in self.resident:
                self.tiers[i].set_active(False)
        self._park()
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._counted: tuple[torch.Tensor, object] | None = None  # counters copied to the host, and their event
        self._last_counted = [0, 0]
        self._joins: set[int] = set()  # layers whose experts call forked to the load stream
        self.times = LayerTimes(self.cuda)
        self.between_steps: Callable[[], None] | None = None  # the planner's hook (esftctl.runtime.paging.planner)

    # ---- what the experts layer calls ------------------------------------------------------------
    def routed(self, num_tokens: int) -> bool:
        if self.fetch_mode == "auto":
            return num_tokens * self.top_k <= self.num_experts
        return self.fetch_mode == "routed"

    def before_kernel(self, layer: int, ids: torch.Tensor, num_tokens: int) -> None:
        """Bring in what layer's kernel will read: its routed rows now, or (fetching ahead) the next layer's.
        Only layers that fetch are timed: the planner's rho is a paged layer's compute over its load."""
        p, routed = self.position[layer], self.routed(num_tokens)
        timed = (not self.cuda or not torch.cuda.is_current_stream_capturing()) and self.fetches(layer)
        if routed or self.window.size == 1:
            self._timed_fetch(layer, ids if routed else None, timed)
        else:
            if p == 0:
                self._timed_fetch(layer, None, timed)
            if p + 1 < len(self.order):
                self._fetch_ahead(layer, self.order[p + 1])
        if timed:
            self.times.start("compute", layer)

    def after_kernel(self, layer: int) -> None:
        if not self.cuda or not torch.cuda.is_current_stream_capturing():
            self.times.stop("compute", layer)
        if layer in self._joins:
            self._joins.discard(layer)
            torch.cuda.current_stream(self.device).wait_stream(self.load_stream)

    def _timed_fetch(self, layer: int, ids: torch.Tensor | None, timed: bool) -> None:
        if timed:
            self.times.start("load", layer)
        self.tiers[layer].fetch(ids, programs=ALONE_PROGRAMS)
        if timed:
            self.times.stop("load", layer)

    def _fetch_ahead(self, layer: int, following: int) -> None:
        if not self.cuda:
            self.tiers[following].fetch(None, programs=1)
            return
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the block's last reader
        with torch.cuda.stream(self.load_stream):
            self.tiers[following].fetch(None, programs=OVERLAP_PROGRAMS)
        self._joins.add(layer)

    def fetches(self, layer: int) -> bool:
        """Whether the layer's rows come in every step (paged, sharing its block): its tiers' active flag."""
        return self.tiers[layer].active

    @property
    def parked(self) -> set[int]:
        """Paged layers alone in their block: filled once, fetching nothing (_park)."""
        return {i for i in self.window.paged if not self.tiers[i].active}

    # ---- between steps ---------------------------------------------------------------------------
    def step(self) -> None:
        """Called by the engine between steps (outside any graph): where the planner may act."""
        if self.between_steps is not None:
            self.between_steps()

    def set_resident(self, layers: Sequence[int]) -> None:
        """Which layers keep memory of their own (the planner's decision); waits for queued work."""
        layers = set(layers)
        if layers == self.resident:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for i in self.resident - layers:
            self.tiers[i].set_active(True)
            self.window.page_out(i)
        for i in layers - self.resident:
            self.window.page_in(i)
            self.tiers[i].fill()  # from the host copies, and base rows without copies from the compressed tier
            self.tiers[i].set_active(False)
        self.resident = layers
        self._park()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _park(self) -> None:
        """Park each paged layer that is alone in its block (fill the block with its rows once, turn its fetches
        off), and let parked layers that now share their block fetch again. Between steps, no kernel queued."""
        for block in range(len(self.window.blocks)):
            paged = [i for i in self.window.members(block) if i in self.window.paged]
            alone = len(paged) == 1
            for i in paged:
                if self.tiers[i].active == alone:  # alone but fetching, or parked but sharing now
                    if alone:
                        self.tiers[i].fill()
                    self.tiers[i].set_active(not alone)

    def set_store_rows(self, rows: int) -> None:
        """How many base rows of each paged layer the store tier delivers from now on."""
        if rows and self.store is None:
            raise EsftError("these layers have no store tier")
        for tiers in self.tiers.values():
            tiers.set_store_rows(rows)

    @property
    def codec(self) -> str | None:
        """The compressed tier's code: "huffman", "fixed", "fixed-host" (its codes in host memory) or None."""
        if self.store is None:
            return None
        if isinstance(self.store, FixedTier):
            return "fixed-host" if self.store.on_host else "fixed"
        return "huffman"

    @property
    def store_rows(self) -> int:
        return next(iter(self.tiers.values())).store_rows

    # ---- measurement -----------------------------------------------------------------------------
    def timed_fetch(self, layer: int, store_rows: int) -> float:
        """Seconds to fetch a whole paged layer with `store_rows` base rows from the store and the rest from host
        (a calibration between steps: the layer's rows hold nothing anyone reads meanwhile)."""
        keep = self.tiers[layer].store_rows
        self.tiers[layer].set_store_rows(store_rows)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.tiers[layer].fetch(None, programs=ALONE_PROGRAMS)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - start
        self.tiers[layer].set_store_rows(keep)
        return took

    def counters(self, *, wait: bool = True) -> dict[str, int]:
        """Rows fetched and fetches of active layers since the start, over all layers. On CUDA `wait` syncs with
        the device; without it (the status, once a second while serving) the counts are copied to the host behind
        the queued work and the last copy that has landed is given, so serving never waits for them."""
        totals = torch.stack([t.stats for t in self.tiers.values()]).sum(0)
        if not self.cuda or wait:
            fetched, fetches = totals.tolist()
            return {"fetched_rows": fetched, "fetches": fetches}
        if self._counted is not None and self._counted[1].query():
            self._last_counted = self._counted[0].tolist()
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(totals, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._counted = (host, event)
        return {"fetched_rows": self._last_counted[0], "fetches": self._last_counted[1]}

    def device_bytes(self) -> dict[str, int]:
        """Device memory per tier: the window's blocks, the resident layers' own rows, the paged layers' adapter
        rows (they stay on the device), the store."""
        resident = sum(self.layers[i].physical_bytes() for i in self.resident)
        adapters = sum(self.layers[i].adapter_device_bytes() for i in self.window.paged)
        return {"window": self.window.nbytes(), "resident": resident, "adapters": adapters,
                "store": self.store.nbytes if self.store is not None and self.store_rows else 0}

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.window.close()
