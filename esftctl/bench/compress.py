"""`esftctl bench compress`: Huffman expert stores against the entropy bound, general-purpose compressors, the
fixed-rate code (esftctl.kernels.fixed_rate, SplitZip's idea), and (on a GPU) each decoder against the
memory-bandwidth bound, from one DeepSeek-V2-Lite expert to a whole layer.

Weights are synthetic but trained-like (esftctl.bench.synthetic_model.trained_like), bf16.
GPU decode: one launch for all tensors of the size (esftctl.kernels.huffman_decode), median of repeats;
its bound is (stored bytes read + 2 bytes written per value) over the measured copy bandwidth.
"""

from __future__ import annotations

import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import torch

from esftctl.bench.shapes import DEEPSEEK_V2_LITE, MoEShape
from esftctl.bench.synthetic_model import trained_like_expert
from esftctl.formats.store import ExpertStore, SourceTensor, write_store

EXPERT_COUNTS = (1, 8, 64)


def _general_purpose(raw: bytes) -> dict[str, int]:
    sizes = {"zlib-6": len(zlib.compress(raw, 6))}
    try:
        import zstandard

        sizes["zstd-3"] = len(zstandard.ZstdCompressor(level=3).compress(raw))
    except ImportError:
        pass
    return sizes


def run(shape: MoEShape = DEEPSEEK_V2_LITE, counts=EXPERT_COUNTS, table_scope: str = "layer",
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    gpu = torch.cuda.is_available()
    bandwidth = None
    if gpu:
        from esftctl.bench.reroute import copy_bandwidth

        bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    experts = {}
    for n in counts:
        on_step(f"{n} expert(s): generating")
        for x in range(len(experts), n):
            experts[x] = trained_like_expert(shape, x)
        tensors = [SourceTensor(f"{x}.{w}", 0, x, w, lambda t=t: t) for x in range(n) for w, t in experts[x].items()]
        with tempfile.TemporaryDirectory() as tmp:
            on_step(f"{n} expert(s): encoding")
            start = time.time()
            header = write_store({"kind": "synthetic", "path": shape.name}, tensors, Path(tmp) / "s",
                                 table_scope=table_scope)
            encode_s = time.time() - start
            row = {"experts": n, "values": header["values"], "bf16_bytes": header["original_bytes"],
                   "stored_bytes": header["data_bytes"], "entropy_bound_bytes": header["entropy_bound_bytes"],
                   "encode_s": encode_s, "encode_values_per_s": header["values"] / encode_s}
            row["stored_over_bf16"] = row["stored_bytes"] / row["bf16_bytes"]
            row["stored_over_bound"] = row["stored_bytes"] / row["entropy_bound_bytes"]
            if n == counts[0]:
                raw = b"".join(t.read().view(torch.int16).numpy().tobytes() for t in tensors)
                row["general_purpose_over_bf16"] = {k: v / len(raw) for k, v in _general_purpose(raw).items()}
            if gpu:
                on_step(f"{n} expert(s): decoding on the GPU")
                row.update(_gpu_decode(ExpertStore(Path(tmp) / "s"), tensors, bandwidth))
        on_step(f"{n} expert(s): the fixed-rate code")
        row.update(_fixed_rate(torch.cat([t.read().reshape(-1) for t in tensors]), bandwidth if gpu else None))
        rows.append(row)
    return {"benchmark": "compress", "model": shape.name, "table_scope": table_scope,
            "device": torch.cuda.get_device_name(0) if gpu else "CPU only",
            "copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None, "rows": rows}


def _gpu_decode(store: ExpertStore, tensors: list[SourceTensor], bandwidth: float) -> dict:
    import triton.testing

    outs = {t.name: torch.empty(store.tensors[t.name]["shape"], dtype=torch.bfloat16, device="cuda")
            for t in tensors}
    plan = store.plan(list(outs.items()))
    plan.run()
    torch.cuda.synchronize()
    exact = all(torch.equal(outs[t.name].cpu().view(torch.int16), t.read().view(torch.int16)) for t in tensors)
    ms = float(triton.testing.do_bench(plan.run, warmup=10, rep=200, return_mode="median"))
    values = sum(store.tensors[t.name]["count"] for t in tensors)
    moved = store.header["data_bytes"] + 2 * values
    bound_ms = moved / bandwidth * 1e3
    return {"gpu_decode_ms": ms, "gpu_bit_exact": exact, "gpu_values_per_s": values / (ms / 1e3),
            "gpu_bound_ms": bound_ms, "gpu_fraction_of_bound": bound_ms / ms}


def _fixed_rate(values: torch.Tensor, bandwidth: float | None) -> dict:
    """The fixed-rate code of the same values (one table for them all, like the store's layer tables): its size,
    and on a GPU its decode against its own bound (its bytes read + 2 written per value)."""
    from esftctl.kernels.fixed_rate import decode, decode_reference, encode

    code = encode(values)
    row = {"fixed_rate_bytes": code.nbytes, "fixed_rate_over_bf16": code.nbytes / (2 * values.numel()),
           "fixed_rate_escapes": code.escapes.numel()}
    if bandwidth is None:
        row["fixed_rate_exact"] = torch.equal(decode_reference(code).view(torch.int16), values.view(torch.int16))
        return row
    import triton.testing

    code.check()
    on_gpu = code.to("cuda")
    out = torch.empty(code.count, dtype=torch.bfloat16, device="cuda")
    decode(on_gpu, out)
    torch.cuda.synchronize()
    row["fixed_rate_exact"] = torch.equal(out.cpu().view(torch.int16), values.view(torch.int16))
    ms = float(triton.testing.do_bench(lambda: decode(on_gpu, out), warmup=10, rep=200, return_mode="median"))
    bound_ms = (code.nbytes + 2 * code.count) / bandwidth * 1e3
    return {**row, "fixed_rate_decode_ms": ms, "fixed_rate_bound_ms": bound_ms,
            "fixed_rate_fraction_of_bound": bound_ms / ms}


def table(result: dict):
    from rich.table import Table

    from esftctl.units import format_bytes

    t = Table(title=f"Huffman expert stores, {result['model']} experts ({result['table_scope']} tables; "
                    f"{result['device']})", header_style="bold")
    for col in ("experts", "bf16", "stored", "of bf16", "x entropy bound", "encode (CPU)", "GPU decode",
                "of bandwidth bound", "fixed-rate of bf16", "fixed-rate decode", "of its bound"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(str(r["experts"]), format_bytes(r["bf16_bytes"]), format_bytes(r["stored_bytes"]),
                  f"{r['stored_over_bf16']:.2%}", f"{r['stored_over_bound']:.4f}",
                  f"{r['encode_values_per_s'] / 1e6:.1f} M/s",
                  f"{r['gpu_decode_ms']:.3f} ms" if "gpu_decode_ms" in r else "-",
                  f"{r['gpu_fraction_of_bound']:.0%}" if "gpu_decode_ms" in r else "-",
                  f"{r['fixed_rate_over_bf16']:.2%}",
                  f"{r['fixed_rate_decode_ms']:.3f} ms" if "fixed_rate_decode_ms" in r else "-",
                  f"{r['fixed_rate_fraction_of_bound']:.0%}" if "fixed_rate_decode_ms" in r else "-")
    first = result["rows"][0].get("general_purpose_over_bf16", {})
    if first:
        t.caption = "general-purpose on the bf16 bytes of 1 expert: " + ", ".join(
            f"{k} {v:.2%}" for k, v in first.items())
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["experts"] for r in rows]
    ax.plot(n, [100 * r["stored_over_bf16"] for r in rows], "o-", label="Huffman store")
    ax.plot(n, [100 * r["entropy_bound_bytes"] / r["bf16_bytes"] for r in rows], "k--", label="exponent-entropy bound")
    for k, v in rows[0].get("general_purpose_over_bf16", {}).items():
        ax.axhline(100 * v, ls=":", label=k, color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("experts")
    ax.set_ylabel("% of bf16 bytes")
    ax.set_title(f"{result['model']}: stored size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
