"""`esftctl merge`: base + adapter bundle -> a full merged checkpoint, the baseline serving is checked against.

An FP8 base's bundle holds its experts in the base's FP8 form with their block scales (esftctl.formats.fp8), so the
merged model is quantized the same way: the bundle's bytes, weights and scales, replace the base's."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint, write_checkpoint


def merge(base_dir: Path, bundle_dir: Path, out: Path, *, overwrite: bool = False,
          on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """Write `out`: the base with the bundle's tensors in place; `on_tensor` after each tensor written."""
    base = MoECheckpoint(base_dir, fp8=True)
    bundle = Bundle.open(bundle_dir)
    bundle.check_base(base)
    experts = {(l, e): w for l, per in bundle.read_experts().items() for e, w in per.items()}
    return write_checkpoint(base, out, bundle.read_non_expert(), experts=experts, overwrite=overwrite,
                            on_tensor=on_tensor)
