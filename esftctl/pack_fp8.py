"""`esftctl pack` against an FP8 base (block-quantized experts: esftctl.formats.fp8).

A fine-tune already in the base's FP8 form (same quantization_config, same block layout) is packed as any other:
its stored bytes, scales included, are compared with the base's. A plain (bf16) fine-tune of an FP8 base, as
people train them (on the model dequantized to bf16, or on the bf16 original the FP8 one was quantized from),
is compared with the base weight by weight: a bf16 weight is unchanged where it equals the base's dequantized
weight (Q * S in float32, cast to its dtype: DeepSeek's fp8_cast_bf16) or where quantizing it gives the base's
bytes; its experts that changed are quantized with the base's scheme once, here, so the bundle holds the bytes
the merged model holds and the server loads (why at pack time: esftctl.formats.fp8). Experts left unchanged
but listed in an expert config are the base's own bytes. A fine-tune in FP8 with another block layout, or an
FP8 fine-tune of a plain base, is refused in one line.
"""

from __future__ import annotations

from typing import Callable

import torch

from esftctl.errors import EsftError
from esftctl.formats.architectures import EXPERT_SCALES, EXPERT_WEIGHTS
from esftctl.formats.bundle import base_identity
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, finite_expert
from esftctl.formats.fp8 import SCALE_SUFFIX, WEIGHT_DTYPE

UNCOMPARED = ("fingerprint", "expert_dtype", "weight_block_size")  # what a plain fine-tune of an FP8 base changes


def plain_over_fp8(base: MoECheckpoint, tuned: MoECheckpoint) -> "PlainOverFp8 | None":
    """Refuse FP8 pairs esftctl does not pack; for a plain fine-tune of an FP8 base, its comparer (None for the
    pairs the stored bytes compare: both plain, or both in the same FP8 form)."""
    if tuned.fp8 is not None and base.fp8 is None:
        raise EsftError(f"the fine-tune's experts are FP8 and the base's {base.expert_dtype}: pack it against the FP8 "
                        "base it was quantized like", tuned.path / "config.json")
    if tuned.fp8 is not None and tuned.fp8 != base.fp8:
        raise EsftError(f"the fine-tune's FP8 experts are in blocks of {list(tuned.fp8.block)}, the base's in "
                        f"{list(base.fp8.block)}: quantize it with the base's block layout",
                        tuned.path / "config.json")
    if base.fp8 is None or tuned.fp8 is not None:
        return None
    comparer = PlainOverFp8(base, tuned)
    comparer.check_same_model()
    return comparer


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0 and a NaN for a change)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class PlainOverFp8:
    """A plain fine-tune compared with its FP8 base, weight by weight."""

    def __init__(self, base: MoECheckpoint, tuned: MoECheckpoint):
        self.base, self.tuned, self.scheme = base, tuned, base.fp8
        # The base's FP8 weights (a float8 tensor with a scale tensor beside it), experts and others alike.
        self.fp8_weights = {n for n, info in base.tensors.items()
                            if info.dtype == WEIGHT_DTYPE and n + SCALE_SUFFIX in base.tensors}

    def check_same_model(self) -> None:
        b, t = base_identity(self.base), base_identity(self.tuned)
        mismatch = [k for k in b if k not in UNCOMPARED and b[k] != t.get(k)]
        if mismatch:
            raise EsftError(f"fine-tuned model does not match the base ({', '.join(mismatch)} differ)", self.tuned.path)
        wanted = set(self.base.tensors) - {n + SCALE_SUFFIX for n in self.fp8_weights}
        if wanted != set(self.tuned.tensors):
            extra = sorted(wanted ^ set(self.tuned.tensors))[:3]
            raise EsftError(f"fine-tuned model has other tensors than the FP8 base less its scales (e.g. {extra})",
                            self.tuned.path)
        for name in sorted(wanted):
            info, mine = self.base.tensors[name], self.tuned.tensors[name]
            fp8 = name in self.fp8_weights
            wrong_dtype = mine.dtype == WEIGHT_DTYPE if fp8 else mine.dtype != info.dtype
            if mine.shape != info.shape or wrong_dtype:
                raise EsftError(f"tensor {name!r} is {mine.dtype} {list(mine.shape)} here, {info.dtype} "
                                f"{list(info.shape)} in the FP8 base", mine.file)

    def same(self, name: str) -> bool:
        """Whether the fine-tune leaves base tensor `name` as it is (for FP8 weights: as above)."""
        mine = self.tuned.read_tensor(name)
        if name not in self.fp8_weights:
            return _bits_equal(mine, self.base.read_tensor(name))
        q, s = self.base.read_tensor(name), self.base.read_tensor(name + SCALE_SUFFIX)
        self.scheme.check(q, s, name=name, file=self.base.tensors[name].file)
        if _bits_equal(mine, self.scheme.dequantize(q, s, mine.dtype)):
            return True
        q2, s2 = self.scheme.quantize(mine)
        return _bits_equal(q2, q) and _bits_equal(s2, s)

    def changed_experts(self, on_layer: Callable[[int], None] = lambda l: None) -> dict[int, list[int]]:
        changed = {}
        for layer in self.base.moe_layers:
            changed[layer] = [e for e in range(self.base.num_experts) if not all(
                self.same(self.base.arch.expert_tensor(layer, e, w)) for w in EXPERT_WEIGHTS)]
            on_layer(layer)
        return changed

    def changed_non_expert(self) -> list[str]:
        """The non-expert tensors the fine-tune changed; EsftError where one is an FP8 weight (an adapter of an FP8
        base replaces routed experts, and no non-expert weight is requantized)."""
        names = [n for n in self.tuned.tensors if not self.base.is_routed_expert_tensor(n) and not self.same(n)]
        fp8 = [n for n in names if n in self.fp8_weights]
        if fp8:
            raise EsftError(f"the fine-tune changed {len(fp8)} FP8 non-expert weights (e.g. {fp8[0]!r}); adapters of "
                            "an FP8 base change routed experts only", self.tuned.path)
        return names

    def adapter_expert(self, layer: int, expert: int, changed: bool) -> ExpertWeights:
        """The expert as the bundle stores it: the fine-tune's quantized with the base's scheme, or, where it did
        not change, the base's own bytes. A changed weight must be finite: a NaN or an infinity quantizes to a NaN
        or infinite block scale, which the bundle would carry to every merge and server (refused naming the file)."""
        if not changed:
            return self.base.read_expert(layer, expert)
        plain = finite_expert(self.tuned, layer, expert, self.tuned.read_expert(layer, expert),
                              why="quantized for the FP8 base, its block scales would be too")
        parts = {}
        for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES):
            parts[w], parts[s] = self.scheme.quantize(getattr(plain, w))
        return ExpertWeights(**parts)
