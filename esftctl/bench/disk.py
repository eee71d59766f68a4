"""The disk as the benches measure it: files dropped from the page cache, and cold sequential reads."""

from __future__ import annotations

import os
import time
from pathlib import Path


def evict(*paths: Path) -> None:
    """Drop the files under `paths` from the page cache (written back first: dirty pages would stay), so the next
    read comes from disk."""
    os.sync()
    for path in map(Path, paths):
        for f in [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_bandwidth(file: Path, chunk: int = 16 << 20) -> float:
    """Bytes per second of one sequential read of `file` from disk (evicted first)."""
    evict(file)
    start, n = time.perf_counter(), 0
    with open(file, "rb", buffering=0) as f:
        while block := f.read(chunk):
            n += len(block)
    return n / (time.perf_counter() - start)
