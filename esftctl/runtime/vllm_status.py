"""esftctl's additions to vLLM's OpenAI server, installed with vLLM's `--middleware` option.

- GET /esftctl/status: the engine's adapter and memory table, as JSON, with the server's process id. The
  engine process writes it to a file after every adapter change (esftctl.runtime.vllm_worker); this serves that file.
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

from starlette.responses import JSONResponse

from esftctl.runtime.serve_config import ServeConfig

STATUS_PATH = "/esftctl/status"
UNLOAD_PATH = "/v1/unload_lora_adapter"


async def status_middleware(request, call_next):
    if request.url.path == STATUS_PATH and request.method == "GET":
        return _status()
    if request.url.path == UNLOAD_PATH and request.method == "POST":
        return await _unload(request, call_next)
    return await call_next(request)


def _status() -> JSONResponse:
    config = ServeConfig.from_env()
    try:
        status = json.loads(Path(config.status_file).read_text()) if config else None
    except (OSError, ValueError):
        status = None
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
