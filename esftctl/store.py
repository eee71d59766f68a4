"""Huffman-compressed expert stores: `esftctl compress`, `esftctl decompress`, and decoding for the runtime.

A store is a folder:

    store.json  format, version, source (model folder or adapter bundle), chunk size, code tables (code
                lengths per symbol), and per tensor: name, shape, (layer, expert, weight), its code table,
                and where its three sections lie in store.bin; the SHA-256 of store.bin
    store.bin   per tensor: the Huffman-coded exponents (chunks laid out as esftctl.huffman.chunk_layout
                says: a warp's 32 chunks take turns by 16 values), the chunks' starting bit offsets
                (uint32), and one sign-and-mantissa byte per value; each section starts on a 16-byte boundary

Only bf16 expert weights are stored; decoding is bit-exact. Code tables are per tensor or shared per layer
(`--table-scope`): `esftctl bench compress` measures both.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from esftctl import __version__
from esftctl.atomic import atomic_dir
from esftctl.errors import EsftError
from esftctl.huffman import (
    GROUP,
    LANES,
    MAX_LENGTH,
    Code,
    build_code,
    chunk_count,
    chunk_firsts,
    decode_bf16,
    encode,
    entropy_bits,
    multi_symbol_table,
    split_and_count,
)
from esftctl.jsonfile import read_json

STORE_FORMAT = "esftctl-expert-store"
STORE_VERSION = 2  # 1: chunks held consecutive values
HEADER, DATA = "store.json", "store.bin"
DEFAULT_CHUNK = 1024
ALIGN = 16


@dataclass(frozen=True)
class SourceTensor:
    name: str
    layer: int | None
    expert: int | None
    weight: str | None
    read: Callable[[], torch.Tensor]


def source_tensors(path: Path) -> tuple[dict, list[SourceTensor]]:
    """What to store from a model folder (every routed expert) or an adapter bundle (all its tensors)."""
    from esftctl.bundle import MANIFEST, Bundle, expert_tensor_name
    from esftctl.checkpoint import MoECheckpoint

    if (path / MANIFEST).exists():
        bundle = Bundle.open(path)
        from safetensors import safe_open

        def reader(name):
            def read():
                with safe_open(bundle.data_file, framework="pt") as f:
                    return f.get_tensor(name)
            return read
        tensors = [SourceTensor(expert_tensor_name(l, e, w), l, e, w, reader(expert_tensor_name(l, e, w)))
                   for l, ids in bundle.experts.items() for e in ids for w in ("gate", "up", "down")]
        tensors += [SourceTensor("non_expert." + n, None, None, None, reader("non_expert." + n))
                    for n in bundle.non_expert_tensors]
        return {"kind": "bundle", "path": str(path), "manifest": bundle.manifest}, tensors
    ckpt = MoECheckpoint(path)
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
    encoding: on DeepSeek-V2-Lite's shapes (2 cores) a layer's 0.55 GB of store took 1.7 s to write and 0.4 s to
    hash, beside 2.4 s to read and encode it (benchmarks/RESULTS.md, 2026-11-24). At most `depth` writes wait.

    A write that fails in the thread (a full disk) is raised by the next `write` or by `close`."""

    def __init__(self, path: Path, depth: int = 32):
        self.path, self.pos, self.sha = path, 0, hashlib.sha256()
        self._file = open(path, "wb")
        self._pending: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="store.bin writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (data := self._pending.get()) is not None:
            if self._error is None:
                try:
                    self._file.write(data)
                    self.sha.update(data)
                except BaseException as e:  # raised in the caller's thread by write or close
                    self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: bytes | np.ndarray) -> None:
        """Queue `data` (bytes, or a contiguous array left unchanged from here on) to be written next."""
        self._raise_error()
        self._pending.put(data)
        self.pos += memoryview(data).nbytes

    def align(self) -> int:
        """Pad to the next section boundary and return it."""
        self.write(b"\0" * (-self.pos % ALIGN))
        return self.pos

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


def compress(src: Path, out: Path, chunk: int = DEFAULT_CHUNK, table_scope: str = "layer",
             overwrite: bool = False, on_tensor: Callable[[str], None] = lambda name: None) -> dict:
    """Write a store for the experts of `src` (a model folder or a bundle); returns its header."""
    source, tensors = source_tensors(src)
    return write_store(source, tensors, out, chunk, table_scope, overwrite, on_tensor)


def write_store(source: dict, tensors: list[SourceTensor], out: Path, chunk: int = DEFAULT_CHUNK,
                table_scope: str = "layer", overwrite: bool = False,
                on_tensor: Callable[[str], None] = lambda name: None) -> dict:
    if table_scope not in ("tensor", "layer"):
        raise EsftError(f"table scope must be 'tensor' or 'layer', not {table_scope!r}")
    if chunk < GROUP or chunk % GROUP:
        raise EsftError(f"chunk size must be a positive multiple of {GROUP}, not {chunk}")
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
        (tmp / HEADER).write_text(json.dumps(header))
    return header


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
            if len(offsets) and int(offsets[-1]) >= 1 << 32:
                raise EsftError(f"tensor {t.name!r} is too large for 32-bit chunk offsets")
            entry = {"name": t.name, "layer": t.layer, "expert": t.expert, "weight": t.weight,
                     "shape": shapes[t.name], "count": len(exponent), "table": len(tables) - 1}
            entry["exp_offset"], entry["exp_bytes"] = data.align(), len(stream)
            data.write(stream)
            entry["chunk_offset"], entry["chunks"] = data.align(), len(offsets)
            data.write(offsets.astype("<u4").tobytes())
            entry["sm_offset"] = data.align()
            data.write(sign_mantissa)
            entries.append(entry)
            h = entropy_bits(tensor_counts) if len(exponent) else 0.0
            total["values"] += len(exponent)
            total["original_bytes"] += 2 * len(exponent)
            total["entropy_bound_bytes"] += len(exponent) * (h + 8) / 8
            on_tensor(t.name)
    return tables, entries, total


def _file_sha256(path: Path, block: int = 8 << 20) -> str:
    sha, buf = hashlib.sha256(), bytearray(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(memoryview(buf)[:n])
    return sha.hexdigest()


def missing_base_experts(base, stored: set[str]) -> list[str]:
    """The routed-expert tensor names of `base` (an MoECheckpoint) that are not among `stored`: a store of the
    base itself (`esftctl compress BASE`) misses none."""
    return [n for l in base.moe_layers for e in range(base.num_experts)
            for n in base.expert_tensor_names(l, e).values() if n not in stored]


class ExpertStore:
    """An opened, verified store (checksum and section bounds checked); decodes on the CPU or a GPU."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        header_file = self.path / HEADER
        if not header_file.exists():
            raise EsftError(f"not an expert store (no {HEADER})", self.path)
        self.header = read_json(header_file)
        if not isinstance(self.header, dict) or self.header.get("format") != STORE_FORMAT:
            raise EsftError(f"not an esftctl expert store (format is not {STORE_FORMAT!r})", header_file)
        if self.header.get("version") != STORE_VERSION:
            raise EsftError(f"store version {self.header.get('version')!r} is not supported (this esftctl reads "
                            f"version {STORE_VERSION}; compress the model again)", header_file)
        self.data_file = self.path / self.header["data_file"]
        if not self.data_file.exists():
            raise EsftError("missing store data file", self.data_file)
        if self.data_file.stat().st_size != self.header["data_bytes"] or (
                verify and _file_sha256(self.data_file) != self.header["sha256"]):
            raise EsftError("checksum mismatch: the file is corrupted or truncated", self.data_file)
        self.chunk = self.header.get("chunk")
        if not isinstance(self.chunk, int) or self.chunk < GROUP or self.chunk % GROUP:
            raise EsftError(f"chunk size {self.chunk!r} is not a positive multiple of {GROUP}", header_file)
        if (self.header.get("lanes"), self.header.get("group")) != (LANES, GROUP):
            raise EsftError(f"chunks laid out for {self.header.get('lanes')!r} lanes of {self.header.get('group')!r} "
                            f"values; this esftctl reads {LANES} of {GROUP}", header_file)
        for e in self.header["tensors"]:
            if e["chunks"] != chunk_count(e["count"], self.chunk):
                raise EsftError(f"tensor {e['name']!r} has {e['chunks']} chunks, not the "
                                f"{chunk_count(e['count'], self.chunk)} its size needs", header_file)
        self.codes = [Code(np.array(t["lengths"], dtype=np.int64)) for t in self.header["tables"]]
        self.tensors = {e["name"]: e for e in self.header["tensors"]}
        self._device_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __iter__(self) -> Iterator[dict]:
        return iter(self.header["tensors"])

    @cached_property
    def data(self) -> np.ndarray:
        """The whole of store.bin in memory (what a GPU copy needs; the CPU decoder reads one tensor at a time)."""
        return np.fromfile(self.data_file, dtype=np.uint8)

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        parts = []
        with open(self.data_file, "rb") as f:
            while nbytes:
                part = os.pread(f.fileno(), min(nbytes, 1 << 30), offset)
                if not part:
                    raise EsftError("a section runs past the end of the data file", self.data_file)
                parts.append(part)
                offset, nbytes = offset + len(part), nbytes - len(part)
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

    def _sections(self, e: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stream = self._read(e["exp_offset"], e["exp_bytes"])
        offsets = self._read(e["chunk_offset"], 4 * e["chunks"]).view("<u4")
        sign_mantissa = self._read(e["sm_offset"], e["count"])
        return stream, offsets, sign_mantissa

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
        decode_bf16(stream, offsets.astype(np.uint64), self.codes[e["table"]], self.chunk, sign_mantissa, bits)
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
            data = np.concatenate([self.data, np.zeros(16, dtype=np.uint8)])  # whole words, one to spare
            self._device_cache[key] = (torch.from_numpy(data).to(device), torch.from_numpy(tables).to(device))
        return self._device_cache[key]

    def plan(self, targets: list[tuple[str, torch.Tensor]]):
        """A DecodePlan writing each named tensor into its CUDA destination in one launch."""
        from esftctl.kernels.huffman_decode import DecodePlan

        device = targets[0][1].device
        data, tables = self.to_device(device)
        bits, sm, dst, remaining, table = [], [], [], [], []
        for name, out in targets:
            e = self._entry(name)
            self._check_destination(e, out)
            if out.device != device:
                raise ValueError("all destinations of one plan must be on one device")
            _, offsets, _ = self._sections(e)
            firsts = chunk_firsts(e["count"], self.chunk)
            # Each tensor's chunks start a warp: its lanes then read and write whole lines. Lanes that pad
            # the last warp have no values.
            pad = -len(firsts) % LANES
            bits.append(np.pad(8 * e["exp_offset"] + offsets.astype(np.int64), (0, pad)))
            sm.append(np.pad(e["sm_offset"] + firsts, (0, pad)))
            dst.append(np.pad(out.data_ptr() + 2 * firsts, (0, pad)))
            remaining.append(np.pad((e["count"] - firsts).astype(np.int32), (0, pad)))
            table.append(np.full(len(firsts) + pad, e["table"], dtype=np.int32))
        descriptors = {k: torch.from_numpy(np.concatenate(v) if v else np.zeros(0, dtype=np.int64)).to(device)
                       for k, v in (("bits", bits), ("sm", sm), ("dst", dst), ("remaining", remaining),
                                    ("table", table))}
        aligned = all(out.data_ptr() % (2 * GROUP) == 0 for _, out in targets)
        return DecodePlan(data, tables, self.chunk, descriptors, [out for _, out in targets], aligned)

    def describe(self) -> dict:
        h = self.header
        return {"kind": "store", "path": str(self.path), "source": h["source"]["kind"],
                "source_path": h["source"]["path"], "tensors": len(h["tensors"]), "values": h["values"],
                "table_scope": h["table_scope"], "tables": len(h["tables"]), "chunk": h["chunk"],
                "original_bytes": h["original_bytes"], "stored_bytes": h["data_bytes"],
                "entropy_bound_bytes": h["entropy_bound_bytes"],
                "stored_over_original": h["data_bytes"] / max(1, h["original_bytes"]),
                "stored_over_bound": h["data_bytes"] / max(1.0, h["entropy_bound_bytes"]),
                "bits_per_weight": 8 * h["data_bytes"] / max(1, h["values"])}


def decompress(store_dir: Path, out: Path, overwrite: bool = False,
               on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """Write the stored tensors back as safetensors: a bundle store becomes its bundle again, byte for byte;
    a model store becomes a folder with experts.safetensors (the experts under their checkpoint names)."""
    from safetensors.torch import save_file

    from esftctl.bundle import DATA_FILE, MANIFEST

    store = ExpertStore(store_dir)
    source = store.header["source"]
    with atomic_dir(out, overwrite=overwrite) as tmp:
        if source["kind"] == "bundle":  # small: in memory, and written as write_bundle wrote it
            tensors = {}
            for e in store:
                tensors[e["name"]] = store.decode_tensor(e["name"])
                on_tensor(e["name"])
            manifest = source["manifest"]
            save_file(tensors, tmp / DATA_FILE, metadata={"format": "esftctl-adapter", "name": manifest["name"]})
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
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
