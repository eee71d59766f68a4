"""esftctl's additions to vLLM's OpenAI server, installed with vLLM's `--middleware` option (StatusMiddleware, plain
ASGI, so that streamed tokens pass straight through).

vLLM adds `--middleware` after its own authentication, and Starlette runs the last added first: this middleware
sees every request before vLLM's key check, which also guards only paths under /v1 (not /esftctl/status, not
/health, /metrics or /invocations). So, when the server has an API key (vLLM's `--api-key` or VLLM_API_KEY, read
as vLLM reads them), this middleware checks it first, on every path, in constant time: a request without a valid
`Authorization: Bearer KEY` gets 401 before anything below runs or any file is read.

- GET /esftctl/status: the engine's adapter and memory table, as JSON, with the server's process id. The
  engine process writes it to a file after every adapter change (esftctl.runtime.vllm.worker); this serves that file,
  and under tensor parallelism adds every rank's memory from the rank's own file (`per_rank`).
- POST /v1/load_lora_adapter: checked here first, so an expected refusal is a 4xx with its real message (vLLM
  answers an engine-side failure with HTTP 500, a traceback in its log, and file paths masked as `<path>`): a bad
  name or a bundle that is not this base's servable adapter (corrupt, another base, non-expert tensors) is 400
  (a bundle whose unchanged files the engine holds staged, verified, is not read again; one opened here is
  recorded as verified, so that the engine does not hash it again),
  and no free slot or no room in the adapter memory budget (by the engine's last status, unloaded adapters making
  room) is 507, as vLLM's own LoRA endpoints answer a full cache. A name already loaded is 400 (unload it first;
  `load_inplace` included: esftctl does not swap an adapter's experts in place). With `serve --adapter-root DIR` a
  path outside DIR, or one that leaves it through a link while it is opened, is 403; the bundle is read through
  the folder opened once beneath DIR (esftctl.beneath), and the engine opens it that way again for its own load.
- A completion for an unknown model: vLLM's 404 names only the base; the answer names every servable model.
- POST /v1/unload_lora_adapter: vLLM's handler forgets the name (new requests for it get vLLM's unknown-
  model error) but leaves the weights in the engine, where LoRA evicts lazily. An ESFT adapter holds a
  slot, so after a successful unload this also tells the engine to remove it; the engine keeps it until
  its last running request finishes (EsftWorkerManager.remove_adapter).
- Any other route that reaches vLLM's adapter load or unload handlers (SageMaker's /adapters, found by reading the
  app's routes at start-up: esftctl.runtime.vllm.routes) is 403: it would skip these checks.
- A load or unload body nested too deeply for the JSON parser is 400 (one that is no JSON goes on to vLLM's answer).
Every other request goes to vLLM untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

from starlette.responses import JSONResponse

from esftctl.runtime.engine_status import (
    EngineStatus,
    NoFreeSlot,
    check_budget,
    check_free_slot,
    check_module_copy,
    check_shared_copy,
)
from esftctl.runtime.serve_config import VLLM_API_KEY_ENV, ServeConfig, rank_status_file
from esftctl.runtime.vllm.routes import adapter_routes

STATUS_PATH = "/esftctl/status"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


ANSWERED = ((STATUS_PATH, "GET"), (LOAD_PATH, "POST"), (UNLOAD_PATH, "POST"))  # what status_middleware handles


class StatusMiddleware:
    """The middleware vLLM installs (`--middleware` adds a class with `app.add_middleware`), as plain ASGI.

    Starlette's function middleware (`BaseHTTPMiddleware`) would wrap every response, each streamed token
    included, in a task and a memory stream: on the dev CPU (benchmarks/lab/middleware_cost.py) that added
    0.18-0.55 ms to a stream's first chunk and 0.02-0.07 ms to each later one, which plain vLLM does not pay.
    Here the key is checked on every HTTP request first; the three paths this module answers or reads (status,
    load, unload) and a request without a valid key go through `status_middleware`; everything else, streams
    included, goes straight to vLLM, a completion's 404 rewritten to name the servable models."""

    def __init__(self, app):
        from starlette.middleware.base import BaseHTTPMiddleware

        self.app = app
        self.answered = BaseHTTPMiddleware(app, dispatch=status_middleware)
        self.refused: list | None = None  # routes that reach the adapter handlers unchecked, read at start-up

    def refused_routes(self, app) -> list:
        """The app's routes that reach vLLM's adapter handlers besides the two checked here (read once: at the
        server's start-up, or the first request where no start-up ran)."""
        if self.refused is None:
            self.refused = [route for route, guarded in adapter_routes(app) if not guarded]
        return self.refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" and scope.get("app") is not None:
            self.refused_routes(scope["app"])
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.routing import Match

        path, method = scope["path"], scope["method"]
        if (path, method) in ANSWERED or (method != "OPTIONS" and not _authorized(Request(scope))):
            await self.answered(scope, receive, send)
        elif any(route.matches(scope)[0] != Match.NONE for route in self.refused_routes(scope.get("app"))):
            await _error(f"{method} {path} would load or unload an adapter without esftctl's checks: this server does "
                         "that through POST /v1/load_lora_adapter and /v1/unload_lora_adapter only (esftctl adapters "
                         "load / unload)", 403, "Forbidden")(scope, receive, send)
        elif path in COMPLETION_PATHS:
            await self.app(scope, receive, _naming_models(scope, receive, send))
        else:
            await self.app(scope, receive, send)


async def status_middleware(request, call_next):
    """The key, then the status, load and unload paths (StatusMiddleware sends only those here, and requests
    without a valid key)."""
    if request.method != "OPTIONS" and not _authorized(request):  # CORS preflights carry no credentials
        response = _error("Unauthorized: this server wants its API key as 'Authorization: Bearer KEY'", 401,
                          "Unauthorized")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    if request.url.path == STATUS_PATH and request.method == "GET":
        return _status()
    if request.url.path == LOAD_PATH and request.method == "POST":
        return await _load(request, call_next)
    if request.url.path == UNLOAD_PATH and request.method == "POST":
        return await _unload(request, call_next)
    return await call_next(request)


def _api_keys(app) -> list[str]:
    """The keys vLLM accepts, as vLLM reads them: `--api-key` (several allowed), else VLLM_API_KEY."""
    given = getattr(getattr(app.state, "args", None), "api_key", None)
    return [key for key in (given or [os.environ.get(VLLM_API_KEY_ENV)]) if key]


def _authorized(request) -> bool:
    """No key set, or the request's bearer token is one of the keys; compared as digests in constant time, all of
    them every time, so the answer's timing tells nothing about a key."""
    keys = _api_keys(request.app)
    if not keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).digest()
    match = False
    for key in keys:
        match |= secrets.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return match and scheme.lower() == "bearer"


TOO_DEEP = object()  # a body nested past the JSON parser's depth


async def _json_body(request):
    """The request's body parsed as JSON, any JSON value (a client may send a list); None where it is not JSON
    (vLLM answers that), TOO_DEEP where it nests too deeply to parse (the parser's RecursionError was a 500)."""
    try:
        return await request.json()
    except ValueError:  # not JSON, or not UTF-8
        return None
    except RecursionError:
        return TOO_DEEP


def _too_deep() -> JSONResponse:
    return _error("the body's JSON nests too deeply", 400, "BadRequestError")


def _is_file_path(path: str) -> bool:
    """Whether the file system can be asked about `path`: os functions raise ValueError for a NUL byte and for a
    lone surrogate, and nothing past the middleware expects that."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return "\0" not in path


def _outside(settings, path: str) -> bool:
    """Whether `path`, every link resolved now, lies outside the adapter root and is no bundle the server started
    with: refused before anything is read (the load itself opens the folder beneath the root, which a link changed
    in between cannot escape)."""
    from esftctl.runtime.serve_config import startup_bundles

    try:
        inside = Path(os.path.realpath(path)).is_relative_to(settings.adapter_root)
    except ValueError:  # a NUL byte in the path
        return True
    return not inside and str(Path(path).resolve()) not in startup_bundles(settings)


def _read_status(path: Path) -> EngineStatus | None:
    try:
        return EngineStatus.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _engine_status() -> EngineStatus | None:
    """Rank 0's status; under tensor parallelism with `per_rank`, every rank's memory (None for a rank whose
    file is not there yet)."""
    config = ServeConfig.from_env()
    status = _read_status(Path(config.status_file)) if config else None
    if status is None or status.ranks == 1:
        return status
    ranks = [status] + [_read_status(rank_status_file(config.status_file, r)) for r in range(1, status.ranks)]
    status.per_rank = [None if r is None else r.rank_memory() for r in ranks]
    return status


def _error(message: str, status_code: int, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status_code}}, status_code=status_code)


def _status() -> JSONResponse:
    status = _engine_status()
    if status is None:
        return JSONResponse({"error": {"message": "the engine has not reported its adapters yet",
                                       "type": "ServiceUnavailable", "code": 503}}, status_code=503)
    status.server_pid = os.getpid()  # the launcher checks it started this server
    return JSONResponse(status.to_json())


async def _unload(request, call_next):
    state = request.app.state
    body = await _json_body(request)
    if body is TOO_DEEP:
        return _too_deep()
    name = body.get("lora_name") if isinstance(body, dict) else None
    known = getattr(state, "openai_serving_models", None)
    lora = known.lora_requests.get(name) if known is not None and isinstance(name, str) else None
    response = await call_next(request)
    if lora is not None and response.status_code == 200:
        await state.engine_client.remove_lora(lora.lora_int_id)
    return response


async def _load(request, call_next):
    """Refuse what the engine would refuse, with the real message and a 4xx, before vLLM passes it on."""
    import asyncio

    from esftctl.beneath import OutsideRoot
    from esftctl.errors import EsftError

    body = await _json_body(request)
    if body is TOO_DEEP:
        return _too_deep()
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    config = ServeConfig.from_env()
    root = config.settings.adapter_root if config is not None else None
    if root is not None and isinstance(path, str) and _outside(config.settings, path):
        return _error(f"adapter {name!r}: this server loads adapters only from under {root} (--adapter-root)", 403,
                      "Forbidden")
    if isinstance(path, str) and not _is_file_path(path):
        return _error(f"adapter {name!r}: lora_path is no file path (a NUL byte or a character the file system "
                      "cannot encode)", 400, "BadRequestError")
    status = _engine_status()
    if not isinstance(body, dict) or status is None or not isinstance(name, str) or not isinstance(path, str):
        return await call_next(request)  # vLLM's own answers (missing fields), or an engine not up yet
    known = getattr(request.app.state, "openai_serving_models", None)
    if known is not None and name in known.lora_requests:
        return _error(f"adapter {name!r} is loaded already: unload it first (esftctl adapters unload {name}); "
                      "esftctl does not swap an adapter's experts in place", 400, "BadRequestError")
    variants = {str(Path(p).resolve()) for p in status.variant_paths}
    if str(Path(path).resolve()) in variants:
        return await call_next(request)
    try:
        await asyncio.to_thread(_check_load, name, path, status)
    except OutsideRoot as e:
        return _error(f"adapter {name!r}: {e.message}", 403, "Forbidden")
    except NoFreeSlot as e:
        return _error(f"adapter {name!r}: {e}", 507, "InsufficientStorage")
    except EsftError as e:
        return _error(f"adapter {name!r}: {e}", 400, "BadRequestError")
    return await call_next(request)


def _check_load(name: str, path: str, status: EngineStatus) -> None:
    """Refuse what the engine would refuse. Under an adapter root the bundle is read through its folder opened
    beneath the root (esftctl.runtime.serve_config.opened_for_load), as the engine reads it. A bundle whose
    unchanged files the engine holds staged (in its host cache, verified against its base when staged) is neither
    hashed nor checked against the base again, only its manifest read for the budget: hashing would be 2.9 of a
    warm load's 3.0 s for a 2.47 GiB adapter (benchmarks/RESULTS.md, Adapter load time). One hashed here is recorded
    as verified, by its file identity taken before reading, so that the engine reading it next does not hash it
    again."""
    import contextlib

    from esftctl.formats.bundle import Bundle, identity_json
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.names import check_name
    from esftctl.runtime.serve_config import (
        bundle_identity,
        non_expert_kinds,
        open_servable_bundle,
        opened_for_load,
        record_verified,
    )

    check_name(name)
    config = ServeConfig.from_env()
    pinned = opened_for_load(config.settings, path) if config is not None else None
    with pinned if pinned is not None else contextlib.nullcontext():
        identity = bundle_identity(path, pinned)
        if identity is not None and identity_json(identity) in status.staged_bundles:
            bundle = Bundle.open(path, hash_data=False, pinned=pinned)  # verified against the base when staged
        else:
            bundle = open_servable_bundle(path, MoECheckpoint(status.base, fp8=True), pinned=pinned)
            if identity is not None and config is not None:
                record_verified(config.status_file, [identity])
    check_free_slot(status.slots, status.taken_by())  # by the engine's last status: unloaded adapters make room
    check_budget(status, bundle.num_experts)
    if bundle.non_expert_tensors:  # which copies it needs: the base's architecture tells shared experts apart
        shared, other = non_expert_kinds(bundle, MoECheckpoint(status.base, fp8=True))
        if shared:
            check_shared_copy(status)
        if other:
            check_module_copy(status)


def _naming_models(scope, receive, send):
    """A `send` that passes a response through as it comes, but holds vLLM's 404 for an unknown model whole and
    sends it naming every model this server answers to."""
    held: list[dict] = []

    async def watch(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] == 404:
            held.append(message)
            return
        if not held:
            await send(message)
            return
        held.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            named = _unknown_model(scope, b"".join(m.get("body", b"") for m in held[1:]))
            if named is None:
                for m in held:
                    await send(m)
            else:
                await named(scope, receive, send)
    return watch


def _unknown_model(scope, body: bytes) -> JSONResponse | None:
    """vLLM's 404 for an unknown model, naming every model this server answers to (None: not vLLM's error)."""
    known = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return None
    if known is not None and "does not exist" in message:
        names = [m.name for m in known.base_model_paths] + sorted(known.lora_requests)
        # vLLM's first sentence, without its full stop (0.25 ends it "exist.", and a second one followed)
        error["message"] = f"{message.split('. ')[0].rstrip('.')}. Servable models: {', '.join(names)}."
    return JSONResponse({"error": error}, status_code=404)
