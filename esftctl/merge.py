"""`esftctl merge`: base + adapter bundle -> a full merged checkpoint, the baseline serving is checked against.

An FP8 base's bundle holds its experts in the base's FP8 form with their block scales (esftctl.formats.fp8), so the
merged model is quantized the same way: the bundle's bytes, weights and scales, replace the base's.

A bundle is bound to its base by a fingerprint of the config and router weights (esftctl.formats.bundle); a merged
model is what people publish, so merge also checks every base tensor it copies against the hash pack recorded of it
(base_tensors.json): a base whose other weights were overwritten since is refused, and nothing is written."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from esftctl.errors import EsftError
from esftctl.formats.bundle import BASE_TENSORS, Bundle, tensor_sha256
from esftctl.formats.checkpoint import MoECheckpoint, write_checkpoint


def merge(base_dir: Path, bundle_dir: Path, out: Path, *, overwrite: bool = False,
          on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """Write `out`: the base with the bundle's tensors in place; `on_tensor` after each tensor written."""
    base = MoECheckpoint(base_dir, fp8=True)
    bundle = Bundle.open(bundle_dir)
    bundle.check_base(base)
    hashes = bundle.base_tensor_hashes()  # None: a version 1 bundle, read as asked for, with nothing to check
    experts = {(l, e): w for l, per in bundle.read_experts().items() for e, w in per.items()}

    def verify(name: str, t: torch.Tensor) -> None:
        info = base.tensors[name]
        if name not in hashes:
            raise EsftError(f"the bundle {bundle.name!r} was packed against a base without a tensor {name!r} (its "
                            f"{BASE_TENSORS} has none): the same model stored in another layout, or another model; "
                            "pack it against this base to merge into it", info.file)
        got = tensor_sha256(info.dtype, info.shape, [t.contiguous().reshape(-1).view(torch.uint8).numpy()])
        if got != hashes[name]:
            raise EsftError(f"tensor {name!r} is not the one the bundle {bundle.name!r} was packed against (its "
                            f"{BASE_TENSORS} records another): this base's weights changed since; merge refuses "
                            "to write a model from them", info.file)

    return write_checkpoint(base, out, bundle.read_non_expert(), experts=experts, overwrite=overwrite,
                            on_tensor=on_tensor, verify=verify if hashes is not None else None)
