"""Which of vLLM's HTTP routes can load or unload an adapter, found by reading the app's routes.

vLLM registers its adapter handlers on more than one route: with runtime LoRA updating on (which `esftctl
serve` needs), vLLM 0.32 also mounts SageMaker's `POST /adapters` and `DELETE /adapters/{adapter_name}` over the
same functions, and a later release or an endpoint plugin may add others. esftctl's middleware checks loads and
unloads on the two routes it knows; every other route that reaches those handlers is refused
(esftctl.runtime.vllm.status). A route reaches them if its endpoint, or a function it wraps (`__wrapped__`, a
closure, a partial), is named as one of ADAPTER_CALLS or names one in its code: what vLLM's handlers are and call
on the serving models or the engine.
"""

from __future__ import annotations

import functools
import inspect
from types import CodeType

ADAPTER_CALLS = frozenset({"load_lora_adapter", "unload_lora_adapter", "add_lora", "remove_lora"})
GUARDED = frozenset({("/v1/load_lora_adapter", "POST"), ("/v1/unload_lora_adapter", "POST")})  # checked by esftctl


def _names(code: CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def reaches_adapters(endpoint) -> bool:
    """Whether calling `endpoint` can reach an adapter load or unload (the module's docstring)."""
    todo, seen = [endpoint], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            todo.append(f.func)
            continue
        if getattr(f, "__wrapped__", None) is not None:
            todo.append(f.__wrapped__)
        code = getattr(f, "__code__", None)
        if code is None:
            continue
        if code.co_name in ADAPTER_CALLS or _names(code) & ADAPTER_CALLS:
            return True
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
            if callable(value):
                todo.append(value)
    return False


def adapter_routes(app) -> list[tuple[object, bool]]:
    """(route, guarded) for every route of `app` whose endpoint reaches an adapter load or unload; guarded: one
    esftctl checks (GUARDED), the others are to be refused."""
    found = []
    for route in getattr(app, "routes", []):
        endpoint = getattr(route, "endpoint", None)
        if endpoint is not None and reaches_adapters(endpoint):
            methods = getattr(route, "methods", None) or set()
            found.append((route, bool(methods) and all((route.path, m) in GUARDED for m in methods)))
    return found
