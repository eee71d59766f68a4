"""Reserved address ranges whose pages get physical memory only when mapped: on the host and on CUDA.

Both backends have one interface: reserve `nbytes` once, `map_pages(pages)` / `unmap_pages(pages)` by page
index (each run of consecutive pages costs one call where the backend allows it: a layer of a large model
is hundreds of pages), and `view(dtype, shape)` returns an ordinary contiguous torch tensor over the whole
range without copying.
Touching an unmapped page faults (SIGSEGV on the host, an illegal-address error on CUDA), so a bug that
reads an expert that is not there cannot pass silently.

- Host: mmap(PROT_NONE, MAP_NORESERVE) reserves; the pages' memory is a memfd of the range's size (the kernel
  backs it on first touch), mapped MAP_SHARED over a run of pages to commit it; a hole punched in the file and
  PROT_NONE mapped back give them back. `resident_pages()` asks mincore.
- CUDA: the driver's virtual memory API through cuda-bindings: cuMemAddressReserve, cuMemCreate (from a
  PhysicalPagePool), cuMemMap of a few large handles per run of pages, one cuMemSetAccess per run,
  cuMemUnmap, cuMemRelease. Granularity from the driver.

Aliasing (`alias(source)`, `unalias()`): a range can map the very memory another range of the same kind has
mapped, page for page at the same offsets, so that two addresses read and write the same bytes. Expert paging
(esftctl.runtime.paging) uses it so that a layer keeps its own addresses, which kernels and captured CUDA graphs
hold, while its memory is one of a few shared blocks; making it resident again swaps the memory, not the address.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


class AddressSpace(Protocol):
    page_size: int
    num_pages: int
    device: torch.device

    def map_pages(self, pages: Iterable[int]) -> None: ...
    def unmap_pages(self, pages: Iterable[int]) -> None: ...
    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...
    def close(self) -> None: ...


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """Pages as runs of consecutive ones: [(first page, count), ...]."""
    runs: list[tuple[int, int]] = []
    for page in sorted(pages):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


class AccountingAddressSpace:
    """Pages counted, never backed: for planning and benchmarks of sizes this machine cannot hold."""

    def __init__(self, nbytes: int, page_size: int = 2 << 20):
        self.page_size = page_size
        self.num_pages = max(1, -(-nbytes // page_size))
        self.device = torch.device("cpu")

    def map_pages(self, pages: Iterable[int]) -> None:
        pass

    def unmap_pages(self, pages: Iterable[int]) -> None:
        pass

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raise RuntimeError("an accounting address space holds no memory to view")

    def close(self) -> None:
        pass


# ---- host ------------------------------------------------------------------------------------------

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_FAILED = ctypes.c_void_p(-1).value


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    got = _libc.mmap(addr, size, prot, flags, fd, offset)
    if got in (None, _FAILED) or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    return got


class HostAddressSpace:
    """A reserved range of host virtual memory, committed page by page from a memory file of its own."""

    DEFAULT_PAGE = 2 << 20  # the CUDA granularity, so host and GPU account memory alike

    def __init__(self, nbytes: int, page_size: int = DEFAULT_PAGE):
        if page_size % mmap.PAGESIZE:
            raise ValueError(f"page size {page_size} is not a multiple of the OS page ({mmap.PAGESIZE})")
        self.page_size = page_size
        self.num_pages = max(1, -(-nbytes // page_size))
        self.nbytes = self.num_pages * page_size
        self.device = torch.device("cpu")
        self.fd = os.memfd_create("esftctl-experts", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)  # sparse: memory only where pages are written
        try:
            self.base = _mmap(None, self.nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError:
            os.close(self.fd)
            raise MemoryError(f"cannot reserve {self.nbytes} bytes of address space") from None
        self._buffer = (ctypes.c_uint8 * self.nbytes).from_address(self.base)
        self._live: set[int] = set()  # pages mapped from this range's own file
        self._aliased: set[int] = set()  # pages mapped from another range's file

    def _reserve_again(self, first: int, count: int) -> None:
        _mmap(self.base + first * self.page_size, count * self.page_size, _PROT_NONE,
              _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED)

    def map_pages(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if any(p in self._live or p in self._aliased for p in pages):
            raise ValueError(f"a page of {sorted(pages)} is already mapped")
        for first, count in page_runs(pages):
            off, size = first * self.page_size, count * self.page_size
            _mmap(self.base + off, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, self.fd, off)
        self._live.update(pages)

    def unmap_pages(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if any(p not in self._live for p in pages):
            raise ValueError(f"a page of {sorted(pages)} is not mapped")
        for first, count in page_runs(pages):
            off, size = first * self.page_size, count * self.page_size
            _check(_libc.fallocate(self.fd, _FALLOC_PUNCH_HOLE, off, size), "fallocate")  # the memory goes back
            self._reserve_again(first, count)
        self._live.difference_update(pages)

    def alias(self, source: "HostAddressSpace") -> None:
        """Map the memory of every page `source` has mapped (and this range has not aliased yet) here, at the
        same offsets; this range's own pages must not be mapped there."""
        if (source.page_size, source.num_pages) != (self.page_size, self.num_pages):
            raise ValueError("an alias needs a range of the same pages")
        new = source._live - self._aliased
        if new & self._live:
            raise ValueError(f"pages {sorted(new & self._live)} are this range's own")
        for first, count in page_runs(new):
            off, size = first * self.page_size, count * self.page_size
            _mmap(self.base + off, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, source.fd, off)
        self._aliased |= new

    def unalias(self) -> None:
        for first, count in page_runs(self._aliased):
            self._reserve_again(first, count)
        self._aliased.clear()

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        flat = torch.frombuffer(self._buffer, dtype=torch.uint8)
        n = dtype.itemsize
        for d in shape:
            n *= d
        return flat[:n].view(dtype).view(shape)

    def resident_pages(self) -> int:
        """How many OS pages of the range hold physical memory now (mincore)."""
        os_pages = self.nbytes // mmap.PAGESIZE
        vec = (ctypes.c_uint8 * os_pages)()
        _check(_libc.mincore(self.base, self.nbytes, vec), "mincore")
        return sum(v & 1 for v in vec)

    def close(self) -> None:
        if self.base is not None:
            _libc.munmap(self.base, self.nbytes)
            os.close(self.fd)
            self.base = None


# ---- CUDA ------------------------------------------------------------------------------------------

def _driver():
    from cuda.bindings import driver

    return driver


def _cu(result):
    """Unpack a cuda-bindings call's (CUresult, *values), raising on an error."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver error {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


class PhysicalPagePool:
    """Physical memory (cuMemCreate handles) of one GPU in handles of 1, 2, 4, ... MAX_RUN pages, reused
    across address spaces.

    Unmapped handles return here instead of to the driver, so evicting and loading adapters, or paging a
    layer, does not pay for allocation; `trim()` hands the free ones back. Sizes are powers of two, so the
    free handles stay few kinds however long the runs that spaces map.

    `reserve(pages)` sets memory aside now for handles made later: an engine that sizes its caches from the
    memory left free (vLLM's KV cache) then leaves room for them. A take that needs a new handle first gives
    back as much of the reserve (so the total never grows past what was reserved while reserve remains).
    """

    MAX_RUN = 32  # pages in the largest handle: 64 MiB at the usual 2 MiB

    def __init__(self, device: int | torch.device | None = None, page_size: int | None = None):
        """`page_size`: the size of a page, rounded up to the driver's granularity; by default the granularity
        itself (2 MiB). Paging with one block per layer maps a whole layer's experts as one page."""
        driver = _driver()
        self.device = torch.device("cuda", torch.device(device or "cuda").index or 0)
        torch.cuda.init()
        torch.zeros(1, device=self.device)  # make torch's primary context current on this thread
        _cu(driver.cuInit(0))
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device.index
        granularity = int(_cu(driver.cuMemGetAllocationGranularity(
            self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.granularity = granularity
        self.page_size = round_up(page_size or granularity, granularity)
        self._access = driver.CUmemAccessDesc()
        self._access.location = self._prop.location
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._free: dict[int, list] = {}  # pages per handle -> free handles
        self._reserve: list[tuple[object, int]] = []  # (handle, pages) set aside by `reserve`
        self.in_use = 0  # pages

    def _create(self, pages: int):
        return _cu(_driver().cuMemCreate(pages * self.page_size, self._prop, 0))

    def take(self, pages: int = 1):
        self.in_use += pages
        free = self._free.get(pages)
        if free:
            return free.pop()
        released = 0
        while self._reserve and released < pages:  # the reserve makes room for what is created now
            handle, size = self._reserve.pop()
            _cu(_driver().cuMemRelease(handle))
            released += size
        if released > pages:  # the rest of the last reserve handle stays set aside
            self._reserve.extend((self._create(size), size) for size in handle_sizes(released - pages, self.MAX_RUN))
        return self._create(pages)

    def give(self, handle, pages: int = 1) -> None:
        self.in_use -= pages
        self._free.setdefault(pages, []).append(handle)

    def reserve(self, pages: int) -> None:
        """Set `pages` more pages of physical memory aside for later takes."""
        self._reserve.extend((self._create(size), size) for size in handle_sizes(pages, self.MAX_RUN))

    @property
    def free_pages(self) -> int:
        return sum(pages * len(handles) for pages, handles in self._free.items())

    @property
    def reserved_pages(self) -> int:
        return sum(pages for _, pages in self._reserve)

    def trim(self) -> None:
        """Give the free handles back to the driver (the reserve stays)."""
        for handles in self._free.values():
            while handles:
                _cu(_driver().cuMemRelease(handles.pop()))

    def release_reserve(self) -> None:
        while self._reserve:
            _cu(_driver().cuMemRelease(self._reserve.pop()[0]))


def handle_sizes(count: int, largest: int) -> list[int]:
    """A run of `count` pages as handles of power-of-two pages, largest first (578, 32 -> 18 x 32, 2)."""
    sizes = [largest] * (count // largest)
    rest = count % largest
    while rest:
        size = 1 << (rest.bit_length() - 1)
        sizes.append(size)
        rest -= size
    return sizes


class _CudaArray:
    """The minimum an object needs for torch.as_tensor to wrap device memory without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


@dataclass
class _Mapping:
    first: int  # page
    pages: int
    handle: object
    live: int  # pages of it that are mapped for a user


class CudaAddressSpace:
    """A reserved range of GPU virtual addresses, backed from a PhysicalPagePool.

    A run of pages is backed by a few large handles (`handle_sizes`), one cuMemMap each, and made accessible
    with one cuMemSetAccess: the driver's calls cost tens of microseconds per mapping, and a layer of a large
    model is hundreds of pages. A handle goes back to the pool only when all its pages are unmapped; until
    then its unmapped pages stay backed (and are reused by the next map of those pages).
    """

    def __init__(self, nbytes: int, pool: PhysicalPagePool):
        driver = _driver()
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        self.num_pages = max(1, -(-nbytes // self.page_size))
        self.nbytes = self.num_pages * self.page_size
        self.base = int(_cu(driver.cuMemAddressReserve(self.nbytes, pool.granularity, 0, 0)))
        self._backing: dict[int, _Mapping] = {}  # page -> the mapping that backs it
        self._live: set[int] = set()
        self._aliased: dict[int, int] = {}  # first page -> pages of another range's handles mapped here

    def _ptr(self, page: int):
        return _driver().CUdeviceptr(self.base + page * self.page_size)

    def map_pages(self, pages: Iterable[int]) -> None:
        driver = _driver()
        new = []
        for page in pages:
            if page in self._live or self._aliased_page(page):
                raise ValueError(f"page {page} is already mapped")
            self._live.add(page)
            if page in self._backing:  # still backed: an unmapped page of a handle that other pages hold
                self._backing[page].live += 1
            else:
                new.append(page)
        for first, count in page_runs(new):
            page = first
            for size in handle_sizes(count, self.pool.MAX_RUN):
                mapping = _Mapping(page, size, self.pool.take(size), live=size)
                _cu(driver.cuMemMap(self._ptr(page), size * self.page_size, 0, mapping.handle, 0))
                for p in range(page, page + size):
                    self._backing[p] = mapping
                page += size
            _cu(driver.cuMemSetAccess(self._ptr(first), count * self.page_size, [self.pool._access], 1))

    def unmap_pages(self, pages: Iterable[int]) -> None:
        for page in pages:
            if page not in self._live:
                raise ValueError(f"page {page} is not mapped")
            self._live.discard(page)
            mapping = self._backing[page]
            mapping.live -= 1
            if mapping.live == 0:
                self._release(mapping)

    def _release(self, mapping: _Mapping) -> None:
        _cu(_driver().cuMemUnmap(self._ptr(mapping.first), mapping.pages * self.page_size))
        self.pool.give(mapping.handle, mapping.pages)
        for p in range(mapping.first, mapping.first + mapping.pages):
            del self._backing[p]

    def _aliased_page(self, page: int) -> bool:
        return any(first <= page < first + count for first, count in self._aliased.items())

    def alias(self, source: "CudaAddressSpace") -> None:
        """Map every handle `source` has mapped (and this range has not aliased yet) here, at the same offsets
        (the driver maps whole handles); this range's own pages must not be mapped there."""
        driver = _driver()
        if (source.page_size, source.num_pages) != (self.page_size, self.num_pages):
            raise ValueError("an alias needs a range of the same pages")
        for mapping in source._mappings():
            if mapping.first in self._aliased:
                continue
            if any(p in self._backing for p in range(mapping.first, mapping.first + mapping.pages)):
                raise ValueError(f"pages {mapping.first}..{mapping.first + mapping.pages - 1} are this range's own")
            size = mapping.pages * self.page_size
            _cu(driver.cuMemMap(self._ptr(mapping.first), size, 0, mapping.handle, 0))
            _cu(driver.cuMemSetAccess(self._ptr(mapping.first), size, [self.pool._access], 1))
            self._aliased[mapping.first] = mapping.pages

    def unalias(self) -> None:
        for first, count in self._aliased.items():
            _cu(_driver().cuMemUnmap(self._ptr(first), count * self.page_size))
        self._aliased.clear()

    def _mappings(self) -> list[_Mapping]:
        return list({id(m): m for m in self._backing.values()}.values())

    @property
    def handles(self) -> int:
        """Physical handles mapped now (each one driver mapping)."""
        return len(self._mappings())

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = dtype.itemsize
        for d in shape:
            n *= d
        flat = torch.as_tensor(_CudaArray(self.base, n), device=self.device)
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        if self.base is None:
            return
        self.unalias()
        for mapping in self._mappings():
            self._release(mapping)
        self._live.clear()
        _cu(_driver().cuMemAddressFree(_driver().CUdeviceptr(self.base), self.nbytes))
        self.base = None
