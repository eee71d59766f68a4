"""esftctl's additions to vLLM's OpenAI server, installed with vLLM's `--middleware` option.

- GET /esftctl/status: the engine's adapter and memory table, as JSON, with the server's process id. The
  engine process writes it to a file after every adapter change (esftctl.runtime.vllm_worker); this serves that file,
  and under tensor parallelism adds every rank's memory from the rank's own file (`per_rank`).
- POST /v1/load_lora_adapter: checked here first, so an expected refusal is a 4xx with its real message (vLLM
  answers an engine-side failure with HTTP 500, a traceback in its log, and file paths masked as `<path>`): a bad
  name or a bundle that is not this base's servable adapter (corrupt, another base, non-expert tensors) is 400,
  and no free slot (by the engine's last status, unloaded adapters making room) is 507, as vLLM's own LoRA
  endpoints answer a full cache.
- A completion for an unknown model: vLLM's 404 names only the base; the answer names every servable model.
- POST /v1/unload_lora_adapter: vLLM's handler forgets the name (new requests for it get vLLM's unknown-
  model error) but leaves the weights in the engine, where LoRA evicts lazily. An ESFT adapter holds a
  slot, so after a successful unload this also tells the engine to remove it; the engine keeps it until
  its last running request finishes (EsftWorkerManager.remove_adapter).
Every other request goes to vLLM untouched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from starlette.responses import JSONResponse, Response

from esftctl.runtime.serve_config import ServeConfig, rank_status_file

STATUS_PATH = "/esftctl/status"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


async def status_middleware(request, call_next):
    if request.url.path == STATUS_PATH and request.method == "GET":
        return _status()
    if request.url.path == LOAD_PATH and request.method == "POST":
        return await _load(request, call_next)
    if request.url.path == UNLOAD_PATH and request.method == "POST":
        return await _unload(request, call_next)
    response = await call_next(request)
    if response.status_code == 404 and request.url.path in COMPLETION_PATHS:
        return await _unknown_model(request, response)
    return response


RANK_FIELDS = ("rank", "device", "base_expert_bytes", "adapter_expert_bytes", "adapter_physical_bytes",
               "expert_device_bytes", "reserved_bytes", "updated")


def _read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _engine_status() -> dict | None:
    """Rank 0's status; under tensor parallelism with `per_rank`, every rank's memory (None for a rank whose
    file is not there yet)."""
    config = ServeConfig.from_env()
    status = _read_status(Path(config.status_file)) if config else None
    if status is None or status.get("ranks", 1) == 1:
        return status
    ranks = [status] + [_read_status(rank_status_file(config.status_file, r)) for r in range(1, status["ranks"])]
    status["per_rank"] = [None if r is None else {k: r.get(k) for k in RANK_FIELDS} for r in ranks]
    return status


def _error(message: str, status_code: int, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status_code}}, status_code=status_code)


def _status() -> JSONResponse:
    status = _engine_status()
    if status is None:
        return JSONResponse({"error": {"message": "the engine has not reported its adapters yet",
                                       "type": "ServiceUnavailable", "code": 503}}, status_code=503)
    return JSONResponse(status | {"server_pid": os.getpid()})  # the launcher checks it started this server


async def _unload(request, call_next):
    state = request.app.state
    try:
        name = (await request.json()).get("lora_name")
    except ValueError:
        name = None
    known = getattr(state, "openai_serving_models", None)
    lora = known.lora_requests.get(name) if known is not None and isinstance(name, str) else None
    response = await call_next(request)
    if lora is not None and response.status_code == 200:
        await state.engine_client.remove_lora(lora.lora_int_id)
    return response


async def _load(request, call_next):
    """Refuse what the engine would refuse, with the real message and a 4xx, before vLLM passes it on."""
    import asyncio

    from esftctl.errors import EsftError

    try:
        body = await request.json()
    except ValueError:
        body = None
    status = _engine_status()
    if not isinstance(body, dict) or status is None:
        return await call_next(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    known = getattr(request.app.state, "openai_serving_models", None)
    if not isinstance(name, str) or not isinstance(path, str) or (known and name in known.lora_requests):
        return await call_next(request)  # vLLM's own answers (missing fields, a name in use)
    variants = {str(Path(p).resolve()) for p in status.get("variant_paths", [])}
    if str(Path(path).resolve()) in variants:
        return await call_next(request)
    try:
        await asyncio.to_thread(_check_load, name, path, status)
    except _NoFreeSlot as e:
        return _error(str(e), 507, "InsufficientStorage")
    except EsftError as e:
        return _error(f"adapter {name!r}: {e}", 400, "BadRequestError")
    return await call_next(request)


class _NoFreeSlot(Exception):
    pass


def _check_load(name: str, path: str, status: dict) -> None:
    from esftctl.checkpoint import MoECheckpoint
    from esftctl.names import check_name
    from esftctl.runtime.serve_config import open_servable_bundle

    check_name(name)
    open_servable_bundle(path, MoECheckpoint(status["base"]))
    held = [a["name"] for a in status["adapters"] if not a["retiring"]]
    variants = [v for v in status.get("variants", []) if not v["home"]]
    if len(held) + len(variants) >= status["slots"]:
        raise _NoFreeSlot(f"adapter {name!r}: no free adapter slot: all {status['slots']} are taken "
                          f"({', '.join(sorted(held + [v['name'] for v in variants]))}); unload one, or serve with "
                          "more --slots")


async def _unknown_model(request, response):
    """vLLM's 404 for an unknown model, naming every model this server answers to."""
    known = getattr(request.app.state, "openai_serving_models", None)
    body = b"".join([chunk async for chunk in response.body_iterator])
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return Response(body, status_code=404, media_type=response.media_type)
    if known is not None and "does not exist" in message:
        names = [m.name for m in known.base_model_paths] + sorted(known.lora_requests)
        # vLLM's first sentence, without its full stop (0.25 ends it "exist.", and a second one followed)
        error["message"] = f"{message.split('. ')[0].rstrip('.')}. Servable models: {', '.join(names)}."
    return JSONResponse({"error": error}, status_code=404)
