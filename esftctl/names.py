"""The one rule for the names of served models, adapters and variants.

A name ends up in a request's `model` field, in vLLM's `--lora-modules NAME=PATH` and `--served-model-name`,
in URLs of the status endpoint and in bundle manifests: letters, digits, '.', '_' and '-' are safe in all
of them, and anything else (a space, '=', '/') breaks at least one.
"""

from __future__ import annotations

import re

from esftctl.errors import EsftError

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_name(name: str, what: str = "adapter") -> str:
    if not _NAME.fullmatch(name):
        raise EsftError(f"{what} name {name!r}: use 1-128 letters, digits, '.', '_' and '-' (no spaces, '=' or '/')")
    return name
