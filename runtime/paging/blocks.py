"""Where a paged layer's experts live while it is loaded: a block backing maps and unmaps a layer's memory,
gives its (w13, w2) at stable addresses, and copies a source's host experts in.

- `HeldRowBlocks`: the held rows of ESFT virtual layers, base and adapter rows together (serving).
- `OwnBlocks`: a reserved range and one physical block (one driver handle on CUDA, so a remap is one map call,
  not hundreds) per layer: the paging benchmark's stack of bare layers, and the pager's tests.
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING, Mapping

import torch

from esftctl.runtime.address_space import HostAddressSpace, round_up
from esftctl.runtime.paging.tiers import LayerSource

if TYPE_CHECKING:
    from esftctl.runtime.moe_layer import VirtualMoELayer


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

