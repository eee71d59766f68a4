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


MAX_LINE = 64 << 20  # bytes of one example: a longer line is refused, not read whole


def read_jsonl(path: Path) -> Iterator[Example]:
    """Yield the examples of `path` a line at a time (a large file is never held whole, and `itertools.islice`
    reads only the lines it takes), refusing a line that is not UTF-8, not an object with string prompt and
    completion, or longer than MAX_LINE."""
    for number, record in read_records(path):
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
            raise EsftError(f"line {number} needs string fields 'prompt' and 'completion'", path)
        yield record


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line of `path`, a line at a time, refusing a line that is not
    UTF-8, not a JSON object, or longer than MAX_LINE."""
    fd = open_regular(path)  # a FIFO would block, /dev/zero never end
    with os.fdopen(fd, "rb") as f:
        # JSON Lines: lines end at b"\n" only (not at U+2028, as str.splitlines would), and no UTF-8 character
        # holds that byte, so each line decodes alone
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            if len(raw) > MAX_LINE:
                raise EsftError(f"line {number} is longer than {MAX_LINE:,} bytes", path)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise EsftError(f"line {number} is not UTF-8 text", path) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, a number past Python's digit limit, deep nesting
                raise EsftError(f"line {number} is not valid JSON", path) from None
            if not isinstance(record, dict):
                raise EsftError(f"line {number} needs string fields 'prompt' and 'completion'", path)
            yield number, record
