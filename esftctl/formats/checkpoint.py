"""Hugging Face MoE checkpoints in safetensors: open lazily, describe, read and write single experts.

A checkpoint folder holds config.json and either one `model.safetensors` or several shards listed in
`model.safetensors.index.json`. Opening one reads only the config and the safetensors headers; tensors
are read one at a time through memory maps, so a 16B model is never loaded whole.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from safetensors.torch import save_file

from esftctl.atomic import atomic_dir
from esftctl.errors import EsftError, one_line
from esftctl.formats.architectures import (
    EXPERT_BIASES,
    EXPERT_SCALES,
    EXPERT_WEIGHTS,
    Architecture,
    FusedExperts,
    Routing,
    architecture_for,
    config_problem,
    supported_model_types,
)
from esftctl.formats.fp8 import SCALE_DTYPE, SCALE_SUFFIX, Fp8Block, scheme_of
from esftctl.formats.quantization import find_quantization, label
from esftctl.jsonfile import open_regular, read_json
from esftctl.units import format_ranges

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the safetensors header alone."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: BF16, F32, ...
    offset: int  # where its bytes start in the file

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def torch_shape(self) -> torch.Size:
        return torch.Size(self.shape)

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: gate [I, H], up [I, H], down [H, I]; for experts with biases (GPT-OSS), gate_bias
    [I], up_bias [I], down_bias [H]; for FP8 experts (esftctl.formats.fp8), the float32 block scales of each
    weight, gate_scale, up_scale, down_scale."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def part(self, name: str) -> torch.Tensor | None:
        """A part by its name (gate, up_scale, ...), as StoredExpert.part gives it for an expert still in its file."""
        return getattr(self, name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        parts = EXPERT_WEIGHTS + EXPERT_BIASES + EXPERT_SCALES
        return iter(((w, getattr(self, w)) for w in parts if getattr(self, w) is not None))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.items())

    def equal(self, other: "ExpertWeights") -> bool:
        return [w for w, _ in self.items()] == [w for w, _ in other.items()] and all(
            torch.equal(a, getattr(other, w)) for w, a in self.items())


HEADER_LIMIT = 100 << 20  # bytes of a safetensors JSON header (safetensors' own limit)


def _header_error(why: str, file: Path) -> EsftError:
    return EsftError(f"not a readable safetensors file (corrupted or truncated: {why})", file)


def _pread_all(fd: int, into: memoryview, offset: int, what: str, file: Path) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise EsftError(f"the file ends inside {what} (truncated?)", file)
        done += n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """A safetensors file's tensors, from its header validated as the format requires before anything trusts
    it: a bounded JSON object of known dtypes, shapes of non-negative integers, and byte ranges of exactly each
    tensor's size that tile the data section, which ends where the file ends. Nothing is mapped."""
    fd = open_regular(file)
    try:
        size = os.fstat(fd).st_size
        head = bytearray(8)
        if size < 8:
            raise _header_error(f"{size} bytes", file)
        _pread_all(fd, memoryview(head), 0, "the header", file)
        length = int.from_bytes(head, "little")
        if length > min(HEADER_LIMIT, size - 8):
            raise _header_error(f"a header of {length} bytes in a file of {size}", file)
        raw = bytearray(length)
        _pread_all(fd, memoryview(raw), 8, "the header", file)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise _header_error(f"header is not JSON: {one_line(e, 80)}", file) from None
    if not isinstance(header, dict):
        raise _header_error("header is not a JSON object", file)
    infos, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = (entry.get(k) if isinstance(entry, dict) else None
                                 for k in ("dtype", "shape", "data_offsets"))
        if dtype not in TORCH_DTYPES or not isinstance(shape, list) or not (
                isinstance(offsets, list) and len(offsets) == 2
                and all(type(v) is int and v >= 0 for v in [*shape, *offsets])):
            raise _header_error(f"tensor {name[:100]!r} has no known dtype, shape and byte range", file)
        if offsets[1] - offsets[0] != math.prod(shape) * TORCH_DTYPES[dtype].itemsize:
            raise _header_error(f"tensor {name[:100]!r}: bytes {offsets} for {dtype} {shape}", file)
        ranges.append(offsets)
        infos[name] = TensorInfo(file, tuple(shape), dtype, 8 + length + offsets[0])
    end = 0
    for begin, stop in sorted(ranges):
        if begin != end:
            raise _header_error("tensors overlap or leave gaps", file)
        end = stop
    if 8 + length + end != size:
        raise _header_error(f"its tensors end at byte {8 + length + end}, the file at {size}", file)
    return infos


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """read_header of a checkpoint's shard, one that is missing named as such."""
    if not os.path.lexists(file):
        raise EsftError("missing safetensors shard", file)
    return read_header(file)


def read_stored_bytes(info: TensorInfo, into: memoryview, start: int = 0, *, name: str) -> None:
    """Fill `into` with tensor `name`'s bytes as stored, from byte `start` of the tensor on: read, not mapped
    (a mapped tensor keeps its whole file mapped: a merge held a shard's mapping per tensor), so memory stays
    what the tensors hold, and Ctrl-C is a KeyboardInterrupt, not a read error."""
    if start + len(into) > info.nbytes:
        raise ValueError(f"bytes {start}..{start + len(into)} outside {name!r} ({info.nbytes} bytes)")
    fd = open_regular(info.file)
    try:
        _pread_all(fd, into, info.offset + start, f"tensor {name!r}", info.file)
    finally:
        os.close(fd)


def read_stored(info: TensorInfo, *, name: str) -> torch.Tensor:
    """Tensor `name` as a new tensor of its own memory (read_stored_bytes)."""
    t = torch.empty(info.shape, dtype=info.torch_dtype)
    read_stored_bytes(info, memoryview(t.reshape(-1).view(torch.uint8).numpy()), name=name)
    return t


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a safetensors file, not read yet: its name there and where it lives. `read_into` fills a buffer
    of its shape and dtype with the bytes as stored, so that a stacked, pinned destination needs no tensor of its
    own in between (an adapter's staging read each expert part into a tensor, then copied it into its rows)."""

    name: str
    info: TensorInfo

    @property
    def shape(self) -> torch.Size:
        return self.info.torch_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.info.torch_dtype

    def read(self) -> torch.Tensor:
        return read_stored(self.info, name=self.name)

    def read_into(self, dst: torch.Tensor) -> None:
        """Fill `dst` with this tensor: read straight into it where it is contiguous host memory of this shape and
        dtype, else read and copied (converting the dtype as `Tensor.copy_` does)."""
        if dst.shape != self.shape or dst.dtype != self.dtype or dst.device.type != "cpu" or not dst.is_contiguous():
            dst.copy_(self.read())
            return
        read_stored_bytes(self.info, memoryview(dst.view(-1).view(torch.uint8).numpy()), name=self.name)


@dataclass(frozen=True)
class StoredExpert:
    """One routed expert whose parts are still in their file (ExpertWeights' part names -> StoredTensor), for
    whoever reads them into place (the runtime's staging: esftctl.runtime.moe_layer.stack_experts)."""

    parts: dict[str, StoredTensor]

    def part(self, name: str) -> StoredTensor | None:
        return self.parts.get(name)


class MoECheckpoint:
    """A Hugging Face MoE checkpoint folder, opened without loading its tensors. A checkpoint with quantized
    experts is refused in one line naming the method, unless `quantized` (only to describe it: its experts are
    not checked and must not be read; esftctl/formats/quantization.py) or, for FP8 block-quantized experts, `fp8`
    (the commands that handle them: pack, merge, serve; `self.fp8` is then the scheme, esftctl.formats.fp8)."""

    def __init__(self, path: str | Path, *, quantized: bool = False, fp8: bool = False):
        self.path = Path(path)
        if not self.path.is_dir():
            raise EsftError("not a model folder (expected a directory with config.json)", self.path)
        self.config = read_json(self.path / "config.json")
        if not isinstance(self.config, dict):
            raise EsftError("config is not a JSON object", self.path / "config.json")
        model_type = self.config.get("model_type")
        arch = architecture_for(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise EsftError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(supported_model_types())})",
                self.path / "config.json",
            )
        self.arch: Architecture = arch
        problem = config_problem(arch, self.config)
        if problem:
            raise EsftError(problem, self.path / "config.json")
        self.tensors: dict[str, TensorInfo] = self._read_tensor_infos()
        memory = arch.in_memory()  # a state dict saved as transformers holds it: experts stacked per layer
        if memory is not arch and self.moe_layers and memory.fused.tensors(self.moe_layers[0])[0] in self.tensors:
            self.arch = memory
        self.quantization: dict | None = find_quantization(self.config, self._routed_dtypes())
        self.fp8: Fp8Block | None = None
        if fp8 and self.quantization is not None and not quantized:
            self.fp8 = scheme_of(self.quantization, self.path / "config.json")
            if self.arch.fused is not None:
                raise EsftError(f"FP8 experts stored fused ({self.config['model_type']}) are not supported",
                                self.path / "config.json")
        if self.quantization is None or self.fp8 is not None:
            self._check_experts()
        elif quantized:
            self._check_routers()
        else:
            raise EsftError(f"experts quantized with {label(self.quantization)} are not supported yet: esftctl reads "
                            "bf16, fp16 or fp32 experts (`esftctl inspect` describes this checkpoint)",
                            self.path / "config.json")

    # ---- structure -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @cached_property
    def moe_layers(self) -> list[int]:
        return self.arch.moe_layers(self.config)

    @property
    def num_experts(self) -> int:
        return self.config[self.arch.num_experts_key(self.config)]

    @property
    def top_k(self) -> int:
        return self.config[self.arch.top_k_key]

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def moe_intermediate_size(self) -> int:
        return self.config[self.arch.intermediate_key]

    @property
    def num_shared_experts(self) -> int:
        return self.arch.num_shared_experts(self.config)

    @cached_property
    def routing(self) -> Routing:
        return self.arch.routing(self.config)

    def router_bias_tensor(self, layer: int) -> str | None:
        """The router's own bias (added to its logits: GPT-OSS), or None."""
        return self.arch.router_bias.format(layer=layer) if self.arch.router_bias else None

    def correction_bias_tensor(self, layer: int) -> str | None:
        """The router's e_score_correction_bias where the routing adds one (Routing.correction_bias), or None."""
        return self.arch.correction_bias.format(layer=layer) if self.routing.correction_bias else None

    def routing_tensors(self, layer: int) -> list[str]:
        """The tensors that decide a MoE layer's routing: the router's weight, its bias and its correction bias
        where it has them."""
        extra = (self.router_bias_tensor(layer), self.correction_bias_tensor(layer))
        return [self.arch.router_tensor(layer), *(n for n in extra if n)]

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each part of one routed expert (Architecture.expert_weights)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        shapes = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_bias": (i,), "up_bias": (i,), "down_bias": (h,)}
        if self.fp8 is not None:
            shapes.update({s: self.fp8.scale_shape(shapes[w]) for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES)})
        return {w: shapes[w] for w in self.expert_parts}

    @property
    def expert_parts(self) -> tuple[str, ...]:
        """What one routed expert is stored as: its weights (and biases), and their scales for FP8 experts."""
        return self.arch.expert_weights + (EXPERT_SCALES if self.fp8 is not None else ())

    def part_dtype(self, part: str) -> str:
        """The stored dtype of one expert part: the experts' dtype, float32 for FP8 block scales."""
        return SCALE_DTYPE if part in EXPERT_SCALES else self.expert_dtype

    def fused_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of a fused layer's tensors, in FusedExperts.tensors' order."""
        return self.arch.fused.shapes(self.num_experts, self.hidden_size, self.moe_intermediate_size)

    @cached_property
    def expert_dtype(self) -> str:
        first = self.expert_ranges(self.moe_layers[0], 0)[0][0]
        info = self.tensors.get(first)
        return info.dtype if info is not None else ",".join(self.quantization["expert_dtypes"])

    def _routed_dtypes(self) -> dict[str, str]:
        """{tensor name: dtype} of every tensor under the MoE layers' routed-expert prefixes."""
        prefixes = tuple(self.arch.experts_prefix(layer) for layer in self.moe_layers)
        return {n: info.dtype for n, info in self.tensors.items() if n.startswith(prefixes)}

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert (gate + up + down, and its biases where it has them)."""
        return sum(n for _, _, n in self.expert_ranges(self.moe_layers[0], 0))

    @cached_property
    def total_nbytes(self) -> int:  # cached: 2.1 ms over DeepSeek-V2-Lite's 5,291 tensors (H100 host), in every status
        return sum(t.nbytes for t in self.tensors.values())

    @cached_property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def expert_tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """{part: tensor name} of one expert, for architectures that store one tensor per expert and weight (and,
        for FP8 experts, one scale tensor beside each weight)."""
        names = {w: self.arch.expert_tensor(layer, expert, w) for w in EXPERT_WEIGHTS}
        if self.fp8 is not None:
            names.update({s: names[w] + SCALE_SUFFIX for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES)})
        return names

    def routed_tensor_names(self, layer: int) -> list[str]:
        """The tensors that hold a MoE layer's routed experts: one per expert and weight, or the fused ones."""
        if self.arch.fused is not None:
            return list(self.arch.fused.tensors(layer))
        return [n for e in range(self.num_experts) for n in self.expert_tensor_names(layer, e).values()]

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[str, int, int]]:
        """(tensor name, first byte, byte count) of every stored byte of one expert: whole tensors, or its slice
        of each fused tensor (expert first, so one contiguous range each)."""
        if self.arch.fused is None:
            return [(n, 0, self.tensors[n].nbytes if n in self.tensors else 0)
                    for n in self.expert_tensor_names(layer, expert).values()]
        ranges = []
        for name in self.arch.fused.tensors(layer):
            size = self.tensors[name].nbytes // self.num_experts if name in self.tensors else 0
            ranges.append((name, expert * size, size))
        return ranges

    def is_routed_expert_tensor(self, name: str) -> bool:
        return name in self._routed_expert_names

    @cached_property
    def _routed_expert_names(self) -> frozenset[str]:
        return frozenset(n for layer in self.moe_layers for n in self.routed_tensor_names(layer))

    # ---- reading ---------------------------------------------------------------------------------
    def read_tensor(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise EsftError(f"no tensor named {name!r}", self.path)
        return read_stored(info, name=name)

    def read_bytes(self, name: str, into: memoryview, start: int = 0) -> None:
        """Fill `into` with the tensor's bytes as stored, from byte `start` of the tensor on: no tensor made, and no
        header parsed (`esftctl pack` compares a fine-tune with its base this way)."""
        read_stored_bytes(self.tensors[name], into, start, name=name)

    def prefetch(self, names: Iterable[str]) -> None:
        """Ask the kernel to start reading these tensors into the page cache now (it returns at once), so that
        later reads of them find their pages there."""
        by_file: dict[Path, list[TensorInfo]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(self.tensors[name])
        for file, infos in by_file.items():
            fd = os.open(file, os.O_RDONLY)
            try:
                for info in infos:
                    os.posix_fadvise(fd, info.offset, info.nbytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        self.check_expert_id(layer, expert)
        if self.arch.fused is None:
            names = self.expert_tensor_names(layer, expert)
            weights = ExpertWeights(**{w: self.read_tensor(n) for w, n in names.items()})
            if self.fp8 is not None:
                for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES):
                    self.fp8.check(getattr(weights, w), getattr(weights, s), name=names[w],
                                   file=self.tensors[names[s]].file)
            return weights
        parts = []
        for (name, start, size), shape in zip(self.expert_ranges(layer, expert), self.fused_shapes()):
            t = torch.empty(shape[1:], dtype=self.tensors[name].torch_dtype)
            read_stored_bytes(self.tensors[name], memoryview(t.reshape(-1).view(torch.uint8).numpy()), start,
                              name=name)
            parts.append(t)
        return unfuse(self.arch.fused, parts)

    def read_router(self, layer: int) -> torch.Tensor:
        return self.read_tensor(self.arch.router_tensor(layer))

    def read_correction_bias(self, layer: int) -> torch.Tensor | None:
        """The router's e_score_correction_bias [E] where the routing adds one (Routing.correction_bias), else None."""
        name = self.correction_bias_tensor(layer)
        return self.read_tensor(name) if name else None

    def read_router_bias(self, layer: int) -> torch.Tensor | None:
        """The router's own bias [E] (GPT-OSS), else None."""
        name = self.router_bias_tensor(layer)
        return self.read_tensor(name) if name else None

    def check_expert_id(self, layer: int, expert: int) -> None:
        if layer not in self.moe_layers:
            raise EsftError(f"layer {layer} is not a MoE layer (MoE layers: {format_ranges(self.moe_layers)})",
                            self.path)
        if not 0 <= expert < self.num_experts:
            raise EsftError(f"expert {expert} out of range (layer {layer} has {self.num_experts} experts)", self.path)

    # ---- describing ------------------------------------------------------------------------------
    def describe(self) -> dict:
        routed = sum(self.tensors[n].nbytes for n in self._routed_dtypes())
        return {
            "kind": "model",
            "path": str(self.path),
            "architecture": self.arch.name,
            "model_type": self.config["model_type"],
            "num_layers": self.num_layers,
            "moe_layers": self.moe_layers,
            "num_moe_layers": len(self.moe_layers),
            "routed_experts_per_layer": self.num_experts,
            "top_k": self.top_k,
            "shared_experts_per_layer": self.num_shared_experts,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "expert_dtype": self.expert_dtype,
            "quantization": self.quantization,
            "expert_bytes": routed // (self.num_experts * len(self.moe_layers)),
            "routed_expert_bytes": routed,
            "total_bytes": self.total_nbytes,
            "num_tensors": len(self.tensors),
            "num_files": len(self.files),
        }

    # ---- validation ------------------------------------------------------------------------------
    def _read_tensor_infos(self) -> dict[str, TensorInfo]:
        index_file = self.path / INDEX_FILE
        if index_file.exists():
            index = read_json(index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise EsftError("index has no weight_map", index_file)
            for name, shard in weight_map.items():  # a file of this folder: nothing outside it is opened
                if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard or "\0" in shard:
                    raise EsftError(f"the index puts tensor {name!r} in {shard!r}, not a file name of the model "
                                    "folder", index_file)
            infos: dict[str, TensorInfo] = {}
            for shard in sorted(set(weight_map.values())):
                header = _read_header(self.path / shard)
                infos.update(header)
            for name, shard in weight_map.items():
                if name not in infos or infos[name].file.name != shard:
                    raise EsftError(f"tensor {name!r} listed in the index is not in {shard}", index_file)
            return infos
        single = self.path / SINGLE_FILE
        if not single.exists():
            raise EsftError(f"no {SINGLE_FILE} and no {INDEX_FILE}", self.path)
        return _read_header(single)

    def _check_routers(self) -> None:
        if not self.moe_layers:
            raise EsftError("config describes no MoE layer", self.path / "config.json")
        self._check_routing()
        shapes = ((self.num_experts, self.hidden_size),) + ((self.num_experts,),) * 2
        for layer in self.moe_layers:
            for router, shape in zip(self.routing_tensors(layer), shapes):
                if router not in self.tensors:
                    raise EsftError(f"missing router tensor {router!r}", self.path)
                if self.tensors[router].shape != shape:
                    raise EsftError(f"router tensor {router!r} has shape {list(self.tensors[router].shape)}, "
                                    f"expected {list(shape)}", self.tensors[router].file)

    def _check_routing(self) -> None:
        r = self.routing
        if r.scoring not in ("softmax", "sigmoid"):
            raise EsftError(f"unsupported scoring function {r.scoring!r} (supported: softmax, sigmoid)",
                            self.path / "config.json")
        per_group = self.num_experts // r.groups
        if self.num_experts % r.groups or not 1 <= r.top_groups <= r.groups or self.top_k > per_group * r.top_groups \
                or (r.correction_bias and r.groups > 1 and per_group < 2):  # a group's score is its 2 best then
            raise EsftError(f"group-limited routing of {self.num_experts} experts in n_group {r.groups} groups, "
                            f"topk_group {r.top_groups} of them, cannot choose top-k {self.top_k}",
                            self.path / "config.json")

    def _check_experts(self) -> None:
        self._check_routers()
        for layer in self.moe_layers:
            self._check_layout(layer)
            if self.arch.fused is not None:
                fused = self.arch.fused.tensors(layer)
                self._check_shapes(zip(fused, self.fused_shapes()))
                if len({self.tensors[n].dtype for n in fused}) > 1:
                    raise EsftError(f"the fused expert tensors of layer {layer} differ in dtype "
                                    f"({', '.join(f'{n}: {self.tensors[n].dtype}' for n in fused)})", self.path)
            else:
                shapes = self.expert_shapes()
                names = [(w, n) for e in range(self.num_experts) for w, n in self.expert_tensor_names(layer, e).items()]
                self._check_shapes((n, shapes[w]) for w, n in names)
                if self.fp8 is not None:
                    self._check_dtypes(names)

    def _check_dtypes(self, names: Iterable[tuple[str, str]]) -> None:
        """FP8 experts: every weight float8_e4m3fn and every scale float32, each refusal naming its file."""
        for part, name in names:
            info, want = self.tensors[name], self.part_dtype(part)
            if info.dtype != want:
                raise EsftError(f"FP8 expert tensor {name!r} is {info.dtype}, expected {want}", info.file)

    def _check_shapes(self, wanted: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        for name, shape in wanted:
            info = self.tensors.get(name)
            if info is None:
                raise EsftError(f"missing expert tensor {name!r}", self.path)
            if info.shape != tuple(shape):
                raise EsftError(f"expert tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}",
                                info.file)

    def _check_layout(self, layer: int) -> None:
        """Refuse experts stored in a layout this architecture's entry does not describe (fused where esftctl reads
        one tensor per expert, or the other way round), naming one such tensor, before any is misread."""
        expected = set(self.routed_tensor_names(layer))
        prefix = self.arch.experts_prefix(layer)
        other = sorted(n for n in self.tensors if n.startswith(prefix) and n not in expected)
        if other:
            want, info = next(iter(sorted(expected))), self.tensors[other[0]]
            raise EsftError(f"experts of layer {layer} are stored as {other[0]!r} {list(info.shape)}, a layout esftctl "
                            f"does not read for {self.config['model_type']} (it reads tensors like {want!r})",
                            info.file)


def unfuse(layout: FusedExperts, parts: Sequence[torch.Tensor]) -> ExpertWeights:
    """One expert's slices of a layer's fused tensors (in FusedExperts.tensors' order, the expert axis taken) as
    ExpertWeights in the usual orientation: GPT-OSS's gate_up [H, 2I] interleaved, its bias [2I], down [I, H], its
    bias [H]; or a stacked gate_up [2I, H], gate's rows first, and down [H, I]."""
    if layout.kind == "stacked":
        gate_up, down = parts
        gate, up = gate_up.chunk(2, dim=0)
        return ExpertWeights(gate.contiguous(), up.contiguous(), down.contiguous())
    gate_up, gate_up_bias, down, down_bias = parts
    return ExpertWeights(gate_up[:, 0::2].T.contiguous(), gate_up[:, 1::2].T.contiguous(), down.T.contiguous(),
                         gate_up_bias[0::2].contiguous(), gate_up_bias[1::2].contiguous(), down_bias.contiguous())


def finite_expert(ckpt: MoECheckpoint, layer: int, expert: int, weights: ExpertWeights, *,
                  why: str = "a bundle of it would carry them to every merge and server") -> ExpertWeights:
    """`weights`, expert `expert` of `layer` as read from `ckpt`, if every value is finite; else EsftError naming
    the file and the tensor holding a NaN or an infinity, and `why` that matters (for what `pack` stores)."""
    for part, t in weights.items():
        if not bool(torch.isfinite(t.float() if t.dtype.itemsize == 1 else t).all()):  # float8: no isfinite
            names = ckpt.expert_tensor_names(layer, expert) if ckpt.arch.fused is None else {}
            name = names.get(part) or ckpt.routed_tensor_names(layer)[0]
            raise EsftError(f"tensor {name!r} (expert {expert} of layer {layer}, {part}) holds values that are not "
                            f"finite (NaN or infinity): {why}", ckpt.tensors[name].file)
    return weights


def _check_replacements(ckpt: MoECheckpoint, experts: Mapping[tuple[int, int], ExpertWeights]) -> None:
    shapes = ckpt.expert_shapes()
    for (layer, expert), weights in experts.items():
        ckpt.check_expert_id(layer, expert)
        parts = [w for w, _ in weights.items()]
        if parts != list(shapes):
            raise EsftError(f"expert ({layer}, {expert}) has {', '.join(parts)}; this model's experts have "
                            f"{', '.join(shapes)}")
        for w, t in weights.items():
            if tuple(t.shape) != shapes[w]:
                raise EsftError(f"expert ({layer}, {expert}) {w} has shape {list(t.shape)}, expected {list(shapes[w])}")
            if t.dtype != TORCH_DTYPES.get(ckpt.part_dtype(w)):
                raise EsftError(f"cannot replace expert ({layer}, {expert}) {w}: {t.dtype} given, the model's "
                                f"are {ckpt.part_dtype(w)}", ckpt.path)


def expert_writer(ckpt: MoECheckpoint, experts: Mapping[tuple[int, int], ExpertWeights]
                  ) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A `write_checkpoint` transform that puts the given (layer, expert) weights into `ckpt`'s layout as each
    tensor streams through: whole tensors, or slices of a fused layer's tensors (a copy; the rest unchanged)."""
    _check_replacements(ckpt, experts)
    if ckpt.arch.fused is None:
        whole = {ckpt.expert_tensor_names(l, e)[w]: t for (l, e), ws in experts.items() for w, t in ws.items()}
        return lambda name, t: whole.get(name, t)
    by_layer: dict[int, dict[int, ExpertWeights]] = {}
    for (layer, expert), weights in experts.items():
        by_layer.setdefault(layer, {})[expert] = weights
    role = {n: (layer, k) for layer in by_layer for k, n in enumerate(ckpt.arch.fused.tensors(layer))}

    def write(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in role:
            return t
        layer, k = role[name]
        out = t.clone()
        parts = tuple(out if j == k else None for j in range(len(ckpt.arch.fused.tensors(layer))))
        for expert, weights in by_layer[layer].items():
            fuse_into(ckpt.arch.fused, parts, expert, weights)
        return out

    return write


def fuse_into(layout: FusedExperts, parts: tuple[torch.Tensor | None, ...], expert: int,
              weights: ExpertWeights) -> None:
    """Write `weights` as expert `expert` of a layer's fused tensors (unfuse's inverse) in place; those given as
    None are skipped."""
    if layout.kind == "stacked":
        gate_up, down = parts
        if gate_up is not None:
            gate_up[expert] = torch.cat([weights.gate, weights.up])
        if down is not None:
            down[expert] = weights.down
        return
    gate_up, gate_up_bias, down, down_bias = parts
    if gate_up is not None:
        gate_up[expert, :, 0::2], gate_up[expert, :, 1::2] = weights.gate.T, weights.up.T
    if gate_up_bias is not None:
        gate_up_bias[expert, 0::2], gate_up_bias[expert, 1::2] = weights.gate_bias, weights.up_bias
    if down is not None:
        down[expert] = weights.down.T
    if down_bias is not None:
        down_bias[expert] = weights.down_bias


def expert_replacements(ckpt: MoECheckpoint, experts: Mapping[tuple[int, int], ExpertWeights]
                        ) -> dict[str, torch.Tensor]:
    """Tensor-name -> tensor for writing the given (layer, expert) weights into `ckpt`'s layout (for a fused
    layout, the whole fused tensors of the layers concerned: `write_checkpoint(..., experts=...)` streams them
    instead)."""
    write = expert_writer(ckpt, experts)
    names = {n for (layer, e) in experts for n, _, _ in ckpt.expert_ranges(layer, e)}
    return {n: write(n, ckpt.read_tensor(n)) for n in sorted(names)}


def _extra_files(folder: Path) -> list[tuple[Path, Path]]:
    """The files a written copy of a model folder carries beside its tensors (README, tokenizer files, ...), as
    (name in the folder, what to open), from lstat: never what a link points to outside the folder, since the copy
    is what people publish and its files are readable by all (a base holding README.md -> ~/private or extra.txt ->
    /proc/self/environ put them in a merged checkpoint). A regular file is itself. A symbolic link is copied by
    content only where it resolves inside the folder, or inside the `blobs` folder of the Hugging Face cache
    repository the folder is a snapshot of (the hub stores snapshots/REVISION/FILE as a link to ../../blobs/HASH);
    any other link, a FIFO, a socket or a device is refused in one line naming it. Sub-folders (and links to
    folders) are no extras, nor are `*.safetensors` files: the tensors are written anew."""
    real = Path(os.path.realpath(folder))
    roots = [real] + ([real.parent.parent / "blobs"] if real.parent.name == "snapshots" else [])
    extras = []
    for name in sorted(folder.iterdir()):
        if name.suffix == ".safetensors":
            continue
        mode = os.lstat(name).st_mode
        if stat.S_ISDIR(mode):
            continue
        if stat.S_ISLNK(mode):
            target = Path(os.path.realpath(name))
            if not any(target.is_relative_to(root) for root in roots):
                raise EsftError(f"a symbolic link to {os.readlink(name)[:200]}, outside the model folder: what esftctl "
                                "writes holds only the folder's own files; put the file itself here or remove the "
                                "link", name)
            if not target.is_dir():
                extras.append((name, target))
        elif stat.S_ISREG(mode):
            extras.append((name, name))
        else:
            raise EsftError("not a regular file (a FIFO, socket or device) in the model folder: what esftctl writes "
                            "holds only regular files; remove it", name)
    return extras


def _copy_extra(name: Path, source: Path, dst: Path) -> None:
    """Copy an extra file (_extra_files: `source` is the file `name` is or resolves to) to `dst`, opened without
    following a link (O_NOFOLLOW) and only if it is a regular file: a name swapped for a link or a FIFO after the
    check is refused, not followed."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EsftError("became a symbolic link while esftctl copied the model folder: not followed",
                            name) from None
        raise EsftError(f"cannot open ({e.strerror or e})", name) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise EsftError("not a regular file (a FIFO, socket or device) in the model folder: what esftctl writes "
                            "holds only regular files; remove it", name)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f, open(dst, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
        os.utime(dst, ns=(status.st_atime_ns, status.st_mtime_ns))
    finally:
        os.close(fd)


def write_checkpoint(
    src: MoECheckpoint,
    dst: str | Path,
    replacements: Mapping[str, torch.Tensor] | None = None,
    *,
    overwrite: bool = False,
    on_tensor: Callable[[str], None] = lambda name: None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    experts: Mapping[tuple[int, int], ExpertWeights] | None = None,
    verify: Callable[[str, torch.Tensor], None] | None = None,
) -> Path:
    """Write a copy of `src` to `dst` with some tensors replaced (same shards, same index, same extras).

    Every replacement must name an existing tensor of the same shape and dtype; `experts` {(layer, expert):
    weights} go into their tensors or fused slices (expert_writer); `transform(name, tensor)`, if given, may
    change any tensor as it streams through (same shape and dtype), so a whole model is never held: one shard at
    a time; `verify(name, tensor)`, if given, sees every tensor read from `src` as read and may refuse it. The copy
    appears at `dst` only once it is complete.
    """
    if experts:
        write, then = expert_writer(src, experts), transform
        transform = (lambda n, t: then(n, write(n, t))) if then is not None else write
    replacements = dict(replacements or {})
    for name, t in replacements.items():
        info = src.tensors.get(name)
        if info is None:
            raise EsftError(f"cannot replace {name!r}: no such tensor", src.path)
        if tuple(t.shape) != info.shape or t.dtype != info.torch_dtype:
            raise EsftError(
                f"cannot replace {name!r}: {t.dtype} {list(t.shape)} given, "
                f"{info.torch_dtype} {list(info.shape)} expected", src.path)
    dst = Path(dst)
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        for name, source in _extra_files(src.path):
            _copy_extra(name, source, tmp / name.name)
        for file in src.files:
            tensors = {}
            for n, info in src.tensors.items():
                if info.file == file:
                    if n in replacements:
                        t = replacements[n]
                    else:
                        t = src.read_tensor(n)
                        if verify is not None:
                            verify(n, t)
                    if transform is not None:
                        t = transform(n, t)
                        if t.shape != info.torch_shape or t.dtype != info.torch_dtype:
                            raise EsftError(f"transform changed {n!r} to {t.dtype} {list(t.shape)}", src.path)
                    tensors[n] = t.contiguous()
                    on_tensor(n)
            save_file(tensors, tmp / file.name, metadata={"format": "pt"})
    return dst
