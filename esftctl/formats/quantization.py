"""What quantization a checkpoint's experts carry: from its config and from its expert tensors' dtypes.

MoE models now ship quantized: DeepSeek-V3 and Qwen3-MoE as FP8 (`quantization_config`: quant_method "fp8",
fmt "e4m3", weight_block_size [128, 128]: each expert weight an F8_E4M3 tensor beside an F32
`weight_scale_inv` of one scale per 128 x 128 block), GPT-OSS as MXFP4 (quant_method "mxfp4": experts as U8
`*_blocks` of packed 4-bit values and U8 `*_scales`), others as GPTQ, AWQ or compressed-tensors (packed I32
weights). esftctl reads, compares, merges and entropy-codes experts as plain bf16/fp16/fp32 values: an FP8
byte read as such, or without its block's scale, is another number, and a Huffman store of FP8 bytes would
split them as if they were bf16. So `esftctl inspect` names what it found, and every other command refuses a
quantized checkpoint in one line naming the method (esftctl/formats/checkpoint.py) until it handles it.

A checkpoint without `quantization_config` is still called quantized when its expert tensors are of another
dtype than those three, or come with scale tensors: the config may have been dropped on the way.
"""

from __future__ import annotations

from typing import Mapping

PLAIN_DTYPES = ("BF16", "F16", "F32")
# Tensor-name endings that only quantized weights have (FP8 block scales, MXFP4, GPTQ/AWQ, compressed-tensors).
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "_blocks", "_scales", "qweight", "qzeros", "weight_packed",
                  "weight_zero_point", "input_scale", "g_idx")
# Fields of a quantization_config worth showing, when present.
DETAIL_KEYS = ("fmt", "weight_block_size", "bits", "group_size", "activation_scheme", "format")


def find_quantization(config: Mapping, dtypes: Mapping[str, str]) -> dict | None:
    """What quantization the experts carry (None: plain floating point), given the model's config and the
    dtypes of the tensors of its MoE layers' routed experts {tensor name: safetensors dtype}:
    {method, source ("config" or "tensors"), the config's details, expert_dtypes, scale_tensors}."""
    found = {"expert_dtypes": sorted(set(dtypes.values())),
             "scale_tensors": sum(1 for n in dtypes if n.endswith(QUANT_SUFFIXES))}
    qconfig = config.get("quantization_config") or config.get("compression_config")
    if isinstance(qconfig, dict) and qconfig:
        method = qconfig.get("quant_method") or qconfig.get("format") or "unknown"
        details = {k: qconfig[k] for k in DETAIL_KEYS if k in qconfig and k != "quant_method"}
        return {"method": str(method), "source": "config", **details, **found}
    odd = sorted({d for d in dtypes.values() if d not in PLAIN_DTYPES})
    if odd or found["scale_tensors"]:
        method = ("fp8" if all(d.startswith("F8") for d in odd) and odd else
                  f"unknown ({', '.join(odd) or 'scale tensors'})")
        return {"method": method, "source": "tensors", **found}
    return None


def label(q: dict | None) -> str:
    """One line for tables and errors: 'fp8 (fmt e4m3, weight_block_size [128, 128]; expert tensors F32,
    F8_E4M3)'; 'none' for plain floating point."""
    if q is None:
        return "none"
    details = [f"{k} {q[k]}" for k in DETAIL_KEYS if k in q]
    found = f"expert tensors {', '.join(q['expert_dtypes'])}" if q["expert_dtypes"] else "no expert tensors found"
    source = "" if q["source"] == "config" else ", from the tensors: no quantization_config"
    return f"{q['method']} ({'; '.join([', '.join(details), found] if details else [found])}{source})"
