"""The window: `size` blocks of device memory that the paged layers share, each layer keeping its own addresses.

Paged layer number p (in forward order) computes its base rows from block p mod size: the pages of its address
range below its adapter area map the block's memory (esftctl.runtime.address_space's aliases), so the fused MoE
kernel, the decoder's plans and CUDA graphs captured once keep the layer's addresses while the memory under them is
shared. A block maps the base rows' pages when a first layer pages out into it, and only those: a layer's adapter
rows, and the page its last base row may share with them, keep memory of its own (esftctl.runtime.moe_layer), so
they are never fetched. Keeping a layer resident swaps the memory under its base rows, not their address: its own
pages are mapped again and filled by the pager, from the host copies (and the compressed tier, where the layers
keep no copies of their base rows).

Two layers of one block never run at once: layer p's rows are filled just before its kernel, on the same stream
as layer p - size's kernel (or, fetched ahead, on a stream that waits for it: esftctl.runtime.paging.pager).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.virtual_tensor import VirtualExpertTensor


class Window:
    def __init__(self, layers: Mapping[int, object], order: Sequence[int], size: int,
                 make_space: Callable[[int], AddressSpace]):
        """`layers`: index -> a layer with `w13` and `w2` virtual tensors, `base_rows`, `page_out()`, `page_in()`
        (esftctl.runtime.moe_layer.VirtualMoELayer); `make_space(nbytes)` reserves a range like theirs."""
        self.layers, self.order, self.size = dict(layers), list(order), size
        self.block_of = {layer: p % size for p, layer in enumerate(self.order)}
        first = self.layers[self.order[0]]
        self.base_rows = first.base_rows
        self.blocks = [tuple(VirtualExpertTensor(make_space(t.space.nbytes), t.num_rows, t.row_shape, t.dtype,
                                                 split_row=self.base_rows) for t in (first.w13, first.w2))
                       for _ in range(min(size, len(self.order)))]
        self.paged: set[int] = set()

    def members(self, block: int) -> list[int]:
        return [l for l in self.order if self.block_of[l] == block]

    def page_out(self, layer: int) -> None:
        """The layer gives its own pages back and computes from its block from now on (queued kernels that read
        its rows must have finished)."""
        self.layers[layer].page_out()
        self.paged.add(layer)
        w13, w2 = self.blocks[self.block_of[layer]]
        for t in (w13, w2):
            if not t.stats().mapped_pages:  # the block's first paged layer: map its memory (kept from then on)
                t.hold_pages(t.pages_below(self.base_rows))
        self.layers[layer].w13.space.alias(w13.space)
        self.layers[layer].w2.space.alias(w2.space)

    def page_in(self, layer: int) -> None:
        """The layer maps pages of its own again; filling them is the caller's (the pager's: LayerTiers.fill, from
        the host copies and the compressed tier)."""
        l = self.layers[layer]
        l.w13.space.unalias()
        l.w2.space.unalias()
        self.paged.discard(layer)
        l.page_in()

    def nbytes(self) -> int:
        """Device memory the blocks hold."""
        return sum(t.stats().mapped_bytes for block in self.blocks for t in block)

    def close(self) -> None:
        for layer in list(self.paged):
            for t in (self.layers[layer].w13, self.layers[layer].w2):
                t.space.unalias()
        self.paged.clear()
        for block in self.blocks:
            for t in block:
                t.close()
