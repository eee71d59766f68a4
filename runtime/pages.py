"""Which physical pages a virtual tensor needs, with reference counts for pages that experts share.

A virtual tensor's bytes are split into pages of the backend's granularity (2 MiB on CUDA). An expert's
byte range rarely starts or ends on a page boundary, so neighbouring experts share the page that straddles
their boundary: each page counts the live expert ranges that touch it, is mapped when the count leaves zero
and unmapped when it returns to zero. The physical bytes of a tensor are then at most one page more per
run of contiguous experts than the bytes the experts need.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PageStats:
    page_size: int
    mapped_pages: int
    needed_bytes: int

    @property
    def mapped_bytes(self) -> int:
        return self.mapped_pages * self.page_size

    @property
    def wasted_bytes(self) -> int:
        return self.mapped_bytes - self.needed_bytes


class PageRefCounts:
    """Reference counts of the pages under byte ranges; reports which pages to map and to unmap."""

    def __init__(self, page_size: int, num_pages: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self._refs: dict[int, int] = {}
        self._needed = 0

    def pages_of(self, start: int, end: int) -> range:
        if not 0 <= start < end <= self.num_pages * self.page_size:
            raise ValueError(f"byte range [{start}, {end}) outside 0..{self.num_pages * self.page_size}")
        return range(start // self.page_size, (end - 1) // self.page_size + 1)

    def acquire(self, start: int, end: int, *, needed: bool = True) -> list[int]:
        """Count one more user of [start, end); return the pages that must be mapped now. `needed` False: a hold
        on the pages (VirtualExpertTensor.hold_pages) that no expert's bytes are counted for."""
        newly = []
        for page in self.pages_of(start, end):
            count = self._refs.get(page, 0)
            if count == 0:
                newly.append(page)
            self._refs[page] = count + 1
        self._needed += (end - start) if needed else 0
        return newly

    def release(self, start: int, end: int, *, needed: bool = True) -> list[int]:
        """Count one user of [start, end) fewer; return the pages that nothing uses any more."""
        freed = []
        for page in self.pages_of(start, end):
            count = self._refs.get(page, 0)
            if count <= 0:
                raise ValueError(f"page {page} released more often than acquired")
            if count == 1:
                del self._refs[page]
                freed.append(page)
            else:
                self._refs[page] = count - 1
        self._needed -= (end - start) if needed else 0
        return freed

    def is_mapped(self, page: int) -> bool:
        return page in self._refs

    def stats(self) -> PageStats:
        return PageStats(self.page_size, len(self._refs), self._needed)
