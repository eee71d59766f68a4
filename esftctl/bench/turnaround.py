"""Turnaround of mixed traffic for several models, where the model of a request decides where it goes.

vLLM's own benchmark (`vllm bench serve`, esftctl.bench.load) sends every request to one URL. Serving M
fine-tuned variants, a user's alternatives differ exactly there: one server for all (`esftctl serve
--variants`), one plain vLLM server per variant side by side (the request's model picks the server), or one
server that is restarted with another model whenever the next request wants one (the "time sharing" baseline
of the consolidation paper, ../seeds 004: a whole-model swap per miss). This client drives all three the same
way: requests arrive as a Poisson process (seeded), each names one of the models (uniformly, seeded) and a
prompt, is sent as a streamed completion (greedy, `ignore_eos`, a fixed number of tokens), and is timed as
vLLM's benchmark times it: TTFT (arrival to first token, so a swap's wait counts), TPOT ((last - first token)
/ (tokens - 1)), end-to-end latency, and request and token throughput over the whole run.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

STATS = ("mean", "median", "p99")
# The set-ups esftctl.bench.variants_serve serves M variants with, {option value: label in results} (here, where
# the CLI can name them cheaply).
SETUPS = {"consolidated": "consolidated", "one-step": "consolidated in one step", "own": "one server per variant",
          "swapping": "whole-model swapping"}


@dataclass(frozen=True)
class Traffic:
    models: list[str]
    rate: float  # requests per second
    requests: int
    prompts: list[str]
    output_len: int
    seed: int = 0

    def arrivals(self) -> list[tuple[float, str, str]]:
        """(seconds after the start, model, prompt) of every request."""
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for i in range(self.requests):
            out.append((t, rng.choice(self.models), self.prompts[i % len(self.prompts)]))
            t += rng.expovariate(self.rate)
        return out


class Fixed:
    """Every model always served: {model: (base URL, the name the server knows it by)}."""

    def __init__(self, targets: dict[str, tuple[str, str]]):
        self.targets = targets

    async def acquire(self, model: str, ticket: int) -> tuple[str, str]:
        return self.targets[model]

    def release(self, model: str) -> None:
        pass


class Swapping:
    """One server at a time, swapped per batch: the loaded model serves every request of it that waited when it
    was swapped in, and new ones while nobody waits for another model; once another model's request waits and
    the running ones have finished, `swap(model)` (blocking: stop the server, start one with that model, wait
    until it answers) loads the model of the oldest waiting request. No model waits more than one batch of each
    other model (strict arrival order, the paper's policy, would swap at almost every request)."""

    def __init__(self, swap: Callable[[str], str], loaded: str | None = None, url: str | None = None):
        self.swap, self.loaded, self.url = swap, loaded, url
        self.waiting: dict[int, str] = {}
        self.batch: set[int] = set()  # tickets waiting for the loaded model when it was swapped in
        self.running = 0
        self.swaps, self.swap_seconds = 0, 0.0
        self.changed = asyncio.Condition()

    async def acquire(self, model: str, ticket: int) -> tuple[str, str]:
        async with self.changed:
            self.waiting[ticket] = model
            while True:
                others_wait = any(m != self.loaded for m in self.waiting.values())
                if model == self.loaded and (ticket in self.batch or not others_wait):
                    break
                first_other = min((t for t, m in self.waiting.items() if m != self.loaded), default=None)
                if ticket == first_other and self.running == 0 and not self.batch & set(self.waiting):
                    start = time.perf_counter()
                    self.url = await asyncio.to_thread(self.swap, model)
                    self.loaded = model
                    self.batch = {t for t, m in self.waiting.items() if m == model}
                    self.swaps += 1
                    self.swap_seconds += time.perf_counter() - start
                    self.changed.notify_all()
                    break
                await self.changed.wait()
            self.batch.discard(ticket)
            del self.waiting[ticket]
            self.running += 1
            return self.url, model

    def release(self, model: str) -> None:
        self.running -= 1

        async def wake():
            async with self.changed:
                self.changed.notify_all()

        asyncio.ensure_future(wake())


async def _one(session, router, ticket: int, arrival: float, model: str, prompt: str, *, output_len: int,
               start: float) -> dict:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    url, name = await router.acquire(model, ticket)
    first = last = None
    tokens = 0
    body = {"model": name, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"{model}: HTTP {reply.status}: {(await reply.text())[:200]}")
            async for line in reply.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):  # a token, whatever its text (a special token decodes to ""), as vLLM's
                    # own benchmark times chunks
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
    finally:
        router.release(model)
    if first is None:
        raise RuntimeError(f"{model}: no tokens came back")
    return {"model": model, "ttft": first - sent, "e2el": last - sent, "tokens": tokens,
            "tpot": (last - first) / max(tokens - 1, 1), "arrival": arrival, "done": last - start}


async def _run(traffic: Traffic, router) -> list[dict]:
    import aiohttp

    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = [_one(session, router, i, t, m, p, output_len=traffic.output_len, start=start)
                for i, (t, m, p) in enumerate(traffic.arrivals())]
        return await asyncio.gather(*jobs)


def run(traffic: Traffic, router) -> dict:
    """Send the traffic through the router; per-request records and their summary (seconds -> ms)."""
    records = asyncio.run(_run(traffic, router))
    return {"summary": summarize(records), "requests": records}


def summarize(records: list[dict]) -> dict:
    makespan = max(r["done"] for r in records)
    out = {"requests": len(records), "duration_s": makespan, "request_throughput": len(records) / makespan,
           "output_throughput": sum(r["tokens"] for r in records) / makespan}
    for metric in ("ttft", "tpot", "e2el"):
        values = sorted(r[metric] * 1000 for r in records)
        out[f"mean_{metric}_ms"] = statistics.fmean(values)
        out[f"median_{metric}_ms"] = statistics.median(values)
        out[f"p99_{metric}_ms"] = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    return out
