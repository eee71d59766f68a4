"""Serving M consolidated variants against what a user would run instead, measured in one run.

Three set-ups take the same traffic (esftctl.bench.turnaround: Poisson arrivals, each request for one of the
M variants uniformly, streamed, greedy, fixed output length):
- `esftctl serve --variants`: one server, the map's shared experts, each variant's misses and non-expert
  weights, one variant per engine step;
- one plain vLLM server per variant, all running side by side on the machine (M engines, M copies of the
  model, M KV caches);
- one plain vLLM server that is restarted with another variant whenever the oldest waiting request wants
  one (whole-model swapping, the seed paper's time-sharing baseline; its first model is loaded before the run).
Each server is warmed up with one request per model before the traffic starts; starts and swaps are timed.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from esftctl.bench.turnaround import Fixed, Swapping, Traffic, run
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import request

SETUPS = ("consolidated", "one server per variant", "whole-model swapping")


def _warm(url: str, names: list[str]) -> None:
    for name in names:
        request(url, "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0.0},
                timeout=600)


def measure(variants: dict[str, Path], map_dir: Path, work: Path, traffic: Traffic, engine_args: list[str], *,
            on_step: Callable[[str], None] = lambda msg: None) -> dict:
    names = list(variants)
    out: dict[str, dict] = {}

    on_step("serving: starting esftctl serve --variants")
    started = time.perf_counter()
    consolidated = plan(None, [], variants=map_dir, variant_names=names, port=free_port(),
                        state_dir=work / "state-consolidated", vllm_args=engine_args)
    with Server(consolidated) as server:
        server.wait_ready(1800)
        ready = time.perf_counter() - started
        _warm(consolidated.url, names)
        on_step("serving: traffic through the consolidated server")
        out["consolidated"] = {**run(traffic, Fixed({n: (consolidated.url, n) for n in names})), "ready_s": ready}

    def plain(name: str, label: str):
        return plan(variants[name], [], name=name, esft=False, port=free_port(),
                    state_dir=work / f"state-{label}-{name}", vllm_args=engine_args)

    on_step(f"serving: starting {len(names)} plain vLLM servers side by side")
    started = time.perf_counter()
    with ExitStack() as stack:
        plans = {n: plain(n, "own") for n in names}
        servers = [stack.enter_context(Server(p)) for p in plans.values()]
        for s in servers:
            s.wait_ready(1800)
        ready = time.perf_counter() - started
        for n, p in plans.items():
            _warm(p.url, [n])
        on_step("serving: traffic through one server per variant")
        out["one server per variant"] = {**run(traffic, Fixed({n: (p.url, n) for n, p in plans.items()})),
                                         "ready_s": ready}

    on_step("serving: whole-model swapping (one plain vLLM server, restarted per model)")
    current: dict[str, Server] = {}

    def swap(name: str) -> str:
        if current:
            current.pop("server").stop()
        on_step(f"serving: swapping in {name}")
        p = plain(name, "swap")
        current["server"] = Server(p)
        current["server"].start()
        current["server"].wait_ready(1800)
        _warm(p.url, [name])
        return p.url

    try:
        started = time.perf_counter()
        first_url = swap(names[0])
        ready = time.perf_counter() - started
        router = Swapping(swap, loaded=names[0], url=first_url)
        result = run(traffic, router)
        out["whole-model swapping"] = {**result, "ready_s": ready, "swaps": router.swaps,
                                       "swap_s": router.swap_seconds / max(router.swaps, 1)}
    finally:
        if current:
            current["server"].stop()
    return {"traffic": {"models": names, "rate": traffic.rate, "requests": traffic.requests,
                        "output_len": traffic.output_len}, "setups": out}
