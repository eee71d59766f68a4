"""The window: `size` blocks of device memory that the paged layers share, each layer keeping its own addresses.

Paged layer number p (in forward order) computes from block p mod size: its address range maps the block's
memory (esftctl.runtime.address_space's aliases), so the fused MoE kernel, the decoder's plans and CUDA graphs
captured once keep the layer's addresses while the memory under them is shared. A block maps the union of the
rows its layers hold (the base rows, and every adapter row any of them holds); it grows when an adapter brings
a new row and never shrinks while serving (rows freed are the first reused). Keeping a layer resident swaps its
memory, not its address: its own pages are mapped again and filled by the pager, from the host copies (and the
compressed tier, where the layers keep no copies of their base rows).

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
        """`layers`: index -> a layer with `w13` and `w2` virtual tensors, `held_rows()`, `page_out()`, `page_in()`
        (esftctl.runtime.moe_layer.VirtualMoELayer); `make_space(nbytes)` reserves a range like theirs."""
        self.layers, self.order, self.size = dict(layers), list(order), size
        self.block_of = {layer: p % size for p, layer in enumerate(self.order)}
        first = self.layers[self.order[0]]
        self.blocks = [tuple(VirtualExpertTensor(make_space(t.space.nbytes), t.num_rows, t.row_shape, t.dtype)
                             for t in (first.w13, first.w2)) for _ in range(min(size, len(self.order)))]
        self.paged: set[int] = set()

    def members(self, block: int) -> list[int]:
        return [l for l in self.order if self.block_of[l] == block]

    def page_out(self, layer: int) -> None:
        """The layer gives its own pages back and computes from its block from now on (queued kernels that read
        its rows must have finished)."""
        self.layers[layer].page_out()
        self.paged.add(layer)
        self.cover(layer)

    def page_in(self, layer: int) -> None:
        """The layer maps pages of its own again; filling them is the caller's (the pager's: LayerTiers.fill, from
        the host copies and the compressed tier)."""
        l = self.layers[layer]
        l.w13.space.unalias()
        l.w2.space.unalias()
        self.paged.discard(layer)
        l.page_in()

    def cover(self, layer: int) -> None:
        """Map the rows `layer` holds in its block, and alias what the block gained into its paged members."""
        block = self.block_of[layer]
        w13, w2 = self.blocks[block]
        new = [r for r in self.layers[layer].held_rows() if not w13.is_mapped(r)]
        if new:
            w13.map_rows(new)
            w2.map_rows(new)
        for member in self.members(block):
            if member in self.paged:
                self.layers[member].w13.space.alias(w13.space)
                self.layers[member].w2.space.alias(w2.space)

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
