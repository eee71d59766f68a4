"""Host time `esftctl serve --admit-by-adapter` adds to a scheduler step: the mixin putting vLLM's own waiting queue
(FCFSRequestQueue) in admission_order, once when it moves requests and once more when the queue is already in that
order. It runs only in steps with a free batch slot and two or more queued, and on the scheduler's thread, so it
adds to the step. Runs wherever vLLM imports (the CPU build here, the CUDA build on the device's host).
Usage: python benchmarks/lab/admit_cost.py [--queued 128,1000] [--adapters 5,20] [--json]"""
import argparse
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import RequestStatus

from esftctl.runtime.serve_config import ServeSettings
from esftctl.runtime.vllm.adapter_groups import AdapterGroupsMixin

SLOTS = 128  # bench serve's max_num_seqs


class Admitting(AdapterGroupsMixin):
    max_num_running_reqs, policy = SLOTS, SimpleNamespace(value="fcfs")


class Queued:
    """A request as the mixin reads it; hashed by identity, as vLLM's Request is."""

    def __init__(self, rid: str, lora: int, arrival: float):
        self.request_id, self.status, self.arrival_time = rid, RequestStatus.WAITING, arrival
        self.lora_request = SimpleNamespace(lora_int_id=lora) if lora else None


def cost(*, queued: int, adapters: int, free: int, reps: int) -> dict:
    """The fastest of `reps` runs, in ms: the queue moved (first come first served in) and already in order."""
    rng, now = random.Random(0), time.time()
    scheduler = Admitting()
    scheduler._init_groups(ServeSettings(base=Path("base"), admit_by_adapter=10.0), None)
    scheduler.running = [Queued(f"run{i}", rng.randrange(adapters + 1), now) for i in range(SLOTS - free)]
    arrivals = [Queued(f"q{i}", rng.randrange(adapters + 1), now - 5 + i * 1e-3) for i in range(queued)]
    moved, in_order = [], []
    for _ in range(reps):
        scheduler.waiting = FCFSRequestQueue(arrivals)
        for times in (moved, in_order):
            start = time.perf_counter()
            scheduler._admit_by_adapter()
            times.append(time.perf_counter() - start)
    return {"queued": queued, "adapters": adapters, "free": free,
            "moved_ms": 1e3 * min(moved), "in_order_ms": 1e3 * min(in_order), "reordered": scheduler.reordered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", default="128,1000", help="queue lengths to time (comma-separated)")
    parser.add_argument("--adapters", default="5,20", help="adapter counts (plus the base) to draw requests over")
    parser.add_argument("--free", type=int, default=4, help="free batch slots out of 128")
    parser.add_argument("--reps", type=int, default=100, help="runs per point; the fastest is kept")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = [cost(queued=q, adapters=a, free=args.free, reps=args.reps)
            for q in map(int, args.queued.split(",")) for a in map(int, args.adapters.split(","))]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("queued  adapters  moved ms  in order ms")
    for r in rows:
        print(f"{r['queued']:>6}  {r['adapters']:>8}  {r['moved_ms']:>8.3f}  {r['in_order_ms']:>11.3f}")


if __name__ == "__main__":
    main()
