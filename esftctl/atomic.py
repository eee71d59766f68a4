"""Outputs that appear whole or not at all: write under a temporary name beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from esftctl.errors import EsftError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder that becomes `target` when the block finishes without error.

    An existing `target` is refused unless `overwrite` is set; on error the temporary folder is removed,
    so a failed command never leaves a half-written output behind.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output should not be
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.replace(tmp, target)


@contextlib.contextmanager
def atomic_file(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target` that replaces it when the block finishes without error."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o666 & ~_umask())
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
