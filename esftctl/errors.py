"""The one exception type the CLI turns into a one-line error and a non-zero exit."""

from __future__ import annotations

from pathlib import Path


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message folded onto one line and cut to `limit` characters, for EsftError texts."""
    return " ".join(str(e).split())[:limit]


class EsftError(Exception):
    """A problem with user input (a file, a flag, a model) that the user can fix.

    The message is one line and names the file it is about, so that the CLI can print it as is.
    """

    def __init__(self, message: str, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.message = message
        super().__init__(f"{path}: {message}" if path is not None else message)
