"""Expert paging: a stack of MoE layers whose experts live elsewhere and are streamed in just before use.

Every paged layer has a stable virtual range holding its w13 [E, 2I, H] and w2 [E, H, I] (so kernels, and
the Huffman decoder's plans, see fixed addresses), but physical memory comes from a pool of `window`
blocks, one block = one layer's experts (one driver handle, so a remap is one map call, not hundreds).
A sliding window: while layer i computes, layer i+1 is loaded into the block that layer i-1 held.

Ordering (CUDA): loads run on their own stream. `ensure(i)` makes the compute stream wait for layer i's
load; `done(i)` records, on the compute stream, that layer i's kernels are queued; a block is taken from a
layer only after the host has waited for that layer's done event, so no queued kernel reads a block that
is being unmapped or overwritten, and no layer starts before its load finished. The host waits on the
layer before the current one, whose work precedes the current layer's in the stream, so the GPU never
idles for it. Remapping is a host-side driver call: CUDA-graph capture is refused (`ensure` raises).

Tiers: experts come from pinned host memory (asynchronous copies) or, for the first `store_experts` experts
of a layer, from a Huffman-coded store already in GPU memory (esftctl.kernels.huffman_decode, decoding
straight into the mapped block; its plan is built once per layer, since the addresses never change).
`resident` layers are mapped once and never paged.

Where the experts live is the `blocks` object's business: `OwnBlocks` (a range and one handle per layer:
the benchmark's stack) or `HeldRowBlocks` (an ESFT layer's own virtual tensors, base and adapter rows
together: serving). `times` measures loads and kernels for the residency planner (esftctl.runtime.residency).

On the CPU the same code runs with host address spaces and synchronous copies: the window and the
ordering logic are exercised by CI; the speed question exists only on a GPU.
"""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.runtime.address_space import HostAddressSpace, round_up

if TYPE_CHECKING:
    from esftctl.runtime.moe_layer import VirtualMoELayer


@dataclass
class LayerSource:
    """Where one layer's experts come from: pinned host tensors, and optionally a decode plan that writes
    experts [0, store_experts) into given destinations (built with the layer's stable w13/w2)."""

    w13: torch.Tensor  # [E, 2I, H], pinned host memory on CUDA
    w2: torch.Tensor  # [E, H, I]
    store_experts: int = 0
    make_decoder: Callable[[torch.Tensor, torch.Tensor], Callable[[], None]] | None = None


@dataclass
class PagingStats:
    loads: int = 0
    host_bytes: int = 0
    decoded_experts: int = 0
    waits: int = 0  # times the host waited for a layer's kernels before taking its block
    max_blocks_in_use: int = 0


class LayerTimes:
    """Milliseconds of paged layers' loads and of their kernels, for the planner's rho = compute / load.

    On CUDA each span is a pair of timing events, read once the second has completed (never waited for);
    on the CPU, where everything runs synchronously, the host clock. Off until a planner turns it on (spans
    pile up until someone takes them)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.enabled = False
        self._open: dict[tuple[str, int], object] = {}
        self._pending: list[tuple[str, object, object]] = []
        self._done: dict[str, list[float]] = {"load": [], "compute": []}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, kind: str, layer: int) -> None:
        if self.enabled:
            self._open[kind, layer] = self._now()

    def stop(self, kind: str, layer: int) -> None:
        start = self._open.pop((kind, layer), None)
        if start is None:
            return
        end = self._now()
        if self.cuda:
            self._pending.append((kind, start, end))
        else:
            self._done[kind].append(1e3 * (end - start))

    def take(self) -> tuple[list[float], list[float]]:
        """The spans finished since the last call: (compute ms, load ms)."""
        waiting = []
        for kind, start, end in self._pending:
            if end.query():
                self._done[kind].append(start.elapsed_time(end))
            else:
                waiting.append((kind, start, end))
        self._pending = waiting
        done, self._done = self._done, {"load": [], "compute": []}
        return done["compute"], done["load"]


class OwnBlocks:
    """Each layer its own reserved range (w13, then w2 at an aligned offset), backed by one physical block
    (one driver handle on CUDA) while it is loaded."""

    def __init__(self, sources: Mapping[int, LayerSource], device: torch.device):
        first = next(iter(sources.values()))
        self.w13_shape, self.w2_shape, dtype = tuple(first.w13.shape), tuple(first.w2.shape), first.w13.dtype
        self._w2_offset = round_up(first.w13.numel() * dtype.itemsize, 256)
        block = self._w2_offset + first.w2.numel() * dtype.itemsize
        if device.type == "cuda":
            from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool

            self.pool = PhysicalPagePool(device, page_size=block)
            self.spaces = {l: CudaAddressSpace(block, self.pool) for l in sources}
        else:
            self.pool = None
            self.spaces = {l: HostAddressSpace(block, page_size=round_up(block, mmap.PAGESIZE)) for l in sources}
        self.views = {l: self._views(space, dtype) for l, space in self.spaces.items()}

    def _views(self, space, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raw = space.view(torch.uint8, (space.num_pages * space.page_size,))
        n13, n2 = math.prod(self.w13_shape) * dtype.itemsize, math.prod(self.w2_shape) * dtype.itemsize
        return (raw[:n13].view(dtype).view(self.w13_shape),
                raw[self._w2_offset: self._w2_offset + n2].view(dtype).view(self.w2_shape))

    def map(self, layer: int) -> None:
        self.spaces[layer].map_pages([0])

    def unmap(self, layer: int) -> None:
        self.spaces[layer].unmap_pages([0])

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[layer]

    def copy_in(self, layer: int, source: LayerSource, skip: int) -> int:
        """Experts from `skip` on, from the source's host tensors into the block (queued); bytes copied."""
        w13, w2 = self.views[layer]
        w13[skip:].copy_(source.w13[skip:], non_blocking=True)
        w2[skip:].copy_(source.w2[skip:], non_blocking=True)
        return (source.w13[skip:].numel() + source.w2[skip:].numel()) * source.w13.element_size()

    def close(self) -> None:
        for space in self.spaces.values():
            space.close()
        if self.pool is not None:
            self.pool.trim()


class HeldRowBlocks:
    """The held rows of ESFT virtual layers (esftctl.runtime.moe_layer): the base experts and every attached
    adapter's, paged together in their layer's own tensors. The layers keep host copies of their rows (the
    sources' tensors are the base rows'); an adapter loaded while its layer is out is written there and
    comes in with the layer."""

    def __init__(self, layers: Mapping[int, "VirtualMoELayer"]):
        self.layers = dict(layers)

    def map(self, layer: int) -> None:
        self.layers[layer].page_in()

    def unmap(self, layer: int) -> None:
        self.layers[layer].page_out()

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        l = self.layers[layer]
        return l.w13.tensor, l.w2.tensor

    def copy_in(self, layer: int, source: LayerSource, skip: int) -> int:
        return self.layers[layer].copy_in(skip)

    def close(self) -> None:
        pass


class PagedExperts:
    def __init__(self, sources: Sequence[LayerSource] | Mapping[int, LayerSource], window: int = 2,
                 resident: Sequence[int] = (), device: torch.device | str = "cuda", blocks=None):
        """`sources` by layer (a sequence: layers 0..n-1); `blocks` where the layers' experts live (default:
        OwnBlocks); `resident` layers stay mapped."""
        if window < 1:
            raise EsftError("the paging window needs at least one block")
        self.device = torch.device(device)
        self.sources = dict(sources) if isinstance(sources, Mapping) else dict(enumerate(sources))
        self.window = window
        self.resident = set(resident)
        self.blocks = blocks if blocks is not None else OwnBlocks(self.sources, self.device)
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


class ResidencyPlanner:
    """How many layers to keep resident, from rho = compute time / load time of a paged layer.

    rho > 1: compute hides the load, so memory can be given back (one layer fewer resident); rho < 0.9:
    loads show, so one more layer stays resident, but never beyond `max_resident` (what the memory left
    after the KV cache's share can hold). Between 0.9 and 1 nothing changes, so it does not oscillate.

    `store_experts` picks the tiers: the store's decoder shares the GPU's SMs with the layer it overlaps
    (measured: ~5% of a large prefill's time on an H100), so it is used only while host copies alone would
    show (rho of the host tier below 1), and then with the bandwidth split.
    """

    SHRINK_ABOVE, GROW_BELOW = 1.0, 0.9

    def __init__(self, num_layers: int, max_resident: int, resident: int = 0):
        self.num_layers, self.max_resident = num_layers, min(max_resident, num_layers)
        self.resident = min(resident, self.max_resident)
        self.decisions: list[dict] = []

    def update(self, compute_ms: float, load_ms: float) -> int:
        rho = compute_ms / load_ms if load_ms > 0 else float("inf")
        before = self.resident
        if rho > self.SHRINK_ABOVE and self.resident > 0:
            self.resident -= 1
        elif rho < self.GROW_BELOW and self.resident < self.max_resident:
            self.resident += 1
        self.decisions.append({"compute_ms": compute_ms, "load_ms": load_ms, "rho": rho, "resident_before": before,
                               "resident": self.resident})
        return self.resident

    @staticmethod
    def store_experts(compute_ms: float, host_load_ms: float, split: int) -> int:
        return 0 if compute_ms > host_load_ms else split


def store_decoder(store, names: Sequence[dict[str, str]]):
    """A LayerSource.make_decoder over an ExpertStore: expert e of the layer is names[e]["gate"|"up"|"down"].

    On CUDA one DecodePlan (one launch) writes every expert; on the CPU the vectorized decoder does."""
    def make(w13: torch.Tensor, w2: torch.Tensor) -> Callable[[], None]:
        inter = w2.shape[-1]
        targets = []
        for e in range(w13.shape[0]):
            targets += [(names[e]["gate"], w13[e, :inter]), (names[e]["up"], w13[e, inter:]),
                        (names[e]["down"], w2[e])]
        if w13.is_cuda:
            return store.plan(targets).run

        def decode_on_cpu() -> None:
            for name, out in targets:
                store.decode_tensor(name, out)

        return decode_on_cpu

    return make


def tier_split(num_experts: int, host_bytes_per_s: float, store_bytes_per_s: float) -> int:
    """How many of a layer's experts to take from the store so that both tiers finish together: each tier's
    share in proportion to its measured bandwidth (bytes of experts delivered per second)."""
    share = store_bytes_per_s / (store_bytes_per_s + host_bytes_per_s)
    return min(num_experts, max(0, round(num_experts * share)))
