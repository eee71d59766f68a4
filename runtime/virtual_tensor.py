"""One stacked expert weight of one MoE layer ([E_total, ...]) in a reserved range, memory only where experts are.

The fused MoE kernel sees `tensor`, an ordinary contiguous tensor of shape [num_rows, *row_shape]. Row r
(one expert) occupies bytes [r * row_bytes, (r + 1) * row_bytes); mapping rows maps the pages under them,
shared pages counted so that neighbours keep them alive.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from esftctl.runtime.address_space import AddressSpace
from esftctl.runtime.pages import PageRefCounts, PageStats


class VirtualExpertTensor:
    def __init__(self, space: AddressSpace, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.space = space
        self.num_rows = num_rows
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.row_bytes = dtype.itemsize * math.prod(self.row_shape)
        if num_rows * self.row_bytes > space.num_pages * space.page_size:
            raise ValueError("address space smaller than the tensor")
        self.pages = PageRefCounts(space.page_size, space.num_pages)
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
        self.space.map_pages(pages)  # all at once: runs of pages cost one call
        self._mapped_rows.update(rows)

    def unmap_rows(self, rows: Iterable[int]) -> None:
        rows = self._distinct(rows)
        for row in rows:
            if row not in self._mapped_rows:
                raise ValueError(f"row {row} is not mapped")
        pages = [page for row in rows for page in self.pages.release(*self._range(row))]
        self.space.unmap_pages(pages)
        self._mapped_rows.difference_update(rows)

    def is_mapped(self, row: int) -> bool:
        return row in self._mapped_rows

    def stats(self) -> PageStats:
        return self.pages.stats()

    def close(self) -> None:
        self._tensor = None
        self.space.close()
