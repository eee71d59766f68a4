"""Formatting of sizes and index ranges for tables and messages."""

from typing import Iterable


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
