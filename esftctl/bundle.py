"""Adapter bundles: only an adapter's fine-tuned experts, in a strict, checksummed format.

A bundle is a folder:

    manifest.json       format, version, name, the base's identity, expert ids per layer, dtype, shapes,
                        and a SHA-256 of the tensors (names, dtypes, shapes and bytes, in name order: the
                        safetensors header's own key order is not stable, so the file's bytes are not hashed)
    experts.safetensors one tensor per expert weight, named layers.{L}.experts.{E}.{gate|up|down};
                        with --include-non-expert also non_expert.{checkpoint tensor name}

The base's identity is a fingerprint: SHA-256 over its structural config and every router weight, so a
bundle is refused by any other base, even one of the same shape.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from esftctl import __version__
from esftctl.architectures import EXPERT_WEIGHTS
from esftctl.atomic import atomic_dir
from esftctl.checkpoint import TORCH_DTYPES, ExpertWeights, MoECheckpoint
from esftctl.errors import EsftError, one_line
from esftctl.jsonfile import read_json
from esftctl.names import check_name

BUNDLE_FORMAT = "esftctl-adapter"
BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE = "experts.safetensors"
NON_EXPERT_PREFIX = "non_expert."


def expert_tensor_name(layer: int, expert: int, weight: str) -> str:
    return f"layers.{layer}.experts.{expert}.{weight}"


def tensors_sha256(path: Path) -> str:
    """SHA-256 over a safetensors file's tensors: name, dtype, shape and bytes of each, in name order."""
    h = hashlib.sha256()
    try:
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    except Exception as e:
        raise EsftError(f"corrupted or truncated: not a readable safetensors file "
                        f"({one_line(e, 120)})", path) from None
    return h.hexdigest()


def base_identity(ckpt: MoECheckpoint) -> dict:
    """What a bundle records of its base: structure, and a fingerprint of config and router weights."""
    structure = {
        "architecture": ckpt.arch.name, "model_type": ckpt.config["model_type"],
        "num_layers": ckpt.num_layers, "moe_layers": ckpt.moe_layers, "num_experts": ckpt.num_experts,
        "top_k": ckpt.top_k, "hidden_size": ckpt.hidden_size, "moe_intermediate_size": ckpt.moe_intermediate_size,
        "vocab_size": ckpt.config.get("vocab_size"), "expert_dtype": ckpt.expert_dtype,
    }
    h = hashlib.sha256(json.dumps(structure, sort_keys=True).encode())
    for layer in ckpt.moe_layers:
        h.update(ckpt.read_router(layer).contiguous().view(torch.uint8).numpy().tobytes())
    return {**structure, "fingerprint": "sha256:" + h.hexdigest()}


def write_bundle(out: Path, name: str, base: MoECheckpoint, experts: dict[int, dict[int, ExpertWeights]],
                 non_expert: dict[str, torch.Tensor] | None = None, overwrite: bool = False) -> Path:
    """Write a bundle folder atomically; experts: {layer: {expert id: weights}}."""
    check_name(name)
    tensors: dict[str, torch.Tensor] = {}
    for layer, per_layer in sorted(experts.items()):
        for e, weights in sorted(per_layer.items()):
            for w, t in weights.items():
                tensors[expert_tensor_name(layer, e, w)] = t.contiguous()
    for tname, t in sorted((non_expert or {}).items()):
        tensors[NON_EXPERT_PREFIX + tname] = t.contiguous()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(tensors, tmp / DATA_FILE, metadata={"format": BUNDLE_FORMAT, "name": name})
        manifest = {
            "format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "name": name, "created_by": f"esftctl {__version__}",
            "base": base_identity(base),
            "dtype": base.expert_dtype,
            "shapes": {w: list(s) for w, s in base.expert_shapes().items()},
            "experts": {str(layer): sorted(ids) for layer, ids in sorted(experts.items()) if ids},
            "non_expert_tensors": sorted(non_expert or {}),
            "file": DATA_FILE, "tensors_sha256": tensors_sha256(tmp / DATA_FILE),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


@dataclass
class Bundle:
    """An opened, verified adapter bundle (checksum, header, tensor names, shapes and dtypes all checked)."""

    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | Path) -> "Bundle":
        path = Path(path)
        manifest_file = path / MANIFEST
        if not manifest_file.exists():
            raise EsftError(f"not an adapter bundle (no {MANIFEST})", path)
        m = read_json(manifest_file)
        if not isinstance(m, dict) or m.get("format") != BUNDLE_FORMAT:
            raise EsftError(f"not an esftctl adapter manifest (format is not {BUNDLE_FORMAT!r})", manifest_file)
        if m.get("version") != BUNDLE_VERSION:
            raise EsftError(f"bundle format version {m.get('version')!r} is not supported (this esftctl reads "
                            f"{BUNDLE_VERSION})", manifest_file)
        for key in ("name", "base", "dtype", "shapes", "experts", "file", "tensors_sha256"):
            if key not in m:
                raise EsftError(f"manifest has no {key!r}", manifest_file)
        bundle = cls(path, m)
        bundle._verify()
        return bundle

    def _verify(self) -> None:
        data = self.data_file
        if not data.exists():
            raise EsftError("missing bundle data file", data)
        if tensors_sha256(data) != self.manifest["tensors_sha256"]:
            raise EsftError("checksum mismatch: the file is corrupted or truncated", data)
        with safe_open(data, framework="pt") as f:
            header = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
        shapes = {w: tuple(s) for w, s in self.manifest["shapes"].items()}
        expected = {expert_tensor_name(l, e, w): (shapes[w], self.manifest["dtype"])
                    for l, ids in self.experts.items() for e in ids for w in EXPERT_WEIGHTS}
        for name, want in expected.items():
            if header.get(name) != want:
                got = header.get(name)
                raise EsftError(f"tensor {name!r} is {'missing' if got is None else got}, expected {want}", data)
        non_expert = {NON_EXPERT_PREFIX + n for n in self.manifest.get("non_expert_tensors", [])}
        extra = set(header) - set(expected) - non_expert
        if extra or not non_expert <= set(header):
            raise EsftError(f"tensors do not match the manifest ({sorted(extra or non_expert - set(header))[:3]})",
                            data)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def data_file(self) -> Path:
        return self.path / self.manifest["file"]

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
        if identity["fingerprint"] != self.base["fingerprint"]:
            mismatch = [k for k in identity if k != "fingerprint" and identity[k] != self.base.get(k)]
            why = f"differs in {', '.join(mismatch)}" if mismatch else "has other router weights"
            raise EsftError(f"bundle {self.name!r} was packed for another base model than {base.path} (this base "
                            f"{why})", self.path)

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        with safe_open(self.data_file, framework="pt") as f:
            return ExpertWeights(**{w: f.get_tensor(expert_tensor_name(layer, expert, w)) for w in EXPERT_WEIGHTS})

    def read_experts(self) -> dict[int, dict[int, ExpertWeights]]:
        with safe_open(self.data_file, framework="pt") as f:
            return {l: {e: ExpertWeights(**{w: f.get_tensor(expert_tensor_name(l, e, w)) for w in EXPERT_WEIGHTS})
                        for e in ids} for l, ids in self.experts.items()}

    def read_non_expert(self) -> dict[str, torch.Tensor]:
        with safe_open(self.data_file, framework="pt") as f:
            return {n: f.get_tensor(NON_EXPERT_PREFIX + n) for n in self.non_expert_tensors}

    def experts_per_layer(self) -> list[int]:
        return [len(self.experts.get(l, [])) for l in self.base["moe_layers"]]

    def describe(self) -> dict:
        counts = self.experts_per_layer()
        layers = len(counts)
        most = max(counts) if counts else 0
        mean = sum(counts) / layers if layers else 0.0
        itemsize = TORCH_DTYPES[self.manifest["dtype"]].itemsize
        expert_bytes = sum(math.prod(s) for s in self.manifest["shapes"].values()) * itemsize
        return {
            "kind": "bundle", "path": str(self.path), "name": self.name, "architecture": self.base["architecture"],
            "base_fingerprint": self.base["fingerprint"], "moe_layers": self.base["moe_layers"],
            "experts_per_layer": counts, "total_experts": sum(counts), "max_experts_per_layer": most,
            "mean_experts_per_layer": mean, "sparsity_factor": 1 - mean / most if most else 0.0,
            "expert_bytes": expert_bytes,
            "bundle_bytes": self.data_file.stat().st_size, "non_expert_tensors": len(self.non_expert_tensors),
        }
