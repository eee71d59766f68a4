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


def check_output(target: str | Path, *, overwrite: bool = False, folder: bool = False) -> Path:
    """Refuse, before any long work, an output that cannot be written: one that exists (without `overwrite`),
    a folder where a file goes (or a file where a folder goes), or a place where nothing can be created (a
    parent that is a file, /proc, no permission). Creates the missing parent folders; writes nothing else."""
    target = Path(target)
    if target.exists():
        if not overwrite:
            raise EsftError("output already exists (choose another path or pass --overwrite)", target)
        if target.is_dir() != folder:
            what = "a folder" if target.is_dir() else "a file"
            raise EsftError(f"output is {what}; give the path of {'a folder' if folder else 'a file'} to write", target)
    _writable_parent(target)
    return target


def _writable_parent(target: Path) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EsftError(f"cannot write the output here ({e.strerror or e})", target) from None
    return target.parent


def _set_modes(root: Path) -> None:
    """The umask's modes for everything written (some writers, safetensors among them, make files 0600)."""
    mask = _umask()
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(folder, f), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder that becomes `target` when the block finishes without error.

    An existing `target` is refused unless `overwrite` is set; on error (Ctrl-C, and SIGTERM, which the CLI turns
    into one) the temporary folder is removed, so a failed command never leaves a half-written output behind.
    """
    target = check_output(target, overwrite=overwrite, folder=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _set_modes(tmp)
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output should not be
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


@contextlib.contextmanager
def atomic_file(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target` that replaces it when the block finishes without error."""
    target = check_output(target, overwrite=overwrite)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o666 & ~_umask())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
