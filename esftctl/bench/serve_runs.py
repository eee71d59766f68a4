"""The runs of `esftctl bench serve`: its scenarios (who gets which requests at what rate) and one server (or
several side by side) measured over them.

A scenario is (rate, N adapters, alpha, which adapters). Its requests in round r are the same on every server:
vLLM draws the prompts and the arrival times from seed r, esftctl.bench.traffic draws each request's adapter
index from the run's own seed, and each server maps index i to its own i-th model name (esftctl's i-th adapter,
the peer's i-th LoRA, merged copy i mod copies). A server started once runs one round, whole or in parts (its
adapter counts: every count is served by the same server, all adapters loaded, so one start serves them in turn;
esftctl.bench.serve_slices starts it anew for each round, so that the spread over rounds includes the start's
own); rows merge the rounds: every round's numbers, their median, TTFT's spread over them, the arrivals' measured
cv and the drawn shares checked against alpha over all rounds.

Routing: the generated DeepSeek-V2-Lite-shaped base routes about uniformly, and its adapters replace experts
chosen at random, so a token of adapter a reaches a's experts only as often as chance has it. Trained ESFT
adapters replace the experts their task's tokens prefer (selection by relevance), which concentrates their
tokens on their own rows, and that costs more rows, not fewer: with the tiny world's four trained adapters (three
worlds), a task's decode tokens chose its replaced experts in 26-38% of their slots against 9-17% by chance, and
the copies added 1.15-1.17x rows over the same fine-tuned models' own routing at 8 sequences a step against 1.05x
under the random router (benchmarks/RESULTS.md, Adapters against the base; benchmarks/lab/rows_trained.py). So
the random router is
not the worst case. This bench does not imitate trained routing: making a generated router prefer each adapter's
experts would need prompts drawn per task (vLLM's random dataset draws every request's token ids from one uniform
pool) and a router built so that hidden states after attention still carry the task, whose concentration would
then be whatever we built in: a number chosen, not measured. The honest measurements with trained routing are
the tiny world's adapters (real ESFT on the CPU build) or DeepSeek's published ESFT adapters on
ESFT-vanilla-lite where they can be downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from esftctl.bench.conditions import Watch, gpu_processes
from esftctl.bench.load import Load, floors, per_request, run_load, summary
from esftctl.bench.traffic import check_shares, draw_adapters, run_seed, slora_shares
from esftctl.serve import Server

INF = math.inf
WARM_UP_S = 10.0  # seconds of paced warm-up traffic (at most the runs' duration)
JIT_WARNING = "JIT compilation during inference"  # vLLM's JIT monitor: "Triton kernel JIT compilation during ..."
RANGES = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "output_throughput")


@dataclass(frozen=True)
class Scenario:
    name: str
    rate: float
    adapters: int = 0  # requests drawn over this many adapters (0: every request to the served base name)
    alpha: float = 1.0  # S-LoRA's skew (1: uniform)
    pool: str = "grid"  # which of the server's model names: "grid" or "esft_sized"

    def draw(self, repeat: int, count: int) -> list[int]:
        """Each request's adapter index in this run (empty: all to the base)."""
        if not self.adapters:
            return []
        seed = run_seed(repeat=repeat, adapters=self.adapters, alpha=self.alpha, rate=self.rate)
        return draw_adapters(self.adapters, self.alpha, count, seed)


def rate_label(rate: float) -> str:
    return "inf rps" if math.isinf(rate) else f"{rate:g} rps"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_")


def scenario_name(adapters: int, alpha: float, rate: float) -> str:
    if adapters == 0:
        return f"base @ {rate_label(rate)}"
    if adapters == 1:
        return f"1 adapter @ {rate_label(rate)}"
    return f"{adapters} adapters, alpha {alpha:g} @ {rate_label(rate)}"


def scenarios(profile, available: int, extra: int) -> list[Scenario]:
    """Per rate: every count up to `available` at the first alpha, the largest count at every alpha; and at the
    highest rate `extra` DeepSeek-sized adapters at the first alpha."""
    counts = [n for n in profile.counts if n <= available]
    largest = max(counts, default=0)
    out = []
    for rate in profile.rates:
        for n in counts:
            for alpha in profile.alphas if n == largest and n > 1 else profile.alphas[:1]:
                out.append(Scenario(scenario_name(n, alpha, rate), rate, n, alpha))
        if extra and rate == max(profile.rates):
            alpha = profile.alphas[0]
            out.append(Scenario(f"{extra} DeepSeek-sized adapters, alpha {alpha:g} @ {rate_label(rate)}", rate, extra,
                                alpha, "esft_sized"))
    return out


def base_runs(profile) -> list[Scenario]:
    """Every request to the base, at each rate: the same prompts and arrivals as every scenario at that rate."""
    return [Scenario(scenario_name(0, 1.0, r), r) for r in profile.rates]


def metrics_text(url: str) -> str:
    """vLLM's /metrics page (Prometheus' text format), any server: plain or esftctl."""
    return urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()


def kv_cache_tokens(url: str) -> int | None:
    """The KV-cache room vLLM reports (its cache_config_info gauge), any server: plain or esftctl."""
    m = re.search(r'kv_cache_size_tokens="(\d+)"', metrics_text(url))
    return int(m.group(1)) if m else None


# vLLM's per-request histograms (/metrics): where a request's time went inside the server. TTFT = queue (waiting
# to be scheduled) + prefill (scheduled to first token) + the API server's own share (client TTFT less vLLM's).
# A client TTFT far above plain vLLM's while the engine steps profiled in-process (benchmarks/lab/profile_step.py)
# cost the same on the GPU was once the base serving half its prompts from its prefix cache (serve.NO_PREFIX_CACHE),
# found only in vLLM's logs. These means keep each run's split measured, so that a gap left says at once where it
# sits.
SERVER_TIMES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                "ttft": "vllm:time_to_first_token_seconds", "decode": "vllm:request_decode_time_seconds"}
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)_(sum|count)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$", re.M)


def server_times(urls: list[str]) -> dict[str, list[float]]:
    """Sum and count of each SERVER_TIMES histogram, added over the servers and their label sets."""
    wanted = {name: key for key, name in SERVER_TIMES.items()}
    out = {key: [0.0, 0.0] for key in SERVER_TIMES}
    for url in urls:
        for name, kind, value in _SAMPLE.findall(metrics_text(url)):
            if name in wanted and value != "NaN":
                out[wanted[name]][kind == "count"] += float(value)
    return out


def server_means(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float | None]:
    """Each histogram's mean over the requests between two server_times, in ms (server_queue_ms, ...)."""
    out = {}
    for key in SERVER_TIMES:
        count = after[key][1] - before[key][1]
        out[f"server_{key}_ms"] = (after[key][0] - before[key][0]) * 1e3 / count if count > 0 else None
    return out


def part_of(s: Scenario) -> str:
    """The slice part a scenario belongs to when a server's round is cut by adapter count (n5; ds5: DeepSeek-sized
    adapters beside Table 1's)."""
    return f"{'ds' if s.pool == 'esft_sized' else 'n'}{s.adapters}"


def measure_server(label: str, plans: list, *, served, profile, parts: list[list[Scenario]],
                   names: dict[str, list[str]], routes: dict[str, str] | None, out: Path, round: int,
                   on_step: Callable[[str], None], after: Callable[[str], dict] | None = None,
                   order: list[Scenario] | None = None) -> Iterator[dict]:
    """Start the server(s) once, then for each part (scenarios of the round, e.g. one adapter count's) warm up,
    run every scenario once (round `round`: its seed, and the order rotated by it) and yield the part's result;
    `after` follows the last part; the server stops when the last result is taken or the caller closes the
    generator. With several plans (merged copies side by side) `routes` sends each model name to its server; the
    first takes the rest. `order`: all the server's scenarios (each run keeps its place there, so that rows merged
    from several parts keep the server's order). Each result says how many parts ran before it on this start
    (`parts_before`; 0: its start-up is its own) and the seconds of its warm-up, runs and `after` (`own_s`)."""
    on_step(f"{label}: starting vLLM" + (f" ({len(plans)} servers side by side)" if len(plans) > 1 else ""))
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        servers = []
        for p in plans:  # one after another: each sizes itself by the memory the ones before left
            servers.append(stack.enter_context(Server(p)))
            servers[-1].wait_ready(timeout=1800)
        stack.enter_context(failures_explained(servers, on_step))
        ready_s = time.perf_counter() - started
        url, model = plans[0].url, plans[0].name
        kv = kv_cache_tokens(url)
        run = runner(url, model, served=served, profile=profile, routes=routes, out=out)
        times = functools.partial(server_times, [p.url for p in plans])
        for i, runs in enumerate(parts):
            began = time.perf_counter()
            warm_up(run, label, runs, names=names, profile=profile, on_step=on_step)
            compiled = jit_compiles(plans)
            measured = _round(run, label, runs, names=names, profile=profile, rnd=round, on_step=on_step,
                              order=order or runs, times=times)
            compiled = jit_compiles(plans) - compiled
            extra = {}
            if after and i == len(parts) - 1:
                try:  # a failure here keeps the runs measured above
                    extra = after(url)
                except Exception as e:
                    extra = {"after_error": " ".join(str(e).split())[:500]}
                    on_step(f"{label}: FAILED after the runs: {extra['after_error']}")
            yield {"server": label, "ready_s": ready_s, "kv_cache_tokens": kv, "runs": measured,
                   "jit_compiles_in_runs": compiled, "parts_before": i, "own_s": time.perf_counter() - began,
                   **extra}


@contextlib.contextmanager
def failures_explained(servers: list[Server], on_step: Callable[[str], None]) -> Iterator[None]:
    """A load run that fails (run_load's RuntimeError) says why, from the servers' logs: each one's first ERROR
    lines go to `on_step`, then what each process holds on the GPUs now, and each server's root cause joins the
    error: a server can answer almost every request with a stream that holds no token (plain vLLM under 256
    requests at once, beside esftctl on one H100), with the cause only in a log too large to read whole."""
    try:
        yield
    except RuntimeError as e:
        for server in servers:
            for line in server.error_lines():
                on_step(f"{server.plan.log_file}: {line}")
        held = gpu_processes()
        if held:
            on_step("GPU memory held now: " + ", ".join(f"{owner(p, servers)} {mib} MiB" for p, mib in held.items()))
        causes = "; ".join(f"{s.plan.log_file}: {s.last_error()}" for s in servers if s.plan.log_file.exists())
        raise RuntimeError(f"{e}; the servers' logs say: {causes}") from e


def owner(pid: int, servers: list[Server]) -> str:
    """A process named by the server it belongs to (its process group: each server starts a session of its own)."""
    try:
        group = os.getpgid(pid)
    except OSError:  # gone, or a pid of another namespace
        return f"process {pid}"
    return next((f"process {pid} ({s.plan.log_file})" for s in servers if s.process and s.process.pid == group),
                f"process {pid}")


def runner(url: str, model: str, *, served, profile, routes, out: Path) -> Callable:
    def run(name: str, load: Load, models: list[str], folder: str = "vllm-results") -> dict:
        return run_load(url, model=model, tokenizer=served.base, load=load, models=models, result_dir=out / folder,
                        name=slug(name), routes=routes)
    return run


def warm_up(run: Callable, label: str, runs: list[Scenario], *, names: dict, profile, on_step) -> None:
    """Every model name the runs use, once or more, then the busiest finite rate of the runs for up to
    WARM_UP_S: first-use costs (kernels, slots) stay out of the numbers. The burst alone (many prompts prefilled
    together, then decode steps replayed from CUDA graphs) left lone prompts and steps of one prompt beside a few
    decodes unseen: vLLM's JIT monitor then caught its Triton MoE kernel compiling in the first measured run after
    it, whose median TTFT came out several times the other rounds'."""
    used = list(dict.fromkeys(n for s in runs if s.adapters for n in names[s.pool][:s.adapters]))

    def models(count: int) -> list[str]:
        return [used[k % len(used)] for k in range(count)] if used else []

    count = max(16, 2 * len(used))
    on_step(f"{label}: warm-up")
    run(label, Load(INF, count, profile.input_len, profile.output_len, seed=99), models(count), folder="warmup")
    rates = [s.rate for s in runs if not math.isinf(s.rate)]
    if rates:
        paced = max(4, round(max(rates) * min(WARM_UP_S, profile.duration)))
        run(f"{label} paced", Load(max(rates), paced, profile.input_len, profile.output_len, seed=98, cv=profile.cv),
            models(paced), folder="warmup")


def jit_compiles(plans: list) -> int:
    """Kernel compiles vLLM's JIT monitor logged while serving (its warning per compile) in the servers' logs."""
    logs = [Path(p.log_file) for p in plans]
    return sum(f.read_text(errors="replace").count(JIT_WARNING) for f in logs if f.exists())


def _round(run: Callable, label: str, runs: list[Scenario], *, names: dict, profile, rnd: int, on_step,
           order: list[Scenario], times: Callable[[], dict] = lambda: {}) -> list[dict]:
    """Every scenario once, in an order rotated by the round; each run's entry keeps its scenario (and place in
    `order`), vLLM's numbers, the machine's state over the run (esftctl.bench.conditions), the server's own
    per-request means (`times`: server_times), the adapters drawn, each request's own times (load.per_request) and
    the seconds it took."""
    out = []
    k = rnd % len(runs) if runs else 0
    for s in runs[k:] + runs[:k]:
        on_step(f"{label}: {s.name} (round r{rnd})")
        count = profile.requests(s.rate)
        drawn = s.draw(rnd, count)
        load = Load(s.rate, count, profile.input_len, profile.output_len, seed=rnd, cv=profile.cv)
        started, before = time.perf_counter(), times()
        with Watch() as machine:
            raw = run(f"{label} {s.name} r{rnd}", load, [names[s.pool][i] for i in drawn])
        result = summary(raw) | machine.result
        if before:
            result.update(server_means(before, times()))
        if math.isinf(s.rate):  # all at once: no gaps to speak of
            result["arrival_cv"] = None
        out.append({"scenario": asdict(s), "index": order.index(s), "round": rnd, "result": result, "drawn": drawn,
                    "requests": per_request(raw), "seconds": time.perf_counter() - started})
    return out


def merge_rounds(label: str, entries: list[dict], profile) -> list[dict]:
    """One server's rows from its runs' entries (_round's, of any rounds and parts): per scenario, in the order
    of the server's scenarios, its rounds merged (row), each run's numbers with its fastest tenth (load.floors)."""
    by_name: dict[str, list[dict]] = {}
    for e in sorted(entries, key=lambda e: (e["index"], e["round"])):
        by_name.setdefault(e["scenario"]["name"], []).append(e)
    return [row(label, Scenario(**reps[0]["scenario"]),
                [e["result"] | floors(e.get("requests") or {}, profile.output_len) for e in reps],
                [i for e in reps for i in e["drawn"]], profile, rounds=[e["round"] for e in reps],
                machines=[e.get("machine") for e in reps], requests=[e.get("requests") or {} for e in reps])
            for reps in by_name.values()]


def row(label: str, s: Scenario, reps: list[dict], drawn: list[int], profile, *, rounds: list[int] | None = None,
        machines: list[str | None] | None = None, requests: list[dict] | None = None) -> dict:
    """One scenario's line: the median of its rounds, TTFT's spread, the drawn shares against alpha; `machines`:
    where each round ran (esftctl.bench.slices.machine_id), which pairs it with the base's runs there; `requests`:
    each round's kept requests (load.per_request), for the request-by-request ratios (bench.serve.finish drops
    them once those are taken)."""
    shares = check_shares(drawn, slora_shares(s.adapters, s.alpha)).to_json() if s.adapters > 1 else None
    return {"server": label, "scenario": s.name, "adapters": s.adapters, "alpha": s.alpha if s.adapters > 1 else None,
            "rate": rate_label(s.rate), "requests": profile.requests(s.rate), "cv": profile.cv, **median_of(reps),
            "shares": shares, "rounds": rounds if rounds is not None else list(range(len(reps))),
            "machines": machines or [None] * len(reps), "repeats": reps,
            "per_request": requests or [{}] * len(reps)}


def median_of(reps: list[dict]) -> dict:
    """Every number's median over the rounds (None where none has it), the ranges of the main ones, and TTFT's
    spread: (max - min) / median of the rounds' median TTFT."""
    out = {}
    for key in reps[0]:
        values = [r[key] for r in reps if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    for key in RANGES:
        out[f"{key}_range"] = [min(r[key] for r in reps), max(r[key] for r in reps)]
    low, high = out["median_ttft_ms_range"]
    out["ttft_spread"] = (high - low) / out["median_ttft_ms"] if out["median_ttft_ms"] else None
    return out
