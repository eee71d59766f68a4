"""The routed-row fetch on the device (esftctl.kernels.row_fetch): how fast kernels read pinned host rows over the
bus (zero-copy) against the copy engine, by number of programs; the routed fetch of 6 rows; the cost of an
inactive layer's launches; and how much a fetch of a whole layer on a side stream slows a matrix product on the
compute stream, by number of programs (what OVERLAP_PROGRAMS is chosen from).

Usage (device machine): python benchmarks/lab/row_fetch_bench.py   (JSON to stdout and $OUT/row_fetch.json)
Rows are DeepSeek-V2-Lite's experts (w13 [2816, 2048], w2 [2048, 1408] bf16: 17.3 MB a row), 64 of them.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from esftctl.kernels.row_fetch import RowFetch

ROWS, I, H = 64, 1408, 2048


def bench(fn, reps=10) -> float:
    """Median milliseconds of fn() over reps runs, each timed with events after 2 warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    host13 = torch.randn(ROWS, 2 * I, H, generator=g).to(torch.bfloat16).pin_memory()
    host2 = torch.randn(ROWS, H, I, generator=g).to(torch.bfloat16).pin_memory()
    dev13, dev2 = torch.empty_like(host13, device=dev), torch.empty_like(host2, device=dev)
    layer_bytes = (host13.numel() + host2.numel()) * 2
    fetch = RowFetch(dev13, dev2)
    fetch.set_sources([(host13[r], host2[r]) for r in range(ROWS)])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"device": torch.cuda.get_device_name(), "sms": sms, "layer_bytes": layer_bytes}
    out["copy_engine_gbps"] = layer_bytes / bench(
        lambda: (dev13.copy_(host13, non_blocking=True), dev2.copy_(host2, non_blocking=True))) / 1e6
    ids6 = torch.tensor([[3, 9, 17, 40, 41, 63]], dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    matmul_ms = bench(lambda: [a @ b for _ in range(20)], reps=5)
    out["matmul_ms"] = matmul_ms
    rows = []
    for programs in (4, 8, 16, 32, 64, 4 * sms):
        whole = bench(lambda p=programs: (fetch.mark(None), fetch.fetch(p)))
        six = bench(lambda p=programs: (fetch.mark(ids6), fetch.fetch(p)))

        def beside(p=programs):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fetch.mark(None)
                    fetch.fetch(p)
            for _ in range(20):
                a @ b
            torch.cuda.current_stream().wait_stream(side)

        both = bench(beside, reps=5)
        rows.append({"programs": programs, "whole_gbps": layer_bytes / whole / 1e6, "six_ms": six,
                     "three_layers_ms": 3 * whole, "with_matmul_ms": both,
                     "overlap": (matmul_ms + 3 * whole - both) / min(matmul_ms, 3 * whole)})
    out["rows"] = rows
    fetch.active.zero_()
    out["inactive_ms"] = bench(lambda: (fetch.mark(ids6), fetch.fetch(4 * sms)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fetch.mark(ids6)
        fetch.fetch(4 * sms)
    out["inactive_graph_ms"] = bench(graph.replay)
    fetch.active.fill_(1)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "row_fetch.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(f"{'programs':>9} {'whole GB/s':>10} {'6 rows ms':>9} {'3 layers ms':>11} {'+matmul ms':>10} {'overlap':>7}")
    for r in rows:
        print(f"{r['programs']:>9} {r['whole_gbps']:>10.1f} {r['six_ms']:>9.2f} {r['three_layers_ms']:>11.1f} "
              f"{r['with_matmul_ms']:>10.1f} {r['overlap']:>7.2f}")
    print(f"copy engine {out['copy_engine_gbps']:.1f} GB/s; matmul alone {matmul_ms:.1f} ms; inactive "
          f"{out['inactive_ms'] * 1e3:.0f} us eager, {out['inactive_graph_ms'] * 1e3:.0f} us in a graph")


if __name__ == "__main__":
    main()
