"""FP8 block quantization of expert weights, as DeepSeek-V3 and Qwen3-MoE FP8 checkpoints store them.

Each weight W [rows, cols] is a float8_e4m3fn tensor Q beside a float32 `weight_scale_inv` S of one scale per
block of bn x bk values (ceil(rows / bn) x ceil(cols / bk) scales; `quantization_config` {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}, usually [128, 128]), and W is
Q * S block by block. That is the layout vLLM's Fp8MoEMethod loads (`w13_weight_scale_inv` [E, 2 ceil(I / bn),
ceil(H / bk)], `w2_weight_scale_inv` [E, ceil(H / bn), ceil(I / bk)]) and its Triton kernel reads as stored.

`quantize` is vLLM's own block quantizer (`per_block_cast_to_fp8`, vllm/utils/deep_gemm.py, the same in 0.25
and 0.32, taken from DeepGEMM): per block amax of |W| in float32, clamped to at least 1e-4, S = amax / 448, Q =
(W * (1 / S)) cast to e4m3 (a multiplication by the reciprocal, not a division: the two round differently).
An adapter packed from bf16 experts is quantized with it once, at pack time, so the bundle holds the very bytes
the merged checkpoint holds and the server loads: `esftctl merge` then copies bytes, plain vLLM serves exactly
them, the row checksums of a load cover what the kernel reads, and no server needs a quantizer of its own.

Tensors read from files are checked before use (`check`): dtypes, scale shapes, finite positive scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from esftctl.errors import EsftError
from esftctl.formats.quantization import label

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# The largest block side read from a config. quantize and dequantize allocate whole blocks: a crafted
# weight_block_size [2**40, 128] with scales of one row passes `check` and then asks dequantize for 2**40 rows.
# Every released FP8 checkpoint's blocks are 128 x 128.
MAX_BLOCK = 4096
AMAX_FLOOR = 1e-4  # vLLM's (and DeepGEMM's) clamp of a block's amax: an all-zero block gets a finite scale
SCALE_SUFFIX = "_scale_inv"  # a weight's scale tensor: its name with this appended
WEIGHT_DTYPE, SCALE_DTYPE = "F8_E4M3", "F32"  # safetensors' names


@dataclass(frozen=True)
class Fp8Block:
    """One FP8 block-quantization scheme: the block of values each scale covers."""

    block: tuple[int, int] = (128, 128)

    @property
    def config(self) -> dict:
        """The `quantization_config` of a checkpoint quantized this way."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A 2-D weight -> (float8_e4m3fn weight, float32 scales), as vLLM's per_block_cast_to_fp8."""
        (rows, cols), (bn, bk) = w.shape, self.block
        sr, sc = self.scale_shape(w.shape)
        padded = torch.zeros(sr * bn, sc * bk, dtype=torch.float32)
        padded[:rows, :cols] = w.float()
        blocks = padded.view(sr, bn, sc, bk)
        scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR) / FP8_MAX
        q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
        return q.view(sr * bn, sc * bk)[:rows, :cols].contiguous(), scale.view(sr, sc).contiguous()

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Q * S block by block, in float32, then cast to `dtype` (as DeepSeek's fp8_cast_bf16 writes bf16)."""
        bn, bk = self.block
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:q.shape[0], :q.shape[1]]
        return (q.float() * full).to(dtype)

    def check(self, q: torch.Tensor, scale: torch.Tensor, *, name: str, file: Path | None) -> None:
        """Refuse, in one line naming the file, a weight and scale read from a file that do not fit the scheme."""
        if q.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise EsftError(f"FP8 weight {name!r} must be float8_e4m3fn with float32 scales, not {q.dtype} with "
                            f"{scale.dtype}", file)
        if q.dim() != 2:
            raise EsftError(f"FP8 weight {name!r} is {list(q.shape)}, not a matrix", file)
        want = self.scale_shape(tuple(q.shape))
        if tuple(scale.shape) != want:
            raise EsftError(f"FP8 weight {name!r} {list(q.shape)} has scales {list(scale.shape)}; blocks of "
                            f"{list(self.block)} need {list(want)}", file)
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise EsftError(f"FP8 weight {name!r} has scales that are not finite and positive", file)


def scheme_of(quantization: Mapping | None, where: Path | None) -> Fp8Block | None:
    """The FP8 block scheme a checkpoint's quantization (esftctl.formats.quantization) declares; None for plain
    floating point; EsftError, one line naming the method, for anything esftctl does not pack, merge or serve."""
    if quantization is None:
        return None
    block = quantization.get("weight_block_size")
    fp8 = (quantization.get("method") == "fp8" and quantization.get("source") == "config"
           and quantization.get("fmt", "e4m3") == "e4m3"
           and quantization.get("activation_scheme", "dynamic") == "dynamic")
    if fp8 and isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= MAX_BLOCK
                                                                     for b in block):
        return Fp8Block((block[0], block[1]))
    raise EsftError(f"experts quantized with {label(quantization)} are not supported: esftctl reads bf16, fp16 or "
                    "fp32 experts, and FP8 ones with block scales (quant_method fp8, fmt e4m3, dynamic activations, "
                    "weight_block_size); `esftctl inspect` describes this checkpoint", where)
