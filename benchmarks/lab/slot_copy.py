"""Does a step's slot copy wait for the GPU? The host time of `EsftModel.set_token_adapters`'s copy while the
stream is busy, from pageable memory (torch.from_numpy, what it did up to 2026-11-27) and from a pinned buffer.

Why: under vLLM's asynchronous scheduling the host prepares step N+1 while step N runs on the GPU. CUDA's API
notes say a host-to-device copy from pageable memory "may synchronize with the stream" to stage it; if it does,
every step whose slots change (each prefill, each change of the batch) waits there for the previous step's
forward, several milliseconds. This keeps the stream busy with a sleep kernel of about `--busy-ms` and times
the copy call on the host: a few microseconds means no wait, about `--busy-ms` means it waited.
Usage (GPU): python3 benchmarks/lab/slot_copy.py [--busy-ms 20] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _sleep_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that take about `ms` on this card (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def copy_call_ms(source: torch.Tensor, target: torch.Tensor, cycles: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # the previous step's forward, still running
        begin = time.perf_counter()
        target[: len(source)].copy_(source, non_blocking=True)
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=20.0, help="how long the stream stays busy per copy")
    parser.add_argument("--repeats", type=int, default=20, help="copies timed per size and kind")
    args = parser.parse_args()
    cycles = _sleep_cycles(args.busy_ms)
    target = torch.empty(16384, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: host time of one copy call while the stream is busy {args.busy_ms} ms")
    for n in (1, 8, 256, 2048, 8192, 16384):
        slots = np.arange(n, dtype=np.int32)
        for kind, source in (("pageable", torch.from_numpy(slots)), ("pinned", torch.from_numpy(slots).pin_memory())):
            times = copy_call_ms(source, target, cycles, args.repeats)
            print(f"{n:6d} slots ({4 * n:6d} B) {kind:8s}: median {statistics.median(times):7.3f} ms, "
                  f"max {max(times):7.3f} ms")


if __name__ == "__main__":
    main()
