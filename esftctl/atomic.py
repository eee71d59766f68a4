"""Outputs that appear whole or not at all, and never destroy what the command was not told to replace.

An output is written under a temporary name beside its target, fsynced (every file, then every folder), and
only then renamed into place, so that a crash or a power loss leaves under the target's name either the old
output or the new one, whole. The rename itself decides, not a check made at the start:

- without --overwrite it refuses a target that appeared while the command ran (renameat2's RENAME_NOREPLACE)
  and keeps the new output beside it, under a name the error gives;
- with --overwrite it exchanges the two in one step (RENAME_EXCHANGE) and deletes the old one afterwards; where
  the file system has no renameat2, the old output is renamed aside first and deleted only once the new one is
  in place (a crash between the two renames leaves both whole, under hidden names beside the target).

A target that is a symbolic link is refused before any work: replacing the link and writing through it would
each surprise someone. Parent folders a command creates are removed again if it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from esftctl.errors import EsftError

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output(target: str | Path, *, overwrite: bool = False, folder: bool = False) -> Path:
    """Refuse, before any long work, an output that cannot be written: one that exists (without `overwrite`),
    a symbolic link, a folder where a file goes (or a file where a folder goes), or a place where nothing can
    be created (a parent that is a file, /proc, no permission). Creates nothing."""
    target = Path(target)
    if target.is_symlink():
        raise EsftError(f"output is a symbolic link (to {os.readlink(target)}): give the path it points to, or "
                        "remove the link", target)
    if target.exists():
        if not overwrite:
            raise EsftError("output already exists (choose another path or pass --overwrite)", target)
        if target.is_dir() != folder:
            what = "a folder" if target.is_dir() else "a file"
            raise EsftError(f"output is {what}; give the path of {'a folder' if folder else 'a file'} to write", target)
    ancestor = target.parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    try:  # where the first missing folder (or the output) will be created
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EsftError(f"cannot write the output here ({e.strerror or e})", target) from None
    return target


@contextlib.contextmanager
def _parents(target: Path) -> Iterator[list[Path]]:
    """Create `target`'s missing parent folders (yielded, deepest first); remove them again if the block fails."""
    created = []
    folder = target.parent
    while not os.path.lexists(folder):
        created.append(folder)
        folder = folder.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EsftError(f"cannot write the output here ({e.strerror or e})", target) from None
    try:
        yield created
    except BaseException:
        for folder in created:
            with contextlib.suppress(OSError):  # only empty ones go: anything kept beside the target stays
                os.rmdir(folder)
        raise


def _fsync(path: str | Path, *, folder: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(tmp: Path, *, durable: bool = True, private: bool = False) -> None:
    """The umask's modes for everything written (mkdtemp, mkstemp and some writers, safetensors among them, make
    things private), or, if `private`, only the owner's, and (if `durable`) everything on disk: files first, then
    the folders that name them."""
    mask = 0o077 if private else _umask()
    if tmp.is_dir():
        for folder, dirs, files in os.walk(tmp, topdown=False):
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o666 & ~mask)
                    if durable:
                        _fsync(path)
            for name in dirs:
                if not os.path.islink(os.path.join(folder, name)):
                    os.chmod(os.path.join(folder, name), 0o777 & ~mask)
            if durable:
                _fsync(folder, folder=True)
        tmp.chmod(0o777 & ~mask)
    else:
        tmp.chmod(0o666 & ~mask)
        if durable:
            _fsync(tmp)


def _rename2(src: Path, dst: Path, flag: int) -> bool:
    """renameat2(src, dst, flag): True once done, False where the kernel, libc or file system lacks it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _rename_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` unless something is there (FileExistsError)."""
    if _rename2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):  # without renameat2: checked just before, a far narrower window than the whole run
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _place(tmp: Path, target: Path, *, overwrite: bool, created: list[Path], durable: bool = True) -> None:
    """Rename the finished `tmp` to `target` (module docstring), then (if `durable`) make the new names durable."""
    old = None
    try:
        if overwrite and os.path.lexists(target):
            if _rename2(tmp, target, _RENAME_EXCHANGE):
                old = tmp
            else:
                old = target.with_name(f".{target.name}.old-{os.urandom(4).hex()}")
                os.rename(target, old)
                _rename_new(tmp, target)
        else:
            _rename_new(tmp, target)
    except FileExistsError:
        raise EsftError(f"output appeared while this command ran and was left as it is; the new output is at {tmp}",
                        target) from None
    for folder in [target.parent, *(f.parent for f in created)] if durable else []:
        _fsync(folder, folder=True)
    if old is not None:
        _remove(old)


@contextlib.contextmanager
def atomic_dir(target: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder that becomes `target` when the block finishes without error.

    An existing `target` is refused unless `overwrite` is set; on error (Ctrl-C, and SIGTERM, which the CLI turns
    into one) the temporary folder is removed, so a failed command never leaves a half-written output behind.
    """
    target = check_output(target, overwrite=overwrite, folder=True)
    with _parents(target) as created:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            yield tmp
            _finish(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _place(tmp, target, overwrite=overwrite, created=created)


@contextlib.contextmanager
def atomic_file(target: str | Path, *, overwrite: bool = True, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target` that replaces it when the block finishes without error. Not
    `durable`: whole for every reader, but not fsynced, for files that only describe a running process (a crash
    ends what they describe) and are rewritten where an fsync's milliseconds would be waited on.

    The file gets the umask's mode, except in a folder only its owner may enter (no group or other bits, as a
    server's state folder: esftctl.serve), where it stays 0600 as mkstemp made it: the launcher and the engine
    write status and records there that its API key protects over HTTP."""
    target = check_output(target, overwrite=overwrite)
    with _parents(target) as created:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            _finish(tmp, durable=durable, private=not os.stat(target.parent).st_mode & 0o077)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _place(tmp, target, overwrite=overwrite, created=created, durable=durable)
