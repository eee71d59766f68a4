"""A folder opened once beneath a root, and its files read through that one opening.

`esftctl serve --adapter-root ROOT` promises that adapters loaded at run time come from under ROOT. Checking a
path and then opening it again leaves a window: a symbolic link under ROOT can point inside at the check and
outside at the open (a link flipped every 0.5 ms won 2 of 60 loads). So the folder is opened once, with
openat2's RESOLVE_BENEATH from a descriptor of ROOT (where the kernel lacks openat2: component by component
with O_NOFOLLOW, refusing every link), and the files in it are opened relative to that descriptor without
following links. Readers then take `/proc/self/fd/N` paths: opening one of those opens the very file behind
descriptor N, whatever has since been renamed or linked in its place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from esftctl.errors import EsftError

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x02, 0x08


class OutsideRoot(EsftError):
    """A path that is not under the root, or leaves it through a link while it is opened (HTTP 403)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, relative: str, flags: int) -> int:
    """openat2(2) with RESOLVE_BENEATH; raises OSError (ENOSYS where the kernel or a filter lacks it)."""
    if _SYS_OPENAT2 is None:
        raise OSError(errno.ENOSYS, "openat2")
    libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(relative),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def _walk_nofollow(dir_fd: int, relative: str, flags: int) -> int:
    """Open `relative` beneath `dir_fd` one component at a time, refusing any symbolic link (ELOOP)."""
    fd = os.dup(dir_fd)
    try:
        for part in Path(relative).parts:
            if part in ("..", "/"):
                raise OSError(errno.EXDEV, "leaves the root")
            try:
                nxt = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except NotADirectoryError:  # O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR, not ELOOP
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, "a symbolic link") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir_beneath(root: Path, path: str | Path) -> int:
    """A descriptor of the folder `path`, which must lie under `root` (a resolved folder) without leaving it
    through a link at any moment of the open. Raises EsftError naming `path`."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:  # the path spelt from the root, links resolved now; the open below re-checks every step
        relative = Path(os.path.realpath(path)).relative_to(root)
    except ValueError:
        raise OutsideRoot(f"not under the adapter root {root} (--adapter-root)", path) from None
    try:
        root_fd = os.open(root, flags)
    except OSError as e:
        raise EsftError(f"cannot open the adapter root ({e.strerror})", root) from None
    try:
        rel = str(relative) or "."
        try:
            return _openat2(root_fd, rel, flags)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            return _walk_nofollow(root_fd, rel, flags)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP):
            raise OutsideRoot(f"leaves the adapter root {root} through a symbolic link (--adapter-root)",
                              path) from None
        if e.errno == errno.ENOTDIR:
            raise EsftError("not a folder", path) from None
        if e.errno == errno.ENOENT:
            raise EsftError("not found", path) from None
        raise EsftError(f"cannot open ({e.strerror})", path) from None
    finally:
        os.close(root_fd)


class PinnedFolder:
    """A folder held open by descriptor, whose files are opened relative to it without following links and read
    as `/proc/self/fd/N` (see the module's docstring). Use as a context manager: every descriptor closes on exit."""

    def __init__(self, dir_fd: int, shown: str | Path):
        self.fd = dir_fd
        self.shown = Path(shown)  # the path the caller gave, for messages
        self._files: list[int] = []

    @classmethod
    def beneath(cls, root: Path, path: str | Path) -> "PinnedFolder":
        return cls(open_dir_beneath(root, path), path)

    @property
    def path(self) -> Path:
        """The folder itself, as a path that opens only this folder."""
        return Path(f"/proc/self/fd/{self.fd}")

    def file(self, name: str) -> Path:
        """The regular file `name` in this folder, opened now without following a link: a path to that very
        file. Raises EsftError naming the file as the caller sees it."""
        shown = self.shown / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise EsftError("file not found", shown) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise EsftError("is a symbolic link: a bundle served from an adapter root holds its files "
                                "themselves", shown) from None
            raise EsftError(f"cannot open ({e.strerror})", shown) from None
        self._files.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EsftError("not a regular file", shown)
        os.set_blocking(fd, True)
        return Path(f"/proc/self/fd/{fd}")

    def shown_path(self, path: Path | None) -> Path | None:
        """The caller's name for a path this folder handed out (messages name files as the user gave them)."""
        if path is None or path.parent != Path("/proc/self/fd") or not path.name.isdigit():
            return path
        if int(path.name) == self.fd:
            return self.shown
        if int(path.name) in self._files:
            return self.shown / os.path.basename(os.readlink(path))
        return path

    @contextlib.contextmanager
    def naming(self) -> Iterator[None]:
        """Errors raised inside name the files as the caller gave them, not by descriptor."""
        try:
            yield
        except EsftError as e:
            shown = self.shown_path(e.path)
            if shown == e.path:
                raise
            raise EsftError(e.message, shown) from None

    def close(self) -> None:
        for fd in [*self._files, self.fd]:
            os.close(fd)
        self._files.clear()
        self.fd = -1

    def __enter__(self) -> "PinnedFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
