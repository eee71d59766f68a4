"""Huffman-compressed expert stores: `esftctl compress`, `esftctl decompress`, and decoding for the runtime.

A store is a folder:

    store.json  format, version, source (model folder or adapter bundle), chunk size, code tables (code
                lengths per symbol), and per tensor: name, shape, (layer, expert, weight), its code table,
                where its three sections lie in store.bin and their SHA-256; the SHA-256 of store.bin; and
                `header_sha256`, the SHA-256 of the header's canonical JSON without that field (header_hash)
    store.bin   per tensor: the Huffman-coded exponents (chunks laid out as esftctl.formats.huffman.chunk_layout
                says: a warp's 32 chunks take turns by 16 values), the chunks' starting bit offsets
                (uint32), and one sign-and-mantissa byte per value; each section starts on a 16-byte boundary

Only bf16 expert weights are stored; decoding is bit-exact. Code tables are per tensor or shared per layer
(`--table-scope`): `esftctl bench compress` measures both.

Stores are files people download and share, and their numbers become memory addresses in the decoders, so a
reader trusts nothing it has not checked (read_header, validate_header): the header is a bounded regular file
of bounded JSON whose every field is type- and range-checked, every tensor's value count is its shape's, every
section lies inside the data file, which is a regular file named in the store folder; then the header's hash
(version 3), and store.bin's (unless the caller defers it: each tensor is then checked against its own hash
before it is decoded). Version 2 stores (no header or tensor hashes) are read only when the user asks
(esftctl.formats.unprotected), and are then marked unprotected. The hashes
catch corruption, not an attacker, who can recompute them: against crafted stores stand the checks, which keep
every decoder inside its buffers and make every refusal one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import reprlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from esftctl import __version__
from esftctl.atomic import atomic_dir
from esftctl.errors import EsftError, one_line
from esftctl.formats import unprotected
from esftctl.formats.huffman import (
    GROUP,
    LANES,
    MAX_CHUNK,
    MAX_LENGTH,
    Code,
    build_code,
    check_chunk,
    check_lengths,
    chunk_count,
    decode_bf16,
    encode,
    entropy_bits,
    multi_symbol_table,
    split_and_count,
)
from esftctl.jsonfile import open_regular, read_json

STORE_FORMAT = "esftctl-expert-store"
STORE_VERSION = 3  # 2: no header or tensor hashes (read only when asked for); 1: chunks held consecutive values
READ_VERSIONS = (2, 3)
HEADER, DATA = "store.json", "store.bin"
DEFAULT_CHUNK = 1024
ALIGN = 16
MAX_HEADER_BYTES = 64 << 20  # a DeepSeek-V2-Lite store's header is about 1.5 MB
MAX_TENSORS = 1 << 20
MAX_COUNT = (1 << 31) - 1  # values per tensor: the GPU decoder counts them in int32
MAX_DIMS = 8
MAX_FIELD = 1 << 62  # any offset, length or size
# store.bin goes to a device in pieces of this size (ExpertStore.to_device): read whole, then padded in a second
# copy, a Qwen3-30B-A3B store (25 GB) had the engine at 36 GB of anonymous memory beside its 39 GB base in /dev/shm
# when a 125 GB host OOM-killed it; one piece at a time it takes 256 MiB.
DEVICE_COPY_CHUNK = 256 << 20
log = logging.getLogger("esftctl.formats.store")


@dataclass(frozen=True)
class SourceTensor:
    name: str
    layer: int | None
    expert: int | None
    weight: str | None
    read: Callable[[], torch.Tensor]


def source_tensors(path: Path) -> tuple[dict, list[SourceTensor]]:
    """What to store from a model folder (every routed expert) or an adapter bundle (all its tensors)."""
    from esftctl.formats.bundle import MANIFEST, Bundle, expert_tensor_name
    from esftctl.formats.checkpoint import MoECheckpoint

    if (path / MANIFEST).exists():
        bundle = Bundle.open(path)
        # read, not mapped (a mapping holds the whole file, and Ctrl-C inside safetensors surfaces as a ValueError)
        tensors = [SourceTensor(name, l, e, w, lambda name=name: bundle.read_tensor(name))
                   for l, ids in bundle.experts.items() for e in ids for w in bundle.weights
                   for name in (expert_tensor_name(l, e, w),)]
        tensors += [SourceTensor("non_expert." + n, None, None, None, lambda n=n: bundle.read_tensor("non_expert." + n))
                    for n in bundle.non_expert_tensors]
        source = {"kind": "bundle", "path": str(path), "manifest": bundle.manifest}
        record = bundle.base_tensor_hashes()
        return source | ({"base_tensors": record} if record is not None else {}), tensors
    ckpt = MoECheckpoint(path)
    if ckpt.arch.fused is not None:  # a layer's experts share its fused tensors: stored whole, as the model has them
        tensors = [SourceTensor(name, l, None, None, lambda name=name: ckpt.read_tensor(name))
                   for l in ckpt.moe_layers for name in ckpt.routed_tensor_names(l)]
        return {"kind": "model", "path": str(path), "architecture": ckpt.arch.name}, tensors
    tensors = [SourceTensor(name, l, e, w, lambda name=name: ckpt.read_tensor(name))
               for l in ckpt.moe_layers for e in range(ckpt.num_experts)
               for w, name in ckpt.expert_tensor_names(l, e).items()]
    return {"kind": "model", "path": str(path), "architecture": ckpt.arch.name}, tensors


def _bf16_bits(t: torch.Tensor, name: str, source: dict) -> np.ndarray:
    if t.dtype != torch.bfloat16:
        raise EsftError(f"tensor {name!r} is {t.dtype}; only bf16 expert weights can be stored", source.get("path"))
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


class _DataWriter:
    """store.bin written as it is produced (a model's store never sits in memory), by a thread of its own that
    also keeps its SHA-256. File writes and hashing release the GIL, so they overlap the next tensors' reading and
    encoding: on DeepSeek-V2-Lite's shapes (2 cores) writing and hashing a layer's store take almost as long as
    reading and encoding it (`esftctl bench offline` times `compress`: benchmarks/RESULTS.md, Offline commands). At
    most `depth` writes wait.

    A write that fails in the thread (a full disk) is raised by the next `write` or by `close`. Between
    `begin_tensor` and `end_tensor(entry)` the thread also hashes what is written (not the padding `align`
    writes) and sets entry["sha256"]: a tensor's own checksum, read once `close` returned."""

    def __init__(self, path: Path, depth: int = 32):
        self.path, self.pos, self.sha = path, 0, hashlib.sha256()
        self._tensor_sha: hashlib._Hash | None = None
        self._file = open(path, "wb")
        self._pending: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="store.bin writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._pending.get()) is not None:
            data, hashed = item
            if isinstance(data, dict):  # end_tensor
                data["sha256"] = self._tensor_sha.hexdigest() if self._tensor_sha else None
                self._tensor_sha = None
            elif data is None:  # begin_tensor
                self._tensor_sha = hashlib.sha256()
            elif self._error is None:
                try:
                    self._file.write(data)
                    self.sha.update(data)
                    if hashed and self._tensor_sha is not None:
                        self._tensor_sha.update(data)
                except BaseException as e:  # raised in the caller's thread by write or close
                    self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: bytes | np.ndarray, hashed: bool = True) -> None:
        """Queue `data` (bytes, or a contiguous array left unchanged from here on) to be written next."""
        self._raise_error()
        self._pending.put((data, hashed))
        self.pos += memoryview(data).nbytes

    def align(self) -> int:
        """Pad to the next section boundary and return it."""
        self.write(b"\0" * (-self.pos % ALIGN), hashed=False)
        return self.pos

    def begin_tensor(self) -> None:
        self._pending.put((None, False))

    def end_tensor(self, entry: dict) -> None:
        self._pending.put((entry, False))

    def close(self) -> None:
        """Wait for every queued write, close the file, and raise what a write raised."""
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join()
        self._file.close()
        self._raise_error()

    def __enter__(self) -> "_DataWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compress(src: Path, out: Path, chunk: int = DEFAULT_CHUNK, table_scope: str = "layer", *,
             overwrite: bool = False, on_tensor: Callable[[str], None] = lambda name: None) -> dict:
    """Write a store for the experts of `src` (a model folder or a bundle); returns its header."""
    source, tensors = source_tensors(src)
    return write_store(source, tensors, out, chunk, table_scope, overwrite=overwrite, on_tensor=on_tensor)


def write_store(source: dict, tensors: list[SourceTensor], out: Path, chunk: int = DEFAULT_CHUNK,
                table_scope: str = "layer", *, overwrite: bool = False,
                on_tensor: Callable[[str], None] = lambda name: None) -> dict:
    if table_scope not in ("tensor", "layer"):
        raise EsftError(f"table scope must be 'tensor' or 'layer', not {table_scope!r}")
    if type(chunk) is not int or not GROUP <= chunk <= MAX_CHUNK or chunk % GROUP:
        raise EsftError(f"chunk size must be a multiple of {GROUP} from {GROUP} to {MAX_CHUNK}, not {chunk}")
    if out.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", out)
    groups: dict[object, list[SourceTensor]] = {}
    for t in tensors:
        groups.setdefault(t.name if table_scope == "tensor" or t.layer is None else t.layer, []).append(t)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        with _DataWriter(tmp / DATA) as data:
            tables, entries, total = _write_groups(groups, data, chunk, source, on_tensor)
            data.align()
        header = {"format": STORE_FORMAT, "version": STORE_VERSION, "created_by": f"esftctl {__version__}",
                  "source": source, "chunk": chunk, "lanes": LANES, "group": GROUP, "max_code_length": MAX_LENGTH,
                  "table_scope": table_scope, "tables": tables, "tensors": entries, "data_file": DATA,
                  "data_bytes": data.pos, "sha256": data.sha.hexdigest(), **total}
        header["header_sha256"] = header_hash(header)
        (tmp / HEADER).write_text(json.dumps(header))
    return header


def header_hash(header: dict) -> str:
    """The SHA-256 of the header's canonical JSON (keys sorted, no spaces, ASCII), `header_sha256` left out."""
    canonical = json.dumps({k: v for k, v in header.items() if k != "header_sha256"}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _write_groups(groups: dict[object, list[SourceTensor]], data: _DataWriter, chunk: int, source: dict,
                  on_tensor: Callable[[str], None]) -> tuple[list, list, dict]:
    """Encode each group (one code table) into `data`: at most one group's tensors in memory at a time."""
    tables, entries = [], []
    total = {"values": 0, "original_bytes": 0, "entropy_bound_bytes": 0.0}
    for members in groups.values():
        split, shapes = {}, {}
        counts = np.zeros(256, dtype=np.int64)
        for t in members:
            tensor = t.read()
            shapes[t.name] = list(tensor.shape)
            split[t.name] = split_and_count(_bf16_bits(tensor, t.name, source))
            counts += split[t.name][2]
        code = build_code(counts) if counts.any() else Code(np.zeros(256, dtype=np.int64))
        tables.append({"lengths": code.lengths.tolist()})
        for t in members:
            exponent, sign_mantissa, tensor_counts = split.pop(t.name)
            if len(exponent):
                stream, offsets = encode(exponent, code, chunk)
            else:
                stream, offsets = b"", np.zeros(0, dtype=np.uint64)
            if (len(offsets) and 8 * len(stream) >= 1 << 32) or len(exponent) > MAX_COUNT:
                raise EsftError(f"tensor {t.name!r} is too large for 32-bit chunk offsets")
            entry = {"name": t.name, "layer": t.layer, "expert": t.expert, "weight": t.weight,
                     "shape": shapes[t.name], "count": len(exponent), "table": len(tables) - 1}
            entry["exp_offset"], entry["exp_bytes"] = data.align(), len(stream)
            data.begin_tensor()
            data.write(stream)
            entry["chunk_offset"], entry["chunks"] = data.align(), len(offsets)
            data.write(offsets.astype("<u4").tobytes())
            entry["sm_offset"] = data.align()
            data.write(sign_mantissa)
            data.end_tensor(entry)  # its "sha256": what a reader hashes, the three sections without padding
            entries.append(entry)
            h = entropy_bits(tensor_counts) if len(exponent) else 0.0
            total["values"] += len(exponent)
            total["original_bytes"] += 2 * len(exponent)
            total["entropy_bound_bytes"] += len(exponent) * (h + 8) / 8
            on_tensor(t.name)
    return tables, entries, total


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill `buf` from `offset` on, or EsftError where the file ends first."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + (1 << 30)]], offset + done)
        if not n:
            raise EsftError("a section runs past the end of the file (truncated?)", path)
        done += n


def _pread(fd: int, offset: int, nbytes: int, path: Path) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    _pread_into(fd, memoryview(out), offset, path)
    return out


def _fd_sha256(fd: int, nbytes: int, path: Path, block: int = 8 << 20) -> str:
    """The SHA-256 of the first `nbytes` bytes of `fd`: a bounded read, whatever the file does meanwhile."""
    sha, buf = hashlib.sha256(), memoryview(bytearray(block))
    for offset in range(0, nbytes, block):
        part = buf[:min(block, nbytes - offset)]
        _pread_into(fd, part, offset, path)
        sha.update(part)
    return sha.hexdigest()


def read_header(path: Path) -> object:
    """store.json parsed, bounded: a regular file of at most MAX_HEADER_BYTES (jsonfile.read_json: a 100,000-digit
    integer or deeply nested arrays are one-line errors like any other bad JSON)."""
    return read_json(path, limit=MAX_HEADER_BYTES)


_brief = reprlib.Repr()
_brief.maxstring = _brief.maxother = _brief.maxlong = 40


class _Fields:
    """Checks of one header's fields: each failure is one line naming the header file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, what: str) -> None:
        raise EsftError(what, self.path)

    def integer(self, obj: dict, key: str, where: str = "", *, lo: int = 0, hi: int = MAX_FIELD,
            none: bool = False) -> int | None:
        v = obj.get(key)
        if not (none and v is None) and (type(v) is not int or not lo <= v <= hi):
            self.fail(f"{where}{key} must be an integer from {lo} to {hi}, not {_brief.repr(v)}")
        return v

    def text(self, obj: dict, key: str, where: str = "", none: bool = False) -> str | None:
        v = obj.get(key)
        if not (none and v is None) and (not isinstance(v, str) or not 0 < len(v) <= 4096):
            self.fail(f"{where}{key} must be a string, not {_brief.repr(v)}")
        return v

    def obj(self, obj: object, where: str) -> dict:
        if not isinstance(obj, dict):
            self.fail(f"{where} must be an object, not {_brief.repr(obj)}")
        return obj

    def array(self, obj: dict, key: str, most: int) -> list:
        v = obj.get(key)
        if not isinstance(v, list) or len(v) > most:
            self.fail(f"{key} must be a list of at most {most}, not {_brief.repr(v)}")
        return v

    def sha256(self, obj: dict, key: str, where: str = "") -> str:
        v = obj.get(key)
        if not isinstance(v, str) or len(v) != 64 or v.strip("0123456789abcdef"):
            self.fail(f"{where}{key} must be a SHA-256 in hex, not {_brief.repr(v)}")
        return v


def validate_header(h: dict, path: Path) -> None:
    """EsftError (one line naming `path`) unless every field a reader uses has its type and range: the chunk
    layout this esftctl decodes, code tables that are prefix codes, and per tensor a unique name, a shape whose
    element count is its value count, a table that exists, the chunk count its size needs, and sections that lie
    inside the `data_bytes` of a data file named plainly in the store folder."""
    f = _Fields(path)
    try:
        chunk = check_chunk(h.get("chunk"))
    except ValueError as e:
        raise EsftError(str(e), path) from None
    lanes, group = h.get("lanes"), h.get("group")
    if type(lanes) is not int or type(group) is not int or (lanes, group) != (LANES, GROUP):
        f.fail(f"chunks laid out for {_brief.repr(lanes)} lanes of {_brief.repr(group)} values; this esftctl reads "
               f"{LANES} of {GROUP}")
    f.integer(h, "max_code_length", lo=MAX_LENGTH, hi=MAX_LENGTH)
    if h.get("table_scope") not in ("tensor", "layer"):
        f.fail(f"table_scope must be 'tensor' or 'layer', not {_brief.repr(h.get('table_scope'))}")
    source = f.obj(h.get("source"), "source")
    f.text(source, "kind", "source.")
    f.text(source, "path", "source.")
    if source["kind"] == "bundle":
        f.text(f.obj(source.get("manifest"), "source.manifest"), "name", "source.manifest.")
        if "base_tensors" in source:
            record = f.obj(source["base_tensors"], "source.base_tensors")
            if not all(isinstance(v, str) for v in record.values()):
                f.fail("source.base_tensors must map tensor names to hashes")
    name = f.text(h, "data_file")
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        f.fail(f"data_file must be a file name in the store folder, not {_brief.repr(name)}")
    size = f.integer(h, "data_bytes")
    f.sha256(h, "sha256")
    tables = f.array(h, "tables", MAX_TENSORS)
    for i, t in enumerate(tables):
        try:
            check_lengths(f.obj(t, f"tables[{i}]").get("lengths"))
        except ValueError as e:
            f.fail(f"tables[{i}]: {e}")
    names, values = set(), 0
    for i, e in enumerate(f.array(h, "tensors", MAX_TENSORS)):
        _validate_tensor(f, f.obj(e, f"tensors[{i}]"), f"tensors[{i}].", chunk=chunk, tables=len(tables),
                         data_bytes=size, hashed=h.get("version", 0) >= 3)
        if e["name"] in names:
            f.fail(f"two tensors named {_brief.repr(e['name'])}")
        names.add(e["name"])
        values += e["count"]
    if f.integer(h, "values") != values or f.integer(h, "original_bytes") != 2 * values:
        f.fail(f"values and original_bytes must be the tensors' {values} values and their {2 * values} bf16 bytes")
    bound = h.get("entropy_bound_bytes")
    if type(bound) not in (int, float) or not 0 <= bound <= MAX_FIELD:
        f.fail(f"entropy_bound_bytes must be a number from 0, not {_brief.repr(bound)}")


def _validate_tensor(f: _Fields, e: dict, where: str, *, chunk: int, tables: int, data_bytes: int,
                     hashed: bool) -> None:
    name = f.text(e, "name", where)
    if name == "__metadata__":
        f.fail(f"{where}name may not be {name!r} (safetensors' own key)")
    f.integer(e, "layer", where, hi=MAX_COUNT, none=True)
    f.integer(e, "expert", where, hi=MAX_COUNT, none=True)
    f.text(e, "weight", where, none=True)
    shape = e.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or any(
            type(n) is not int or not 0 <= n <= MAX_COUNT for n in shape):
        f.fail(f"{where}shape must be a list of at most {MAX_DIMS} sizes, not {_brief.repr(shape)}")
    count = f.integer(e, "count", where, hi=MAX_COUNT)
    numel = math.prod(shape)
    if count != numel:
        f.fail(f"tensor {name!r} has {count} values, but its shape {shape} holds {numel}")
    f.integer(e, "table", where, hi=tables - 1)
    for key, length, most in (("exp", "exp_bytes", (1 << 29) - 1), ("chunk", "chunks", MAX_COUNT), ("sm", None, 0)):
        offset = f.integer(e, f"{key}_offset", where, hi=data_bytes)
        nbytes = f.integer(e, length, where, hi=most) if length else count
        if offset % ALIGN or offset + (4 * nbytes if key == "chunk" else nbytes) > data_bytes:
            f.fail(f"tensor {name!r}: its {key} section is not aligned or runs past the data file's {data_bytes} "
                   "bytes")
    if e["chunks"] != chunk_count(count, chunk):
        f.fail(f"tensor {name!r} has {e['chunks']} chunks, not the {chunk_count(count, chunk)} its size needs")
    if hashed:
        f.sha256(e, "sha256", where)


_warned: set[str] = set()


def _warn_unprotected(header_file: Path, version: int) -> None:
    """Once per store and process: where a user sees it (stderr, or the log of a server)."""
    if str(header_file) not in _warned:
        _warned.add(str(header_file))
        log.warning("%s: store version %d has no header checksum: a changed or corrupted store.json goes "
                    "unnoticed (compress the source again to protect it)", header_file, version)


def missing_base_experts(base, stored: set[str]) -> list[str]:
    """The routed-expert tensor names of `base` (an MoECheckpoint) that are not among `stored`: a store of the
    base itself (`esftctl compress BASE`) misses none."""
    return [n for l in base.moe_layers for n in base.routed_tensor_names(l) if n not in stored]


class ExpertStore:
    """An opened store, every header field checked (module docstring), decoding on the CPU or a GPU.

    With `verify` (the default) store.bin's SHA-256 is checked on opening. Without it opening reads only the
    header, and each tensor is checked against its own SHA-256 (version 3) before it is decoded: what a start-up
    probe that decodes one tensor of a large store needs. `protected` says whether the header has a checksum."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        header_file = self.path / HEADER
        if not header_file.exists():
            raise EsftError(f"not an expert store (no {HEADER})", self.path)
        self.header = h = read_header(header_file)
        if not isinstance(h, dict) or h.get("format") != STORE_FORMAT:
            raise EsftError(f"not an esftctl expert store (format is not {STORE_FORMAT!r})", header_file)
        self.version = h.get("version")
        if type(self.version) is not int or self.version not in READ_VERSIONS:
            raise EsftError(f"store version {_brief.repr(self.version)} is not supported (this esftctl reads "
                            f"versions {READ_VERSIONS[0]} to {READ_VERSIONS[-1]}; compress the model again)",
                            header_file)
        self.protected = self.version >= 3
        if self.protected and h.get("header_sha256") != _header_hash_of(h, header_file):
            raise EsftError("header checksum mismatch: store.json was changed or is corrupted", header_file)
        if not self.protected:
            unprotected.check(f"a version {self.version} store", header_file, "compress the source again")
        validate_header(h, header_file)
        if not self.protected:
            _warn_unprotected(header_file, self.version)
        self.data_file = self.path / h["data_file"]
        fd = self._open_data()
        try:
            if os.fstat(fd).st_size != h["data_bytes"] or (
                    verify and _fd_sha256(fd, h["data_bytes"], self.data_file) != h["sha256"]):
                raise EsftError("checksum mismatch: the file is corrupted or truncated", self.data_file)
        finally:
            os.close(fd)
        self.verified = verify
        self.chunk = h["chunk"]
        self.codes = [Code(np.array(t["lengths"], dtype=np.int64)) for t in h["tables"]]
        self.tensors = {e["name"]: e for e in h["tensors"]}
        self._device_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __iter__(self) -> Iterator[dict]:
        return iter(self.header["tensors"])

    def _open_data(self) -> int:
        """store.bin's descriptor: a regular file (no FIFO, no device), and not a link out of the store folder."""
        if self.data_file.is_symlink():
            raise EsftError("the store data file is a symbolic link; it must be a regular file in the store folder",
                            self.data_file)
        return open_regular(self.data_file)

    def _sections(self, e: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A tensor's (exponent stream, chunk offsets, sign-and-mantissa bytes), read from the file; checked against
        the tensor's own hash where the file was not, and its chunk offsets in order from 0 inside its stream (the
        C decoder's bounds)."""
        parts = self._read(((e["exp_offset"], e["exp_bytes"]), (e["chunk_offset"], 4 * e["chunks"]),
                            (e["sm_offset"], e["count"])))
        if not self.verified and e.get("sha256") is not None:
            sha = hashlib.sha256()
            for part in parts:
                sha.update(part)
            if sha.hexdigest() != e["sha256"]:
                raise EsftError(f"checksum mismatch in tensor {e['name']!r}: the file is corrupted", self.data_file)
        stream, offsets, sign_mantissa = parts[0], parts[1].view("<u4"), parts[2]
        self._check_offsets(e, offsets)
        return stream, offsets, sign_mantissa

    def _chunk_offsets(self, e: dict) -> np.ndarray:
        """A tensor's chunk offsets, all a decode plan reads on the host: only that section where store.bin was
        hashed on opening (4 bytes per chunk: a 25 GB store's plans read 0.1 GB, not the store), else every section
        against the tensor's own hash (`_sections`)."""
        if not self.verified:
            return self._sections(e)[1]
        offsets = self._read([(e["chunk_offset"], 4 * e["chunks"])])[0].view("<u4")
        self._check_offsets(e, offsets)
        return offsets

    def _read(self, spans) -> list[np.ndarray]:
        """The bytes of each (offset, length) span of store.bin, in one open of the file."""
        fd = self._open_data()
        try:
            return [_pread(fd, o, n, self.data_file) for o, n in spans]
        finally:
            os.close(fd)

    def _check_offsets(self, e: dict, offsets: np.ndarray) -> None:
        if len(offsets) and (offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1])
                             or int(offsets[-1]) > 8 * e["exp_bytes"]):
            raise EsftError(f"tensor {e['name']!r}: chunk offsets out of order or past its stream", self.data_file)

    def decode_tensor(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one tensor into `out` (any device; a GPU decodes with the Triton kernel) or a new CPU tensor."""
        e = self._entry(name)
        if out is None:
            out = torch.empty(e["shape"], dtype=torch.bfloat16)
        if out.device.type == "cuda":
            self.plan([(name, out)]).run()
            return out
        self._check_destination(e, out)
        stream, offsets, sign_mantissa = self._sections(e)
        bits = out.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        try:
            decode_bf16(stream, offsets.astype(np.uint64), self.codes[e["table"]], self.chunk, sign_mantissa, out=bits)
        except ValueError as err:  # a corrupt stream
            raise EsftError(f"tensor {name!r}: {one_line(err)}", self.data_file) from None
        return out

    def _entry(self, name: str) -> dict:
        e = self.tensors.get(name)
        if e is None:
            raise EsftError(f"no tensor named {name!r} in the store", self.path)
        return e

    @staticmethod
    def _check_destination(e: dict, out: torch.Tensor) -> None:
        if list(out.shape) != e["shape"] or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"destination must be a contiguous bf16 tensor of shape {e['shape']}")

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's data and decode tables on `device` (copied once, then kept)."""
        key = str(device)
        if key not in self._device_cache:
            tables = np.stack([multi_symbol_table(c) for c in self.codes]) if self.codes else \
                np.zeros((1, 1 << MAX_LENGTH), dtype=np.int64)
            self._device_cache[key] = (self._data_on(device), torch.from_numpy(tables).to(device))
        return self._device_cache[key]

    def _data_on(self, device: torch.device) -> torch.Tensor:
        """store.bin on `device`, then zeros to whole 4-byte words and 16 bytes more (the decoder reads words, past
        a stream's end too): allocated once and filled DEVICE_COPY_CHUNK bytes at a time through one host buffer
        (pinned beside a GPU), so host memory never holds the store. A read of its own: without `verify` the
        tensors' hashes are checked on what `plan` and `decode_tensor` read, not on these bytes."""
        n = self.header["data_bytes"]
        out = torch.empty(n + 16 + -n % 4, dtype=torch.uint8, device=device)
        out[n:].zero_()
        buf = torch.empty(min(n, DEVICE_COPY_CHUNK), dtype=torch.uint8, pin_memory=device.type == "cuda")
        fd = self._open_data()
        try:
            for start in range(0, n, DEVICE_COPY_CHUNK):
                part = buf[:min(DEVICE_COPY_CHUNK, n - start)]
                _pread_into(fd, memoryview(part.numpy()), start, self.data_file)
                out[start:start + len(part)].copy_(part)  # synchronous: the buffer is refilled next
        finally:
            os.close(fd)
        return out

    def plan(self, targets: list[tuple[str, torch.Tensor]], *, rows: list[int] | None = None):
        """A DecodePlan writing each named tensor into its CUDA destination in one launch; every bound checked on
        the host before anything is launched (DecodePlan.build). `rows`: each target's expert row, for runs
        masked by the rows a step needs (paging)."""
        from esftctl.kernels.huffman_decode import DecodePlan, Segment

        device = targets[0][1].device
        data, tables = self.to_device(device)
        segments = []
        for k, (name, out) in enumerate(targets):
            e = self._entry(name)
            self._check_destination(e, out)
            offsets = self._chunk_offsets(e)
            segments.append(Segment(8 * e["exp_offset"] + offsets.astype(np.int64), e["sm_offset"], e["count"],
                                    e["table"], out, row=rows[k] if rows else 0))
        try:
            return DecodePlan.build(data, tables, self.chunk, segments)
        except ValueError as err:
            raise EsftError(f"cannot decode on {device}: {one_line(err)}", self.data_file) from None

    def describe(self) -> dict:
        h = self.header
        d = {"kind": "store", "path": str(self.path), "version": self.version, "header_checksum": self.protected,
             "source": h["source"]["kind"],
             "source_path": h["source"]["path"], "tensors": len(h["tensors"]), "values": h["values"],
             "table_scope": h["table_scope"], "tables": len(h["tables"]), "chunk": h["chunk"],
             "original_bytes": h["original_bytes"], "stored_bytes": h["data_bytes"],
             "entropy_bound_bytes": h["entropy_bound_bytes"],
             "stored_over_original": h["data_bytes"] / max(1, h["original_bytes"]),
             "stored_over_bound": h["data_bytes"] / max(1.0, h["entropy_bound_bytes"]),
             "bits_per_weight": 8 * h["data_bytes"] / max(1, h["values"])}
        if not self.protected:
            d["warning"] = (f"store version {self.version} has no header checksum: a changed or corrupted store.json "
                            "goes unnoticed (compress the source again to protect it)")
        return d


def _header_hash_of(h: dict, header_file: Path) -> str:
    try:
        return header_hash(h)
    except (ValueError, RecursionError):
        raise EsftError("header checksum mismatch: store.json cannot be hashed", header_file) from None


def decompress(store_dir: Path, out: Path, *, overwrite: bool = False,
               on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """Write the stored tensors back as safetensors: a bundle store becomes its bundle again, byte for byte;
    a model store becomes a folder with experts.safetensors (the experts under their checkpoint names)."""
    from safetensors.torch import save_file

    from esftctl.formats.bundle import BASE_TENSORS, BUNDLE_FORMAT, DATA_FILE, MANIFEST, base_record_bytes

    store = ExpertStore(store_dir)
    source = store.header["source"]
    with atomic_dir(out, overwrite=overwrite) as tmp:
        if source["kind"] == "bundle":  # small: in memory, and written as write_bundle wrote it
            tensors = {}
            for e in store:
                tensors[e["name"]] = store.decode_tensor(e["name"])
                on_tensor(e["name"])
            manifest = source["manifest"]
            save_file(tensors, tmp / DATA_FILE, metadata={"format": BUNDLE_FORMAT})  # as write_bundle: same bytes
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if "base_tensors" in source:
                (tmp / BASE_TENSORS).write_bytes(base_record_bytes(source["base_tensors"]))
        else:  # a whole model's experts: one tensor in memory at a time
            _stream_safetensors(tmp / "experts.safetensors", store, on_tensor)
    return out


def _stream_safetensors(path: Path, store: ExpertStore, on_tensor: Callable[[str], None]) -> None:
    """Write every tensor of `store` to one safetensors file, decoding and writing one tensor at a time: the
    header (names, shapes, offsets) is known before any tensor is decoded."""
    entries, header, offset = list(store), {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        nbytes = 2 * e["count"]
        header[e["name"]] = {"dtype": "BF16", "shape": e["shape"], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for e in entries:
            f.write(store.decode_tensor(e["name"]).view(torch.int16).numpy().tobytes())
            on_tensor(e["name"])
