"""Where a warm adapter load's time goes: DeepSeek-V2-Lite's 26 MoE layers as virtual layers, an adapter of
`--experts` experts (6 a layer: 156, about a 153-expert DeepSeek-sized one) staged in pinned rows as the host cache
holds them, loaded and unloaded `--repeats` times each way: rows mapped only; mapped and copied; mapped, copied
and checked (AdapterSlots.load's `checksums`, what a served load does since 2026-11-25); and the row checksums
alone over rows on the device, the kernel's (esftctl.kernels.row_checksum, on a GPU) and the reference's, and
over the staged rows in pinned host memory (what a cold load's staging takes: the kernel reads them over the bus).
The staging itself is timed once first. Why: `bench serve` on an H100 (2026-11-27) measured a warm `esftctl
adapters load` of a 2.47 GiB adapter at 2.98 s, 61x its copy floor, where the H200 of 2026-11-23 took 0.083 s
(1.44x) before loads checked their rows.
Usage: python3 benchmarks/lab/load_cost.py [--small] [--repeats 5]   (--small: 4 layers of small experts, CPU)
"""

import argparse
import statistics
import time

import torch

from esftctl.bench.shapes import DEEPSEEK_V2_LITE
from esftctl.formats.checkpoint import ExpertWeights
from esftctl.kernels.row_checksum import row_checksums, row_checksums_reference
from esftctl.runtime.adapters import AdapterSlots
from esftctl.runtime.address_space import CudaAddressSpace, HostAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import VirtualMoELayer

args = argparse.ArgumentParser()
args.add_argument("--small", action="store_true")
args.add_argument("--repeats", type=int, default=5)
args.add_argument("--per-layer", type=int, default=6)
a = args.parse_args()
cuda = torch.cuda.is_available() and not a.small
layers_n, experts, hidden, inter = (4, 8, 64, 32) if a.small else (DEEPSEEK_V2_LITE.moe_layers, 64, 2048, 1408)
if cuda:
    pool = PhysicalPagePool(0)

    def make_space(n):
        return CudaAddressSpace(n, pool)
else:
    def make_space(n):
        return HostAddressSpace(n)
layers = {l: VirtualMoELayer(experts, hidden, inter, num_slots=2, experts_per_slot=a.per_layer, dtype=torch.bfloat16,
                             make_space=make_space)
          for l in range(layers_n)}
slots = AdapterSlots(layers)
weights = [ExpertWeights(*(torch.full(s, 0.01 * (k + 1), dtype=torch.bfloat16) for s in
                           ((inter, hidden), (inter, hidden), (hidden, inter)))) for k in range(a.per_layer)]
started = time.perf_counter()
staged = {l: layer.stage(weights) for l, layer in layers.items()}
print(f"stage (stack, pin, row checksums) {1e3 * (time.perf_counter() - started):9.1f} ms")
rows = {l: s[:-1] for l, s in staged.items()}
sums = {l: s[-1] for l, s in staged.items()}
ids = {l: {e: None for e in range(a.per_layer)} for l in layers}
nbytes = sum(t.nbytes for r in rows.values() for t in r)


def sync():
    if cuda:
        torch.cuda.synchronize()


def timed(way: str) -> float:
    start = time.perf_counter()
    if way == "map":
        slots.load("a", ids)
    else:
        slots.load("a", ids, rows, sums if way == "check" else None)
    sync()
    took = time.perf_counter() - start
    slots.evict("a")
    slots.collect()
    sync()
    return took


def checksums_alone(checksums, where: str = "device") -> float:
    on = rows if where == "host" else {l: tuple(t.to("cuda" if cuda else "cpu") for t in r) for l, r in rows.items()}
    sync()
    start = time.perf_counter()
    for r in on.values():
        checksums(*r).cpu()
    return time.perf_counter() - start


print(f"{'CUDA' if cuda else 'CPU'}: {layers_n} layers x {a.per_layer} experts, {nbytes / 2**30:.2f} GiB staged")
for way in ("map", "copy", "check", "map", "copy", "check"):  # twice: the first round warms up
    times = [timed(way) for _ in range(a.repeats)]
    print(f"{way:6s} median {1e3 * statistics.median(times):9.1f} ms  runs {[round(1e3 * t, 1) for t in times]}")
for name, checksums, where in (("row_checksums", row_checksums, "device"),
                               ("reference", row_checksums_reference, "device"),
                               ("row_checksums of the staged rows",
                                lambda *r: row_checksums(*r, device="cuda" if cuda else "cpu"), "host")):
    times = [checksums_alone(checksums, where) for _ in range(a.repeats)]
    print(f"{name} alone median {1e3 * statistics.median(times):9.1f} ms  runs {[round(1e3 * t, 1) for t in times]}")
