"""ExpertWeave's load on plain vLLM and esftctl side by side on one card, the runs alternated (issue 29.1, TTFT).

Why: the grid (`esftctl bench serve`) starts one server at a time and pairs each run with plain vLLM's run of the
same traffic on the same card, minutes apart. That resolved TPOT (esftctl 1.000-1.004x plain vLLM's request by
request, H200, 2026-12-04) but not TTFT: esftctl's runs of one server start gave 1.02x to 1.15x with no pattern in
the adapter count, and plain vLLM's runs of one round on two cards differed by 1-8% (benchmarks/RESULTS.md,
twenty-eighth session). A run's TTFT moves with its card, its server start and its minute by more than the 3%
target. Here both servers are up at once on one card, `bench serve`'s memory share split so that each keeps the
same room for weights and KV cache beside esftctl's adapter experts (esftctl.bench.serve.split_memory), and each
round sends the same traffic (vLLM's seed for prompts and arrivals, S-LoRA's shares drawn for the adapters) to
plain vLLM, then esftctl, then plain vLLM again. Only one server has load at a time. So esftctl is set against
plain vLLM runs just before and just after it, and plain vLLM's second run over its first is the yardstick of
what a minute moves, in the same table. What it cannot take out: each arm is one server start, and Inductor's autotuned
picks, drawn per process, ride with it (two plain vLLM starts differed by 0.3-1.4% of a step's GPU time on an H200,
benchmarks/RESULTS.md, twenty-sixth session), so a difference that small needs another start to tell.

Ratios are request by request (esftctl.bench.load.request_ratios): each request's TTFT, TTFT where both servers
prefilled it alone, and TPOT, over the same request in the plain run. esftctl's ratios pool both plain runs of its
round. Each is the median with a 95% interval over rounds, then requests (esftctl.bench.slices.clustered_median).
Each run also records the machine's state over it (esftctl.bench.conditions: the card's clocks and slowdown
reasons, the host's steal), shown per arm in a second table: if a minute moves TTFT, the machine may say why. And
it records where TTFT went inside each server, from vLLM's own histograms (serve_runs.server_times): waiting to be
scheduled, vLLM's prefill interval (scheduled to first token), the API server's share, and what lies outside the
server (the client's TTFT less vLLM's), shown per arm in a third table. In the grid's round 0 with the fold (H200,
2026-12-04), where a run's TTFT was 1.15x plain vLLM's, 2.45 of its 3.7 ms sat in the prefill interval, and its
prompts that met an idle server were 1.17x (benchmarks/RESULTS.md, thirtieth session): side by side, this says
whether such an excess is the engine's step or the server around it.
Writes OUT/side_by_side.json (every run's requests, machine and server times) and prints the three tables.
Usage (device, after ../shared/gpu/README.md's install; about 7 min for the base, the adapters and the two
starts, then 3 x (duration + 3) s a rate and round):
  bash benchmarks/lab/background.sh start side "PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3
    benchmarks/lab/side_by_side.py --out /tmp/side --rates 1,2,5 --rounds 3 --budget 700"
  bash benchmarks/lab/background.sh wait side 240 /tmp/side/side_by_side.json   (again until it ends; short
    waits, since a machine lost during one brings nothing of it back)
It needs about 97 GiB with 20 adapters, so an H200 (on an H100, `esftctl bench serve` has the same settings as
servers that each have the card alone: benchmarks/serve-bench/README.md's third command). An 80 GB H100 holds
two bases and 5 adapters' experts with `--adapters 5 --share 0.95`: by arithmetic, 3.6 GiB left to each server
past its weights (75.6 GiB, less 9.5 for the experts, halved, less the base's 29.4). A smoke run on vLLM's CPU
build: `--model tiny --adapters 2 --rates 4 --duration 2 --rounds 1`.
esftctl runs here in vLLM's first-come-first-served order (`--admit-by-adapter 0`), as in every run kept before
its default became admitting by adapter (2026-12-06); `--admit-by-adapter 10` adds the default as a setting.
`--group-adapters 0,G` measures esftctl ungrouped, then served with `esftctl serve --group-adapters G --group-wait
W` (at most G adapters a step, esftctl.runtime.adapter_groups): issue 29's lever for the rows adapters add. Each
setting is a server of its own, started in turn beside the one plain vLLM server and set against it the same way,
its runs in OUT/side_by_side-groups-G.json with what the scheduler did (steps, requests held) under "groups". So
the settings share plain vLLM's start, and each has its own yardstick (plain again / plain). At 5 requests/s on an
H100 with 5 adapters: `--rates 5 --rounds 3 --group-adapters 0,2`, about 7 min for the starts, then 5 min a
setting (its start and three rounds). `--rates 5,inf` adds the load where requests queue (all at once), and
`--admit-by-adapter S` one more setting, `esftctl serve --admit-by-adapter S` (queued requests of the adapters
already running admitted first; in OUT/side_by_side-admit-S.json), and `--max-loras K` one more, esftctl under
vLLM's own bound at admission, at most K adapters among the running requests (in OUT/side_by_side-max-loras-K.json;
issue 29 asks the trade set against it). On an H100 at `--share 0.95` plain vLLM's
engine failed every request of its first run at inf (256 at once, 2026-12-06), where it had served 16 at once
in its warm-up; on the CPU build the same run passes. A run that fails now prints each server's first ERROR
lines (serve_runs.failures_explained); until its cause is known, run inf on an H200. There (2026-12-06, 5 adapters,
`--rates inf --rounds 3 --group-adapters 0,2 --admit-by-adapter 10`) every run completed: admitted by adapter,
esftctl's throughput was 0.958x plain vLLM's against 0.912x in vLLM's order and 0.691x in groups of 2.
Last, a trade table over the settings, in the terms issue 29 asks for: TTFT and TPOT median and p99 and output
tok/s, and TTFT's mean (all at once, the median lies between the first wave of prompts and the rest), each arm's
and esftctl's over plain vLLM's a round at a time. `--report OUT` prints every table again from the JSON files,
nothing started.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from ttft_alone import arm_plan

from esftctl.bench import serve_models
from esftctl.bench.conditions import Watch
from esftctl.bench.load import REQUEST_KINDS as KINDS
from esftctl.bench.load import Load, per_request, request_ratios
from esftctl.bench.serve import MEMORY_FLAG, PROFILES, split_memory, utilization, with_flag
from esftctl.bench.serve_report import interval, number, percent
from esftctl.bench.serve_runs import (
    Scenario,
    failures_explained,
    kv_cache_tokens,
    runner,
    server_means,
    server_times,
    warm_up,
)
from esftctl.bench.slices import clustered_median
from esftctl.errors import EsftError
from esftctl.jsonfile import read_json
from esftctl.runtime.adapter_groups import stats_file
from esftctl.serve import Server


def round_runs(run: dict[str, Callable], scenario: Scenario, *, names: list[str], profile, rnd: int,
               urls: dict[str, str]) -> dict[str, dict]:
    """One round of one scenario: plain vLLM, esftctl, plain vLLM again, the same traffic each time (vLLM's seed
    and the grid's draw of adapters, Scenario.draw, kept as esftctl's "drawn"); each run's kept requests
    (load.per_request), the machine's state over it ("machine": esftctl.bench.conditions) and where its TTFT went
    ("server": server_split) by arm.
    `run`: each server's serve_runs.runner; `urls`: each server's address, for its /metrics."""
    count = profile.requests(scenario.rate)
    load = Load(scenario.rate, count, profile.input_len, profile.output_len, seed=rnd, cv=profile.cv)
    drawn = scenario.draw(rnd, count)
    adapters = [names[i] for i in drawn]
    out = {}
    for arm, server, models in (("plain", "plain", []), ("esftctl", "esftctl", adapters), ("plain again", "plain", [])):
        before = server_times([urls[server]])
        with Watch() as machine:
            raw = run[server](f"{arm} {scenario.name} r{rnd}", load, models)
        out[arm] = per_request(raw) | {"machine": machine.result,
                                       "server": server_split(server_means(before, server_times([urls[server]])),
                                                              raw.get("mean_ttft_ms"))}
    out["esftctl"]["drawn"] = drawn  # each request's adapter, by index into the served names (tpot_rows.py reads it)
    return out


def server_split(means: dict[str, float | None], client_ttft_ms: float | None) -> dict[str, float | None]:
    """A run's mean TTFT (ms) cut where it went: vLLM's queue and prefill interval (serve_runs.server_means), the
    API server's share (vLLM's TTFT less the two) and what lies outside the server (the client's less vLLM's)."""
    queue, prefill, ttft = (means.get(f"server_{k}_ms") for k in ("queue", "prefill", "ttft"))
    return {"ttft_ms": client_ttft_ms, "queue_ms": queue, "prefill_ms": prefill,
            "api_ms": None if None in (ttft, queue, prefill) else ttft - queue - prefill,
            "outside_ms": None if None in (client_ttft_ms, ttft) else client_ttft_ms - ttft}


def summarize(rounds: list[dict[str, dict]], output_len: int) -> dict[str, dict]:
    """esftctl over plain vLLM (both plain runs of each round pooled) and plain vLLM's second run over its first:
    each kind's median with its interval (slices.clustered_median), and the requests paired."""
    pairs = {"esftctl / plain": [("esftctl", "plain"), ("esftctl", "plain again")],
             "plain again / plain": [("plain again", "plain")]}
    out = {}
    for label, which in pairs.items():
        groups: dict[str, list[list[float]]] = {k: [] for k in KINDS}
        for runs in rounds:
            pooled = {k: [] for k in KINDS}
            for arm, base in which:
                for kind, values in request_ratios(runs[arm], runs[base], output_len).items():
                    pooled[kind] += values
            for kind in KINDS:
                groups[kind].append(pooled[kind])
        out[label] = {kind: clustered_median(groups[kind]) for kind in KINDS}
        out[label]["pairs"] = sum(len(g) for g in groups["ttft"])
    return out


ARMS = ("plain", "esftctl", "plain again")  # a round's runs, in the order they are sent
MACHINE = ("gpu_sm_mhz", "gpu_sm_mhz_p10", "gpu_util", "gpu_idle_share", "gpu_slowdown_share", "host_steal")
SERVER = ("ttft_ms", "queue_ms", "prefill_ms", "api_ms", "outside_ms")


def arm_medians(rounds: list[dict[str, dict]], record: str, keys: tuple[str, ...]) -> dict[str, dict]:
    """Each arm's median over rounds of `keys` in its runs' `record` (None where no run has the key)."""
    out = {}
    for arm in ARMS:
        runs = [r[arm].get(record) or {} for r in rounds]
        out[arm] = {k: statistics.median(v) if (v := [m[k] for m in runs if m.get(k) is not None]) else None
                    for k in keys}
    return out


def machine(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each arm's machine over its runs (esftctl.bench.conditions): the median over rounds of MACHINE's keys."""
    return arm_medians(rounds, "machine", MACHINE)


def where(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Where each arm's TTFT went (server_split): the median over rounds of SERVER's keys."""
    return arm_medians(rounds, "server", SERVER)


TRADE = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "tok_s")


def completed(requests: dict) -> list[tuple[float, float, float]]:
    """A run's completed requests from its kept ones (load.per_request): (sent s, TTFT ms, latency ms) of each whose
    first token came, before its last."""
    return [(s, t, lat) for s, t, lat in zip(requests["start_s"], requests["ttft_ms"], requests["latency_ms"])
            if 0 < t < lat]


def run_numbers(requests: dict, output_len: int) -> dict[str, float | None]:
    """A run's aggregates from its requests (load.per_request), what issue 29's trade is told in: TTFT and TPOT (ms
    a token after the first), median and p99 (linear, as vLLM's), TTFT's mean, and output tokens a second from the
    first send to the last finish. None where no request completed. The mean, because all at once, past
    --max-num-seqs, the median lies between the first wave of prompts and the rest, one or two requests deciding it
    (benchmarks/RESULTS.md, 2026-12-06, forty-second session)."""
    done = completed(requests)
    if not done:
        return dict.fromkeys(TRADE)
    ttft = [t for _, t, _ in done]
    tpot = [(lat - t) / max(output_len - 1, 1) for _, t, lat in done]
    span = max(s + lat / 1000 for s, _, lat in done) - min(s for s, _, _ in done)
    return {"ttft_mean": statistics.fmean(ttft), "ttft_p50": statistics.median(ttft),
            "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": statistics.median(tpot), "tpot_p99": float(np.percentile(tpot, 99)),
            "tok_s": len(done) * output_len / span if span > 0 else None}


def trade(rounds: list[dict[str, dict]], output_len: int) -> dict[str, dict]:
    """A setting's trade at one rate: plain vLLM's numbers (run_numbers, the mean of its two runs in a round) and
    esftctl's, medians over rounds; and esftctl's over plain's, a round at a time, as [median, lowest, highest]
    over rounds (None where either lacks the number)."""
    per_round = []
    for runs in rounds:
        arms = {arm: run_numbers(runs[arm], output_len) for arm in ARMS}
        plain = {k: None if None in (a := (arms["plain"][k], arms["plain again"][k])) else sum(a) / 2 for k in TRADE}
        per_round.append({"plain": plain, "esftctl": arms["esftctl"]})
    out = {arm: {k: statistics.median(v) if (v := [r[arm][k] for r in per_round if r[arm][k] is not None]) else None
                 for k in TRADE}
           for arm in ("plain", "esftctl")}
    ratios = {k: [r["esftctl"][k] / r["plain"][k] for r in per_round if r["esftctl"][k] and r["plain"][k]]
              for k in TRADE}
    out["esftctl / plain"] = {k: [statistics.median(v), min(v), max(v)] if v else None for k, v in ratios.items()}
    return out


def trade_table(results: list[dict]):
    """Every setting's trade (settle's "trade") by rate: plain vLLM, esftctl and esftctl over plain."""
    from rich.table import Table

    t = Table(title="the trade by setting: TTFT's mean, TTFT and TPOT (ms), median and p99, output tok/s from first "
                    "send to last finish; plain vLLM's two runs a round averaged, medians over rounds; esftctl / "
                    "plain a round at a time, median over rounds with its lowest and highest", title_justify="left")
    for col in ("setting", "rate", "arm", "TTFT mean", "TTFT", "TTFT p99", "TPOT", "TPOT p99", "tok/s"):
        t.add_column(col, justify="left" if col in ("setting", "arm") else "right")
    for result in results:
        label = setting(result).strip(" ()").removeprefix("esftctl ") or "vLLM's order"
        for rate, arms in result.get("trade", {}).items():
            for arm, m in arms.items():
                cells = [ranged(m[k]) if arm == "esftctl / plain" else number(m[k], ".0f" if k == "tok_s" else ".2f")
                         for k in TRADE]
                t.add_row(label, f"{rate} rps", arm, *cells)
    return t


def ranged(m: list[float] | None) -> str:
    """[median, lowest, highest] over rounds as a cell: the median alone where the rounds agree (or there is one)."""
    return "-" if not m else f"{m[0]:.3f}" if m[1] == m[2] else f"{m[0]:.3f} [{m[1]:.3f}-{m[2]:.3f}]"


def table(summary: dict[float, dict[str, dict]], rounds: int, setting: str = ""):
    from rich.table import Table

    t = Table(title=f"side by side on one card{setting}, {rounds} round(s) a rate: request by request, median [95%]",
              title_justify="left")
    for col in ("rate", "ratio", "pairs", "TTFT x", "TTFT x, both alone", "TPOT x"):
        t.add_column(col, justify="left" if col == "ratio" else "right")
    for rate, by in summary.items():
        for label, s in by.items():
            t.add_row(f"{rate:g} rps", label, str(s["pairs"]), *(interval(s[k]) for k in KINDS))
    return t


def arm_table(title: str, by_rate: dict[float, dict[str, dict]], cells: dict[str, tuple[str, Callable, str]]):
    """A line per rate and arm; each column's cell is (key, formatter, spec): the formatter (serve_report.number or
    percent) given the arm's median of the key (arm_medians)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("rate", "arm", *cells):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for rate, arms in by_rate.items():
        for arm, m in arms.items():
            t.add_row(f"{rate:g} rps", arm, *(fmt(m[key], spec) for key, fmt, spec in cells.values()))
    return t


def machine_table(machines: dict[float, dict[str, dict]]):
    return arm_table("the machine over each arm's runs (esftctl.bench.conditions), medians over rounds: the SM clock's "
                     "mean and 10th percentile, how busy nvidia-smi found the GPU (the time a kernel ran: one that "
                     "waits on its host is less busy for the same work), the shares of its samples idle or slowed "
                     "down, the host's steal", machines,
                     {"SM MHz": ("gpu_sm_mhz", number, ".0f"), "SM p10": ("gpu_sm_mhz_p10", number, ".0f"),
                      "GPU busy %": ("gpu_util", number, ".0f"), "idle": ("gpu_idle_share", percent, ".1f"),
                      "slowed": ("gpu_slowdown_share", percent, ".1f"),
                      "steal": ("host_steal", percent, ".1f")})


def where_table(splits: dict[float, dict[str, dict]]):
    return arm_table("where each arm's TTFT went, ms (means over a run's requests, medians over rounds): the client's "
                     "TTFT, then from vLLM's histograms waiting to be scheduled, the prefill interval (scheduled to "
                     "first token), the API server's share, and what lies outside the server", splits,
                     {col: (key, number, ".2f")
                      for col, key in zip(("TTFT", "queue", "prefill", "API server", "outside"), SERVER)})


def say(message: str) -> None:
    """A line of progress with the time of day: the log of a background run says how long each phase took."""
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


MIN_ROOM = 2 << 30  # bytes a server needs past its weights and adapters: activations, CUDA graphs, KV cache


def check_room(engine_args: dict[str, list[str]], aside: dict[str, int], weights: int, *, card: int) -> None:
    """Refuse, before any server starts, a split that leaves a server under MIN_ROOM past the base's weights and its
    set-aside (20 adapters on an 80 GB card: both bases and their experts do not fit; the CUDA build only, whose
    engine arguments carry a share)."""
    for arm, args in engine_args.items():
        if MEMORY_FLAG not in args:
            continue
        room = utilization(args) * card - weights - aside[arm]
        if room < MIN_ROOM:
            raise SystemExit(f"side_by_side: {arm} would have {room / 2**30:.1f} GiB past the base's "
                             f"{weights / 2**30:.1f} GiB and {aside[arm] / 2**30:.1f} GiB of adapters on this "
                             f"{card / 2**30:.1f} GiB card (needs {MIN_ROOM >> 30} GiB): fewer --adapters, a larger "
                             f"--share or a larger card")


def card_bytes() -> int:
    """The GPU's memory (0 on vLLM's CPU build, whose engine arguments carry no memory share)."""
    import torch

    return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0


class Setting(NamedTuple):
    """One way esftctl is served here: ungrouped in vLLM's first-come-first-served order (both 0: `esftctl serve
    --admit-by-adapter 0`, esftctl's default before 2026-12-06, so the kept runs compare), `esftctl serve
    --group-adapters group` (in vLLM's order too), `--admit-by-adapter admit` (seconds; 10 is esftctl's
    default), or vLLM's `--max-loras max_loras` below the adapter count (in vLLM's order)."""

    group: int = 0
    admit: float = 0.0
    max_loras: int = 0

    def flags(self, wait: int | str | None) -> str:
        """The setting as esftctl's flags in a title: ` (esftctl --group-adapters G --group-wait W)`,
        ` (esftctl --admit-by-adapter S)`, ` (esftctl --max-loras K)`, or nothing ungrouped."""
        if self.group:
            return f" (esftctl --group-adapters {self.group} --group-wait {wait})"
        if self.max_loras:
            return f" (esftctl --max-loras {self.max_loras})"
        return f" (esftctl --admit-by-adapter {self.admit:g})" if self.admit else ""


def out_file(out: Path, setting: Setting) -> Path:
    """Where one esftctl setting's runs go: side_by_side.json ungrouped, side_by_side-groups-G.json grouped,
    side_by_side-admit-S.json admitted by adapter, side_by_side-max-loras-K.json under vLLM's --max-loras."""
    if setting.group:
        return out / f"side_by_side-groups-{setting.group}.json"
    if setting.max_loras:
        return out / f"side_by_side-max-loras-{setting.max_loras}.json"
    return out / (f"side_by_side-admit-{setting.admit:g}.json" if setting.admit else "side_by_side.json")


def measure(run: dict[str, Callable], urls: dict[str, str], *, args, served, profile, result: dict,
            path: Path) -> dict[float, list]:
    """esftctl's warm-up, then its rounds against plain vLLM (round_runs), each rate's runs written to `path` as
    they end; `result` is the JSON so far (arguments, engine arguments)."""
    scenarios = [Scenario(f"{args.adapters} adapters @ {rate:g} rps", rate, adapters=args.adapters, alpha=args.alpha)
                 for rate in args.rates]
    # the grid's warm-up: every name once, then the busiest rate paced (serve_runs.warm_up says why)
    warm_up(run["esftctl"], "esftctl", scenarios, names={"grid": served.grid}, profile=profile, on_step=say)
    ready, done = time.monotonic(), {rate: [] for rate in args.rates}
    for rnd in range(args.rounds):
        if time.monotonic() - ready > args.budget:
            say(f"budget spent after {rnd} round(s)")
            break
        for rate, scenario in zip(args.rates, scenarios):
            say(f"round {rnd} at {rate:g} rps")
            done[rate].append(round_runs(run, scenario, names=served.grid, profile=profile, rnd=rnd, urls=urls))
            result["rounds"] = {f"{r:g}": runs for r, runs in done.items()}
            path.write_text(json.dumps(result))
    return done


def settle(done: dict[float, list], *, result: dict, output_len: int, stats: Path | None) -> None:
    """One esftctl setting's summary, machine, TTFT split and trade (trade) into `result`; a grouped server's
    scheduler statistics (`stats`) kept too (the server writes them at most once a second while it steps, so the
    last second's steps may be missing)."""
    done = {rate: runs for rate, runs in done.items() if runs}
    for key, of in (("summary", lambda runs: summarize(runs, output_len)), ("machine", machine), ("where", where),
                    ("trade", lambda runs: trade(runs, output_len))):
        result[key] = {f"{r:g}": of(runs) for r, runs in done.items()}
    if stats is not None and stats.is_file():
        result["groups"] = read_json(stats)


def setting_of(result: dict) -> Setting:
    """A setting's JSON's Setting (its arguments kept as strings; runs before a setting had its flag had none)."""
    args = result["args"]
    return Setting(int(args.get("group_adapters", "0")), float(args.get("admit_by_adapter", "0")),
                   int(args.get("max_loras", "0")))


def setting(result: dict) -> str:
    """How esftctl was served in a setting's JSON, as Setting.flags."""
    return setting_of(result).flags(result["args"].get("group_wait"))


def show(result: dict) -> None:
    """One setting's tables (settle's records), printed."""
    if not result.get("summary"):
        return
    rounds = max(len(v) for v in result["rounds"].values())
    by_rate = {key: {float(r): v for r, v in result[key].items()} for key in ("summary", "machine", "where")}
    print_tables(table(by_rate["summary"], rounds, setting(result)), machine_table(by_rate["machine"]),
                 where_table(by_rate["where"]))
    if "groups" in result:
        say(f"the grouping scheduler over the runs: {json.dumps(result['groups'])}")


def print_tables(*tables) -> None:
    from rich.console import Console

    Console(width=180).print(*tables)


def reread(paths: list[Path]) -> list[dict]:
    """`--report`: each setting's JSON (a file, or each .json in a folder: --out's, or the ones kept), its records
    settled again from its rounds (a run before the trade table kept none), ungrouped first; SystemExit with one
    line naming the file where one is not side_by_side's."""
    files = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    if not files:
        raise SystemExit(f"error: {', '.join(map(str, paths))}: no .json files")
    results = []
    for path in files:
        try:
            result = read_json(path)
            done = {float(r): runs for r, runs in result["rounds"].items()}
            settle(done, result=result, output_len=PROFILES[result["args"]["model"]].output_len, stats=None)
        except EsftError as e:
            raise SystemExit(f"error: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError, statistics.StatisticsError) as e:
            raise SystemExit(f"error: {path}: not side_by_side.py's JSON ({type(e).__name__}: {e})") from None
        results.append(result)
    return sorted(results, key=setting_of)  # vLLM's order ungrouped first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", choices=sorted(PROFILES))
    parser.add_argument("--work", type=Path, default=Path("/dev/shm/bench-side"))
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench/scratch-side"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/side"))
    parser.add_argument("--adapters", type=int, default=20, help="adapters esftctl serves and spreads requests over")
    parser.add_argument("--alpha", type=float, default=1.0, help="S-LoRA's power-law alpha of the shares")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 5.0],
                        help="requests per second, one after another in each round")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each rate's three runs) at most, per setting")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds after esftctl's warm-up in which a round may start, per setting")
    parser.add_argument("--share", type=float, default=None,
                        help="the card's memory share both servers split (default: the profile's, 0.92 for "
                             "DeepSeek-V2-Lite); an 80 GB card holds two bases and 5 adapters' experts at 0.95")
    parser.add_argument("--group-adapters", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                        help="esftctl's settings, one after another beside one plain vLLM server: at most this many "
                             "adapters a step, 0 not grouped (0,2: ungrouped, then groups of 2)")
    parser.add_argument("--group-wait", type=int, default=8,
                        help="with --group-adapters: steps a request may be held back in a row")
    parser.add_argument("--admit-by-adapter", type=float, default=0.0, metavar="SECONDS",
                        help="after the --group-adapters settings, esftctl served with `--admit-by-adapter SECONDS` "
                             "(queued requests of running adapters admitted first; 0: not)")
    parser.add_argument("--max-loras", type=int, default=0, metavar="K",
                        help="last, esftctl served with vLLM's --max-loras K, below --adapters: at most K adapters "
                             "among the running requests, the others' requests wait for a slot (0: not)")
    parser.add_argument("--report", type=Path, nargs="+", metavar="PATH",
                        help="print the tables of earlier runs and exit, nothing started: their JSON files, or folders "
                             "of them (--out's, benchmarks/serve-bench/side-by-side)")
    args = parser.parse_args()
    if args.report:
        results = reread(args.report)
        for result in results:
            show(result)
        print_tables(trade_table(results))
        return
    if any(g < 0 for g in args.group_adapters) or len(set(args.group_adapters)) < len(args.group_adapters):
        raise SystemExit("error: --group-adapters: distinct counts, 0 or more")
    if not 0 <= args.admit_by_adapter < float("inf"):
        raise SystemExit("error: --admit-by-adapter: seconds, 0 (not) or more")
    if not 0 <= args.max_loras < args.adapters:
        raise SystemExit(f"error: --max-loras {args.max_loras}: give 0 (not) or fewer than --adapters {args.adapters}")
    profile = dataclasses.replace(PROFILES[args.model], duration=args.duration)
    if args.share is not None and MEMORY_FLAG in profile.engine_args:
        profile = dataclasses.replace(profile, engine_args=with_flag(profile.engine_args, MEMORY_FLAG,
                                                                     f"{args.share:g}"))
    say("side by side: the base")
    served = serve_models.prepare_base(args.model, args.work, say)
    shape = "deepseek" if args.model != "tiny" else "table1"
    serve_models.write_adapters(served, args.model, args.scratch, args.adapters, distinct=min(args.adapters, 10),
                                shape=shape, on_step=say)
    aside = serve_models.adapter_bytes(served.base, served.bundles.values())  # what arm_plan sets aside for esftctl
    card = card_bytes()
    engine_args = dict(zip(("plain", "esftctl"), split_memory(profile.engine_args, [0, aside], card=card)))
    say(f"engine arguments: {engine_args}")
    weights = sum(f.stat().st_size for f in served.base.glob("*.safetensors"))
    check_room(engine_args, {"plain": 0, "esftctl": aside}, weights, card=card)
    args.out.mkdir(parents=True, exist_ok=True)

    def esft_plan(how: Setting):
        if how == Setting():
            return arm_plan(served, True, engine_args["esftctl"], admit_by_adapter=0.0)
        state = args.work / f"state-{out_file(Path(), how).stem}"
        stats_file(state / "status.json").unlink(missing_ok=True)  # an earlier run's statistics are not this one's
        bound = ["--max-loras", str(how.max_loras)] if how.max_loras else []  # after esftctl's own: vLLM takes it
        return arm_plan(served, True, [*engine_args["esftctl"], *bound], state_dir=state, group_adapters=how.group,
                        group_wait=args.group_wait, admit_by_adapter=how.admit)

    settings = [Setting(group=g) for g in args.group_adapters]
    settings += [Setting(admit=args.admit_by_adapter)] if args.admit_by_adapter else []
    settings += [Setting(max_loras=args.max_loras)] if args.max_loras else []
    # one at a time, each sizing its KV cache by the memory free as it starts; esftctl first, since its start-up
    # maps each layer's experts before vLLM's copy goes (beside plain vLLM on an H100 that once ran out, 2026-12-05;
    # since ad69d94 it holds one layer's twice at most, so a later setting starts beside plain vLLM)
    results = []
    with contextlib.ExitStack() as servers:
        say(f"starting esftctl{settings[0].flags(args.group_wait)}")
        esft = servers.enter_context(Server(esft_plan(settings[0])))
        esft.wait_ready(timeout=1200)
        say("esftctl ready; starting plain vLLM")
        plain = servers.enter_context(Server(arm_plan(served, False, engine_args["plain"])))
        plain.wait_ready(timeout=1200)
        say(f"plain vLLM ready (KV cache: {kv_cache_tokens(plain.plan.url)} tokens; esftctl's: "
            f"{kv_cache_tokens(esft.plan.url)}); warming it up")
        run_plain = runner(plain.plan.url, "base", served=served, profile=profile, routes=None, out=args.out)
        warm_up(run_plain, "plain", [Scenario("base", rate) for rate in args.rates], names={}, profile=profile,
                on_step=say)
        for i, how in enumerate(settings):
            if i:
                esft.stop()
                say(f"starting esftctl{how.flags(args.group_wait)} beside plain vLLM")
                esft = servers.enter_context(Server(esft_plan(how)))
                esft.wait_ready(timeout=1200)
                say(f"esftctl ready (KV cache: {kv_cache_tokens(esft.plan.url)} tokens)")
            result = {"args": {k: str(v) for k, v in vars(args).items()} | {"group_adapters": str(how.group),
                                                                              "admit_by_adapter": str(how.admit),
                                                                              "max_loras": str(how.max_loras)},
                      "engine_args": engine_args, "rounds": {}}
            run = {"plain": run_plain, "esftctl": runner(esft.plan.url, "base", served=served, profile=profile,
                                                         routes=None, out=args.out)}
            path = out_file(args.out, how)
            with failures_explained([plain, esft], say):
                done = measure(run, {"plain": plain.plan.url, "esftctl": esft.plan.url}, args=args, served=served,
                               profile=profile, result=result, path=path)
            settle(done, result=result, output_len=profile.output_len,
                   stats=stats_file(esft.plan.state_dir / "status.json") if how != Setting() else None)
            path.write_text(json.dumps(result))
            show(result)
            results.append(result)
    print_tables(trade_table(results))


if __name__ == "__main__":
    main()
