"""Adapter bundles as untrusted input (issue 32): crafted manifests and data files are refused with one line
naming the file, never a traceback, a hang or a wrong result; files outside the bundle are neither read nor
revealed; and a small fuzz pass (fixed seed, time-bounded) over manifests and data through every reader."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from esftctl.describe import describe_path
from esftctl.errors import EsftError
from esftctl.formats.bundle import DATA_FILE, MANIFEST, Bundle, manifest_sha256, write_bundle
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.formats.esft_adapter import export_adapter
from esftctl.merge import merge
from esftctl.world.synthetic import synthetic_experts


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    """(base folder, a bundle of it with 1, 2 and 1 experts in MoE layers 1-3, its experts as read)."""
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    write_bundle(out, "tiny", base, synthetic_experts(base, seed=3, experts_per_layer=[1, 2, 1], scale=2.0))
    return base.path, out, Bundle.open(out).read_experts()


def crafted(src: Path, dst: Path, edit=None, raw: str | None = None) -> Path:
    """A copy of bundle `src` whose manifest `edit(manifest)` changed, its checksum recomputed as an attacker would
    (or whose manifest text is `raw`): what the field checks stand against."""
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST).read_text())
    if edit is not None:
        edit(m)
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            m["manifest_sha256"] = manifest_sha256(m)
    (dst / MANIFEST).write_text(raw if raw is not None else json.dumps(m))
    return dst


def test_experts_read_into_place_are_the_experts_read_and_a_cut_file_is_one_line(tiny, tmp_path, monkeypatch):
    """A served load's staging reads a bundle's experts straight into their stacked rows, on several threads
    (Bundle.stored_experts, stack_experts): the rows equal those stacked from the experts read one by one, a
    destination of another dtype is converted, and a data file cut after it was opened is one line naming it."""
    from esftctl.runtime import moe_layer
    from esftctl.runtime.moe_layer import stack_experts

    monkeypatch.setattr(moe_layer, "STAGE_THREADED_BYTES", 0)  # these tiny layers on threads too
    monkeypatch.setattr(moe_layer.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # also on a one-core CI
    _, src, read = tiny
    stored = Bundle.open(src).stored_experts()
    assert {l: sorted(per) for l, per in stored.items()} == {l: sorted(per) for l, per in read.items()}
    for layer, per in read.items():
        ids = sorted(per)
        into_place = stack_experts([stored[layer][e] for e in ids])
        for got, want in zip(into_place, stack_experts([per[e] for e in ids]), strict=True):
            assert torch.equal(got, want)
    part = stored[2][sorted(stored[2])[0]].part("down")
    wide = torch.empty(part.shape, dtype=torch.float32)
    part.read_into(wide)
    assert torch.equal(wide, part.read().float()) and part.read().dtype != torch.float32
    cut = shutil.copytree(src, tmp_path / "cut")
    late = Bundle.open(cut).stored_experts()
    os.truncate(cut / DATA_FILE, (cut / DATA_FILE).stat().st_size // 2)
    with pytest.raises(EsftError, match=re.escape(f"{cut / DATA_FILE}: the file ends inside tensor")) as failed:
        for per in late.values():
            stack_experts(list(per.values()))
    assert "\n" not in str(failed.value)


@contextlib.contextmanager
def deadline(seconds: int):
    """A blocking read (a FIFO) becomes a failure after `seconds`, not a hung test run."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def unblocked(fifo: Path, after: float = 10):
    """If a reader still waits on `fifo` after `after` seconds, a shell opens and closes its write end, so that
    the reader gets on and the test fails instead of hanging (a FIFO's open can block in C holding the GIL, where
    neither a signal handler nor a thread of this process runs)."""
    writer = subprocess.Popen(["sh", "-c", 'sleep "$1"; : > "$2"', "sh", str(after), str(fifo)])
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


def refused(path: Path, match: str) -> str:
    """Bundle.open(path) fails with one line that matches `match`; the message."""
    with deadline(20), pytest.raises(EsftError, match=match) as e:
        Bundle.open(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def _set(path: str, value):
    def edit(m):
        *parents, last = path.split(".")
        for key in parents:
            m = m[key]
        m[last] = value
    return edit


@pytest.mark.parametrize("path,value,match", [
    ("version", True, "version True is not supported"),
    ("name", "../../x", r"manifest.json: manifest adapter name '\.\./\.\./x'"),
    ("name", 123, "manifest.json: manifest field name must be a string, not 123"),
    ("name", None, "field name must be a string, not None"),
    ("experts", {"1": [3, 3]}, r"field experts\[1\] must be a list without repeats"),
    ("experts", {"1": [16]}, r"field experts\[1\]\[0\] must be an integer from 0 to 15, not 16"),
    ("experts", {"1": [True]}, r"field experts\[1\]\[0\] must be an integer"),
    ("experts", {"1": ["3"]}, r"field experts\[1\]\[0\] must be an integer"),
    ("experts", {"0": [1]}, r"field experts must be keyed by the base's MoE layers \(1-3\), not '0'"),
    ("experts", {"01": [1]}, "field experts must be keyed by the base's MoE layers"),
    ("experts", [1], "field experts must be an object"),
    ("shapes", {"gate": [64, 256], "up": [64, 256], "down": [64, 256]}, "field shapes must be the base's"),
    ("dtype", "F32", "field dtype must be the base's expert dtype 'BF16'"),
    ("base.num_experts", 10**30, "field base.num_experts must be an integer from 1 to"),
    ("base.num_experts", 2.0, "field base.num_experts must be an integer"),
    ("base.moe_layers", [1, 2, 9], r"field base.moe_layers\[2\] must be an integer from 0 to 3"),
    ("base.moe_layers", [3, 2, 1], "field base.moe_layers must be a non-empty list in increasing order"),
    ("base.fingerprint", "sha256:zz", "field base.fingerprint must be 'sha256:' and 64 hex digits"),
    ("base", None, "field base must be an object"),
    ("non_expert_tensors", ["a", "a"], "non_expert_tensors must be a list without repeats"),
    ("tensors_sha256", None, "field tensors_sha256 must be a string"),
    ("file", "/etc/passwd", "field file must name a file in the bundle folder, not '/etc/passwd'"),
    ("file", "../x.safetensors", "field file must name a file in the bundle folder"),
    ("file", ".", "field file must name a file in the bundle folder"),
    ("file", 7, "field file must be a string"),
])
def test_manifest_fields_are_checked(tiny, tmp_path, path, value, match):
    """Every field type- and range-checked against the declared base before anything trusts it (these
    ended in tracebacks, or were accepted: True as version 1, a name of `../../x`, 123 or null)."""
    bundle = crafted(tiny[1], tmp_path / "b", _set(path, value))
    assert refused(bundle, match).startswith(str(bundle / MANIFEST))


@pytest.mark.parametrize("raw,match", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON .nested too deeply"),
    ('{"format": "esftctl-adapter", "version": 1' + "0" * 100_000 + "}", "not valid JSON"),
    ("\xff\xfe", "not valid JSON"),
    ('"' + "x" * (17 << 20) + '"', "larger than 16777216 bytes"),
    ("[1]", "not an esftctl adapter manifest"),
])
def test_manifest_json_is_bounded(tiny, tmp_path, raw, match):
    refused(crafted(tiny[1], tmp_path / "b", raw=raw), "manifest.json: " + match)


def test_files_outside_the_bundle_are_not_read_or_revealed(tiny, tmp_path):
    """A data file given as a path out of the folder, or a link out of it, and a manifest that is a link out of
    it are refused by name alone: the message is the same whether the outside file exists or not."""
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tiny[1] / DATA_FILE, outside)
    messages = []
    for exists in (True, False):
        for case, edit in (("dotdot", _set("file", "../outside.safetensors")),
                           ("absolute", _set("file", str(outside)))):
            b = crafted(tiny[1], tmp_path / f"{case}-{exists}", edit)
            messages.append(refused(b, "must name a file in the bundle folder").replace(str(b), "B"))
        b = crafted(tiny[1], tmp_path / f"link-{exists}")
        (b / DATA_FILE).unlink()
        (b / DATA_FILE).symlink_to(outside)
        messages.append(refused(b, "is a link out of the bundle folder").replace(str(b), "B"))
        b = crafted(tiny[1], tmp_path / f"manifest-link-{exists}")
        shutil.move(b / MANIFEST, tmp_path / f"outside-{exists}.json")
        (b / MANIFEST).symlink_to(tmp_path / f"outside-{exists}.json" if exists else tmp_path / "none.json")
        messages.append(refused(b, "manifest.json: is a link out of the bundle folder").replace(str(b), "B"))
        outside.unlink(missing_ok=True)
    assert messages[:4] == messages[4:]
    inside = crafted(tiny[1], tmp_path / "inside", _set("file", "data.safetensors"))  # another plain name: fine
    (inside / DATA_FILE).rename(inside / "data.safetensors")
    assert Bundle.open(inside).data_file == inside / "data.safetensors"


def test_only_regular_files_are_opened(tiny, tmp_path):
    """A FIFO as data file or manifest is refused at once (it blocked every command, ignoring SIGTERM), and so
    are a folder or a device."""
    fifo = crafted(tiny[1], tmp_path / "fifo")
    (fifo / DATA_FILE).unlink()
    os.mkfifo(fifo / DATA_FILE)
    fifo_manifest = crafted(tiny[1], tmp_path / "fifo-manifest")
    (fifo_manifest / MANIFEST).unlink()
    os.mkfifo(fifo_manifest / MANIFEST)
    start = time.monotonic()
    with unblocked(fifo / DATA_FILE), unblocked(fifo_manifest / MANIFEST):
        refused(fifo, f"{DATA_FILE}: not a regular file")
        refused(fifo_manifest, f"{MANIFEST}: not a regular file")
    assert time.monotonic() - start < 5
    folder = crafted(tiny[1], tmp_path / "folder")
    (folder / DATA_FILE).unlink()
    (folder / DATA_FILE).mkdir()
    refused(folder, "not a regular file")
    device = crafted(tiny[1], tmp_path / "device")
    (device / DATA_FILE).unlink()
    (device / DATA_FILE).symlink_to("/dev/zero")
    refused(device, "link out of the bundle folder")


def test_data_header_is_checked_before_hashing(tiny, tmp_path):
    """A data file whose header says other tensors than the manifest is named as such (checked before the
    checksum); one whose tensors overrun the file is refused by esftctl's own header check."""
    b = crafted(tiny[1], tmp_path / "b")
    raw = (b / DATA_FILE).read_bytes()
    (b / DATA_FILE).write_bytes(raw + b"\0" * 10)
    refused(b, "corrupted or truncated: its tensors end at byte")
    (b / DATA_FILE).write_bytes((1 << 62).to_bytes(8, "little") + raw[8:])
    refused(b, "corrupted or truncated: a header of")


def test_base_identity_is_compared_whole(tiny, tmp_path):
    """A manifest that changes a base field it records (within range) opens, and any base then refuses it."""
    b = crafted(tiny[1], tmp_path / "b", _set("base.top_k", 3))
    Bundle.open(b)
    with pytest.raises(EsftError, match="packed for another base model .*differs in top_k"):
        merge(tiny[0], b, tmp_path / "merged")


def test_host_cache_keys_by_the_data_file_the_manifest_names(tiny, tmp_path):
    """The key follows the manifest's `file`, not experts.safetensors (a decoy beside it stays unchanged)."""
    from esftctl.formats.bundle import file_identity
    from esftctl.runtime.host_cache import HostAdapterCache

    b = crafted(tiny[1], tmp_path / "b", _set("file", "data.safetensors"))
    shutil.copy(b / DATA_FILE, b / "data.safetensors")
    key = file_identity(b)
    os.utime(b / "data.safetensors", ns=(1, 1))
    assert file_identity(b) != key
    os.utime(b / DATA_FILE, ns=(1, 1))
    assert file_identity(b) == file_identity(b)
    cache = HostAdapterCache(1 << 20)
    assert cache.lookup(crafted(tiny[1], tmp_path / "bad", _set("file", "../x")))[0] is None


def test_bytes_verified_already_are_not_hashed_again_but_still_checked(tiny, tmp_path):
    """A server's record of the bundles its launcher and middleware verified (runtime.serve_config), by file
    identity: the engine then opens such a bundle with every check but the data's checksum
    (Bundle.open(hash_data=False)); a changed file has another identity and is hashed again, and so is one verified
    more than VERIFIED_FOR_S ago. The record keeps the newest VERIFIED_KEEP."""
    from esftctl.formats.bundle import file_identity
    from esftctl.runtime.serve_config import (
        VERIFIED_FOR_S,
        VERIFIED_KEEP,
        record_verified,
        verified_record,
        was_verified,
    )

    b = tmp_path / "b"
    shutil.copytree(tiny[1], b)
    status_file = tmp_path / "state" / "status.json"
    status_file.parent.mkdir()
    identity = file_identity(b)
    assert not was_verified(status_file, identity)
    record_verified(status_file, [identity])
    assert was_verified(status_file, identity) and not was_verified(status_file, None)
    [[entry, at]] = json.loads(verified_record(status_file).read_text())
    verified_record(status_file).write_text(json.dumps([[entry, at - VERIFIED_FOR_S - 1]]))
    assert not was_verified(status_file, identity)  # verified too long ago: hashed again
    record_verified(status_file, [identity])
    assert was_verified(status_file, identity)
    raw = bytearray((b / DATA_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (b / DATA_FILE).write_bytes(bytes(raw))
    os.utime(b / DATA_FILE, ns=(1, 1))  # another modification time, whatever the clock's granularity
    assert not was_verified(status_file, file_identity(b))
    with pytest.raises(EsftError, match="checksum mismatch"):
        Bundle.open(b)
    Bundle.open(b, hash_data=False)  # what it skips is the data's checksum alone:

    def other_experts(m):
        m["experts"]["1"] = [e for e in range(16) if e not in m["experts"]["1"]][:len(m["experts"]["1"])]
    with pytest.raises(EsftError, match="is missing"):
        Bundle.open(crafted(tiny[1], tmp_path / "moved", other_experts), hash_data=False)
    for k in range(VERIFIED_KEEP + 5):
        record_verified(status_file, [((k, 0, 0, 0),)])
    kept = json.loads(verified_record(status_file).read_text())
    assert len(kept) == VERIFIED_KEEP and kept[-1][0] == [[VERIFIED_KEEP + 4, 0, 0, 0]]
    verified_record(status_file).write_text("{half")
    assert not was_verified(status_file, ((1, 0, 0, 0),))  # an unreadable record verifies nothing


# ---- fuzz --------------------------------------------------------------------------------------------------

VALUES = [None, True, False, 0, -1, 1, 3, 15, 16, 2**31, 2**64, 1.5, "", "x", "1", "-dash", "../x", "/dev/zero",
          "BF16", [], {}, [0], [3, 3], {"1": [0]}, {"a": 1}]


def _paths(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def mutate_manifest(m: dict, rng: random.Random) -> dict:
    m = copy.deepcopy(m)
    path = rng.choice([p for p in _paths(m) if p])
    parent = m
    for key in path[:-1]:
        parent = parent[key]
    op = rng.random()
    if op < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif op < 0.3 and isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
        parent[path[-1]] += rng.choice([-1, 1])
    elif op < 0.4 and isinstance(parent[path[-1]], list):
        parent[path[-1]] = parent[path[-1]] + parent[path[-1]][:1]
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
    return m


def mutate_data(data: Path, rng: random.Random) -> None:
    raw = bytearray(data.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    op = rng.randrange(5)
    if op == 0:  # a byte of the header
        raw[rng.randrange(header_end)] ^= 1 << rng.randrange(8)
    elif op == 1:  # a byte of the tensors
        raw[rng.randrange(header_end, len(raw))] ^= 1 << rng.randrange(8)
    elif op == 2:
        del raw[rng.randrange(len(raw)):]
    elif op == 3:
        raw += bytes(rng.randrange(1, 64))
    else:  # the header's length field
        raw[:8] = rng.choice([0, 1, header_end - 9, header_end, len(raw), 2**63]).to_bytes(8, "little")
    data.write_bytes(bytes(raw))


def check_case(bundle: Path, base: Path, want: dict, out: Path) -> str:
    """Open `bundle` and, if it opens, read it every way: 'refused' or 'accepted' (then it holds `want`)."""
    try:
        with deadline(20):
            b = Bundle.open(bundle)
            assert b.read_experts().keys() == want.keys()
            for layer, per in want.items():
                assert b.read_experts()[layer].keys() == per.keys()
                assert all(b.read_expert(layer, e).equal(w) for e, w in per.items()), (layer, bundle)
            describe_path(bundle)
            export_adapter(bundle, out / "export", overwrite=True)
            merge(base, bundle, out / "merged", overwrite=True)
        return "accepted"
    except EsftError as e:
        assert "\n" not in str(e) and str(bundle) in str(e), str(e)
        return "refused"


def test_fuzz_bundles(tiny, tmp_path):
    """Mutated manifests and data files of a tiny bundle, fixed seed, about 15 s: each is refused with one line
    naming a file of the bundle, or accepted holding exactly the original experts (through open, inspect,
    export and merge); never another exception or a hang."""
    base, src, want = tiny
    original = json.loads((src / MANIFEST).read_text())
    rng = random.Random(32)
    outcomes = {"refused": 0, "accepted": 0}
    start, n = time.monotonic(), 0
    while time.monotonic() - start < 15 and n < 1500:
        case = tmp_path / f"case{n}"
        shutil.copytree(src, case)
        if rng.random() < 0.75:
            (case / MANIFEST).write_text(json.dumps(mutate_manifest(original, rng)))
        else:
            mutate_data(case / DATA_FILE, rng)
        outcomes[check_case(case, base, want, tmp_path)] += 1
        shutil.rmtree(case)
        n += 1
    assert n >= 50 and outcomes["refused"] > 0.5 * n, outcomes


@pytest.mark.parametrize("edit,args,match", [
    (_set("name", "../../x"), ["inspect", "{b}"], r"manifest adapter name '\.\./\.\./x'"),
    (_set("experts", {"1": None}), ["merge", "{base}", "{b}", "--out", "{out}"], r"experts\[1\] must be a list"),
    ("fifo", ["export", "{b}", "--format", "esft", "--out", "{out}"], "not a regular file"),
])
def test_cli_refuses_crafted_bundles_with_one_line(tiny, tmp_path, edit, args, match):
    b = crafted(tiny[1], tmp_path / "b", edit if callable(edit) else None)
    if edit == "fifo":
        (b / DATA_FILE).unlink()
        os.mkfifo(b / DATA_FILE)
    args = [a.format(b=b, base=tiny[0], out=tmp_path / "out") for a in args]
    proc = subprocess.run([sys.executable, "-m", "esftctl.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})  # run_cli, with a bound on a hang
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and re.search(match, proc.stderr), proc.stderr
    assert not (tmp_path / "out").exists()


def test_bundle_reads_are_not_mapped(tiny):
    """Expert tensors are read into their own memory, not views of a mapping of the whole file."""
    t = Bundle.open(tiny[1]).read_expert(1, next(iter(tiny[2][1]))).gate
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert isinstance(t, torch.Tensor)


def test_bounded_reads_allocate_the_file_not_the_bound(tiny):
    """read_json's bound (64 MiB) is a limit, not an allocation: reading a small file allocates about its size."""
    import tracemalloc

    from esftctl.jsonfile import read_json

    tracemalloc.start()
    read_json(tiny[1] / MANIFEST)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_the_data_hash_is_the_definition_whatever_the_chunk_size(tiny, monkeypatch):
    """tensors_sha256 is SHA-256 over name, dtype, shape and bytes of each tensor in name order, whatever the
    chunk size it reads, and a read that fails is one line naming the file, with nothing read past it."""
    from esftctl.formats import bundle as bundle_format
    from esftctl.formats.checkpoint import read_header, read_stored

    data = tiny[1] / DATA_FILE
    tensors = read_header(data)
    h = hashlib.sha256()
    for name in sorted(tensors):
        info = tensors[name]
        h.update(f"{name}|{info.torch_dtype}|{list(info.shape)}|".encode())
        h.update(read_stored(info, name=name).reshape(-1).view(torch.uint8).numpy().tobytes())
    assert bundle_format.tensors_sha256(data) == h.hexdigest() == Bundle.open(tiny[1]).manifest["tensors_sha256"]
    for chunk in (7, 4096):  # many chunks a tensor
        monkeypatch.setattr(bundle_format, "HASH_CHUNK", chunk)
        assert bundle_format.tensors_sha256(data) == h.hexdigest()
    calls = []

    def failing(info, into, start=0, *, name):
        calls.append(name)
        raise EsftError(f"tensor {name!r}: short read", info.file)
    monkeypatch.setattr(bundle_format, "read_stored_bytes", failing)
    with pytest.raises(EsftError, match=f"{data}: tensor .*short read"):
        bundle_format.tensors_sha256(data)
    assert len(calls) == 1  # nothing read past the failure


def test_the_launcher_hashes_each_file_once_and_names_the_first_bad_one(tiny, tmp_path, monkeypatch):
    """esftctl serve's plan opens every adapter's bundle (esftctl.serve.open_bundles): names that share a file share
    one verification, files are verified several at a time, and of several bad bundles the error names the first in
    the adapters' order, as verifying one after another did."""
    from esftctl import serve
    from esftctl.formats import bundle as bundle_format
    from esftctl.runtime.serve_config import bundle_identity

    base, good = MoECheckpoint(tiny[0]), tiny[1]
    hashed = []
    real = bundle_format.tensors_sha256
    monkeypatch.setattr(bundle_format, "tensors_sha256", lambda path: hashed.append(path) or real(path))

    def opened(adapters: dict):
        return serve.open_bundles(adapters, {n: bundle_identity(p) for n, p in adapters.items()}, base)
    copy = tmp_path / "copy"
    shutil.copytree(good, copy)
    bundles = opened({"a": good, "b": good, "c": copy})
    assert bundles["a"] is bundles["b"] and bundles["c"] is not bundles["a"] and len(hashed) == 2
    bad = []
    for k in range(2):
        shutil.copytree(good, tmp_path / f"bad{k}")
        data = tmp_path / f"bad{k}" / DATA_FILE
        raw = bytearray(data.read_bytes())
        raw[-1 - k] ^= 0xFF
        data.write_bytes(bytes(raw))
        bad.append(data)
    for first, second in ((0, 1), (1, 0)):
        with pytest.raises(EsftError, match=f"{bad[first]}: checksum mismatch"):
            opened({"a": good, "x": bad[first].parent, "y": bad[second].parent})
    assert opened({}) == {}
