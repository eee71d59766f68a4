"""Adapter bundles: only an adapter's fine-tuned experts, in a strict, checksummed format.

A bundle is a folder:

    manifest.json       format, version, name, the base's identity, expert ids per layer, dtype, shapes,
                        a SHA-256 of the tensors (names, dtypes, shapes and bytes, in name order: the
                        safetensors header's own key order is not stable, so the file's bytes are not hashed),
                        one of base_tensors.json, and one of the manifest itself (manifest_sha256, over its
                        other fields as canonical JSON), so that an edited manifest is refused by every reader
    experts.safetensors one tensor per expert weight, named layers.{L}.experts.{E}.{gate|up|down} (and
                        {gate|up|down}_bias for experts with biases: GPT-OSS; every architecture's experts in
                        the same orientation, whatever its checkpoint's layout; for an FP8 base, the weights
                        in the base's FP8 form with their float32 block scales {gate|up|down}_scale, and the
                        base's block in base.weight_block_size: esftctl.formats.fp8);
                        with --include-non-expert also non_expert.{checkpoint tensor name}
    base_tensors.json   a SHA-256 of every tensor of the base as pack read it (dtype, shape and bytes), by name

The base's identity is a fingerprint: SHA-256 over its structural config and every router weight (and router
correction bias, where the routing uses one), so a bundle is refused by any other base, even one of the same
shape. That is what serving checks at every start and load: hashing a 31 GB base each time would cost minutes.
It does not cover the other weights: a base whose expert or attention bytes were overwritten in place still has
the fingerprint. `esftctl merge`, whose output is a whole model people publish, reads every base tensor anyway and
checks each against base_tensors.json.

Version 1 bundles have neither manifest_sha256 nor base_tensors.json: they are read only when the user asks
(esftctl.formats.unprotected).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save_file

from esftctl import __version__
from esftctl.atomic import atomic_dir
from esftctl.beneath import PinnedFolder
from esftctl.errors import EsftError
from esftctl.formats import unprotected
from esftctl.formats.architectures import EXPERT_BIASES, EXPERT_SCALES, EXPERT_WEIGHTS, architecture_for
from esftctl.formats.checkpoint import (
    TORCH_DTYPES,
    ExpertWeights,
    MoECheckpoint,
    StoredExpert,
    StoredTensor,
    TensorInfo,
    read_header,
    read_stored_bytes,
)
from esftctl.formats.fp8 import Fp8Block
from esftctl.jsonfile import JSON_LIMIT, check_regular, read_bounded, read_json
from esftctl.names import check_name
from esftctl.units import format_ranges

BUNDLE_FORMAT = "esftctl-adapter"
BUNDLE_VERSION = 2
READ_VERSIONS = (1, 2)  # 1: no manifest_sha256 nor base_tensors.json, read only when the user asks
MANIFEST = "manifest.json"
DATA_FILE = "experts.safetensors"
BASE_TENSORS = "base_tensors.json"
MANIFEST_LIMIT = 16 << 20  # bytes; a 60-layer model with every expert listed writes about 100 KB
NON_EXPERT_PREFIX = "non_expert."


def expert_tensor_name(layer: int, expert: int, weight: str) -> str:
    return f"layers.{layer}.experts.{expert}.{weight}"


HASH_CHUNK = 16 << 20  # bytes read at a time while hashing


def tensors_sha256(path: Path) -> str:
    """SHA-256 over a safetensors file's tensors: name, dtype, shape and bytes of each, in name order (the bytes
    read a chunk at a time)."""
    tensors = read_header(path)
    h = hashlib.sha256()
    buffer = memoryview(bytearray(HASH_CHUNK))
    for name in sorted(tensors):
        info = tensors[name]
        h.update(f"{name}|{info.torch_dtype}|{list(info.shape)}|".encode())
        for start in range(0, info.nbytes, HASH_CHUNK):
            chunk = buffer[:min(HASH_CHUNK, info.nbytes - start)]
            read_stored_bytes(info, chunk, start, name=name)
            h.update(chunk)
    return h.hexdigest()


def manifest_sha256(m: dict) -> str:
    """SHA-256 of a manifest's fields but manifest_sha256, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tensor_sha256(dtype: str, shape: tuple[int, ...], chunks) -> str:
    """SHA-256 of one tensor as base_tensors.json records it: dtype and shape, then its bytes (`chunks`)."""
    h = hashlib.sha256(f"{dtype}|{list(shape)}|".encode())
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def base_tensor_hashes(ckpt: MoECheckpoint) -> dict[str, str]:
    """Every tensor of `ckpt` hashed from its file (tensor_sha256), by name; two threads (hashing and reading
    release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> str:
        info, buffer = ckpt.tensors[name], bytearray(min(HASH_CHUNK, ckpt.tensors[name].nbytes))

        def chunks():
            for start in range(0, info.nbytes, HASH_CHUNK):
                view = memoryview(buffer)[:min(HASH_CHUNK, info.nbytes - start)]
                read_stored_bytes(info, view, start, name=name)
                yield view
        return tensor_sha256(info.dtype, info.shape, chunks())

    names = sorted(ckpt.tensors)
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(names, pool.map(one, names)))


def base_record_bytes(hashes: dict[str, str]) -> bytes:
    """base_tensors.json's bytes: one way of writing a record, so that a store's copy gives back the same file."""
    return json.dumps(hashes, indent=0, sort_keys=True).encode()


def base_identity(ckpt: MoECheckpoint) -> dict:
    """What a bundle records of its base: structure, and a fingerprint of config and router weights."""
    structure = {
        "architecture": ckpt.arch.name, "model_type": ckpt.config["model_type"],
        "num_layers": ckpt.num_layers, "moe_layers": ckpt.moe_layers, "num_experts": ckpt.num_experts,
        "top_k": ckpt.top_k, "hidden_size": ckpt.hidden_size, "moe_intermediate_size": ckpt.moe_intermediate_size,
        "vocab_size": ckpt.config.get("vocab_size"), "expert_dtype": ckpt.expert_dtype,
    }
    if ckpt.fp8 is not None:  # only then: the fingerprints of bundles of plain bases stay what they were
        structure["weight_block_size"] = list(ckpt.fp8.block)
    h = hashlib.sha256(json.dumps(structure, sort_keys=True).encode())
    for layer in ckpt.moe_layers:
        for name in ckpt.routing_tensors(layer):
            h.update(ckpt.read_tensor(name).contiguous().view(torch.uint8).numpy().tobytes())
    return {**structure, "fingerprint": "sha256:" + h.hexdigest()}


def write_bundle(out: Path, name: str, base: MoECheckpoint, experts: dict[int, dict[int, ExpertWeights]],
                 non_expert: dict[str, torch.Tensor] | None = None, *, overwrite: bool = False) -> Path:
    """Write a bundle folder atomically; experts: {layer: {expert id: weights}}."""
    check_name(name)
    tensors: dict[str, torch.Tensor] = {}
    for layer, per_layer in sorted(experts.items()):
        for e, weights in sorted(per_layer.items()):
            for w, t in weights.items():
                if t.dtype.is_floating_point and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
                    raise EsftError(f"expert {e} of layer {layer} ({w}) holds values that are not finite (NaN or "
                                    "infinity): no bundle written", out)
                tensors[expert_tensor_name(layer, e, w)] = t.contiguous()
    for tname, t in sorted((non_expert or {}).items()):
        tensors[NON_EXPERT_PREFIX + tname] = t.contiguous()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        # One metadata key: safetensors writes its metadata map in a random order, and a bundle's store decodes
        # back to this very file (esftctl decompress) only if the header comes out the same every time.
        save_file(tensors, tmp / DATA_FILE, metadata={"format": BUNDLE_FORMAT})
        record = base_record_bytes(base_tensor_hashes(base))
        (tmp / BASE_TENSORS).write_bytes(record)
        manifest = {
            "format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "name": name, "created_by": f"esftctl {__version__}",
            "base": base_identity(base),
            "dtype": base.expert_dtype,
            "shapes": {w: list(s) for w, s in base.expert_shapes().items()},
            "experts": {str(layer): sorted(ids) for layer, ids in sorted(experts.items()) if ids},
            "non_expert_tensors": sorted(non_expert or {}),
            "file": DATA_FILE, "tensors_sha256": tensors_sha256(tmp / DATA_FILE),
            "base_tensors_sha256": hashlib.sha256(record).hexdigest(),
        }
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def _short(value: object) -> str:
    """A manifest value for a message: reprlib's bounds on nesting, digits and items, then 60 characters."""
    text = reprlib.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Type and range checks of one manifest's fields, each refusal one line naming the manifest."""

    def __init__(self, file: Path):
        self.file = file

    def fail(self, what: str, value: object, want: str) -> EsftError:
        return EsftError(f"manifest field {what} must be {want}, not {_short(value)}", self.file)

    def get(self, d: dict, key: str, where: str = "") -> object:
        if key not in d:
            raise EsftError(f"manifest has no {where}{key!r}", self.file)
        return d[key]

    def int(self, value: object, what: str, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:  # type(): True is an int to isinstance
            raise self.fail(what, value, f"an integer from {lo} to {hi}")
        return value

    def str(self, value: object, what: str, limit: int = 1024) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise self.fail(what, value, f"a string of 1-{limit} characters")
        return value

    def dict(self, value: object, what: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(what, value, "an object")
        return value

    def distinct_ints(self, value: object, what: str, lo: int, hi: int) -> list[int]:
        if not isinstance(value, list):
            raise self.fail(what, value, "a list")
        ids = [self.int(v, f"{what}[{k}]", lo, hi) for k, v in enumerate(value)]
        if len(set(ids)) != len(ids):
            raise self.fail(what, value, "a list without repeats")
        return ids


MAX_COUNT = 1 << 20  # layers, experts, and vocabulary entries (real models: hundreds; hundreds of thousands)
MAX_DIM = 1 << 31


def _check_base(base: object, fields: _Fields) -> dict:
    base = fields.dict(base, "base")
    for key in ("architecture", "model_type", "expert_dtype", "fingerprint"):
        fields.str(fields.get(base, key, "base."), f"base.{key}", 128)
    if base["expert_dtype"] not in TORCH_DTYPES:
        raise fields.fail("base.expert_dtype", base["expert_dtype"], f"one of {', '.join(TORCH_DTYPES)}")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", base["fingerprint"]):
        raise fields.fail("base.fingerprint", base["fingerprint"], "'sha256:' and 64 hex digits")
    layers = fields.int(fields.get(base, "num_layers", "base."), "base.num_layers", 1, MAX_COUNT)
    experts = fields.int(fields.get(base, "num_experts", "base."), "base.num_experts", 1, MAX_COUNT)
    fields.int(fields.get(base, "top_k", "base."), "base.top_k", 1, experts)
    for key in ("hidden_size", "moe_intermediate_size"):
        fields.int(fields.get(base, key, "base."), f"base.{key}", 1, MAX_DIM)
    if fields.get(base, "vocab_size", "base.") is not None:
        fields.int(base["vocab_size"], "base.vocab_size", 1, MAX_COUNT)
    if "weight_block_size" in base:
        block = base["weight_block_size"]
        if not isinstance(block, list) or len(block) != 2:
            raise fields.fail("base.weight_block_size", block, "two integers")
        for k, b in enumerate(block):
            fields.int(b, f"base.weight_block_size[{k}]", 1, MAX_DIM)
    moe = fields.distinct_ints(fields.get(base, "moe_layers", "base."), "base.moe_layers", 0, layers - 1)
    if not moe or moe != sorted(moe):
        raise fields.fail("base.moe_layers", moe, "a non-empty list in increasing order")
    return base


def _check_manifest(m: object, fields: _Fields) -> dict:
    """Every field of a manifest type- and range-checked, ids against the declared base, shapes its shapes."""
    if not isinstance(m, dict) or m.get("format") != BUNDLE_FORMAT:
        raise EsftError(f"not an esftctl adapter manifest (format is not {BUNDLE_FORMAT!r})", fields.file)
    if type(m.get("version")) is not int or m["version"] not in READ_VERSIONS:
        raise EsftError(f"bundle format version {_short(m.get('version'))} is not supported (this esftctl reads "
                        f"{READ_VERSIONS[0]} to {READ_VERSIONS[-1]})", fields.file)
    if m["version"] == 1:
        unprotected.check("a version 1 bundle", fields.file, "pack the adapter again")
    else:
        for key in ("manifest_sha256", "base_tensors_sha256"):
            if not re.fullmatch(r"[0-9a-f]{64}", fields.str(fields.get(m, key), key, 64)):
                raise fields.fail(key, m[key], "64 hex digits")
        try:
            digest = manifest_sha256(m)
        except (ValueError, RecursionError):
            digest = None
        if digest != m["manifest_sha256"]:
            raise EsftError("manifest checksum mismatch: manifest.json was changed or is corrupted", fields.file)
    name = fields.get(m, "name")
    if not isinstance(name, str):
        raise fields.fail("name", name, "a string")
    try:
        check_name(name)
    except EsftError as e:
        raise EsftError(f"manifest {e}", fields.file) from None
    if "created_by" in m:
        fields.str(m["created_by"], "created_by")
    base = _check_base(fields.get(m, "base"), fields)
    if fields.get(m, "dtype") != base["expert_dtype"]:
        raise fields.fail("dtype", m["dtype"], f"the base's expert dtype {base['expert_dtype']!r}")
    h, i = base["hidden_size"], base["moe_intermediate_size"]
    want = {"gate": [i, h], "up": [i, h], "down": [h, i]}
    arch = architecture_for(base["model_type"])
    if arch is not None and EXPERT_BIASES[0] in arch.expert_weights:
        want.update(gate_bias=[i], up_bias=[i], down_bias=[h])
    if "weight_block_size" in base:
        bn, bk = base["weight_block_size"]
        want.update({s: [-(-want[w][0] // bn), -(-want[w][1] // bk)] for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES)})
    if fields.get(m, "shapes") != want:
        raise fields.fail("shapes", m["shapes"], f"the base's expert shapes {want}")
    experts = fields.dict(fields.get(m, "experts"), "experts")
    layers = {str(layer) for layer in base["moe_layers"]}
    for layer, ids in experts.items():
        if layer not in layers:
            raise fields.fail("experts", layer, f"keyed by the base's MoE layers ({format_ranges(base['moe_layers'])})")
        fields.distinct_ints(ids, f"experts[{layer}]", 0, base["num_experts"] - 1)
    names = m.get("non_expert_tensors", [])
    if not isinstance(names, list):
        raise fields.fail("non_expert_tensors", names, "a list")
    for k, n in enumerate(names):
        fields.str(n, f"non_expert_tensors[{k}]")
    if len(set(names)) != len(names):
        raise fields.fail("non_expert_tensors", names, "a list without repeats")
    fields.str(fields.get(m, "file"), "file", 255)
    if not re.fullmatch(r"[0-9a-f]{64}", fields.str(fields.get(m, "tensors_sha256"), "tensors_sha256", 64)):
        raise fields.fail("tensors_sha256", m["tensors_sha256"], "64 hex digits")
    return m


def data_file_name(manifest: dict, manifest_file: Path) -> str:
    """The data file a manifest names: a plain name of a file in the bundle folder. The refusal of a name that
    leaves the folder says nothing about what lies outside."""
    name = manifest.get("file")
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise EsftError(f"manifest field file must name a file in the bundle folder, not {_short(name)}",
                        manifest_file)
    return name


def data_file_of(folder: Path, manifest: dict, manifest_file: Path) -> Path:
    """The data file a manifest names (data_file_name), a regular file in the bundle folder, not a link out."""
    name = data_file_name(manifest, manifest_file)
    path = folder / name
    if path.resolve().parent != folder.resolve():
        raise EsftError(f"manifest field file {name!r} is a link out of the bundle folder", manifest_file)
    check_regular(path)
    return path


def read_manifest(folder: Path) -> object:
    """A bundle folder's manifest.json as parsed JSON: a regular file in the folder (not a link out of it),
    bounded in size."""
    manifest_file = folder / MANIFEST
    if not os.path.lexists(manifest_file):
        raise EsftError(f"not an adapter bundle (no {MANIFEST})", folder)
    if manifest_file.resolve().parent != folder.resolve():
        raise EsftError("is a link out of the bundle folder", manifest_file)
    return read_json(manifest_file, MANIFEST_LIMIT)


def bundle_files(path: str | Path, pinned: PinnedFolder | None = None, check=None) -> tuple[Path, dict, Path]:
    """(manifest file, its parsed JSON, the data file it names) of a bundle folder, checked as Bundle.open checks
    them (`check(manifest)` before the data file is looked for). With `pinned` (the folder opened beneath an
    adapter root) both are opened through it, links refused, and the paths returned open those very files
    (esftctl.beneath); messages name the files as given."""
    path = Path(path)
    with pinned.naming() if pinned is not None else contextlib.nullcontext():
        if pinned is None:
            manifest_file = path / MANIFEST
            m = read_manifest(path)
        else:
            if not os.path.lexists(pinned.path / MANIFEST):
                raise EsftError(f"not an adapter bundle (no {MANIFEST})", path)
            manifest_file = pinned.file(MANIFEST)
            m = read_json(manifest_file, MANIFEST_LIMIT)
        if check is not None:
            m = check(m)
        elif not isinstance(m, dict):
            raise EsftError("not an esftctl adapter manifest (not a JSON object)", path / MANIFEST)
        if pinned is None:
            return manifest_file, m, data_file_of(path, m, manifest_file)
        return manifest_file, m, pinned.file(data_file_name(m, manifest_file))


def file_identity(path: str | Path, pinned: PinnedFolder | None = None) -> tuple[tuple[int, int, int, int], ...]:
    """What makes two reads of a bundle the same bytes: the device, inode, size and mtime of its manifest and of
    the data file that manifest names (the engine's host cache keys its staged rows by it)."""
    manifest_file, _, data = bundle_files(path, pinned)
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, (manifest_file, data)))


def identity_json(identity: tuple) -> list[list[int]]:
    """A file identity as JSON has it (lists): how the status and a server's record of verified bundles hold it."""
    return [list(part) for part in identity]


@dataclass
class PackReport:
    """What `esftctl pack` (or an ESFT adapter's import) wrote: the bundle's experts per layer, and what it left out."""

    name: str
    out: Path
    experts: dict[int, list[int]]
    unchanged_listed: list[tuple[int, int]] = field(default_factory=list)  # in the config, identical to base
    non_expert_changed: list[str] = field(default_factory=list)
    layer_base: int | None = None  # how the expert config numbered layers (0 or 1); None without one
    layer_base_decided: bool = False  # the config's keys fit both numberings; the fine-tune's changes chose one


@dataclass
class Bundle:
    """An opened, verified adapter bundle (manifest fields, data file, checksum, header, tensor names, shapes and
    dtypes all checked)."""

    path: Path
    manifest: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)  # the data file's, by name

    data: Path | None = field(default=None, repr=False)  # the data file as read (through `pinned`'s descriptor)
    pinned: PinnedFolder | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | Path, *, hash_data: bool = True, pinned: PinnedFolder | None = None) -> "Bundle":
        """`hash_data` False: every check but the data's checksum, for bytes verified already (the same file
        identity, file_identity, hashed by this server's launcher or load check just before). `pinned`: the
        folder opened beneath an adapter root, through which every file is read (bundle_files); the bundle reads
        through it while it stays open."""
        path = Path(path)
        _, m, data = bundle_files(path, pinned, check=lambda m: _check_manifest(m, _Fields(path / MANIFEST)))
        bundle = cls(path, m, data=data, pinned=pinned)
        with pinned.naming() if pinned is not None else contextlib.nullcontext():
            bundle._verify(data, hash_data)
        return bundle

    def _verify(self, data: Path, hash_data: bool = True) -> None:
        """The data file's tensors are exactly the manifest's, then its bytes are the ones packed (checksum)."""
        self.tensors = read_header(data)
        header = {n: (info.shape, info.dtype) for n, info in self.tensors.items()}
        shapes = {w: tuple(s) for w, s in self.manifest["shapes"].items()}
        expected = {expert_tensor_name(l, e, w): (shapes[w], self.part_dtype(w))
                    for l, ids in self.experts.items() for e in ids for w in self.weights}
        for name, want in expected.items():
            if header.get(name) != want:
                got = header.get(name)
                raise EsftError(f"tensor {name!r} is {'missing' if got is None else got}, expected {want}", data)
        non_expert = {NON_EXPERT_PREFIX + n for n in self.manifest.get("non_expert_tensors", [])}
        extra = set(header) - set(expected) - non_expert
        if extra or not non_expert <= set(header):
            raise EsftError(f"tensors do not match the manifest ({sorted(extra or non_expert - set(header))[:3]})",
                            data)
        if hash_data and tensors_sha256(data) != self.manifest["tensors_sha256"]:
            raise EsftError("checksum mismatch: the file is corrupted or truncated", data)
        if self.fp8 is not None:  # small, and what a load would refuse only inside the engine
            for l, ids in self.experts.items():
                for e in ids:
                    for w, sc in zip(EXPERT_WEIGHTS, EXPERT_SCALES):
                        scale = self.read_tensor(expert_tensor_name(l, e, sc))
                        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                            raise EsftError(f"FP8 weight {expert_tensor_name(l, e, w)!r} has scales that are not "
                                            "finite and positive", data)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def weights(self) -> list[str]:
        """What one expert consists of here: gate, up, down, their biases where the base's experts have them, and
        their block scales where they are FP8."""
        return [w for w in EXPERT_WEIGHTS + EXPERT_BIASES + EXPERT_SCALES if w in self.manifest["shapes"]]

    def part_dtype(self, part: str) -> str:
        """The stored dtype of one expert part: the manifest's, float32 for FP8 block scales."""
        return "F32" if part in EXPERT_SCALES else self.manifest["dtype"]

    @property
    def data_file(self) -> Path:
        """The data file, as the user names it (messages, sizes)."""
        return self.path / self.manifest["file"]

    def base_tensor_hashes(self) -> dict[str, str] | None:
        """base_tensors.json, checked against the manifest: {base tensor name: tensor_sha256}; None for a version 1
        bundle, which has none."""
        if self.manifest["version"] == 1:
            return None
        shown = self.path / BASE_TENSORS
        file = self.pinned.file(BASE_TENSORS) if self.pinned is not None else shown
        if self.pinned is None:
            check_regular(file)
        raw = read_bounded(file, JSON_LIMIT)
        if hashlib.sha256(raw).hexdigest() != self.manifest["base_tensors_sha256"]:
            raise EsftError("checksum mismatch: the file was changed or is corrupted", shown)
        record = json.loads(raw)  # the bytes pack wrote, checked
        if not isinstance(record, dict) or not all(isinstance(v, str) for v in record.values()):
            raise EsftError("not a record of base tensor hashes", shown)
        return record

    @cached_property
    def experts(self) -> dict[int, list[int]]:
        return {int(l): list(ids) for l, ids in self.manifest["experts"].items()}

    @property
    def base(self) -> dict:
        return self.manifest["base"]

    @property
    def num_experts(self) -> int:
        return sum(len(ids) for ids in self.experts.values())

    @property
    def non_expert_tensors(self) -> list[str]:
        return list(self.manifest.get("non_expert_tensors", []))

    def check_base(self, base: MoECheckpoint) -> None:
        """Refuse a base other than the one this bundle was packed against."""
        identity = base_identity(base)
        if any(identity[k] != self.base.get(k) for k in identity):  # the fingerprint, and what the manifest says
            mismatch = [k for k in identity if k != "fingerprint" and identity[k] != self.base.get(k)]
            why = f"differs in {', '.join(mismatch)}" if mismatch else "has other router weights"
            raise EsftError(f"bundle {self.name!r} was packed for another base model than {base.path} (this base "
                            f"{why})", self.path)

    def read_tensor(self, name: str) -> torch.Tensor:
        """A tensor of the data file by its name there (layers.L.experts.E.W or non_expert.NAME), read, not mapped."""
        return self.stored_tensor(name).read()

    def stored_tensor(self, name: str) -> StoredTensor:
        """A tensor of the data file by its name there, not read yet (read_tensor's, to read into place)."""
        if name not in self.tensors:
            raise EsftError(f"bundle has no tensor {name!r}", self.data_file)
        return StoredTensor(name, self.tensors[name])

    @property
    def fp8(self) -> Fp8Block | None:
        """The base's FP8 block scheme, in which the bundle's experts are stored; None for plain experts."""
        block = self.base.get("weight_block_size")
        return Fp8Block(tuple(block)) if block is not None else None

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        weights = ExpertWeights(**{w: self.read_tensor(expert_tensor_name(layer, expert, w)) for w in self.weights})
        if self.fp8 is not None:
            for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES):
                self.fp8.check(getattr(weights, w), getattr(weights, s), name=expert_tensor_name(layer, expert, w),
                               file=self.data_file)
        return weights

    def read_experts(self) -> dict[int, dict[int, ExpertWeights]]:
        return {l: {e: self.read_expert(l, e) for e in ids} for l, ids in self.experts.items()}

    def stored_experts(self) -> dict[int, dict[int, StoredExpert]]:
        """The experts as where their parts lie in the data file, to be read into place (a served load's staging:
        one copy of each byte, not two). Plain experts only: FP8 experts' scales are checked as they are read
        (read_experts)."""
        if self.fp8 is not None:
            raise ValueError("FP8 experts are read with read_experts, which checks their scales")
        return {l: {e: StoredExpert({w: self.stored_tensor(expert_tensor_name(l, e, w)) for w in self.weights})
                    for e in ids} for l, ids in self.experts.items()}

    def read_non_expert(self) -> dict[str, torch.Tensor]:
        return {n: self.read_tensor(NON_EXPERT_PREFIX + n) for n in self.non_expert_tensors}

    def experts_per_layer(self) -> list[int]:
        return [len(self.experts.get(l, [])) for l in self.base["moe_layers"]]

    def describe(self) -> dict:
        counts = self.experts_per_layer()
        layers = len(counts)
        most = max(counts) if counts else 0
        mean = sum(counts) / layers if layers else 0.0
        expert_bytes = sum(math.prod(s) * TORCH_DTYPES[self.part_dtype(w)].itemsize
                           for w, s in self.manifest["shapes"].items())
        return {
            "kind": "bundle", "path": str(self.path), "name": self.name, "architecture": self.base["architecture"],
            "base_fingerprint": self.base["fingerprint"], "moe_layers": self.base["moe_layers"],
            "experts_per_layer": counts, "total_experts": sum(counts), "max_experts_per_layer": most,
            "mean_experts_per_layer": mean, "sparsity_factor": 1 - mean / most if most else 0.0,
            "expert_bytes": expert_bytes,
            "bundle_bytes": (self.data or self.data_file).stat().st_size,
            "non_expert_tensors": len(self.non_expert_tensors),
        }
