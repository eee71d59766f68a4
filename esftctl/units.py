"""Formatting of sizes for tables."""


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; exact bytes under 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")
