"""One stacked expert weight of one MoE layer ([E_total, ...]) in a reserved range, memory only where experts are.

The fused MoE kernel sees `tensor`, an ordinary contiguous tensor of shape [num_rows, *row_shape]. Row r
(one expert) occupies bytes [r * row_bytes, (r + 1) * row_bytes); mapping rows maps the pages under them,
shared pages counted so that neighbours keep them alive.

A paged layer (esftctl.runtime.paging) computes its base rows from a block of memory it shares with other layers and
keeps its adapter rows in pages of its own. The two sides meet at `split_row` (the first adapter row): pages below
that row's first page are mapped in calls of their own, so that no physical handle spans both sides (the CUDA driver
aliases whole handles, esftctl.runtime.address_space), and the page the boundary straddles, where row split_row - 1
ends and split_row starts, can be held mapped while the rows below are unmapped (`hold_pages`).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.pages import PageRefCounts, PageStats


class VirtualExpertTensor:
    def __init__(self, space: AddressSpace, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 split_row: int = 0):
        self.space = space
        self.num_rows = num_rows
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.row_bytes = dtype.itemsize * math.prod(self.row_shape)
        if num_rows * self.row_bytes > space.num_pages * space.page_size:
            raise ValueError("address space smaller than the tensor")
        self.pages = PageRefCounts(space.page_size, space.num_pages)
        self.split_page = split_row * self.row_bytes // space.page_size  # the first page of row split_row
        self._mapped_rows: set[int] = set()
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The whole [num_rows, *row_shape] tensor; only mapped rows may be touched."""
        if self._tensor is None:
            self._tensor = self.space.view(self.dtype, (self.num_rows, *self.row_shape))
        return self._tensor

    def _range(self, row: int) -> tuple[int, int]:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} outside 0..{self.num_rows - 1}")
        return row * self.row_bytes, (row + 1) * self.row_bytes

    def _distinct(self, rows: Iterable[int]) -> list[int]:
        rows = list(rows)
        if len(set(rows)) < len(rows):
            raise ValueError(f"rows {sorted(rows)} name a row twice")
        return rows

    def map_rows(self, rows: Iterable[int]) -> None:
        rows = self._distinct(rows)
        for row in rows:
            if row in self._mapped_rows:
                raise ValueError(f"row {row} is already mapped")
        pages = [page for row in rows for page in self.pages.acquire(*self._range(row))]
        self._map(pages)
        self._mapped_rows.update(rows)

    def _map(self, pages: list[int]) -> None:
        """All at once (runs of pages cost one call), below and from the split page apart."""
        for side in ([p for p in pages if p < self.split_page], [p for p in pages if p >= self.split_page]):
            if side:
                self.space.map_pages(side)

    def unmap_rows(self, rows: Iterable[int]) -> None:
        rows = self._distinct(rows)
        for row in rows:
            if row not in self._mapped_rows:
                raise ValueError(f"row {row} is not mapped")
        pages = [page for row in rows for page in self.pages.release(*self._range(row))]
        self.space.unmap_pages(pages)
        self._mapped_rows.difference_update(rows)

    def pages_below(self, row: int) -> range:
        """The pages wholly below row `row`'s first byte (row `row` does not touch them)."""
        return range(row * self.row_bytes // self.space.page_size)

    def boundary_page(self, row: int) -> list[int]:
        """The page that rows `row` - 1 and `row` share, if their boundary falls inside one; else none."""
        start = row * self.row_bytes
        return [start // self.space.page_size] if 0 < row < self.num_rows and start % self.space.page_size else []

    def hold_pages(self, pages: Iterable[int]) -> None:
        """Keep `pages` mapped whatever rows come and go, until `let_go` (counted as mapped, not as experts' bytes):
        a window block's base pages, or the page a paged layer's base and adapter rows share."""
        size = self.space.page_size
        self._map([new for p in pages for new in self.pages.acquire(p * size, (p + 1) * size, needed=False)])

    def let_go(self, pages: Iterable[int]) -> None:
        size = self.space.page_size
        freed = [old for p in pages for old in self.pages.release(p * size, (p + 1) * size, needed=False)]
        if freed:
            self.space.unmap_pages(freed)

    def is_mapped(self, row: int) -> bool:
        return row in self._mapped_rows

    def stats(self) -> PageStats:
        return self.pages.stats()

    def close(self) -> None:
        self._tensor = None
        self.space.close()
