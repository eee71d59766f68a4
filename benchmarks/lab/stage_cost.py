"""Where a cold adapter load's staging time goes: a DeepSeek-sized adapter (26 MoE layers of 6 experts, 156 experts
of 2048 x 1408, about 2.7 GB in bf16) written as one safetensors file (in /dev/shm: the page cache's speed, not the
disk's), then staged layer by layer as a served load stages it: each expert read into a tensor of its own and
stacked into pinned rows (before 2026-11-27's thirteenth session), or read straight into the pinned rows on
STAGE_THREADS threads (Bundle.stored_experts); then the row checksums of the pinned rows (on a GPU the kernel reads
them over the bus); and the whole of VirtualMoELayer.stage with a layout that converts on the device, as vLLM's does
(read into place, to the GPU and back into the pinned rows, checksums on the GPU). The first repeat pins fresh
memory, later ones reuse torch's cached pinned blocks (min and max show both). Why: on the H200 of that session a
cold `esftctl adapters load` of a 2.47 GiB adapter staged for 6.9-7.5 s alone (0.37 GB/s, its disk read 1.43
GB/s) and for 17-24 s beside three busy cards; esftctl's start-up stages every adapter it serves, one after another.
Usage: python3 benchmarks/lab/stage_cost.py [--small] [--repeats 3] [--dir /dev/shm]   (--small: CPU)
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from esftctl.formats.checkpoint import ExpertWeights, StoredExpert, StoredTensor, read_header
from esftctl.kernels.row_checksum import row_checksums
from esftctl.runtime.address_space import CudaAddressSpace, HostAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import ExpertLayout, VirtualMoELayer, stack_experts

args = argparse.ArgumentParser()
args.add_argument("--small", action="store_true")
args.add_argument("--repeats", type=int, default=3)
args.add_argument("--dir", type=Path, default=Path("/dev/shm"))
a = args.parse_args()
cuda = torch.cuda.is_available() and not a.small
layers, per, hidden, inter = (4, 6, 256, 128) if a.small else (26, 6, 2048, 1408)
path = a.dir / "stage_cost.safetensors"
shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
started = time.perf_counter()
save_file({f"{l}.{e}.{w}": torch.randn(s).to(torch.bfloat16) for l in range(layers) for e in range(per)
           for w, s in shapes.items()}, str(path))
nbytes = path.stat().st_size
print(f"wrote {nbytes / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s; cuda {cuda}, "
      f"{len(os.sched_getaffinity(0))} CPUs")
infos = read_header(path)
stored = {l: [StoredExpert({w: StoredTensor(f"{l}.{e}.{w}", infos[f"{l}.{e}.{w}"]) for w in shapes})
              for e in range(per)] for l in range(layers)}


def read_then_stack() -> dict:
    return {l: stack_experts([ExpertWeights(*(s.part(w).read() for w in shapes)) for s in experts], pin=cuda)
            for l, experts in stored.items()}


def into_place() -> dict:
    return {l: stack_experts(experts, pin=cuda) for l, experts in stored.items()}


def checksums(rows: dict) -> None:
    for parts in rows.values():
        row_checksums(*parts, device=torch.device("cuda") if cuda else None).cpu()


if cuda:
    pool = PhysicalPagePool(0)
    on_device = ExpertLayout((2 * inter, hidden), (hidden, inter), lambda *parts: tuple(t.to("cuda") for t in parts))
    virtual = [VirtualMoELayer(64, hidden, inter, num_slots=1, experts_per_slot=per, dtype=torch.bfloat16,
                               make_space=lambda n: CudaAddressSpace(n, pool), layout=on_device) for _ in range(layers)]
else:
    virtual = [VirtualMoELayer(64, hidden, inter, num_slots=1, experts_per_slot=per, dtype=torch.bfloat16,
                               make_space=HostAddressSpace) for _ in range(layers)]


def layer_stage() -> None:
    staged = [layer.stage(stored[l]) for l, layer in enumerate(virtual)]
    assert all(t.is_pinned() == cuda for rows in staged for t in rows[:-1])


times: dict[str, list[float]] = {}
for _ in range(a.repeats):
    for name, way in (("read, then stack", read_then_stack), ("read into place", into_place)):
        t0 = time.perf_counter()
        rows = way()
        t1 = time.perf_counter()
        checksums(rows)
        t2 = time.perf_counter()
        times.setdefault(name, []).append(t1 - t0)
        times.setdefault(f"row checksums after {name}", []).append(t2 - t1)
        del rows
    t0 = time.perf_counter()
    layer_stage()
    times.setdefault("VirtualMoELayer.stage (convert on the device)" if cuda else "VirtualMoELayer.stage",
                     []).append(time.perf_counter() - t0)
for name, ts in times.items():
    print(f"{name:46s} median {statistics.median(ts):7.3f} s  min {min(ts):7.3f}  max {max(ts):7.3f}  "
          f"({nbytes / 1e9 / statistics.median(ts):5.2f} GB/s)")
for layer in virtual:
    layer.close()
path.unlink()
