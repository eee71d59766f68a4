"""Task data as JSONL: one {"prompt": ..., "completion": ...} object per line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from esftctl.errors import EsftError
from esftctl.jsonfile import open_regular

Example = dict[str, str]


def write_jsonl(path: Path, examples: list[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))


def read_jsonl(path: Path) -> Iterator[Example]:
    """Yield the examples of `path`, refusing a line that is not an object with string prompt and completion."""
    fd = open_regular(path)  # a FIFO would block, /dev/zero never end
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            lines = f.read().decode("utf-8").split("\n")  # JSON Lines: not splitlines(), which also splits at U+2028
    except UnicodeDecodeError:
        raise EsftError("not a UTF-8 text file", path) from None
    finally:
        os.close(fd)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, a number past Python's digit limit, deep nesting
            raise EsftError(f"line {number} is not valid JSON", path) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                or not isinstance(record.get("completion"), str):
            raise EsftError(f"line {number} needs string fields 'prompt' and 'completion'", path)
        yield record
