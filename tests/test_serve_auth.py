"""Authenticated serving (issue 32, items 4 and 5): an API key for `esftctl serve`, its launcher and `esftctl adapters`,
esftctl's own endpoints behind it, and runtime adapter loads limited to `--adapter-root`.

Most of it without vLLM: the middleware is called through FastAPI's test client with spies on what it reads, the
launcher and the client talk to a small HTTP server that wants a key. One test starts `esftctl serve` on vLLM's CPU
build with a key and an adapter root and checks the whole path.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import engine_settings, run_cli, server_args
from rich.console import Console

from esftctl.errors import EsftError
from esftctl.runtime.engine_status import EngineStatus
from esftctl.runtime.serve_config import ServeConfig, ServeSettings
from esftctl.serve import ServePlan, Server, free_port, plan, vllm_api_keys
from esftctl.serve_client import status_table

KEY = "s3cret-key"


# ---- the middleware, through FastAPI's test client ------------------------------------------------------------


@pytest.fixture
def app(tmp_path, monkeypatch):
    """A FastAPI app with esftctl's middleware in front of stand-ins for vLLM's routes; `calls` records what reached
    them and what the middleware read (the status file, a bundle)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from esftctl.runtime.vllm import status as vllm_status

    calls: list[str] = []
    api = FastAPI()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/completions"):
        api.post(path)(lambda path=path: calls.append(path) or {"ok": path})
    api.get("/v1/models")(lambda: calls.append("/v1/models") or {"data": []})
    api.get("/health")(lambda: calls.append("/health") or {})
    api.add_middleware(vllm_status.StatusMiddleware)

    root = tmp_path / "root"
    (root / "bundle").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    status_file = tmp_path / "status.json"
    status_file.write_text(json.dumps(engine_status(base="b", slots=4).to_json()))
    config = ServeConfig(settings=ServeSettings(base=tmp_path, adapter_root=root), slots=4, experts_per_slot=2,
                         status_file=str(status_file))
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    read = vllm_status._read_status
    monkeypatch.setattr(vllm_status, "_read_status", lambda path: calls.append(f"read {path.name}") or read(path))
    monkeypatch.setattr(vllm_status, "_check_load", lambda name, path, status: calls.append(f"open {path}"))
    return TestClient(api), calls, root


def bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_without_a_valid_key_nothing_answers_and_nothing_is_read(app):
    client, calls, root = app
    requests = [("get", "/esftctl/status", None), ("get", "/health", None), ("get", "/v1/models", None),
                ("post", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "bundle")}),
                ("post", "/v1/unload_lora_adapter", {"lora_name": "a"}),
                ("post", "/v1/completions", {"model": "a", "prompt": "x"})]
    for headers in ({}, bearer("wrong"), bearer(KEY + "x"), {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        for method, path, body in requests:
            reply = client.request(method, path, json=body, headers=headers)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.headers["WWW-Authenticate"] == "Bearer"
    assert calls == []  # no route ran, no status file or bundle was read
    assert client.get("/esftctl/status", headers=bearer()).json()["slots"] == 4
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "bundle")},
                       headers=bearer()).status_code == 200
    assert calls == ["read status.json", "read status.json", f"open {root / 'bundle'}", "/v1/load_lora_adapter"]


def test_completions_stream_straight_through_and_an_unknown_model_is_named(monkeypatch):
    """The middleware is plain ASGI: a completion's stream goes to the client without status_middleware (Starlette's
    function middleware, which wraps every streamed chunk), and vLLM's 404 for an unknown model comes back naming
    every servable model; a 404 that is not vLLM's error passes unchanged."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from fastapi.testclient import TestClient

    from esftctl.runtime.vllm import status as vllm_status

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    dispatched = []
    function = vllm_status.status_middleware
    monkeypatch.setattr(vllm_status, "status_middleware",
                        lambda request, call_next: dispatched.append(request.url.path) or function(request, call_next))
    api = FastAPI()

    async def chat(request):  # a Starlette route: the request as it comes
        model = (await request.json())["model"]
        if model == "nope":
            return JSONResponse({"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                           "code": 404}}, status_code=404)
        if model == "garbled":
            return PlainTextResponse("not json", status_code=404)

        async def tokens():
            for k in range(3):
                yield f"data: {k}\n\n".encode()
        return StreamingResponse(tokens(), media_type="text/event-stream")
    api.router.add_route("/v1/chat/completions", chat, methods=["POST"])
    api.add_middleware(vllm_status.StatusMiddleware)
    api.state.openai_serving_models = SimpleNamespace(base_model_paths=[SimpleNamespace(name="base")],
                                                      lora_requests={"b": 1, "a": 2})
    client = TestClient(api)
    reply = client.post("/v1/chat/completions", json={"model": "a"})
    assert reply.status_code == 200 and reply.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    reply = client.post("/v1/chat/completions", json={"model": "nope"})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "The model `nope` does not exist. Servable models: base, a, b."
    reply = client.post("/v1/chat/completions", json={"model": "garbled"})
    assert (reply.status_code, reply.text) == (404, "not json")
    assert dispatched == []
    assert client.get("/esftctl/status").status_code == 503 and dispatched == ["/esftctl/status"]  # no engine yet


def test_keys_given_to_vllm_are_the_ones_checked(app, monkeypatch):
    """`-- --api-key A B` reaches the middleware as vLLM's parsed arguments, which win over VLLM_API_KEY (as in
    vLLM); with no key at all everything answers as before."""
    from types import SimpleNamespace

    client, calls, _ = app
    client.app.state.args = SimpleNamespace(api_key=["first", "second"])
    assert client.get("/health", headers=bearer("second")).status_code == 200
    assert client.get("/health", headers=bearer(KEY)).status_code == 401
    client.app.state.args = SimpleNamespace(api_key=None)
    monkeypatch.delenv("VLLM_API_KEY")
    assert client.get("/esftctl/status").status_code == 200 and client.get("/health").status_code == 200


def test_loads_outside_the_adapter_root_are_forbidden_unopened(app, tmp_path):
    client, calls, root = app
    for path in (tmp_path / "outside", root / "link", root / ".." / "outside", Path("/etc"), "relative/x", "a\0b"):
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)}, headers=bearer())
        assert reply.status_code == 403, (path, reply.text)
        assert f"only from under {root}" in reply.json()["error"]["message"]
    assert calls == []  # not even the status file
    reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "bundle")},
                        headers=bearer())
    assert reply.status_code == 200 and calls[-1] == "/v1/load_lora_adapter"


NO_PATH, BAD_NAME = "lora_path is no file path", "use 1-128 letters"


@pytest.mark.parametrize("body, load", [
    (b"[]", None), (b'"x"', None), (b"1", None), (b"null", None), (b"\xff\xfe", None), (b"{", None),
    (b'{"lora_name": 1, "lora_path": []}', None),  # not strings: vLLM's own answer
    (b'{"lora_name": "a", "lora_path": "a\\u0000b"}', NO_PATH),
    (b'{"lora_name": "a", "lora_path": "\\ud800"}', NO_PATH),
    (b'{"lora_name": "\\ud800", "lora_path": "x"}', BAD_NAME),
    (b'{"lora_name": "a\\u0000", "lora_path": "x"}', BAD_NAME),
])
def test_odd_load_and_unload_bodies_are_answered_not_failed(tmp_path, monkeypatch, body, load):
    """Bodies that are not JSON objects of strings, and paths the file system cannot take (a NUL byte, a lone
    surrogate): a load gets a 400 naming the problem, or goes on to vLLM (`load` None), which answers its own; an
    unload of no known adapter goes on to vLLM. Never a 500 from the middleware (a JSON list sent to the unload
    path and a NUL byte in a load's path were)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from esftctl.runtime.vllm import status as vllm_status

    api = FastAPI()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        api.post(path)(lambda path=path: {"reached": path})
    api.add_middleware(vllm_status.StatusMiddleware)
    status_file = tmp_path / "status.json"
    status_file.write_text(json.dumps(engine_status(base=str(tmp_path)).to_json()))
    config = ServeConfig(settings=ServeSettings(base=tmp_path), slots=4, experts_per_slot=2,
                         status_file=str(status_file))  # no adapter root: every path reaches the checks
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    client = TestClient(api, raise_server_exceptions=False)
    json_headers = {"content-type": "application/json"}
    reply = client.post("/v1/load_lora_adapter", content=body, headers=json_headers)
    if load is None:
        assert reply.status_code == 200 and reply.json() == {"reached": "/v1/load_lora_adapter"}, reply.text
    else:
        assert reply.status_code == 400 and load in reply.json()["error"]["message"], reply.text
    reply = client.post("/v1/unload_lora_adapter", content=body, headers=json_headers)
    assert reply.status_code == 200 and reply.json() == {"reached": "/v1/unload_lora_adapter"}, reply.text


def engine_status(**fields) -> EngineStatus:
    """A status record of an engine serving nothing yet, with `fields` changed."""
    empty = dict(updated=0.0, base="b", device="cpu", rank=0, ranks=1, slots=4, experts_per_slot=2, moe_layers=[],
                 adapters=[], variants=[], variant_map=None, variant_paths=[], variant_switch_bytes=0,
                 base_expert_bytes=0, model_bytes=0, adapter_expert_bytes=0, adapter_budget_bytes=None,
                 reserved_bytes=0, page_bytes=0, adapter_physical_bytes=0, expert_device_bytes=0, padded_bytes=0,
                 merged_bytes=0, kv_cache_tokens=None, host_cache_used_bytes=0, host_cache_hits=0,
                 host_cache_misses=0, paging_window=0)
    return EngineStatus(**empty | fields)


def test_a_load_is_verified_unless_the_engine_holds_its_files_staged(tiny_models, tmp_path, monkeypatch):
    """The middleware's check of a load hashes the bundle's data, unless the engine's status lists the same files,
    unchanged, as staged in its host cache (verified against its base when staged): a warm load of a 2.47 GiB
    adapter took 3.0 s, 2.9 of them this second hash (H100, 2026-11-27). A changed file is checked again. What it
    hashes it records as verified, so that the engine reading it next does not hash it again."""
    from esftctl.formats import bundle as bundle_format
    from esftctl.formats.bundle import DATA_FILE, file_identity, write_bundle
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.runtime.serve_config import was_verified
    from esftctl.runtime.vllm import status as vllm_status
    from esftctl.world.synthetic import synthetic_experts

    base = MoECheckpoint(tiny_models["deepseek_v2"])
    b = tmp_path / "b"
    write_bundle(b, "b", base, synthetic_experts(base, seed=3, experts_per_layer=[1, 2, 1]))
    hashed = []
    real = bundle_format.tensors_sha256
    monkeypatch.setattr(bundle_format, "tensors_sha256", lambda path: hashed.append(path) or real(path))
    status_file = tmp_path / "status.json"
    config = ServeConfig(settings=ServeSettings(base=base.path), slots=4, experts_per_slot=2,
                         status_file=str(status_file))
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    vllm_status._check_load("a", str(b), engine_status(base=str(base.path)))
    assert len(hashed) == 1 and was_verified(status_file, file_identity(b))  # the engine need not hash it again
    staged = engine_status(base=str(base.path), staged_bundles=[[list(part) for part in file_identity(b)]])
    staged = EngineStatus.from_json(json.loads(json.dumps(staged.to_json())))  # as the status file carries it
    vllm_status._check_load("a", str(b), staged)
    assert len(hashed) == 1  # not read again
    data = bytearray((b / DATA_FILE).read_bytes())
    data[-1] ^= 0xFF
    (b / DATA_FILE).write_bytes(bytes(data))
    os.utime(b / DATA_FILE, ns=(1, 1))  # another modification time, whatever the clock's granularity
    with pytest.raises(EsftError, match="checksum mismatch"):
        vllm_status._check_load("a", str(b), staged)
    assert not was_verified(status_file, file_identity(b))


def test_the_status_record_reads_and_writes_the_servers_json():
    """Issue 30: one typed record; on the wire the flat JSON clients have always read (paging keys only while
    paging, the API server's additions only when it adds them)."""
    from esftctl.runtime.engine_status import AdapterStatus, PagingStatus

    paged = engine_status(adapters=[AdapterStatus(name="a", lora_id=1, slot=0, bytes=8, retiring=False,
                                                  experts_per_layer=[1, 2], load_s={"verify": 0.5, "stage": 1.0,
                                                                                    "copy": 0.25},
                                                  loaded_from="file, hashed")],
                          paging=PagingStatus(fetch="auto", store_experts=2, window_bytes=4, resident_bytes=2,
                                              store_bytes=1, host_bytes=9, freed_bytes=2, freed_kv_tokens=None,
                                              held_rows=6, fetched_rows=5, fetches=3, resident_layers=[1],
                                              parked_layers=[2, 3], decisions=[]))
    data = paged.to_json()
    assert data["adapters"][0] == {"name": "a", "lora_id": 1, "slot": 0, "bytes": 8, "retiring": False,
                                   "experts_per_layer": [1, 2], "checked_rows": 0,
                                   "load_s": {"verify": 0.5, "stage": 1.0, "copy": 0.25}, "loaded_from": "file, hashed",
                                   "shared_layers": 0, "modules": 0}
    older = ("load_s", "loaded_from", "shared_layers", "modules")  # a status written before these still reads
    assert AdapterStatus(**{k: v for k, v in data["adapters"][0].items() if k not in older}).load_s == {}
    assert data["paging_store_experts"] == 2 and data["paging_resident_layers"] == [1] and "paging" not in data
    assert data["paging_parked_layers"] == [2, 3]
    console = Console(file=io.StringIO(), width=200)
    console.print(status_table(engine_status(paging=paged.paging, adapter_physical_bytes=None)))  # as paged serving
    assert "2 layers alone in theirs: parked, fetching nothing" in console.file.getvalue()
    console.print(status_table(paged))
    assert "1.75 s file " in console.file.getvalue()  # hashed; the phases are in the JSON above
    narrow = Console(file=io.StringIO(), width=80)
    long_name = "an-adapter-whose-name-is-long"
    narrow.print(status_table(engine_status(adapters=[replace(paged.adapters[0], name=long_name, retiring=True)]
                                            * 3)))
    lines = narrow.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) <= 25, "\n".join(lines)  # a row or two per adapter
    assert long_name in "".join(line.split()[0] if line.strip() else "" for line in lines)  # folded, not cut
    assert "per_rank" not in data and "server_pid" not in data and "paging_store_experts" not in \
        engine_status().to_json()
    assert EngineStatus.from_json(json.loads(json.dumps(data | {"server_pid": 7}))) == \
        engine_status(adapters=paged.adapters, paging=paged.paging, server_pid=7)
    assert paged.taken_by() == ["a"]


# ---- the plan: where the key goes ---------------------------------------------------------------------------


def test_the_key_reaches_vllm_through_its_environment_not_a_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    serve_plan = ServePlan(ServeSettings(base=tmp_path, state_dir=tmp_path / "state", api_key=KEY), tmp_path, "base")
    assert serve_plan.env()["VLLM_API_KEY"] == KEY and serve_plan.request_key == KEY
    assert KEY not in " ".join(serve_plan.command()) and KEY not in repr(serve_plan)
    given = ServePlan(ServeSettings(base=tmp_path, state_dir=tmp_path / "state",
                                    vllm_args=("--api-key", "A", "B", "--enforce-eager")), tmp_path, "base")
    assert given.request_key == "A" and "VLLM_API_KEY" not in given.env()
    monkeypatch.setenv("VLLM_API_KEY", "inherited")  # vLLM reads it: so does the launcher
    assert ServePlan(ServeSettings(base=tmp_path, state_dir=tmp_path / "state"), tmp_path, "base").request_key == \
        "inherited"
    assert vllm_api_keys(["--api-key=K", "--x"]) == ["K"] and vllm_api_keys(["--api_key", "L"]) == ["L"]
    assert vllm_api_keys(["--api-key", "A", "--api-key", "B"]) == ["B"] and vllm_api_keys(["--port", "1"]) == []
    with pytest.raises(EsftError, match="an API key is given twice"):
        plan(tmp_path, [], api_key=KEY, vllm_args=["--api-key", "K"])
    with pytest.raises(EsftError, match="--adapter-root: not a folder"):
        plan(tmp_path, [], adapter_root=tmp_path / "missing")


def test_a_plan_never_started_leaves_no_state_folder(tmp_path, monkeypatch):
    """Issue 32, item 12: every plan made a /tmp/esftctl-serve-* folder, removed only by a server that started and
    stopped cleanly (tests and `bench` make plans they never start, or only ask for their environment)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    serve_plan = ServePlan(ServeSettings(base=tmp_path / "base"), tmp_path / "base", "base")
    assert list(tmp_path.iterdir()) == []
    server = Server(serve_plan)
    server.remove_state()  # nothing to remove, nothing fails
    assert serve_plan.log_file.parent.name.startswith("esftctl-serve-")  # made when first needed
    server.remove_state()
    assert list(tmp_path.iterdir()) == []


# ---- the launcher and the client against a server that wants a key ------------------------------------------


class KeyedServer(http.server.ThreadingHTTPServer):
    """Answers /health, /v1/models, /esftctl/status and the adapter endpoints only with `Authorization: Bearer KEY`,
    as `esftctl serve --api-key KEY` does; `pid` is the process it claims as its server."""

    pid: int | None = None
    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                code, reply = 401, {"error": {"message": "Unauthorized", "code": 401}}
            else:
                self.server.seen.append((self.path, json.loads(body) if body else None))
                code, reply = 200, {"/v1/models": {"data": [{"id": "base"}]},
                                    "/esftctl/status": {"server_pid": self.server.pid, "adapters": [], "slots": 1,
                                                        "base": "b", "device": "cpu", "moe_layers": [1],
                                                        "model_bytes": 1, "adapter_expert_bytes": 0,
                                                        "adapter_physical_bytes": 0, "padded_bytes": 0,
                                                        "merged_bytes": 0}}.get(self.path, "done")
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    def __init__(self):
        super().__init__(("127.0.0.1", 0), self.Handler)
        self.seen = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.parametrize("how", ["--api-key", "after --"])
def test_the_launcher_waits_for_its_server_with_the_key(tmp_path, how, monkeypatch):
    """Issue 32, item 4: the readiness calls sent no key, got 401 and stopped vLLM after the timeout."""
    monkeypatch.setattr(ServePlan, "command", lambda self: ["sleep", "60"])  # "our vLLM"
    with KeyedServer() as fake:
        options = {"api_key": KEY} if how == "--api-key" else {"vllm_args": ["--api-key", KEY]}
        options = {"vllm_args": tuple(options["vllm_args"])} if "vllm_args" in options else options
        settings = ServeSettings(base=tmp_path, port=fake.server_address[1], state_dir=tmp_path / "s", **options)
        serve_plan = ServePlan(settings, tmp_path, "base")
        server = Server(serve_plan)
        server.start()
        fake.pid = server.process.pid
        try:
            server.wait_ready(timeout=10)
        finally:
            server.stop()
        fake.shutdown()


def test_adapters_commands_send_the_key(tmp_path, monkeypatch, capsys):
    from esftctl import cli

    def esftctl(*args) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["esftctl", *map(str, args)])
        with pytest.raises(SystemExit) as stop:
            cli.main()
        out, err = capsys.readouterr()
        return stop.value.code, out, err

    monkeypatch.delenv("ESFTCTL_API_KEY", raising=False)
    with KeyedServer() as fake:
        code, _, err = esftctl("adapters", "list", "--url", fake.url)
        assert code == 1 and err.count("\n") == 1, err
        assert "HTTP 401" in err and "give the server's API key (--api-key or $ESFTCTL_API_KEY)" in err, err
        code, out, err = esftctl("adapters", "list", "--url", fake.url, "--api-key", KEY, "--json")
        assert code == 0 and json.loads(out)["models"] == ["base"], err
        monkeypatch.setenv("ESFTCTL_API_KEY", KEY)  # the variable keeps the key out of `ps`
        assert esftctl("adapters", "load", "a", tmp_path, "--url", fake.url)[0] == 0
        assert esftctl("adapters", "unload", "a", "--url", fake.url)[0] == 0
        assert fake.seen[-2:] == [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}),
                                  ("/v1/unload_lora_adapter", {"lora_name": "a"})]
        code, _, err = esftctl("adapters", "list", "--url", fake.url, "--api-key", "wrong")
        assert code == 1 and "the server refused this API key" in err, err
        fake.shutdown()


# ---- the whole path, on vLLM ---------------------------------------------------------------------------------


@contextlib.contextmanager
def flipping_link(link: Path, targets: tuple[Path, Path], pause: float = 0.0):
    """`link` made a symbolic link to the first target, then flipped between the two (atomically, by renaming a new
    link over it) as fast as it goes, or every `pause` seconds, while the block runs; removed after: the race
    between checking a path and opening it."""
    link.symlink_to(targets[0])
    spare, stop = link.with_name(f".{link.name}-next"), threading.Event()

    def flip():
        order = list(targets)
        while not stop.is_set():
            order.reverse()
            spare.symlink_to(order[0])
            os.replace(spare, link)
            time.sleep(pause)
    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        yield link
    finally:
        stop.set()
        flipper.join()
        link.unlink()


def raw(url: str, path: str, body: dict | None = None, key: str | None = None,
        method: str | None = None) -> tuple[int, dict | str]:
    """One request, its HTTP status and decoded reply, without the client's error handling."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            code, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:  # nothing listens yet
        return 0, str(e)
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


@pytest.mark.vllm
def test_a_server_with_a_key_and_an_adapter_root(world, tmp_path, monkeypatch):
    """`esftctl serve --adapter-root ROOT` with the key in ESFTCTL_API_KEY: every unauthenticated request is 401,
    esftctl's endpoints included; the authorised ones work, `esftctl adapters` with the key too; a load from outside
    ROOT (directly or through a link) is 403, on every route (SageMaker's /adapters too), and under a link flipped
    between an inside and an outside bundle no load serves the outside one; a second load of a loaded name, in
    place or not, is one line saying to unload first; the table is right the moment an unload answers; no route
    leaves a slot behind; the key is on no process's command line."""
    from esftctl.world.synthetic import write_synthetic_adapter

    root = tmp_path / "root"
    inside = write_synthetic_adapter(world.base_dir, root / "inside", "inside", seed=1, experts_per_layer=2)
    outside = write_synthetic_adapter(world.base_dir, tmp_path / "outside", "outside", seed=2, experts_per_layer=3)
    (root / "link").symlink_to(outside)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    proc = subprocess.Popen([sys.executable, "-m", "esftctl.cli", "serve", world.base_dir, "--name", "base",
                             "--port", str(port), "--adapter-root", root, "--state-dir", tmp_path / "state", "--",
                             *server_args(engine_settings())], env={**os.environ, "ESFTCTL_API_KEY": KEY},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and raw(url, "/health", key=KEY)[0] != 200:
            time.sleep(1)
        assert raw(url, "/health", key=KEY)[0] == 200, proc.poll()
        load = {"lora_name": "inside", "lora_path": str(inside)}
        completion = {"model": "base", "prompt": "1", "max_tokens": 1}
        for key in (None, "wrong"):
            assert raw(url, "/esftctl/status", key=key)[0] == 401
            assert raw(url, "/v1/load_lora_adapter", load, key=key)[0] == 401
            assert raw(url, "/v1/unload_lora_adapter", {"lora_name": "inside"}, key=key)[0] == 401
            assert raw(url, "/v1/completions", completion, key=key)[0] == 401
            assert raw(url, "/v1/models", key=key)[0] == 401 and raw(url, "/health", key=key)[0] == 401
        status = raw(url, "/esftctl/status", key=KEY)[1]
        assert status["adapters"] == []  # the unauthenticated load did nothing
        for pid in (status["server_pid"], proc.pid):
            assert KEY not in Path(f"/proc/{pid}/cmdline").read_text()

        monkeypatch.delenv("ESFTCTL_API_KEY", raising=False)
        listed = run_cli("adapters", "list", "--url", url, "--api-key", KEY, "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)["models"] == ["base"], listed.stderr
        monkeypatch.setenv("ESFTCTL_API_KEY", KEY)
        run_cli("adapters", "load", "inside", inside, "--url", url, check=True)
        code, reply = raw(url, "/v1/completions", {**completion, "model": "inside"}, key=KEY)
        assert code == 200 and reply["choices"], reply
        for name, path in (("outside", outside), ("linked", root / "link")):
            refused = run_cli("adapters", "load", name, path, "--url", url)
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
            assert f"loads adapters only from under {root}" in refused.stderr and "HTTP 403" in refused.stderr
        assert raw(url, "/adapters", {"name": "sm", "src": str(outside)}, key=KEY)[0] == 403
        assert raw(url, "/adapters/inside", method="DELETE", key=KEY)[0] == 403
        again = run_cli("adapters", "load", "inside", inside, "--url", url)
        assert again.returncode == 1 and "unload it first (esftctl adapters unload inside)" in again.stderr
        code, reply = raw(url, "/v1/load_lora_adapter", {**load, "load_inplace": True}, key=KEY)
        assert code == 400 and "unload it first" in reply["error"]["message"]
        assert [a["name"] for a in raw(url, "/esftctl/status", key=KEY)[1]["adapters"]] == ["inside"]
        run_cli("adapters", "unload", "inside", "--url", url, check=True)
        listed = json.loads(run_cli("adapters", "list", "--url", url, "--json", check=True).stdout)
        assert all(a["retiring"] for a in listed["adapters"] if a["name"] == "inside"), listed
        assert [m["id"] for m in raw(url, "/v1/models", key=KEY)[1]["data"]] == ["base"]

        answers, served = [], []
        with flipping_link(root / "flip", (inside, outside), pause=0.0005) as flip:  # the audit's rate
            for k in range(30):  # each one loaded is checked and unloaded: slots never run out
                answers.append(raw(url, "/v1/load_lora_adapter", {"lora_name": f"f{k}", "lora_path": str(flip)},
                                   key=KEY)[0])
                if answers[-1] == 200:
                    status = raw(url, "/esftctl/status", key=KEY)[1]["adapters"]
                    served += [a["experts_per_layer"] for a in status if a["name"] == f"f{k}"]
                    run_cli("adapters", "unload", f"f{k}", "--url", url, check=True)
        assert set(answers) <= {200, 403, 500}, answers  # 500: the engine's own refusal of a link out
        assert len(served) == answers.count(200) and all(set(s) == {2} for s in served), (answers, served)
        run_cli("adapters", "load", "inside", inside, "--url", url, check=True)  # no slot left behind
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "serving at" in out
