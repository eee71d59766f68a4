"""The grouping trade of issue 29 (item 3), modelled: decode steps simulated with esftctl's own grouping policy
and a step cost set by the expert rows the step reads; the side to measure on the device is side_by_side.py's.

Why: a step reads every expert row some token routes to, and each adapter's tokens read its copies where it
replaced an expert, so adapters add rows. `esftctl serve --group-adapters G` holds each step to G adapters. But a
request its step holds back waits the step out, and vLLM keeps a held running request in its batch (its KV cache,
its slot: esftctl.runtime.vllm.scheduling), so the step runs fewer tokens. vLLM's `--max-loras M` bounds the
adapters among running requests at admission instead: a queued request of an adapter not running waits for a
slot, and slots stay empty. `esftctl serve --admit-by-adapter S` leaves none empty: when requests queue for
slots, those of the adapters already running take them first (none passed over for more than S seconds), so the
running requests gather on fewer adapters. Which trade wins, and where? This steps one run's requests through
each policy (the grouping and admission ones are the server's own: esftctl.runtime.adapter_groups.AdapterGroups
and admission_order) beside plain vLLM's base on the same arrivals, one step taking
    fixed_ms + all_rows_ms x rows / E + prompt_ms x prompts,
rows from tpot_rows.py's closed form (uniform routing, bench serve's DeepSeek-sized bundles; a prompt's 256 tokens
read every row, and its adapter's copies), over bench serve's deepseek-v2-lite profile (256-token prompts, 128
tokens out, at most 128 sequences running, 256 requests at once at inf). The step's defaults are fitted to plain
vLLM's base on the H200 at inf (TPOT 9.56 ms with 64 sequences, which read every row; DeepSeek-V2-Lite's 28.8 GB
of routed experts at 4.8 TB/s is 6.0 ms; a 256-token prompt's 1.2 TFLOP at about 400 TFLOP/s is 3 ms). So fitted,
it gives esftctl ungrouped 1.149x the base's TPOT with 64 requests at once over 5 DeepSeek-sized adapters, where
that H200 measured 1.132x (benchmarks/RESULTS.md, 2026-11-23, when bench serve sent 64). Compute beyond the
prompts, vLLM's KV-cache bound and its host time are left out: a model to say where to measure, not a measurement.

Another card: --fixed-ms, --all-rows-ms and --prompt-ms (an H100's 3.35 TB/s reads the experts in 8.6 ms).
Usage: python benchmarks/lab/group_trade.py [--adapters 5] [--rate 5|inf] [--requests N] [--groups 2,4]
         [--admit 2,10] [--max-loras 2,4] [--max-seqs 128] [--fixed-ms 3.5 --all-rows-ms 6 --prompt-ms 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from tpot_rows import E, adapter_experts, rows

from esftctl.bench.serve import PROFILES
from esftctl.bench.serve_runs import Scenario
from esftctl.runtime.adapter_groups import AdapterGroups, Work, admission_order

PROFILE = PROFILES["deepseek-v2-lite"]  # bench serve's: 256-token prompts, 128 tokens out, 256 requests at inf
MAX_SEQS = int(PROFILE.engine_args[PROFILE.engine_args.index("--max-num-seqs") + 1])  # 128 there


@dataclass(frozen=True)
class StepCost:
    """One step's time (ms) from the rows it reads and the prompts it prefills."""

    fixed_ms: float = 3.5
    all_rows_ms: float = 6.0
    prompt_ms: float = 3.0
    input_len: int = PROFILE.input_len

    def ms(self, rows_read: float, prompts: int) -> float:
        return self.fixed_ms + self.all_rows_ms * rows_read / E + self.prompt_ms * prompts


@dataclass
class Request:
    arrive: float  # ms
    adapter: int | None  # None: the base
    first: float | None = None  # ms, the first token (the end of its prefill step)
    done: float | None = None
    tokens: int = 0


@dataclass(frozen=True)
class Policy:
    """How a server picks a step's requests: all (esftctl ungrouped, plain vLLM), `groups` adapters a step held to
    (esftctl --group-adapters, `wait` its --group-wait), `max_loras` adapters among running requests, or queued
    requests admitted by adapter, none passed over longer than `admit_ms` (esftctl --admit-by-adapter)."""

    label: str
    groups: int = 0
    wait: int = 8
    max_loras: int = 0
    admit_ms: float = 0.0


@dataclass
class Run:
    requests: list[Request]
    steps: int = 0
    excess: list[float] = field(default_factory=list)  # each step's rows over the base's for as many tokens, - 1


def traffic(adapters: int, rate: float, count: int, *, seed: int = 0, alpha: float = 1.0) -> list[Request]:
    """`count` requests: Poisson arrivals at `rate` a second (all at 0 when inf), adapters drawn as the grid draws
    them (Scenario.draw; None for each when `adapters` is 0)."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(count):
        arrivals.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate) * 1000
    drawn = Scenario("model", rate, adapters=adapters, alpha=alpha).draw(seed, count) or [None] * count
    return [Request(a, d) for a, d in zip(arrivals, drawn)]


def simulate(requests: list[Request], policy: Policy, *, output_len: int = PROFILE.output_len,
             max_seqs: int = MAX_SEQS, token_budget: int = 8192, cost: StepCost = StepCost(),
             adapters: int = 20) -> Run:
    """Step `requests` (fresh copies) through `policy` until every one has its `output_len` tokens: each step
    decodes the running requests it allows and prefills the arrived ones it admits (slots under `max_seqs`,
    prompts under `token_budget`), in arrival order, as vLLM does."""
    reqs = [Request(r.arrive, r.adapter) for r in requests]
    replaced = adapter_experts(max(adapters, 1))
    groups = AdapterGroups(most=policy.groups, wait=policy.wait) if policy.groups else None
    run, now, queue, running = Run(reqs), 0.0, list(reqs), []
    while queue or running:
        arrived = [r for r in queue if r.arrive <= now]
        if not running and not arrived:
            now = queue[0].arrive
            continue
        if groups:
            work = {id(r): Work(r.adapter, True) for r in running} | {id(r): Work(r.adapter) for r in arrived}
            allowed = groups.choose(work)
            decode = [r for r in running if r.adapter in allowed]
            candidates = [r for r in arrived if r.adapter in allowed]
        else:
            decode, candidates = list(running), arrived
        if policy.admit_ms and len(candidates) > 1:
            by_id = {id(r): r for r in candidates}
            per_adapter = Counter(r.adapter for r in running)
            candidates = [by_id[i] for i in admission_order([(id(r), r.adapter, now - r.arrive) for r in candidates],
                                                            per_adapter, wait=policy.admit_ms)]
        admit, lora = [], {r.adapter for r in running}
        for r in candidates:
            slots = max_seqs - len(running) - len(admit)
            budget = token_budget - len(decode) - cost.input_len * (len(admit) + 1)
            if slots <= 0 or budget < 0:
                break
            if policy.max_loras and r.adapter is not None and r.adapter not in lora:
                if len(lora - {None}) >= policy.max_loras:
                    continue
                lora.add(r.adapter)
            admit.append(r)
        counts: dict[int | None, int] = {}
        for r in decode:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
        tokens = sum(counts.values())
        for r in admit:
            counts[r.adapter] = counts.get(r.adapter, 0) + cost.input_len
        read = rows(counts, replaced)
        now += cost.ms(read, len(admit))
        run.steps += 1
        if tokens and not admit:
            run.excess.append(read / rows({None: tokens}, replaced) - 1)
        for r in decode:
            r.tokens += 1
            if r.tokens == output_len:
                r.done = now
                running.remove(r)
        for r in admit:
            r.first, r.tokens = now, 1
            queue.remove(r)
            running.append(r)
    return run


def numbers(run: Run, output_len: int) -> dict[str, float]:
    """TTFT and TPOT (ms), median and p99, TTFT's mean (all at once, the median lies between the first wave of
    prompts and the rest), output tok/s from the first arrival to the last finish, and the mean rows excess of the
    decode-only steps."""
    ttft = [r.first - r.arrive for r in run.requests]
    tpot = [(r.done - r.first) / (output_len - 1) for r in run.requests]
    span = max(r.done for r in run.requests) - min(r.arrive for r in run.requests)
    return {"ttft_mean": statistics.fmean(ttft), "ttft_p50": statistics.median(ttft),
            "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": statistics.median(tpot), "tpot_p99": float(np.percentile(tpot, 99)),
            "tok_s": len(run.requests) * output_len / span * 1000,
            "rows_x": 1 + statistics.fmean(run.excess) if run.excess else 1.0, "steps": run.steps}


def trade(adapters: int, rate: float, count: int, policies: list[Policy], *, seed: int = 0, **kw) -> dict[str, dict]:
    """Each policy's numbers on one run's traffic over `adapters`, and plain vLLM's on the same arrivals to the base
    ("plain"); each with its ratios to plain's ("x": TTFT, TPOT and tok/s)."""
    out_len = kw.get("output_len", PROFILE.output_len)
    plain = numbers(simulate(traffic(0, rate, count, seed=seed), Policy("plain"), adapters=adapters, **kw), out_len)
    out = {"plain": plain}
    load = traffic(adapters, rate, count, seed=seed)
    for p in policies:
        n = numbers(simulate(load, p, adapters=adapters, **kw), out_len)
        out[p.label] = n | {"x": {k: n[k] / plain[k] for k in ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_p50",
                                                                 "tpot_p99", "tok_s")}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=5, help="adapters the requests are drawn over (uniform)")
    parser.add_argument("--rate", type=float, default=float("inf"), help="requests a second (inf: all at once)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in the run (default: bench serve's, 256 at inf, else 60 s of arrivals)")
    parser.add_argument("--groups", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                        help="esftctl --group-adapters settings to model")
    parser.add_argument("--wait", type=int, default=8, help="their --group-wait")
    parser.add_argument("--max-loras", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                        help="vLLM --max-loras settings to model")
    parser.add_argument("--admit", type=lambda s: [float(x) for x in s.split(",")], default=[10.0],
                        help="esftctl --admit-by-adapter settings to model, seconds")
    parser.add_argument("--max-seqs", type=int, default=MAX_SEQS, help="vLLM's --max-num-seqs (bench serve's)")
    for name, default, what in (("fixed", StepCost.fixed_ms, "a step's time apart from its experts and prompts"),
                                ("all-rows", StepCost.all_rows_ms, "reading every routed expert of every layer once"),
                                ("prompt", StepCost.prompt_ms, "a prompt's compute")):
        parser.add_argument(f"--{name}-ms", type=float, default=default, help=f"ms of {what} (default: the H200's)")
    parser.add_argument("--json", action="store_true", help="the numbers as JSON instead of a table")
    args = parser.parse_args()
    if args.adapters < 1 or min(args.groups + args.max_loras + [args.wait, args.max_seqs], default=1) < 1:
        raise SystemExit("error: --adapters, --groups, --max-loras, --wait and --max-seqs take counts of 1 or more")
    if not all(0 < a < math.inf for a in args.admit):
        raise SystemExit("error: --admit takes seconds above 0")
    if not args.rate > 0 or (args.requests is not None and args.requests < 2):
        raise SystemExit("error: --rate must be above 0 and --requests at least 2")
    if min(args.fixed_ms, args.all_rows_ms, args.prompt_ms) < 0:
        raise SystemExit("error: --fixed-ms, --all-rows-ms and --prompt-ms take times of 0 or more")
    cost = StepCost(fixed_ms=args.fixed_ms, all_rows_ms=args.all_rows_ms, prompt_ms=args.prompt_ms)
    count = args.requests or (PROFILE.prompts if math.isinf(args.rate) else max(2, round(args.rate * 60)))
    policies = [Policy("esftctl"), *(Policy(f"esftctl, groups of {g}", groups=g, wait=args.wait) for g in args.groups),
                *(Policy(f"esftctl, admit by adapter {a:g} s", admit_ms=a * 1000) for a in args.admit),
                *(Policy(f"max-loras {m}", max_loras=m) for m in args.max_loras)]
    out = trade(args.adapters, args.rate, count, policies, max_seqs=args.max_seqs, cost=cost)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"modelled (not measured): {count} requests over {args.adapters} adapters at {args.rate:g} "
                    f"requests/s, TTFT and TPOT in ms; x: over plain vLLM's base on the same arrivals",
              title_justify="left")
    for col in ("policy", "TTFT", "TTFT p99", "TPOT", "TPOT p99", "tok/s", "TTFT x", "TTFT mean x", "TPOT x",
                "TPOT p99 x", "tok/s x", "rows x", "steps"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for label, n in out.items():
        x = n.get("x", {})
        t.add_row(label, *(f"{n[k]:.1f}" for k in ("ttft_p50", "ttft_p99")),
                  *(f"{n[k]:.2f}" for k in ("tpot_p50", "tpot_p99")), f"{n['tok_s']:.0f}",
                  *(f"{x[k]:.3f}" if k in x else "-"
                    for k in ("ttft_p50", "ttft_mean", "tpot_p50", "tpot_p99", "tok_s")),
                  f"{n['rows_x']:.3f}", str(n["steps"]))
    Console(width=180).print(t)


if __name__ == "__main__":
    main()
