"""What esftctl's HTTP middleware adds to a streamed completion, without vLLM: a FastAPI app streaming 128 chunks
4 ms apart (a decode step), served by uvicorn three ways (no middleware, as plain vLLM; status_middleware as
Starlette's function middleware, what `esftctl serve` installed before 2026-11-27's eleventh session; the plain
ASGI StatusMiddleware it installs now), each timed over 20 requests: the median first chunk and the median gap
between later chunks, three rounds. Runs on the CPU; no key set (the key check is the same in both forms).
Usage: python3 benchmarks/lab/middleware_cost.py
"""

import asyncio
import statistics
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from esftctl.runtime.vllm.status import StatusMiddleware, status_middleware


def app(kind: str) -> FastAPI:
    api = FastAPI()

    @api.post("/v1/completions")
    async def completions():
        async def tokens():
            for i in range(128):
                await asyncio.sleep(0.004)
                yield f'data: {{"i": {i}}}\n\n'.encode()
        return StreamingResponse(tokens(), media_type="text/event-stream")
    if kind == "function":
        api.middleware("http")(status_middleware)
    elif kind == "class":
        api.add_middleware(StatusMiddleware)
    return api


def serve(api: FastAPI, port: int) -> None:
    server = uvicorn.Server(uvicorn.Config(api, port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)


def measure(port: int, n: int = 20) -> tuple[float, float]:
    firsts, gaps = [], []
    with httpx.Client() as client:
        for _ in range(n):
            start, first, last = time.perf_counter(), None, None
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions") as reply:
                for _chunk in reply.iter_raw():
                    last = time.perf_counter()
                    first = first if first is not None else last - start
            firsts.append(first)
            gaps.append((last - start - first) / 127)
    return 1e3 * statistics.median(firsts), 1e3 * statistics.median(gaps)


ports = {"none": 18001, "function": 18002, "class": 18003}
for kind, port in ports.items():
    serve(app(kind), port)
for _ in range(3):
    for kind, port in ports.items():
        first, gap = measure(port)
        print(f"{kind:9s} first chunk {first:6.2f} ms, then {gap:6.3f} ms a chunk")
