"""Sizes and index ranges: formatted for tables and messages, and sizes parsed from options."""

import re
from fractions import Fraction
from typing import Iterable

from esftctl.errors import EsftError

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, option: str = "size") -> int:
    """'500MB' -> 500000000, '1.5GiB' -> 1610612736, '2TiB', '1048576': decimal and binary units up to tera,
    any case, computed exactly (no float rounding), whole bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise EsftError(f"{option}: cannot read {text!r} as a size (examples: 500MB, 12GiB, 2TiB, 1048576)")
    return int(Fraction(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; exact bytes under 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def format_ranges(values: Iterable[int]) -> str:
    """[1, 2, 3] -> '1-3'; [0, 2, 5] -> '0,2,5'."""
    values = sorted(values)
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
    return ",".join(map(str, values))
