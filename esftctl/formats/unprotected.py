"""Files of format versions without a checksum over their headers, read only when the user asks.

A store of version 2 has no checksum over store.json, a bundle of version 1 none over manifest.json. Reading them
as before would let one changed bit of the version field ("version": 3 to 2) turn every header check off, so
they are refused unless the user says otherwise: `esftctl --allow-unprotected COMMAND ...`, which sets
ESFTCTL_ALLOW_UNPROTECTED=1 for the command and every process it starts (a server's engine reads bundles too).
"""

from __future__ import annotations

import os
from pathlib import Path

from esftctl.errors import EsftError

ENV = "ESFTCTL_ALLOW_UNPROTECTED"


def allowed() -> bool:
    return os.environ.get(ENV) == "1"


def allow() -> None:
    os.environ[ENV] = "1"


def check(what: str, path: str | Path, again: str) -> None:
    """Refuse `what` (a format version without a header checksum) unless unprotected files are allowed; `again`
    says how to write the file anew."""
    if not allowed():
        raise EsftError(f"{what} has no checksum over its header, so a change to it would go unnoticed: {again}, or "
                        "read it anyway with `esftctl --allow-unprotected ...`", path)
