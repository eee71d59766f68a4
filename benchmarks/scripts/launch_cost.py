"""Host time of one reroute launch, as an eager step pays it per MoE layer (issue 29.2).

On an H100 (2026-11-28, `mixed_step.py --profile`), vLLM's step that prefills a 256-token prompt beside six
decodes ran eagerly and was bound by the host: 80-100 ms of host time for 21 ms of kernels over 27 layers. In the
profiler's timeline, from the router's last launch to vLLM's next op, esftctl spent about 0.26 ms a layer where
plain vLLM spent 0.06 ms, most of it between the reroute's slice of the adapter ids and its kernel's launch
(Triton's JITFunction.run: binding and specializing nine arguments, a cache lookup, launch metadata). Unprofiled,
this measured the launch at 18 us, 9-11 us since (kernels/reroute.py): the profiler had inflated it about sevenfold.

This times, per call, with no profiler: the launch as it was (a slice of the adapter ids, then Triton's own
launch path), `reroute` as it is now (the whole buffer, Triton's launcher called directly after the first call),
and an aten op (`torch.add(..., out=)`) for the host's speed. The shapes are the mixed step's: 262 tokens, top 6,
a table of 21 rows (20 adapters and the base) by 64 + 153 experts. Calls go in batches of `--calls` with a
synchronize between batches (outside the timing); the GPU keeps up (each kernel takes about 2 us).
Usage (device; needs only torch and Triton, no install): python3 benchmarks/scripts/launch_cost.py
"""

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "reroute", Path(__file__).resolve().parents[2] / "kernels" / "reroute.py")
rr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rr)


def per_call_us(fn, calls: int, batches: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=262)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    experts, top_k, slots = 64 + 153, 6, 20
    table = torch.randint(0, experts, (slots + 1, experts), dtype=torch.int32, device="cuda")
    adapters = torch.randint(-1, slots, (8192,), dtype=torch.int32, device="cuda")  # the engine's planned buffer
    ids = torch.randint(0, 64, (args.tokens, top_k), dtype=torch.int32, device="cuda")
    want = rr.reroute_reference(ids, adapters[: args.tokens], table)
    n = ids.numel()
    grid = (max(1, -(-n // rr.BLOCK)),)

    def triton_path():  # as before 2026-11-28: a slice, then Triton's own launch
        rr._reroute_kernel[grid](ids, adapters[: ids.shape[0]], table, ids, n, top_k, table.shape[1],
                                 table.shape[0] - 1, BLOCK=rr.BLOCK)

    x, y = torch.zeros(args.tokens, top_k, device="cuda"), torch.empty(args.tokens, top_k, device="cuda")
    arms = {"aten add (host speed)": lambda: torch.add(x, 1, out=y),
            "slice + Triton's launch": triton_path,
            "reroute() now": lambda: rr.reroute(ids, adapters, table, out=ids)}
    for name, fn in arms.items():
        ids.copy_(want)  # in place, every call: the values do not matter for the time, only for the check below
        t = per_call_us(fn, args.calls, args.batches)
        print(f"{name:26s} per call: min {min(t):6.2f} us, median {statistics.median(t):6.2f} us, "
              f"max {max(t):6.2f} us ({args.batches} batches of {args.calls})", flush=True)
    fresh = torch.randint(0, 64, (args.tokens, top_k), dtype=torch.int32, device="cuda")
    got = rr.reroute(fresh, adapters, table)
    assert torch.equal(got, rr.reroute_reference(fresh, adapters[: args.tokens], table)), "fast path differs"
    print("fast path launches cached:", {str(k): v is not None for k, v in rr._launchers.items()})


if __name__ == "__main__":
    main()
