"""The one rule for the names of served models, adapters and variants.

A name ends up in a request's `model` field, in vLLM's `--lora-modules NAME=PATH` and `--served-model-name`,
in URLs of the status endpoint and in bundle manifests: letters, digits, '.', '_' and '-' are safe in all
of them, and anything else (a space, '=', '/') breaks at least one. A name starts with a letter or a digit: one
starting with '-' reads as an option on vLLM's command line (`--lora-modules -x=PATH` fails after vLLM's start-up),
and '.' or '..' would be path components.
"""

from __future__ import annotations

import re

from esftctl.errors import EsftError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str, what: str = "adapter") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise EsftError(f"{what} name {name!r}: use 1-128 letters, digits, '.', '_' and '-', starting "
                         "with a letter or digit (no spaces, '=' or '/')")
    return name
