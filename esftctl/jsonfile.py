"""JSON files read with one-line errors naming the file, and written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from esftctl.atomic import atomic_file
from esftctl.errors import EsftError, one_line


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EsftError("file not found", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EsftError(f"not valid JSON ({one_line(e, 120)})", path) from None


def write_json(path: str | Path, obj: Any, indent: int | None = 1, overwrite: bool = True) -> None:
    with atomic_file(path, overwrite=overwrite) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent))
