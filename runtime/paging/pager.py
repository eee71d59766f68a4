"""The paging window (esftctl.runtime.paging says the whole idea): PagedExperts loads a layer's experts into one
of `window` blocks just before its kernels run, and prefetches the next layer while the current one computes.

Ordering (CUDA): loads run on their own stream. `ensure(i)` makes the compute stream wait for layer i's
load; `done(i)` records, on the compute stream, that layer i's kernels are queued; a block is taken from a
layer only after the host has waited for that layer's done event, so no queued kernel reads a block that
is being unmapped or overwritten, and no layer starts before its load finished. The host waits on the
layer before the current one, whose work precedes the current layer's in the stream, so the GPU never
idles for it. Remapping is a host-side driver call: CUDA-graph capture is refused (`ensure` raises).

Where the experts live is the `blocks` backing's business (esftctl.runtime.paging.blocks), where they come
from the sources' (esftctl.runtime.paging.tiers); `times` measures loads and kernels for the residency planner
(esftctl.runtime.paging.planner). `resident` layers are mapped once and never paged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.runtime.paging.tiers import LayerSource
from esftctl.runtime.paging.timing import LayerTimes


class Blocks(Protocol):
    """Where the layers' experts live while loaded (esftctl.runtime.paging.blocks)."""

    def map(self, layer: int) -> None: ...
    def unmap(self, layer: int) -> None: ...
    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def copy_in(self, layer: int, source: LayerSource, skip: int) -> int: ...
    def close(self) -> None: ...


@dataclass
class PagingStats:
    loads: int = 0
    host_bytes: int = 0
    decoded_experts: int = 0
    waits: int = 0  # times the host waited for a layer's kernels before taking its block
    max_blocks_in_use: int = 0



class PagedExperts:
    def __init__(self, sources: Sequence[LayerSource] | Mapping[int, LayerSource], *, blocks: Blocks,
                 window: int = 2, resident: Sequence[int] = (), device: torch.device | str = "cuda"):
        """`sources` by layer (a sequence: layers 0..n-1); `blocks` where the layers' experts live (a backing of
        esftctl.runtime.paging.blocks); `resident` layers stay mapped."""
        if window < 1:
            raise EsftError("the paging window needs at least one block")
        self.device = torch.device(device)
        self.sources = dict(sources) if isinstance(sources, Mapping) else dict(enumerate(sources))
        self.window = window
        self.resident = set(resident)
        self.blocks = blocks
        if self.device.type == "cuda":
            self.load_stream = torch.cuda.Stream(self.device)
            self.decode_stream = torch.cuda.Stream(self.device)  # the store tier, beside the host copies
        else:
            self.load_stream = None
        self._decoders: dict[tuple[int, int], Callable[[], None]] = {}  # (layer, store experts) -> decode
        self.loaded: dict[int, object] = {}  # paged layer -> its load event (None on the CPU)
        self.last_use: dict[int, int] = {}
        self._done: dict[int, object] = {}
        self._clock = 0
        self.stats = PagingStats()
        self.times = LayerTimes(self.device.type == "cuda")
        self.before_pass: tuple[int, Callable[[], None]] | None = None  # (first layer, call) at each pass start
        for layer in sorted(self.resident):
            self.blocks.map(layer)
            self._fill(layer)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.load_stream)

    # ---- what the model calls --------------------------------------------------------------------
    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's (w13, w2) at their stable addresses; valid between `ensure(layer)` and `done(layer)`."""
        return self.blocks.weights(layer)

    def ensure(self, layer: int) -> None:
        """Before layer's kernels: load it if it is not, and order the compute stream after the load."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise EsftError("expert paging remaps memory from the host between layers and cannot run inside "
                            "CUDA-graph capture; serve with --enforce-eager or without paging")
        if self.before_pass is not None and layer == self.before_pass[0]:
            self.before_pass[1]()  # between passes: where the planner may change what stays resident
        self._clock += 1
        self.last_use[layer] = self._clock
        if layer in self.resident:
            return
        if layer not in self.loaded:
            self._load(layer, keep=layer)
        event = self.loaded[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.times.start("compute", layer)

    def done(self, layer: int) -> None:
        """After layer's kernels are queued on the compute stream."""
        if layer in self.resident:
            return
        self.times.stop("compute", layer)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._done[layer] = event

    def prefetch(self, layer: int, current: int) -> None:
        """Start loading `layer` (the next to run) while `current` computes."""
        if layer in self.resident or layer in self.loaded or self.window == 1:
            return  # a window of one block has no room to load ahead
        self._load(layer, keep=current)

    def set_resident(self, layers: Sequence[int]) -> None:
        """Change which layers stay mapped for good (the planner's decision); waits for queued work."""
        layers = set(layers)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for layer in self.resident - layers:
            self.blocks.unmap(layer)
        for layer in layers - self.resident:
            if layer in self.loaded:  # already in a block: it keeps it
                self.loaded.pop(layer)
                self._done.pop(layer, None)
            else:
                self.blocks.map(layer)
                self._fill(layer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.resident = layers

    def set_store_experts(self, count: int) -> None:
        """How many experts of each paged layer the store tier delivers from now on (the planner's choice)."""
        for source in self.sources.values():
            if count and source.make_decoder is None:
                raise EsftError("these layers have no store tier")
            source.store_experts = min(count, source.w13.shape[0])

    def timed_load(self, layer: int, store_experts: int) -> float:
        """Seconds to load a paged-out layer with `store_experts` from the store, the rest from the host; the
        layer is paged out again after (a calibration outside serving; its load counts nowhere)."""
        source, keep = self.sources[layer], self.sources[layer].store_experts
        source.store_experts = store_experts
        self.blocks.map(layer)
        start = time.perf_counter()
        stats, self.stats = self.stats, PagingStats()
        self._fill(layer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - start
        self.stats, source.store_experts = stats, keep
        self.blocks.unmap(layer)
        return took

    # ---- loading ---------------------------------------------------------------------------------
    def _load(self, layer: int, keep: int) -> None:
        if len(self.loaded) >= self.window:
            victims = [l for l in self.loaded if l != keep]
            if not victims:
                raise EsftError(f"paging window of {self.window} block(s) cannot hold layer {layer} beside {keep}")
            self._release(min(victims, key=lambda l: self.last_use.get(l, 0)))
        self.blocks.map(layer)
        if self.device.type == "cuda":
            with torch.cuda.stream(self.load_stream):
                self.times.start("load", layer)
                self._fill(layer)
                self.times.stop("load", layer)
                event = torch.cuda.Event()
                event.record(self.load_stream)
        else:
            self.times.start("load", layer)
            self._fill(layer)
            self.times.stop("load", layer)
            event = None
        self.loaded[layer] = event
        self.stats.max_blocks_in_use = max(self.stats.max_blocks_in_use, len(self.loaded))
        self.stats.loads += 1

    def _release(self, layer: int) -> None:
        done = self._done.pop(layer, None)
        if done is not None:  # the layer's queued kernels must finish before its block is unmapped
            self.stats.waits += 1
            done.synchronize()
        load = self.loaded.pop(layer)
        if load is not None:  # and so must its own load, if it never ran
            load.synchronize()
        self.blocks.unmap(layer)

    def _fill(self, layer: int) -> None:
        """Both tiers into the layer's block: on CUDA the decoder runs on its own stream, concurrently with
        the host copies on the load stream, which then waits for it (the load event covers both)."""
        source, (w13, w2) = self.sources[layer], self.blocks.weights(layer)
        k = source.store_experts
        if k:
            if (layer, k) not in self._decoders:
                self._decoders[layer, k] = source.make_decoder(w13[:k], w2[:k])
            if self.device.type == "cuda":
                load_stream = torch.cuda.current_stream(self.device)
                self.decode_stream.wait_stream(load_stream)
                with torch.cuda.stream(self.decode_stream):
                    self._decoders[layer, k]()
            else:
                self._decoders[layer, k]()
            self.stats.decoded_experts += k
        self.stats.host_bytes += self.blocks.copy_in(layer, source, skip=k)  # the rest from host memory
        if k and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.blocks.close()



def run_stack(pager: PagedExperts, order: Sequence[int], layer_fn: Callable[[int, torch.Tensor, torch.Tensor], None],
              then: int | None = None) -> None:
    """Run layers in `order` with a sliding window: each layer computes while the next one loads. `then`:
    the layer the next pass starts with (a model's forwards follow each other), loaded during the last."""
    for n, layer in enumerate(order):
        pager.ensure(layer)
        layer_fn(layer, *pager.weights(layer))
        pager.done(layer)
        following = order[n + 1] if n + 1 < len(order) else then
        if following is not None:
            pager.prefetch(following, current=layer)

