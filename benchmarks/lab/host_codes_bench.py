"""Compressed bytes over the bus (issue 87 item 2): a paged layer's rows delivered from the host as the fixed-rate code
against the same rows as bf16, on the device.

One DeepSeek-V2-Lite layer of trained-like experts (64 rows: w13 [2816, 2048], w2 [2048, 1408] bf16), its rows in
pinned host memory as bf16 and as the tier's fixed-rate code (esftctl.kernels.fixed_rate.encode_rows: 0.75 of the
bytes). Each way below ends with every row's bf16 in device memory; its rate is the bf16 bytes delivered a second:
- bf16, copy engine:      `copy_` of the pinned rows (what a whole-layer fetch can do at best over the bus);
- bf16, zero-copy:        the pager's fetch kernel (esftctl.kernels.row_fetch) reading the pinned rows, 64 programs;
- code, copy then decode: the code copied by the copy engine, then decoded on the device (`decode_rows`), in
                          `--pieces` row pieces on two streams, so that a piece decodes while the next one crosses;
- code, zero-copy decode: `decode_rows` reading the pinned code itself through CUDA views of it
                          (FixedRows.over_the_bus; the decoder's loads cross the bus), the small tables on the
                          device.
Item 2's target: the code's effective rate at least 1.3x the bf16 copy of the same rows, measured in the same run.
Each way is checked bit for bit against the weights first. Median of --reps runs after 2 warm-ups (CUDA events).

Usage (device machine, vLLM's CUDA build on PYTHONPATH): python benchmarks/lab/host_codes_bench.py [--reps 10]
[--pieces 8]. JSON to $OUT/host_codes.json if $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from row_fetch_bench import bench  # the lab's event-timed median (this folder is on the path when run)

ROWS, H, I = 64, 2048, 1408


def pinned(code):
    """The same code with every tensor in pinned host memory."""
    from esftctl.kernels.fixed_rate import FixedRows

    return FixedRows(code.count, code.block, *(t.cpu().pin_memory() for t in (code.table, code.sm, code.codes,
                                                                               code.escapes, code.base, code.starts)))


def on_device(code, device):
    from esftctl.kernels.fixed_rate import FixedRows

    return FixedRows(code.count, code.block, *(torch.empty_like(t, device=device) for t in (
        code.table, code.sm, code.codes, code.escapes, code.base, code.starts)))


def copy_code(dst, src, rows: slice | None = None, *, tables: bool = True) -> None:
    """src's code into dst's buffers, by the copy engine (non-blocking from pinned memory); `rows`: those rows'
    sign-mantissa bytes and exponent codes only; `tables`: the small tables, escapes and escape counts too."""
    for name in ("table", "escapes", "base", "starts") if tables else ():
        getattr(dst, name).copy_(getattr(src, name), non_blocking=True)
    for name in ("sm", "codes"):
        d, s = getattr(dst, name), getattr(src, name)
        (d if rows is None else d[rows]).copy_(s if rows is None else s[rows], non_blocking=True)


def main() -> None:
    from esftctl.bench.synthetic_model import trained_like
    from esftctl.kernels.fixed_rate import decode_rows, encode_rows
    from esftctl.kernels.row_fetch import RowFetch

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pieces", type=int, default=8)
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {"w13": trained_like((ROWS, 2 * I, H), g), "w2": trained_like((ROWS, H, I), g)}
    host = {n: w.cpu().pin_memory() for n, w in weights.items()}
    codes = {n: encode_rows(w) for n, w in weights.items()}
    host_codes = {n: pinned(c) for n, c in codes.items()}
    dev_codes = {n: on_device(c, dev) for n, c in codes.items()}
    out = {n: torch.empty_like(w) for n, w in weights.items()}
    layer_bytes = sum(w.numel() * 2 for w in weights.values())
    code_bytes = sum(c.nbytes for c in codes.values())
    result = {"device": torch.cuda.get_device_name(), "layer_bytes": layer_bytes, "code_bytes": code_bytes}

    def same() -> bool:
        torch.cuda.synchronize()
        ok = all(torch.equal(out[n].view(torch.int16), weights[n].view(torch.int16)) for n in weights)
        for t in out.values():
            t.zero_()
        return ok

    def copy_engine():
        for n in weights:
            out[n].copy_(host[n], non_blocking=True)

    fetch = RowFetch(out["w13"], out["w2"])
    fetch.set_sources([(host["w13"][r], host["w2"][r]) for r in range(ROWS)])

    def zero_copy():
        fetch.mark(None)
        fetch.fetch(64)

    side = torch.cuda.Stream()
    bounds = [round(ROWS * p / args.pieces) for p in range(args.pieces + 1)]
    marks = []  # each piece's rows marked for the masked decode
    for p in range(args.pieces):
        needed = torch.zeros(ROWS, dtype=torch.int32, device=dev)
        needed[bounds[p]:bounds[p + 1]] = 1
        marks.append(needed)
    every = torch.full((1,), ROWS, dtype=torch.int32, device=dev)  # first_host: no row is the host tier's

    def copy_then_decode():
        # piece p crosses on the side stream while piece p - 1 decodes on the current one
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        done = []
        for p in range(args.pieces):
            rows = slice(bounds[p], bounds[p + 1])
            with torch.cuda.stream(side):
                for n in weights:
                    copy_code(dev_codes[n], host_codes[n], rows, tables=p == 0)
                event = torch.cuda.Event()
                event.record(side)
            done.append((rows, event))
        for (rows, event), needed in zip(done, marks):
            main_stream.wait_event(event)
            for n in weights:
                decode_rows(dev_codes[n], out[n], needed, every)

    over_bus = {n: c.over_the_bus() for n, c in codes.items()}

    def zero_copy_decode():
        for n in weights:
            decode_rows(over_bus[n], out[n])

    ways = {"bf16 copy engine": copy_engine, "bf16 zero-copy": zero_copy, "code copy then decode": copy_then_decode,
            "code zero-copy decode": zero_copy_decode}
    rows = []
    for name, fn in ways.items():
        try:
            fn()
            exact = same()
            ms = bench(fn, args.reps)
        except Exception as e:  # a way this build cannot run (the decoder given host tensors, say): said, not fatal
            rows.append({"way": name, "error": " ".join(str(e).split())[:300]})
            print(f"{name:24s} failed: {rows[-1]['error']}", flush=True)
            continue
        rows.append({"way": name, "ms": ms, "gbps": layer_bytes / ms / 1e6, "exact": exact})
        print(f"{name:24s} {ms:8.3f} ms {layer_bytes / ms / 1e6:7.1f} GB/s of bf16 delivered  exact={exact}",
              flush=True)
    result["ways"] = rows
    base = next((r for r in rows if r["way"] == "bf16 copy engine" and "ms" in r), None)
    if base:
        for r in rows:
            if "ms" in r:
                r["vs_bf16_copy"] = base["ms"] / r["ms"]
        print("against the bf16 copy: " + ", ".join(f"{r['way']} {r['vs_bf16_copy']:.2f}x" for r in rows if "ms" in r))
    print(f"code {code_bytes / layer_bytes:.3f} of bf16")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_codes.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
