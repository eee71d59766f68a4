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
Two more questions of a decode step at low load, where esftctl's steps took 0.10-0.13 ms more than plain vLLM's
on one H200 (2026-11-29, the grid's round 2 at 1 request/s; 1 adapter as much as 20):
- the GPU's share: 26 reroutes (one per MoE layer of DeepSeek-V2-Lite) captured in a CUDA graph, as a decode
  step replays them, against 26 aten adds of the same size (a trivial kernel node), timed with CUDA events over
  `--replays` replays, at 3 and 262 tokens;
- the host's share of the slots' copy (`EsftModel.set_token_adapters`, written when a step's requests change): the
  host time of `copy_(non_blocking=True)` of that many int32 slots from a pageable array (as today) and from a
  pinned one, issued while the stream is still busy with 5 ms of earlier work (`torch.cuda._sleep`). CUDA lets a
  pageable host-to-device copy wait for the stream ("the driver may synchronize with the stream", the runtime
  API's synchronization behaviour): a pageable copy that took about 5 ms here would, and then such a step would lose
  what asynchronous scheduling overlaps.
On an H200 (2026-11-29, benchmarks/data/serve/2026-11-29-h200-grid512-r2/launch_cost.log): a reroute node took
1.33 us at 3 tokens against an add's 0.88 (35 us a decode step), 2.68 us at 262; the pageable copy returned in 19 us
by the median (pinned: 13), so it does not wait for the stream.
Usage (device; needs only torch and Triton, no install): python3 benchmarks/lab/launch_cost.py
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


def graph_us_per_node(fn, nodes: int, replays: int) -> float:
    """GPU time per node of a CUDA graph of `nodes` calls of `fn`, by CUDA events over `replays` replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compiled and cached before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(nodes):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / nodes


def sleep_cycles(ms: float) -> int:
    """The `torch.cuda._sleep` cycles that keep the stream busy about `ms` (timed with CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def copy_host_us(tokens: int, pinned: bool, cycles: int) -> float:
    """Host time of the slots' copy issued behind `cycles` of GPU work on the same stream."""
    target = torch.full((8192,), -1, dtype=torch.int32, device="cuda")
    source = torch.arange(tokens, dtype=torch.int32) % 20
    if pinned:
        source = source.pin_memory()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    target[:tokens].copy_(source if pinned else torch.from_numpy(source.numpy()), non_blocking=True)
    host = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    assert torch.equal(target[:tokens].cpu(), source), "the copy differs"
    return host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=262)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--replays", type=int, default=2000, help="replays of each 26-node CUDA graph")
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

    layers = 26  # DeepSeek-V2-Lite's MoE layers: one reroute each per step
    for tokens in (3, args.tokens):
        step_ids = torch.randint(0, 64, (tokens, top_k), dtype=torch.int32, device="cuda")
        a, b = torch.zeros(tokens, top_k, device="cuda"), torch.empty(tokens, top_k, device="cuda")
        reroutes = graph_us_per_node(lambda: rr.reroute(step_ids, adapters, table, out=step_ids), layers, args.replays)
        adds = graph_us_per_node(lambda: torch.add(a, 1, out=b), layers, args.replays)
        print(f"in a CUDA graph, {tokens} tokens: reroute {reroutes:.2f} us a node, aten add {adds:.2f} us; "
              f"{layers} reroutes {reroutes * layers:.1f} us a step", flush=True)
    cycles = sleep_cycles(5.0)
    for tokens in (3, args.tokens):
        times = {kind: [copy_host_us(tokens, kind == "pinned", cycles) for _ in range(20)]
                 for kind in ("pageable", "pinned")}
        print(f"slots' copy of {tokens} tokens behind 5 ms of GPU work, host us (min / median / max): " + "; ".join(
            f"{kind} {min(t):.0f} / {statistics.median(t):.0f} / {max(t):.0f}" for kind, t in times.items()),
            flush=True)


if __name__ == "__main__":
    main()
