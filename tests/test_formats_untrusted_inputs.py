"""Model folders, expert configs, scores files, fine-tunes, serve state folders and consolidated maps as untrusted
input: what a writer copies out of a model folder is the folder's own files, never what a link points to; layer keys
of any length are one line; non-finite experts are not packed; a server's state folder and its files are private;
and a map names the same models from every folder, checked against their fingerprints."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_formats_fp8 import fp8_world  # noqa: F401 (a fixture)

from esftctl.consolidate import MAP_FILE, ExpertMap, average, consolidate, materialize
from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.formats.esft_adapter import import_adapter
from esftctl.jsonfile import write_json
from esftctl.pack import pack
from esftctl.relevance import Relevance
from esftctl.runtime.serve_config import ServeSettings
from esftctl.selection import ExpertConfig
from esftctl.serve import ServePlan, Server
from esftctl.variants import VariantSet
from esftctl.world.synthetic import synthetic_experts


def model_copy(src: Path, dst: Path) -> Path:
    """A model folder of regular files, copied from `src`."""
    shutil.copytree(src, dst, symlinks=False)
    return dst


def tmp_leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


# ---- item 5: a model folder's extra files ---------------------------------------------------------------------


@pytest.mark.parametrize("plant", ["outside", "environ", "dangling", "fifo"])
def test_a_model_folders_links_and_special_files_are_refused_not_copied(tiny_models, tmp_path, plant):
    """A base with README.md -> ~/private or extra.txt -> /proc/self/environ gave a merged checkpoint (what people
    publish) holding the private file and the environment as 0644 files; a FIFO was skipped without a word."""
    base = model_copy(tiny_models["deepseek_v2"], tmp_path / "base")
    secret = tmp_path / "private"
    secret.write_text("my private notes")
    planted = base / ("extra.txt" if plant == "environ" else "README.md")
    if plant == "fifo":
        os.mkfifo(planted)
    else:
        planted.symlink_to({"outside": secret, "environ": Path("/proc/self/environ"),
                            "dangling": tmp_path / "gone"}[plant])
    out = tmp_path / "out"
    with pytest.raises(EsftError) as refused:
        write_checkpoint(MoECheckpoint(base), out)
    message = str(refused.value)
    assert message.startswith(f"{planted}: ") and "\n" not in message
    assert ("symbolic link" if plant != "fifo" else "not a regular file") in message
    assert not out.exists() and not tmp_leftovers(tmp_path)
    with pytest.raises(EsftError, match=f"^{planted}: "):  # average and materialize write through it too
        average([base, base], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_links_inside_the_model_folder_and_into_a_hugging_face_cache_are_copied_as_files(tiny_models, tmp_path):
    """A Hugging Face cache snapshot holds every file as a link into ../../blobs, and a folder may link one of its
    files to another: those are copied by content, as regular files (a link to outside stays refused)."""
    src = Path(tiny_models["deepseek_v2"])
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    (repo / "blobs" / "readme").write_text("# tiny")
    (snapshot / "README.md").symlink_to(Path("../../blobs/readme"))
    (snapshot / "LICENSE").symlink_to("README.md")  # inside the folder itself
    out = write_checkpoint(MoECheckpoint(snapshot), tmp_path / "out")
    for name in ("README.md", "LICENSE", "config.json"):
        assert stat.S_ISREG(os.lstat(out / name).st_mode)
    assert (out / "LICENSE").read_text() == "# tiny" and (out / "config.json").read_bytes() == \
        (src / "config.json").read_bytes()

    (tmp_path / "elsewhere").write_text("not the model's")
    (snapshot / "NOTES").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EsftError, match=f"^{snapshot / 'NOTES'}: .*symbolic link"):
        write_checkpoint(MoECheckpoint(snapshot), tmp_path / "out2")


def test_a_file_swapped_for_a_link_after_the_check_is_not_followed(tiny_models, tmp_path, monkeypatch):
    """The copy opens the name it checked without following a link: a swap between the check and the open is
    refused, not copied."""
    from esftctl.formats import checkpoint

    base = model_copy(tiny_models["deepseek_v2"], tmp_path / "base")
    (base / "README.md").write_text("fine")
    (tmp_path / "private").write_text("secret")
    checked = checkpoint._extra_files

    def swap_after_check(folder):
        found = checked(folder)
        (base / "README.md").unlink()
        (base / "README.md").symlink_to(tmp_path / "private")
        return found

    monkeypatch.setattr(checkpoint, "_extra_files", swap_after_check)
    with pytest.raises(EsftError, match=f"^{base / 'README.md'}: .*symbolic link"):
        write_checkpoint(MoECheckpoint(base), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- item 7: layer keys of any length ----------------------------------------------------------------------


LONG_KEY = "1" * 5000  # past int()'s 4,300 digits


def test_an_expert_config_layer_key_of_thousands_of_digits_is_one_line(tiny_models, tmp_path):
    where = tmp_path / "cfg.json"
    where.write_text(json.dumps({"experts": {LONG_KEY: [0]}}))
    with pytest.raises(EsftError) as refused:
        ExpertConfig.load(where)
    message = str(refused.value)
    assert message.startswith(f"{where}: ") and len(message) < 400 and "layer index" in message
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    with pytest.raises(EsftError, match=f"^{where}: "):
        pack(base.path, base.path, tmp_path / "out", "a", where)
    # a DeepSeek ESFT adapter folder's expert_cfg.json
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    name = base.arch.expert_tensor(1, 0, "gate")
    save_file({name: base.read_tensor(name)}, adapter / "model.safetensors")
    (adapter / "expert_cfg.json").write_text(json.dumps({"experts": {LONG_KEY: [0]}}))
    with pytest.raises(EsftError, match=rf"^{adapter / 'expert_cfg.json'}: "):
        import_adapter(base.path, adapter, tmp_path / "out", name="a")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["1_0", " 1", "-1", "+1", LONG_KEY])
def test_a_scores_file_layer_key_is_plain_digits(tmp_path, key):
    """int() reads "1_0" as 10 and " 1" as 1: a scores file's layer keys are the digits esftctl writes."""
    good = Relevance("m", "d", 3, 30, 2, [1, 10], {m: {1: [0.5, 0.5], 10: [0.25, 0.75]} for m in ("gate", "token")})
    where = tmp_path / "scores.json"
    good.save(where)
    assert Relevance.load(where).scores == good.scores
    d = good.to_json()
    for m in ("gate", "token"):
        d["scores"][m] = {key if k == "10" else k: v for k, v in d["scores"][m].items()}
    where.write_text(json.dumps(d))
    with pytest.raises(EsftError) as refused:
        Relevance.load(where)
    assert str(refused.value).startswith(f"{where}: ") and len(str(refused.value)) < 400
    d = good.to_json() | {"moe_layers": [1, "10"]}  # a layer as a string, read by int() before
    where.write_text(json.dumps(d))
    with pytest.raises(EsftError, match=f"^{where}: "):
        Relevance.load(where)


# ---- item 8: non-finite experts of a fine-tune of an FP8 base -------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_pack_refuses_a_non_finite_changed_expert_of_a_plain_fine_tune_of_an_fp8_base(fp8_world, tmp_path,  # noqa: F811
                                                                                      value):
    tuned = Path(fp8_world["tuned"])
    layer, ids = next(iter(sorted(fp8_world["synthetic"].experts.items())))
    name = MoECheckpoint(tuned).arch.expert_tensor(layer, ids[0], "down")
    bad = tmp_path / "tuned"
    bad.mkdir()
    for f in tuned.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, bad / f.name)
    tensors = load_file(tuned / "model.safetensors")
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = value
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EsftError) as refused:
        pack(fp8_world["base"], bad, tmp_path / "out", "a")
    message = str(refused.value)
    assert message.startswith(f"{bad / 'model.safetensors'}: ") and name in message and "finite" in message
    assert not (tmp_path / "out").exists()


# ---- item 9: a server's state folder --------------------------------------------------------------------


@pytest.fixture
def started(tmp_path, monkeypatch):
    """start(state_dir): a Server of a plan whose "vLLM" is `true`, started with that state folder (and a bundle
    recorded as verified, as the launcher records those it hashed), stopped again."""
    monkeypatch.setattr(ServePlan, "command", lambda self: ["true"])
    servers = []

    def start(state_dir: Path) -> Server:
        serve_plan = ServePlan(ServeSettings(base=tmp_path, state_dir=state_dir), tmp_path, "base",
                               verified=[((1, 2, 3, 4),)])
        server = Server(serve_plan)
        servers.append(server)
        server.start()
        server.process.wait()
        return server

    yield start
    for server in servers:
        server.stop()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_state_folder_and_its_files_are_private(started, tmp_path):
    old = os.umask(0o022)
    try:
        server = started(tmp_path / "deep" / "state")
    finally:
        os.umask(old)
    state = tmp_path / "deep" / "state"
    assert mode(state) == 0o700
    assert mode(state / "vllm.log") == 0o600 and mode(state / "verified.json") == 0o600
    assert server.plan.log_file == state / "vllm.log"


def test_an_own_state_folder_readable_by_others_is_tightened(started, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)
    (state / "vllm.log").write_text("an earlier run\n")
    (state / "vllm.log").chmod(0o644)
    started(state)
    assert mode(state) == 0o700 and mode(state / "vllm.log") == 0o600
    assert (state / "vllm.log").read_text().startswith("an earlier run\n")  # appended to, as before


@pytest.mark.parametrize("bits", [0o775, 0o757, 0o1777])
def test_a_state_folder_others_may_write_is_refused(started, tmp_path, bits):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(bits)
    with pytest.raises(EsftError, match=rf"^{state}: .*writable by others"):
        started(state)
    assert list(state.iterdir()) == []


def test_a_state_folder_of_another_user_is_refused(started, tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(state).st_uid + 1)
    with pytest.raises(EsftError, match=rf"^{state}: .*belongs to another user"):
        started(state)


def test_a_state_folder_that_is_a_file_or_under_one_is_one_line(started, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(EsftError, match=rf"^{tmp_path / 'file'}: --state-dir: not a folder$"):
        started(tmp_path / "file")
    with pytest.raises(EsftError, match=rf"^{tmp_path / 'file' / 'state'}: cannot create the state folder"):
        started(tmp_path / "file" / "state")


def test_a_planted_log_link_receives_nothing(started, tmp_path):
    """A `vllm.log` link left in the state folder (one that was writable before) would receive the server's log."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "collected"
    target.write_text("")
    (state / "vllm.log").symlink_to(target)
    with pytest.raises(EsftError, match=rf"^{state / 'vllm.log'}: .*symbolic link"):
        started(state)
    assert target.read_text() == ""


def test_a_temporary_state_folder_stays_private(started, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    server = started(None)
    assert mode(server.plan.state) == 0o700 and mode(server.plan.log_file) == 0o600
    server.remove_state()


def test_json_written_into_a_private_folder_stays_private(tmp_path):
    """The engine writes its status beside the log (esftctl.jsonfile.write_json): private there, umask's elsewhere."""
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir()
    private.chmod(0o700)
    shared.mkdir()
    shared.chmod(0o755)
    old = os.umask(0o022)
    try:
        write_json(private / "status.json", {"a": 1})
        write_json(shared / "status.json", {"a": 1})
    finally:
        os.umask(old)
    assert mode(private / "status.json") == 0o600 and mode(shared / "status.json") == 0o644


# ---- item 10: consolidated maps -----------------------------------------------------------------------


@pytest.fixture
def two_variants(tiny_models, tmp_path):
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    dirs = []
    for k in (1, 2):
        reps = expert_replacements(base, {(l, e): w for l, per in synthetic_experts(
            base, seed=k, experts_per_layer=2, scale=2.0).items() for e, w in per.items()})
        router = base.arch.router_tensor(base.moe_layers[0])
        reps[router] = base.read_tensor(router) + k  # the variants' own routers: fingerprints differ
        dirs.append(write_checkpoint(base, tmp_path / "models" / f"v{k}", reps))
    return dirs


def test_relative_variant_paths_resolve_against_the_maps_folder(two_variants, tmp_path, monkeypatch):
    """The same map and --variant 0 materialized from two folders gave two different checkpoints (relative paths
    resolved against the current folder)."""
    consolidate(two_variants, tmp_path / "map", capacity=10)
    d = json.loads((tmp_path / "map" / MAP_FILE).read_text())
    d["models"] = [os.path.relpath(p, tmp_path / "map") for p in two_variants]  # ../models/v1, ...
    (tmp_path / "map" / MAP_FILE).write_text(json.dumps(d))
    # a decoy where the relative paths would land from another folder: the variants swapped
    (tmp_path / "x" / "cwd").mkdir(parents=True)
    (tmp_path / "x" / "models").mkdir()
    for name, src in zip(("v1", "v2"), reversed(two_variants)):
        (tmp_path / "x" / "models" / name).symlink_to(src)
    outs = []
    for k, cwd in enumerate((tmp_path / "map", tmp_path / "x" / "cwd")):
        monkeypatch.chdir(cwd)
        outs.append(materialize(tmp_path / "map", 0, tmp_path / f"m{k}"))
        assert VariantSet.open(tmp_path / "map").paths == [Path(p).resolve() for p in two_variants]
    a, b = (load_file(o / "model.safetensors") for o in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_variant_that_changed_since_the_map_was_made_is_refused(two_variants, tmp_path):
    consolidate(two_variants, tmp_path / "map", capacity=10)
    d = json.loads((tmp_path / "map" / MAP_FILE).read_text())
    assert len(d["fingerprints"]) == 2 and all(f.startswith("sha256:") for f in d["fingerprints"])
    shutil.rmtree(two_variants[1])
    base = MoECheckpoint(two_variants[0])
    router = base.arch.router_tensor(base.moe_layers[-1])
    write_checkpoint(base, two_variants[1], {router: base.read_tensor(router) * 2})  # another model, same place
    where = tmp_path / "map" / MAP_FILE
    for read in (lambda: materialize(tmp_path / "map", 0, tmp_path / "m"), lambda: VariantSet.open(tmp_path / "map")):
        with pytest.raises(EsftError, match=rf"^{where}: variant 1 of the map, \S*v2, is not the model the map was "
                                            r"made of .*run `esftctl consolidate` again$"):
            read()
    assert not (tmp_path / "m").exists()


def test_a_map_without_fingerprints_is_refused(two_variants, tmp_path):
    consolidate(two_variants, tmp_path / "map", capacity=10)
    where = tmp_path / "map" / MAP_FILE
    d = json.loads(where.read_text())
    del d["fingerprints"]
    where.write_text(json.dumps(d | {"version": 1}))
    for read in (lambda: ExpertMap.load(where), lambda: materialize(tmp_path / "map", 0, tmp_path / "m"),
                 lambda: VariantSet.open(tmp_path / "map")):
        with pytest.raises(EsftError, match=rf"^{where}: .*fingerprints.*run `esftctl consolidate` again"):
            read()


def test_a_map_of_thousands_of_variants_is_refused_at_once(tmp_path):
    """A 20,000-entry models list ran past 120 s."""
    import time

    n = 20_000
    d = {"format": "esftctl-expert-map", "version": 2, "models": [f"/m/{i}" for i in range(n)],
         "fingerprints": ["sha256:" + "0" * 64] * n, "moe_layers": [1], "num_experts": 2, "capacity": 2,
         "map": {"1": [0, 1]}}
    where = tmp_path / MAP_FILE
    where.write_text(json.dumps(d))
    start = time.monotonic()
    with pytest.raises(EsftError, match=rf"^{where}: malformed expert map: models must .* at most 64"):
        VariantSet.open(tmp_path)
    assert time.monotonic() - start < 5
