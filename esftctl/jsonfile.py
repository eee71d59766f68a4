"""Input files opened without trusting them, and JSON files read with one-line errors and written atomically.

Files come from other people (bundles and stores are shared): a name that is a FIFO blocks an open for reading
until someone writes to it, and /dev/zero never ends. So only regular files are read, checked on a descriptor
opened without blocking, and JSON is read up to a size bound; a parse that nests too deeply or holds a number of
100,000 digits is one line too, not a RecursionError or ValueError traceback.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from esftctl.atomic import atomic_file
from esftctl.errors import EsftError, one_line

JSON_LIMIT = 64 << 20  # bytes: far above any manifest, config or index esftctl reads (a few MB at most)


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of `path` if it is a regular file (a FIFO, a device or a folder is refused at once,
    not waited on); the caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise EsftError("file not found", path) from None
    except OSError as e:
        raise EsftError(f"cannot open ({e.strerror or e})", path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EsftError("not a regular file", path)
    os.set_blocking(fd, True)
    return fd


def check_regular(path: str | Path) -> os.stat_result:
    """`path`'s status if it is a regular file (open_regular's check, without keeping the file open)."""
    fd = open_regular(path)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_bounded(path: str | Path, limit: int) -> bytes:
    """A regular file's bytes, refused if it holds more than `limit`."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb", closefd=False) as f:  # read() allocates what it is asked for: the size, not the limit
            data = f.read(min(size, limit) + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise EsftError(f"larger than {limit} bytes: not a file esftctl wrote", path)
    return data


def read_json(path: str | Path, limit: int = JSON_LIMIT) -> Any:
    path = Path(path)
    raw = read_bounded(path, limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise EsftError("not valid JSON (nested too deeply)", path) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints past Python's digit limit
        raise EsftError(f"not valid JSON ({one_line(e, 120)})", path) from None


def write_json(path: str | Path, obj: Any, indent: int | None = 1, *, overwrite: bool = True,
               durable: bool = True) -> None:
    with atomic_file(path, overwrite=overwrite, durable=durable) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent))
