"""Expert stores are shared files: crafted ones, their checksums recomputed as an attacker would, must end in one
line naming the file (EsftError; exit 1 from the CLI with nothing left behind) or decode correctly, never in a
traceback, a hang, a read or write outside a buffer, or silently wrong weights from an honest checksum.

Every store here is written by the test itself: a tiny one of a few tensors, then changed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_interpreted

from esftctl.errors import EsftError
from esftctl.formats import native
from esftctl.formats.huffman import MAX_CHUNK
from esftctl.formats.store import DATA, HEADER, ExpertStore, SourceTensor, header_hash, write_store
from esftctl.formats.unprotected import ENV
from esftctl.kernels.huffman_decode import DecodePlan, Segment

TENSORS = {"a": torch.tensor([[1.0, -2.5, 0.0], [3.0e-3, 7.0, -0.125]], dtype=torch.bfloat16),
           "b": torch.arange(20, dtype=torch.float32).div(8).to(torch.bfloat16),
           "c": (torch.randn(40, 40, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)}


def _write(out: Path, tensors: dict = TENSORS, **kw) -> Path:
    sources = [SourceTensor(n, 0, i, "gate", lambda t=t: t) for i, (n, t) in enumerate(tensors.items())]
    write_store({"kind": "tensors", "path": "test"}, sources, out, **{"chunk": 16, "table_scope": "layer", **kw})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("tiny") / "store", table_scope="tensor")


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _header(store: Path) -> dict:
    return json.loads((store / HEADER).read_text())


def _seal(store: Path, header: dict, data: bytes | None = None) -> None:
    """Write `header` (and `data` as store.bin) with every checksum recomputed, as an attacker would."""
    if data is not None:
        (store / DATA).write_bytes(data)
        header["data_bytes"], header["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        for e in header["tensors"] if isinstance(header.get("tensors"), list) else []:
            try:
                spans = ((e["exp_offset"], e["exp_bytes"]), (e["chunk_offset"], 4 * e["chunks"]),
                         (e["sm_offset"], e["count"]))
                e["sha256"] = hashlib.sha256(b"".join(data[o:o + n] for o, n in spans)).hexdigest()
            except (TypeError, KeyError, ValueError, OverflowError):  # fields a mutation broke: left as they are
                pass
    if header.get("version") == 3:
        header["header_sha256"] = header_hash(header)
    (store / HEADER).write_text(json.dumps(header))


def _as_version_2(store: Path) -> None:
    """What esftctl wrote before the header and tensor hashes."""
    header = _header(store)
    header.pop("header_sha256", None)
    for e in header["tensors"]:
        e.pop("sha256", None)
    (store / HEADER).write_text(json.dumps({**header, "version": 2}))


def _one_line_error(excinfo, path: Path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


def _decode_all(store: ExpertStore) -> dict[str, torch.Tensor]:
    return {e["name"]: store.decode_tensor(e["name"]) for e in store}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# --- the format -------------------------------------------------------------------------------------------------

PINNED_LENGTHS = ({0: 3, 118: 3, 124: 3, 127: 3, 128: 2, 129: 2}, {0: 4, 124: 4, 125: 3, 126: 2, 127: 2, 128: 2})
PINNED_BIN = ("e4ae00000000000000000000000000000000000000000000000000000000000000a00045608000000000000000000000"
              "efd8015556a800000000000000000000000000002600000000000000000000000000004000204060001020304050607000"
              "081018000000000000000000000000")


def test_store_format_version_3_is_pinned(tmp_path, monkeypatch):
    """The exact header and store.bin of a tiny store: a change to the format must be a new version. The header
    hash is the SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of every other field."""
    import esftctl.formats.store

    monkeypatch.setattr(esftctl.formats.store, "__version__", "0.0.0")
    store = _write(tmp_path / "s", {"a": TENSORS["a"], "b": TENSORS["b"]}, table_scope="tensor")
    header = _header(store)
    tables = [{"lengths": [lengths.get(i, 0) for i in range(256)]} for lengths in PINNED_LENGTHS]
    common = {"layer": 0, "weight": "gate"}
    assert header == {
        "format": "esftctl-expert-store", "version": 3, "created_by": "esftctl 0.0.0",
        "source": {"kind": "tensors", "path": "test"}, "chunk": 16, "lanes": 32, "group": 16, "max_code_length": 12,
        "table_scope": "tensor", "tables": tables,
        "tensors": [
            {"name": "a", "expert": 0, **common, "shape": [2, 3], "count": 6, "table": 0, "exp_offset": 0,
             "exp_bytes": 2, "chunk_offset": 16, "chunks": 1, "sm_offset": 32,
             "sha256": "011d72545882f15592a07dd60afe199e08ff7d1800474b5705409e0c7eb7bd5e"},
            {"name": "b", "expert": 1, **common, "shape": [20], "count": 20, "table": 1, "exp_offset": 48,
             "exp_bytes": 6, "chunk_offset": 64, "chunks": 2, "sm_offset": 80,
             "sha256": "f6931279bcedef9beb7a75e275cd93f152895e8d19118b6ef4deb16ddf68533b"}],
        "data_file": "store.bin", "data_bytes": 112,
        "sha256": "ce3aa69f0baac4ba49c9c40a01e7998e0d99e68a25fc28b76d018ca5156caa43",
        "values": 26, "original_bytes": 52, "entropy_bound_bytes": 33.49354211275927,
        "header_sha256": "2b76bf57a503ee7f0539cb74cd15c4a496a17aa60a70d78641a2f5d139ed861c"}
    data = (store / DATA).read_bytes()
    assert data.hex() == PINNED_BIN
    for e in header["tensors"]:  # a tensor's hash: its three sections, without the padding between them
        spans = ((e["exp_offset"], e["exp_bytes"]), (e["chunk_offset"], 4 * e["chunks"]), (e["sm_offset"], e["count"]))
        assert hashlib.sha256(b"".join(data[o:o + n] for o, n in spans)).hexdigest() == e["sha256"]
    canonical = json.dumps({k: v for k, v in header.items() if k != "header_sha256"}, sort_keys=True,
                           separators=(",", ":"))
    assert hashlib.sha256(canonical.encode()).hexdigest() == header["header_sha256"]
    opened = ExpertStore(store)
    assert opened.describe()["header_checksum"] is True and "warning" not in opened.describe()
    assert all(_same(opened.decode_tensor(n), t) for n, t in (("a", TENSORS["a"]), ("b", TENSORS["b"])))


@pytest.mark.parametrize("field,value", [("sm_offset", 48), ("table", 2), ("exp_offset", 16), ("shape", [400, 4])])
def test_a_changed_header_field_is_a_checksum_mismatch(tiny, tmp_path, field, value):
    """Before version 3 one changed field (a section offset, a table index) decoded wrong weights with exit 0."""
    store = _copy(tiny, tmp_path / "s")
    header = _header(store)
    header["tensors"][1][field] = value
    (store / HEADER).write_text(json.dumps(header))
    with pytest.raises(EsftError, match="header checksum mismatch") as excinfo:
        ExpertStore(store)
    _one_line_error(excinfo, store / HEADER)


def test_version_2_stores_are_read_only_when_asked_for_and_say_they_are_unprotected(tiny, tmp_path, caplog,
                                                                                    monkeypatch):
    """A version 2 store has no header checksum: one changed bit of "version": 3 would turn the checks off, so it is
    refused in one line naming --allow-unprotected; asked for, it reads, marked unprotected."""
    store = _copy(tiny, tmp_path / "v2")
    _as_version_2(store)
    with pytest.raises(EsftError, match="version 2 store has no checksum over its header.*--allow-unprotected"):
        ExpertStore(store)
    proc = _cli("inspect", store, "--json")
    assert proc.returncode == 1 and "--allow-unprotected" in proc.stderr and len(proc.stderr.splitlines()) == 1
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level(logging.WARNING, logger="esftctl.formats.store"):
        opened = ExpertStore(store)
    assert any("no header checksum" in r.getMessage() and str(store) in r.getMessage() for r in caplog.records)
    d = opened.describe()
    assert d["version"] == 2 and d["header_checksum"] is False and "no header checksum" in d["warning"]
    assert all(_same(opened.decode_tensor(n), t) for n, t in TENSORS.items())
    monkeypatch.delenv(ENV)
    proc = _cli("--allow-unprotected", "inspect", store, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["header_checksum"] is False
    assert "no header checksum" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_tensor_is_checked_against_its_own_hash_when_the_file_is_not(tiny, tmp_path):
    """A start-up probe opens a large store without hashing all of store.bin (verify=False) and decodes one
    tensor: that tensor's bytes are still checked, so a probe never compares unverified weights."""
    store = _copy(tiny, tmp_path / "s")
    header, data = _header(store), bytearray((store / DATA).read_bytes())
    e = header["tensors"][2]
    data[e["sm_offset"] + 5] ^= 1  # a mantissa bit: decodes without any other error
    (store / DATA).write_bytes(bytes(data))
    opened = ExpertStore(store, verify=False)
    assert _same(opened.decode_tensor("a"), TENSORS["a"])
    with pytest.raises(EsftError, match="checksum mismatch in tensor 'c'") as excinfo:
        opened.decode_tensor("c")
    _one_line_error(excinfo, store / DATA)
    with pytest.raises(EsftError, match="checksum mismatch"):
        ExpertStore(store)


# --- crafted headers (checksums recomputed) -------------------------------------------------------------------

def _set(path: str, value):
    """A change of the header at `path` (dots; digits index lists)."""
    def change(header: dict) -> None:
        *parents, last = path.split(".")
        obj = header
        for key in parents:
            obj = obj[int(key)] if key.isdigit() else obj[key]
        obj[int(last) if last.isdigit() else last] = value
    return change


CRAFTED = {
    "count above its shape": (_set("tensors.2.count", 2112), "has 2112 values, but its shape \\[40, 40\\] holds 1600"),
    "shape below its count": (_set("tensors.2.shape", [40, 39]), "shape \\[40, 39\\] holds 1560"),
    "chunk 2**59": (_set("chunk", 1 << 59), "chunk size must be a multiple of 16 from 16 to 65536"),
    "chunk 2**58": (_set("chunk", 1 << 58), "chunk size must be"),
    "chunk true": (_set("chunk", True), "chunk size must be"),
    "chunk as text": (_set("chunk", "16"), "chunk size must be"),
    "lanes as float": (_set("lanes", 32.0), "chunks laid out for 32.0 lanes"),
    "negative offset": (_set("tensors.1.sm_offset", -16), "sm_offset must be an integer from 0"),
    "offset past the data": (_set("tensors.1.sm_offset", 1 << 40), "sm_offset must be an integer from 0"),
    "section past the data": (lambda h: h["tensors"][2].update(sm_offset=h["data_bytes"] // 16 * 16 - 16),
                              "sm section is not aligned or runs past"),
    "unaligned section": (_set("tensors.1.sm_offset", 81), "sm section is not aligned"),
    "stream past the data": (_set("tensors.0.exp_bytes", 1 << 20), "exp section is not aligned or runs past"),
    "a huge integer": (_set("tensors.0.exp_offset", 10 ** 300), "exp_offset must be an integer from 0"),
    "table out of range": (_set("tensors.0.table", 3), "table must be an integer from 0 to 2"),
    "table index a bool": (_set("tensors.0.table", False), "table must be an integer"),
    "chunk count": (_set("tensors.2.chunks", 99), "has 99 chunks, not the"),
    "code lengths over Kraft": (_set("tables.0.lengths", [1] * 256), "Kraft sum above 1"),
    "code length 13": (_set("tables.0.lengths.0", 13), "256 code lengths from 0 to 12"),
    "tables not a list": (_set("tables", {"lengths": []}), "tables must be a list"),
    "two tensors of one name": (_set("tensors.1.name", "a"), "two tensors named 'a'"),
    "safetensors' own key": (_set("tensors.1.name", "__metadata__"), "may not be '__metadata__'"),
    "shape of bools": (_set("tensors.0.shape", [True, 6]), "shape must be a list"),
    "deep shape": (_set("tensors.0.shape", [1] * 9 + [6]), "shape must be a list of at most 8"),
    "absolute data file": (_set("data_file", "/dev/zero"), "data_file must be a file name in the store folder"),
    "data file upwards": (_set("data_file", "../store.bin"), "data_file must be a file name"),
    "data file dot dot": (_set("data_file", ".."), "data_file must be a file name"),
    "data file a number": (_set("data_file", 7), "data_file must be a string"),
    "source not an object": (_set("source", []), "source must be an object"),
    "bundle without manifest": (_set("source.kind", "bundle"), "source.manifest must be an object"),
    "values": (_set("values", 5), "values and original_bytes must be"),
    "entropy bound text": (_set("entropy_bound_bytes", "1"), "entropy_bound_bytes must be a number"),
    "layer a string": (_set("tensors.0.layer", "0"), "layer must be an integer"),
    "data sha not hex": (_set("sha256", "z" * 64), "sha256 must be a SHA-256"),
    "tensor sha missing": (_set("tensors.0.sha256", None), "sha256 must be a SHA-256"),
    "data bytes": (_set("data_bytes", 4096), "checksum mismatch: the file is corrupted or truncated"),
    "version 4": (_set("version", 4), "store version 4 is not supported"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_header_is_one_line_naming_the_file(tiny, tmp_path, case):
    change, message = CRAFTED[case]
    store = _copy(tiny, tmp_path / "s")
    header = _header(store)
    change(header)
    _seal(store, header)
    with pytest.raises(EsftError, match=message) as excinfo:
        ExpertStore(store, verify=False)
    _one_line_error(excinfo, store)


def test_the_issues_overlong_tensor_is_refused(tiny, tmp_path):
    """Issue 32's store: count 2112 for a [40, 40] tensor, the extra offsets and bytes appended to store.bin and
    every checksum recomputed. The Triton kernel wrote 512 values past its destination."""
    store = _copy(tiny, tmp_path / "s")
    header, data = _header(store), (store / DATA).read_bytes()
    e = header["tensors"][2]
    extra = 2112 - 1600
    e["chunk_offset"], e["chunks"] = len(data), 5
    tail = np.array([0, 8, 16, 24, 32], dtype="<u4").tobytes() + bytes(-20 % 16)
    e["sm_offset"], e["count"] = len(data) + len(tail), 2112
    _seal(store, header, data + tail + bytes(2112 + extra % 16))
    with pytest.raises(EsftError, match="has 2112 values, but its shape"):
        ExpertStore(store)


@pytest.mark.parametrize("text,message", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ('{"format": "esftctl-expert-store", "version": 3, "chunk": ' + "9" * 100_000 + "}", "not valid JSON"),
    ('{"format": "esftctl-expert-store", "version": 3, "entropy_bound_bytes": NaN}', "cannot be hashed"),
    ("\xff\xfe", "not valid JSON"),
    ("[1, 2]", "not an esftctl expert store"),
])
def test_unparsable_headers(tiny, tmp_path, text, message):
    store = _copy(tiny, tmp_path / "s")
    (store / HEADER).write_text(text, encoding="latin-1")
    with pytest.raises(EsftError, match=message) as excinfo:
        ExpertStore(store)
    _one_line_error(excinfo, store / HEADER)


def test_header_reads_are_bounded(tiny, tmp_path, monkeypatch):
    import esftctl.formats.store

    store = _copy(tiny, tmp_path / "s")
    monkeypatch.setattr(esftctl.formats.store, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(EsftError, match="larger than 1000 bytes"):
        ExpertStore(store)


def test_only_regular_files_in_the_store_folder_are_opened(tiny, tmp_path):
    """A symbolic link out of the folder (or to /dev/zero, which hashed forever) and a FIFO (which blocked) are
    refused before any read; so is a store.json that is not a regular file."""
    outside = tmp_path / "outside.bin"
    shutil.copy(tiny / DATA, outside)
    for target in (outside, Path("/dev/zero")):
        store = _copy(tiny, tmp_path / f"link{len(target.name)}")
        (store / DATA).unlink()
        (store / DATA).symlink_to(target)
        with pytest.raises(EsftError, match="is a symbolic link") as excinfo:
            ExpertStore(store)
        _one_line_error(excinfo, store / DATA)
    store = _copy(tiny, tmp_path / "fifo")
    (store / DATA).unlink()
    os.mkfifo(store / DATA)
    with pytest.raises(EsftError, match="store.bin: not a regular file"):
        ExpertStore(store)
    (store / HEADER).unlink()
    os.mkfifo(store / HEADER)
    with pytest.raises(EsftError, match="store.json: not a regular file"):
        ExpertStore(store)


# --- the GPU decoder's plan -----------------------------------------------------------------------------------

def _segment(store: ExpertStore, name: str, out: torch.Tensor | None = None, **change) -> Segment:
    e = store.tensors[name]
    _, offsets, _ = store._sections(e)
    s = dict(bits=8 * e["exp_offset"] + offsets.astype(np.int64), sm_offset=e["sm_offset"], count=e["count"],
             table=e["table"], out=out if out is not None else torch.empty(e["shape"], dtype=torch.bfloat16))
    return Segment(**{**s, **change})


def test_decode_plan_checks_every_bound_before_a_launch(tiny):
    """DecodePlan.build refuses what would make a lane read or write outside its buffers (CPU tensors stand in
    for device ones: nothing is launched)."""
    store = ExpertStore(tiny)
    data, tables = store.to_device(torch.device("cpu"))
    size = data.numel()
    good = _segment(store, "c")
    assert DecodePlan.build(data, tables, store.chunk, [good]).n_chunks == 128  # 100 chunks, in whole warps
    bad = {
        "more values than the destination": _segment(store, "c", count=2112),
        "a destination larger than the tensor": _segment(store, "c", out=torch.empty(41, 40, dtype=torch.bfloat16)),
        "a chunk past the data": _segment(store, "c", bits=good.bits + 8 * size),
        "chunks out of order": _segment(store, "c", bits=good.bits[::-1].copy()),
        "too few chunks": _segment(store, "c", bits=good.bits[:-1]),
        "sign-and-mantissa bytes past the data": _segment(store, "c", sm_offset=size - 1000),
        "a negative offset": _segment(store, "c", sm_offset=-16),
        "a table that does not exist": _segment(store, "c", table=tables.shape[0]),
        "a float destination": _segment(store, "c", out=torch.empty(40, 40)),
    }
    for what, segment in bad.items():
        with pytest.raises(ValueError):
            DecodePlan.build(data, tables, store.chunk, [good, segment])
            pytest.fail(what)
    with pytest.raises(ValueError, match="chunk size"):
        DecodePlan.build(data, tables, 1 << 59, [good])


def test_store_plan_refuses_what_its_header_does_not_check(tiny, tmp_path):
    """ExpertStore.plan checks the same bounds itself, with one line naming the data file: here a store whose
    entries were changed after opening, and chunk offsets past a tensor's stream (only in the data, which the
    header's checks cannot see)."""
    store = ExpertStore(tiny)
    store.tensors["c"] = {**store.tensors["c"], "count": 2112}
    with pytest.raises(EsftError, match="cannot decode on cpu: a destination of 1600 values for a tensor of 2112"):
        store.plan([("c", torch.empty(40, 40, dtype=torch.bfloat16))])
    crafted = _copy(tiny, tmp_path / "s")
    header, data = _header(crafted), bytearray((crafted / DATA).read_bytes())
    e = header["tensors"][2]
    data[e["chunk_offset"] + 4:e["chunk_offset"] + 8] = np.array([1 << 30], dtype="<u4").tobytes()
    _seal(crafted, header, bytes(data))
    opened = ExpertStore(crafted)
    for decode in (lambda: opened.plan([("c", torch.empty(40, 40, dtype=torch.bfloat16))]),
                   lambda: opened.decode_tensor("c")):
        with pytest.raises(EsftError, match="chunk offsets out of order or past its stream") as excinfo:
            decode()
        _one_line_error(excinfo, crafted / DATA)


INTERPRETED = """
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from esftctl.kernels.huffman_decode import DecodePlan
from esftctl.formats.store import ExpertStore
from test_formats_untrusted_stores import TENSORS, _segment
store = ExpertStore(Path({store!r}))
data, tables = store.to_device(torch.device("cpu"))
guard = 64
for case in ("exact", "chunks at the data's end", "chunks at the stream's end"):
    buffer = torch.full((1600 + 2 * guard,), 7.0, dtype=torch.bfloat16)
    out = buffer[guard:guard + 1600].view(40, 40)
    segment = _segment(store, "c", out=out)
    if case != "exact":  # every chunk's bits from the last bit on: the lanes decode zero bits from there
        end = 8 * data.numel() if case == "chunks at the data's end" else segment.bits[-1] + 1
        segment = _segment(store, "c", out=out, bits=np.full(len(segment.bits), end, dtype=np.int64))
    DecodePlan.build(data, tables, store.chunk, [segment]).run()
    assert torch.equal(buffer[:guard], torch.full((guard,), 7.0, dtype=torch.bfloat16)), case
    assert torch.equal(buffer[-guard:], torch.full((guard,), 7.0, dtype=torch.bfloat16)), case
    if case == "exact":
        assert torch.equal(out.view(torch.int16), TENSORS["c"].view(torch.int16))
print("ok")
"""


def test_triton_decoder_stays_inside_its_buffers_in_the_interpreter(tiny):
    """The kernel, run by Triton's interpreter: chunks that start at the data's very end (read masked, past it
    only zero bits) write the tensor's values and not one past them."""
    pytest.importorskip("triton")
    code = INTERPRETED.format(tests=str(Path(__file__).parent), store=str(tiny))
    run_interpreted(code)


# --- the native decoder ---------------------------------------------------------------------------------------

@pytest.mark.skipif(native.module() is None, reason="the native decoder was not built")
def test_native_decoder_refuses_a_chunk_size_python_refuses():
    """At 2**59 or 2**62 LANES * chunk overflowed (SIGFPE); at 2**58 the decoder wrote uninitialised memory."""
    code = ("from esftctl import _native\n"
            "for chunk in (1 << 59, 1 << 62, 1 << 58, {big}, 8):\n"
            "    try:\n"
            "        _native.decode_bf16(b'', b'', 40, bytes(4096), bytes(4096), chunk, bytes(40), bytearray(80), 1)\n"
            "        print('decoded', chunk)\n"
            "    except ValueError as e:\n"
            "        print('refused', e)\n").format(big=MAX_CHUNK + 16)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["refused the chunk size must be a multiple of 16 from 16 to 65536"] * 5


# --- fuzz -------------------------------------------------------------------------------------------------------

VALUES = [-1, 0, 1, 15, 16, 17, 1 << 31, 1 << 40, 1 << 63, 10 ** 30, True, False, None, "", "x", 1.5, float(1 << 70),
          [], {}, [1], "store.bin", "/dev/zero", "../store.bin"]


def _paths(obj, prefix=()):
    """Every path into a header (a list's first three and last two items)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i in sorted({*range(min(3, len(obj))), *range(max(0, len(obj) - 2), len(obj))}):
            yield from _paths(obj[i], prefix + (i,))


def _mutate_header(header: dict, rng: random.Random) -> None:
    paths = [p for p in _paths(header) if p]
    path = rng.choice(paths)
    obj = header
    for key in path[:-1]:
        obj = obj[key]
    old = obj[path[-1]]
    if type(old) is int and rng.random() < 0.5:
        new = old + rng.choice([-16, -4, -1, 1, 4, 16, old, -old])
    else:
        new = rng.choice(VALUES)
    obj[path[-1]] = new


def _decode_with_both_decoders(store: Path, verify: bool, monkeypatch) -> list[dict] | None:
    """Each tensor decoded by the native decoder and by the numpy reference, and planned for the GPU (CPU tensors:
    built, not run); None where the store was refused."""
    results, errors = [], []
    for reference in (False, True):
        with monkeypatch.context() as m:
            if reference:
                m.setattr(native, "module", lambda: None)
            try:
                opened = ExpertStore(store, verify=verify)
                decoded = _decode_all(opened)
                if decoded:
                    opened.plan([(n, torch.empty(t.shape, dtype=torch.bfloat16)) for n, t in decoded.items()])
                results.append(decoded)
            except EsftError as e:
                assert "\n" not in str(e) and str(e).startswith(str(store)), str(e)
                results.append(None)
                errors.append(str(e))
    assert (results[0] is None) == (results[1] is None), errors  # the reference refuses what the native one does
    return results[0] if results[0] is None else results


def test_fuzz_stores(tiny, tmp_path, monkeypatch):
    """Random changes of header fields and data bytes, with checksums as written (then: refused, or decoded
    bit-exactly) or recomputed as an attacker would (then: refused, or decoded into the header's shapes, the native
    decoder and the numpy reference alike). Never another exception. Fixed seed, at most about 15 s."""
    rng = random.Random(32)
    monkeypatch.setenv(ENV, "1")  # version 2 stores too, read as asked for
    v2 = _copy(tiny, tmp_path / "v2")
    _as_version_2(v2)
    outcomes = {"refused": 0, "exact": 0, "attacker": 0}
    start, case = time.monotonic(), 0
    while time.monotonic() - start < 15 and case < 600:
        case += 1
        source = v2 if case % 5 == 0 else tiny
        store = _copy(source, tmp_path / f"c{case}")
        header, data = _header(store), bytearray((store / DATA).read_bytes())
        kind = rng.choice(["header", "data", "truncate", "text"])
        if kind == "header":
            _mutate_header(header, rng)
        elif kind == "data":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[:rng.randrange(len(data))] if rng.random() < 0.7 else data + bytes(rng.randint(1, 64))
        attacker = rng.random() < 0.5 or source is v2
        if kind == "text":
            text = json.dumps(header)
            at = rng.randrange(len(text))
            (store / HEADER).write_text(text[:at] + rng.choice(["", "}", "[", '"', "9" * 5000, "\\ud800"]) +
                                        text[at + rng.randint(0, 3):])
        elif attacker:
            _seal(store, header, bytes(data))
        else:
            (store / HEADER).write_text(json.dumps(header))
            (store / DATA).write_bytes(bytes(data))
        for verify in (True, False):
            results = _decode_with_both_decoders(store, verify, monkeypatch)
            if results is None:
                outcomes["refused"] += 1
            elif attacker:
                assert all(_same(results[0][n], results[1][n]) for n in results[0])
                assert {n: t.shape for n, t in results[0].items()} == {
                    e["name"]: torch.Size(e["shape"]) for e in _header(store)["tensors"]}
                outcomes["attacker"] += 1
            else:  # honest checksums: what decodes is the original
                assert set(results[0]) == set(TENSORS) and all(_same(results[0][n], TENSORS[n]) for n in TENSORS)
                outcomes["exact"] += 1
        shutil.rmtree(store)
    assert case >= 100 and all(outcomes.values()), (case, outcomes)


# --- the CLI --------------------------------------------------------------------------------------------------

def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "esftctl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


def _crafted_for_cli(tiny: Path, folder: Path, how: str) -> Path:
    store = _copy(tiny, folder / how)
    header = _header(store)
    if how == "chunk-2-59":  # a version 2 store (no header checksum) of tensors whose chunk counts stay the same
        _as_version_2(store)
        header = _header(store)
        header["tensors"] = [e for e in header["tensors"] if e["name"] in ("a", "b")]
        header.update(chunk=1 << 59, values=26, original_bytes=52)
        (store / HEADER).write_text(json.dumps(header))
    elif how in ("dev-zero", "fifo"):  # an empty store: its data file is all there is to read (forever, before)
        _seal(store, {**header, "tensors": [], "tables": [], "values": 0, "original_bytes": 0,
                      "entropy_bound_bytes": 0.0, "data_bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()})
        (store / DATA).unlink()
        if how == "fifo":
            os.mkfifo(store / DATA)
        else:
            (store / DATA).symlink_to("/dev/zero")
    elif how == "nested":
        (store / HEADER).write_text("[" * 100_000)
    elif how == "corrupt-stream":  # a code that does not exist, every checksum recomputed
        data = bytearray((store / DATA).read_bytes())
        e = header["tensors"][2]
        data[e["exp_offset"]:e["exp_offset"] + e["exp_bytes"]] = b"\xff" * e["exp_bytes"]
        header["tables"][0]["lengths"] = [0] * 256
        header["tables"][0]["lengths"][0] = 1
        _seal(store, header, bytes(data))
    return store


@pytest.mark.parametrize("how", ["chunk-2-59", "dev-zero", "fifo", "nested", "corrupt-stream"])
def test_cli_refuses_crafted_stores_in_one_line(tiny, tmp_path, how):
    store = _crafted_for_cli(tiny, tmp_path, how)
    work = tmp_path / "work"
    work.mkdir()
    for args in (("decompress", store, "--out", work / "out"), ("inspect", store)):
        if how == "corrupt-stream" and args[0] == "inspect":  # inspect decodes nothing
            continue
        proc = _cli(*(("--allow-unprotected",) if how == "chunk-2-59" else ()), *args)  # past the version check
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
        assert str(store) in lines[0] and "Traceback" not in proc.stderr
        assert list(work.iterdir()) == []  # no output, no temporary folder
