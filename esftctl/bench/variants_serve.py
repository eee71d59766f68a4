"""Serving M consolidated variants against what a user would run instead, measured in one run.

Up to four set-ups take the same traffic (esftctl.bench.turnaround: Poisson arrivals, each request for one of
the M variants uniformly, streamed, greedy, fixed output length):
- `esftctl serve --variants`: one server, the map's shared experts, each variant's misses and non-expert
  weights, one variant per engine step (its weights copied in before the step);
- `esftctl serve --variants --one-step`: the same server with the variants' requests in the same steps, each
  token taking its variant's copies of what differs; it may hold the sequences of M servers (M times
  `--max-num-seqs`), since it stands for them on the card;
- one plain vLLM server per variant, all running side by side on the machine (M engines, M copies of the
  model, M KV caches), started one after another: vLLM sizes its KV cache from the memory that grew on the card
  while it profiled, so engines profiling at once count each other's memory (on an H200 they found none left);
- one plain vLLM server that is restarted with another variant whenever the oldest waiting request wants
  one (whole-model swapping, the seed paper's time-sharing baseline; its first model is loaded before the run).
Each server is warmed up with one request per model before the traffic starts; starts and swaps are timed.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from esftctl.bench.turnaround import SETUPS, Fixed, Swapping, Traffic, run
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import request


def _warm(url: str, names: list[str]) -> None:
    for name in names:
        request(url, "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0.0},
                timeout=600)


def _scaled_seqs(engine_args: list[str], factor: int) -> list[str]:
    """engine_args with `--max-num-seqs` multiplied by factor (added, from vLLM's default of 256, if absent)."""
    args = list(engine_args)
    if "--max-num-seqs" in args:
        i = args.index("--max-num-seqs") + 1
        args[i] = str(int(args[i]) * factor)
    else:
        args += ["--max-num-seqs", str(256 * factor)]
    return args


def measure(variants: dict[str, Path], map_dir: Path, work: Path, traffic: Traffic, engine_args: list[str], *,
            setups: tuple[str, ...] = tuple(SETUPS), on_step: Callable[[str], None] = lambda msg: None) -> dict:
    """Serve `traffic` with each of `setups` (keys of SETUPS) in turn; the results by SETUPS' labels."""
    names = list(variants)
    out: dict[str, dict] = {}
    for key, one_step in (("consolidated", False), ("one-step", True)):
        if key not in setups:
            continue
        label = SETUPS[key]
        on_step(f"serving: starting esftctl serve --variants{' --one-step' if one_step else ''}")
        started = time.perf_counter()
        args = _scaled_seqs(engine_args, len(names)) if one_step else engine_args
        consolidated = plan(None, [], variants=map_dir, variant_names=names, port=free_port(), one_step=one_step,
                            state_dir=work / f"state-{key}", vllm_args=args)
        with Server(consolidated) as server:
            server.wait_ready(1800)
            ready = time.perf_counter() - started
            _warm(consolidated.url, names)
            on_step(f"serving: traffic through the {label} server")
            out[label] = {**run(traffic, Fixed({n: (consolidated.url, n) for n in names})), "ready_s": ready}

    if "own" in setups:
        out[SETUPS["own"]] = _own_servers(variants, work, traffic, engine_args, on_step)
    if "swapping" in setups:
        out[SETUPS["swapping"]] = _swapping(variants, work, traffic, engine_args, on_step)
    return {"traffic": {"models": names, "rate": traffic.rate, "requests": traffic.requests,
                        "output_len": traffic.output_len}, "setups": out}


def _plain(variants: dict[str, Path], work: Path, engine_args: list[str], name: str, label: str):
    return plan(variants[name], [], name=name, esft=False, port=free_port(),
                state_dir=work / f"state-{label}-{name}", vllm_args=engine_args)


def _own_servers(variants: dict[str, Path], work: Path, traffic: Traffic, engine_args: list[str],
                 on_step: Callable[[str], None]) -> dict:
    names = list(variants)
    on_step(f"serving: starting {len(names)} plain vLLM servers side by side, one after another")
    started = time.perf_counter()
    with ExitStack() as stack:
        plans = {n: _plain(variants, work, engine_args, n, "own") for n in names}
        for p in plans.values():
            stack.enter_context(Server(p)).wait_ready(1800)
        ready = time.perf_counter() - started
        for n, p in plans.items():
            _warm(p.url, [n])
        on_step("serving: traffic through one server per variant")
        return {**run(traffic, Fixed({n: (p.url, n) for n, p in plans.items()})), "ready_s": ready}


def _swapping(variants: dict[str, Path], work: Path, traffic: Traffic, engine_args: list[str],
              on_step: Callable[[str], None]) -> dict:
    names = list(variants)
    on_step("serving: whole-model swapping (one plain vLLM server, restarted per model)")
    current: dict[str, Server] = {}

    def swap(name: str) -> str:
        if current:
            current.pop("server").stop()
        on_step(f"serving: swapping in {name}")
        p = _plain(variants, work, engine_args, name, "swap")
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
    finally:
        if current:
            current["server"].stop()
    return {**result, "ready_s": ready, "swaps": router.swaps, "swap_s": router.swap_seconds / max(router.swaps, 1)}
