"""ExpertWeave's microbenchmarks (5.3) on a running server, through vLLM's own load generator.

- Prefill: batch 1 (one request in flight), `micro_runs` requests of each prompt length, one output token each;
  the median TTFT.
- Decode: `decode_prompt`-token prompts (ExpertWeave: 1,024) decoding `decode_steps` tokens after the first
  (ExpertWeave: 128) at each batch size (requests in flight), `micro_runs` batches' worth; the median TPOT.
All requests go to one model (ExpertWeave: its gate-math adapter; here the first adapter, or the base), with
`loaded` adapters held by the server: on esftctl and multi-LoRA, for each count k of `micro_loaded` (largest
first), every adapter past the first k is unloaded before the k runs, so what is measured is the cost of holding
k adapters, not of using them. At batch 1 one adapter runs at a time, so the runtime's per-token work (rerouting)
and anything that grows with what is loaded shows, and nothing of reading other adapters' rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from esftctl.bench.conditions import Watch
from esftctl.bench.load import Load, run_load

ALL = "all"  # the key of a server's numbers when nothing is unloaded (the base, merged copies)


def microbench(url: str, *, model: str, tokenizer: Path, profile, out: Path, on_step: Callable[[str], None],
               loaded: Callable[[str, int], None] | None = None, available: int = 0) -> dict[str, dict]:
    """{adapters loaded (or "all"): {"ttft_ms": {length: median}, "tpot_ms": {batch: median}, "machine": the
    machine over those runs (esftctl.bench.conditions)}}; `loaded(url, k)` leaves k of the `available` adapters
    loaded (a count of `micro_loaded` above `available` is all of them)."""
    if loaded is None:
        return {ALL: _measure(url, model, tokenizer, profile, out, on_step, ALL)}
    results = {}
    for k in sorted({min(k, available) for k in profile.micro_loaded}, reverse=True):
        loaded(url, k)
        results[str(k)] = _measure(url, model, tokenizer, profile, out, on_step, f"{k} loaded")
    return results


def _measure(url: str, model: str, tokenizer: Path, profile, out: Path, on_step, what: str) -> dict:
    runs = profile.micro_runs

    def median(metric: str, load: Load, name: str) -> float:
        result = run_load(url, model=model, tokenizer=tokenizer, load=load, models=[],
                          result_dir=out / "vllm-micro", name=f"{model}_{what.replace(' ', '_')}_{name}")
        return result[f"median_{metric}_ms"]

    ttft, tpot = {}, {}
    with Watch() as machine:
        for length in profile.micro_lengths:
            on_step(f"microbenchmark {model}, {what}: TTFT, prompt {length}")
            ttft[str(length)] = median("ttft", Load(math.inf, runs, length, 1, seed=0, concurrency=1),
                                       f"ttft{length}")
        for batch in profile.micro_batches:
            on_step(f"microbenchmark {model}, {what}: TPOT, batch {batch}")
            load = Load(math.inf, runs * batch, profile.decode_prompt, profile.decode_steps + 1, seed=0,
                        concurrency=batch)
            tpot[str(batch)] = median("tpot", load, f"tpot{batch}")
    return {"ttft_ms": ttft, "tpot_ms": tpot, "machine": machine.result}
