"""Load runs through vLLM's own serving benchmark (`vllm bench serve`), so every number is one vLLM users publish.

Its `main` runs in this process (importing vLLM costs 10-30 s; a subprocess per run would pay it every time)
with the arguments the console command would parse: the random dataset (token ids drawn from the model's
tokenizer, re-aligned on the server), `--request-rate` with `--burstiness` (Gamma arrivals of a given
coefficient of variation, esftctl.bench.traffic; inf = all at once), greedy, ignore_eos, TTFT/TPOT/ITL/E2EL
with mean, median and p99, and `--save-detailed` for every request's own times. Which model each request names
is given request by request (`--lora-modules` as long as the run, `--lora-assignment round-robin`: request k
gets entry k), drawn by esftctl.bench.traffic, so that every server gets the same requests. `routes` sends
each model name to its own server (several merged copies side by side) by wrapping vLLM's request function:
the load generator, its clock and its trace stay one. Its result JSON is kept beside our own, and its printed
summary goes to a log.

From each run's per-request times we add what vLLM does not print: prefill speed (prompt tokens / TTFT) and
decode speed (tokens after the first / the time they took) per request, median and worst 1% (the 1st
percentile: of a speed, the low tail is the bad one), and the coefficient of variation of the gaps between
requests as sent (the arrivals' check).

And TTFT split by what the prompt met (prefill_modes): alone (no other request in flight from its arrival to its
first token) or beside others. Why: at 1-5 requests/s TTFT is two populations. With vLLM's default capture sizes
(up to 256 tokens at 128 sequences), a 256-token prompt prefilled alone replays a CUDA graph, one prefilled in a
step beside any decode (257 tokens or more) runs eagerly, two to four times as long on an H100
(benchmarks/lab/mixed_step.py measures both); which one a prompt gets depends on the other requests' decode
times, so a small TPOT difference moves a run's median and mean TTFT by far more. Each mode's
median compares like with like, and the alone share says how much the mixture moved.

And what such a step costs the requests decoding beside it (prefill_stalls): for each prompt prefilled beside
others, the longest gap between two tokens of any other request among the gaps that end between its arrival and
its first token, the step that prefilled it with their decodes as they saw it. Such a step, eager and bound by
the host, stalls the decodes beside it for tens of milliseconds in plain vLLM and esftctl alike
(benchmarks/lab/mixed_step.py); at 5 requests/s such steps are a large share of a run's streamed time, so they
move TPOT more than the decode steps do.

And the fastest tenth (floors), from the requests each slice keeps: the 10th percentile of the requests' TPOT and
of the TTFT of prompts prefilled alone. At 1-2 requests/s a run's medians move with its traffic and with the
machine: the median TPOT sits where per-request TPOTs jump from lone decoders to those that shared steps with a
prefill, and the same lone prompt's TTFT spreads within every run, so a run's median moves from sampling alone.
The fastest tenth is the requests that decoded alone and the prompts that met an idle engine: the same work in
both servers, so a fixed cost per step shows there undiluted.

And request by request (request_ratios): two servers' runs of one round send the same prompts at the same times,
so each request's TTFT and TPOT can be set against the same request's in plain vLLM's run, and the median of those
ratios carries an interval (esftctl.bench.slices.clustered_median). On one H200 esftctl's TPOT came to
1.000-1.004x plain vLLM's request by request, each 95% interval under 0.6% wide from one round, while plain
vLLM's runs of one round on two H200s differed by 0.1-1.0% in TPOT and by 1-8% in TTFT, and esftctl's TTFT moved
from 1.02x to 1.15x between runs of one server start (benchmarks/RESULTS.md, Adapters against the base): a run's
TTFT moves by several percent with its start, card and minute, which only more runs average.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from esftctl.bench.traffic import burstiness, gaps_cv

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 99)


@dataclass(frozen=True)
class Load:
    """One load-generator run's traffic."""

    rate: float  # requests per second; math.inf sends them all at once
    prompts: int
    input_len: int
    output_len: int
    seed: int = 0
    cv: float = 1.0  # coefficient of variation of the gaps between arrivals (1: Poisson)
    concurrency: int | None = None  # at most this many requests in flight (the microbenchmarks' batch)


def bench_args(url: str, *, model: str, tokenizer: Path, load: Load, models: list[str], result_dir: Path,
               result_file: str) -> list[str]:
    """The `vllm bench serve` command line of one run: `models` names each request's model in order (as long as
    the run), or is empty: every request to `model`."""
    if models and len(models) != load.prompts:
        raise ValueError(f"{len(models)} model names for {load.prompts} requests: give one per request")
    args = ["--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(load.prompts), "--request-rate", "inf" if math.isinf(load.rate) else str(load.rate),
            "--burstiness", repr(burstiness(load.cv)), "--seed", str(load.seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
            "--disable-tqdm"]
    if load.concurrency:
        args += ["--max-concurrency", str(load.concurrency)]
    return args + (["--lora-modules", *models, "--lora-assignment", "round-robin"] if models else [])


def run_load(url: str, *, model: str, tokenizer: Path, load: Load, models: list[str], result_dir: Path,
             name: str, routes: dict[str, str] | None = None) -> dict:
    """One run of vLLM's serving benchmark; its result dict (vLLM's keys), its printed output in NAME.log.
    `routes`: model name -> the base URL of the server that serves it (default: `url` serves every model)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(bench_args(url, model=model, tokenizer=tokenizer, load=load, models=models,
                                        result_dir=result_dir, result_file=f"{name}.json"))
    result_dir.mkdir(parents=True, exist_ok=True)
    with open(result_dir / f"{name}.log", "w") as log, contextlib.redirect_stdout(log), routed(routes):
        result = main(args)
    if result.get("failed"):
        raise RuntimeError(f"{name}: {result['failed']} of {load.prompts} requests failed "
                           f"(first error: {next((e for e in result.get('errors', []) if e), '?')})")
    return result


@contextlib.contextmanager
def routed(routes: dict[str, str] | None):
    """While it lasts, vLLM's OpenAI request function sends a request for model m to routes[m] (same path)."""
    if not routes:
        yield
        return
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    plain = funcs.ASYNC_REQUEST_FUNCS["openai"]

    async def to_its_server(request_func_input, *args, **kwargs):
        path = urllib.parse.urlsplit(request_func_input.api_url).path
        target = routes[request_func_input.model].rstrip("/") + path
        return await plain(dataclasses.replace(request_func_input, api_url=target), *args, **kwargs)

    funcs.ASYNC_REQUEST_FUNCS["openai"] = to_its_server
    try:
        yield
    finally:
        funcs.ASYNC_REQUEST_FUNCS["openai"] = plain


def summary(result: dict) -> dict:
    """The numbers we report from one vLLM result: throughput, each metric's mean, median and p99 (ms), the
    per-request prefill and decode speeds (median, worst 1%), and the arrivals' measured cv."""
    out = {"duration_s": result["duration"], "completed": result["completed"],
           "output_throughput": result["output_throughput"], "request_throughput": result["request_throughput"]}
    for m in METRICS:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            out[f"{stat}_{m}_ms"] = result[f"{stat}_{m}_ms"]
    return out | speeds(result)


def speeds(result: dict) -> dict:
    """From `--save-detailed`'s per-request lists: prefill tokens/s (prompt / TTFT), decode tokens/s (tokens after
    the first / their inter-token times), median and 1st percentile; the gaps' cv; total tokens."""
    ttfts, inputs = result.get("ttfts") or [], result.get("input_lens") or []
    outputs, itls = result.get("output_lens") or [], result.get("itls") or []
    prefill = [n / t for n, t in zip(inputs, ttfts) if t and t > 0]
    decode = [(n - 1) / sum(gaps) for n, gaps in zip(outputs, itls) if n > 1 and gaps and sum(gaps) > 0]
    out = {"total_input_tokens": result.get("total_input_tokens"),
           "total_output_tokens": result.get("total_output_tokens"),
           "arrival_cv": gaps_cv(result["start_times"]) if len(result.get("start_times") or []) > 2 else None}
    for what, values in (("prefill", prefill), ("decode", decode)):
        out[f"median_{what}_tps"] = float(np.median(values)) if values else None
        out[f"p1_{what}_tps"] = float(np.percentile(values, 1)) if values else None
    return out | prefill_modes(result) | prefill_stalls(result)


def alone(result: dict) -> list[bool]:
    """Per request: whether no other request was in flight (sent, last token not yet in) between its arrival and
    its first token, from `--save-detailed`'s start times, TTFTs and latencies (client clock). A failed request
    (TTFT 0) is in flight for no time and is never alone."""
    starts, ttfts = (np.asarray(result.get(k) or [], dtype=np.float64) for k in ("start_times", "ttfts"))
    latencies = np.asarray(latencies_of(result), dtype=np.float64)
    if not len(starts) == len(ttfts) == len(latencies):
        return []
    firsts, ends = starts + ttfts, starts + latencies
    overlap = (starts[None, :] < firsts[:, None]) & (ends[None, :] > starts[:, None])  # [i, j]: j in flight in i's
    np.fill_diagonal(overlap, False)
    return [bool(t > 0 and not row.any()) for t, row in zip(ttfts, overlap)]


def latencies_of(result: dict) -> list[float]:
    """Each request's latency (s): `--save-detailed`'s own where it has them, else its TTFT and inter-token
    latencies added up (vLLM 0.25's files keep no latencies; a streamed request's latency is its first token's
    time plus the gaps between its tokens)."""
    if result.get("latencies"):
        return list(result["latencies"])
    ttfts, itls = result.get("ttfts") or [], result.get("itls") or []
    return [t + sum(gaps or []) for t, gaps in zip(ttfts, itls)] if len(ttfts) == len(itls) else []


def prefill_modes(result: dict) -> dict:
    """TTFT by what each prompt met (the module says why): the share of requests prefilled alone, and the median
    TTFT (ms) of those alone and of those beside others (None where a mode has no request)."""
    ttfts = [t * 1000 for t in result.get("ttfts") or []]
    flags = alone(result)
    if not flags:
        return {"alone_share": None, "median_ttft_alone_ms": None, "median_ttft_beside_ms": None}
    by = {mode: [t for t, a in zip(ttfts, flags) if a == mode and t > 0] for mode in (True, False)}
    return {"alone_share": sum(flags) / len(flags),
            "median_ttft_alone_ms": float(np.median(by[True])) if by[True] else None,
            "median_ttft_beside_ms": float(np.median(by[False])) if by[False] else None}


def floors(requests: dict, output_len: int) -> dict:
    """The fastest tenth of a run (the module says why), from its kept requests (per_request): the 10th percentile
    of the requests' TPOT (ms a token after the first) and of the TTFT (ms) of those prefilled alone; None where a
    run kept no requests (slices written before runs kept them) or has none of a kind."""
    ttfts, latencies, flags = (requests.get(k) or [] for k in ("ttft_ms", "latency_ms", "alone"))
    tpots = [(lat - t) / (output_len - 1) for t, lat in zip(ttfts, latencies) if 0 < t < lat] if output_len > 1 else []
    lone = [t for t, a in zip(ttfts, flags) if a and t > 0]
    return {"p10_tpot_ms": float(np.percentile(tpots, 10)) if tpots else None,
            "p10_ttft_alone_ms": float(np.percentile(lone, 10)) if lone else None}


REQUEST_KINDS = ("ttft", "ttft_alone", "tpot")  # what request_ratios sets against the base's same request
SAME_SEND_S = 0.1  # two runs of one round send each request within this of each other (their clocks jitter by ms)


def request_ratios(requests: dict, base: dict, output_len: int, *, aligned: bool = False) -> dict:
    """Each request of a run (per_request) over the same request in the base's run of its round (the module says
    why): TTFT, TTFT where both servers prefilled the prompt alone, and TPOT (ms a token after the first); a
    request either server did not complete is left out (`aligned`: kept as None, one entry per request, in the
    order sent). Empty lists where either run kept no requests or the two did not send the same traffic (counts or
    sending times differ)."""
    starts, base_starts = requests.get("start_s") or [], base.get("start_s") or []
    if not starts or len(starts) != len(base_starts) or max(
            abs(a - b) for a, b in zip(starts, base_starts)) > SAME_SEND_S:
        return {k: [] for k in REQUEST_KINDS}
    out: dict[str, list] = {k: [] for k in REQUEST_KINDS}
    tokens = output_len - 1
    for t, lat, lone, bt, blat, blone in zip(requests["ttft_ms"], requests["latency_ms"], requests["alone"],
                                             base["ttft_ms"], base["latency_ms"], base["alone"]):
        done = 0 < t < lat and 0 < bt < blat
        ratios = {"ttft": t / bt if done else None, "ttft_alone": t / bt if done and lone and blone else None,
                  "tpot": (lat - t) / (blat - bt) if done and tokens > 0 else None}
        for kind, value in ratios.items():
            if value is not None or aligned:
                out[kind].append(value)
    return out


STALL_AFTER_S = 0.002  # a token of a step reaches the client within this of the others of that step


def prefill_stalls(result: dict) -> dict:
    """The median over prompts prefilled beside others of their stall (ms): the longest gap between two tokens of
    any other request that ends between the prompt's arrival and its first token (None without such prompts).
    With vLLM's asynchronous scheduling the step that prefills a prompt beside decodes ends one short decode step
    before the prompt's first token reaches the client (the long gap, then a short one)."""
    starts, ttfts, itls = result.get("start_times") or [], result.get("ttfts") or [], result.get("itls") or []
    if not starts or not len(starts) == len(ttfts) == len(itls):
        return {"median_stall_ms": None}
    times = [s + t + np.concatenate(([0.0], np.cumsum(gaps or []))) for s, t, gaps in zip(starts, ttfts, itls)]
    stalls = []
    for i, was_alone in enumerate(alone(result)):
        if was_alone or ttfts[i] <= 0:
            continue
        others = [t for j, t in enumerate(times) if j != i]
        worst = longest_gap(others, starts[i], starts[i] + ttfts[i] + STALL_AFTER_S)
        if worst > 0:
            stalls.append(worst * 1000)
    return {"median_stall_ms": float(np.median(stalls)) if stalls else None}


def longest_gap(streams: list, start: float, end: float) -> float:
    """The longest gap (s) between two consecutive token times of any stream among the gaps ending in (start,
    end], 0 without one: the stall of a prompt sent at `start` whose first token came STALL_AFTER_S before `end`
    (prefill_stalls, benchmarks/lab/mixed_step.py)."""
    worst = 0.0
    for t in streams:
        t = np.asarray(t, dtype=np.float64)
        ends = (t[1:] > start) & (t[1:] <= end)
        worst = max(worst, float(np.max(np.diff(t)[ends], initial=0.0)))
    return worst


def per_request(result: dict) -> dict:
    """A run's requests, in the order sent (the run's `drawn` names their adapters), compact enough to keep in a
    slice: start (s from the first), TTFT and latency (ms), and whether each was prefilled alone, for what the
    medians cannot tell (TTFT by adapter, by mode, over time)."""
    starts = result.get("start_times") or []
    first = min(starts, default=0.0)
    return {"start_s": [round(s - first, 4) for s in starts],
            "ttft_ms": [round(t * 1000, 3) for t in result.get("ttfts") or []],
            "latency_ms": [round(t * 1000, 2) for t in latencies_of(result)],
            "alone": alone(result)}
