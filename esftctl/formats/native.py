"""The package's C extension (native/, built by setup.py): the Huffman encoder and decoder of expert stores and
consolidation's distances. Where the package was installed without a C compiler it is missing, and each caller
uses its numpy or torch reference instead (the same results, 10-50x slower)."""

from __future__ import annotations

import os
from types import ModuleType


def module() -> ModuleType | None:
    """esftctl._native, or None where it was not built."""
    try:
        from esftctl import _native
    except ImportError:
        return None
    return _native


def threads(requested: int | None = None) -> int:
    """`requested`, or every core."""
    return requested or os.cpu_count() or 1
