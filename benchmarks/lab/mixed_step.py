"""The step that prefills a prompt beside decoding requests, plain vLLM against esftctl, to the ms (issue 29.2).

In the H100 grid's slices of 2026-11-27's fifteenth session, every esftctl count (1, 5, 10 and 20 adapters, two
cards) stalled its decoders longer than plain vLLM whenever a prompt was prefilled beside them (a 256-token prompt
in a step with the decodes, past the 256 tokens vLLM captures as CUDA graphs): the stall's median
(esftctl.bench.load.prefill_stalls) was 81-115 ms against the base's 76-86 ms on the same card. At 5 requests/s
such steps are about 40% of a run's streamed time, so they carry most of esftctl's TPOT excess there (1.09-1.33x a
slice) and its TTFT beside others (1.11-1.32x); its decode steps took 4-14% more there, and the same at 1 request/s.
In the fourteenth session's one count (10 adapters, round 1) the stalls were 74-86 ms, equal to the base's. So:
which is it, esftctl or the host, and where do those milliseconds go?

The probe isolates that step. `--decoders` requests decode (long outputs, 64-token prompts) while every `--gap`
seconds one prompt of `--length` tokens arrives and streams `--output` tokens. For each arrival: its TTFT (the
client's) and its stall as `bench serve`'s runs measure it (esftctl.bench.load.prefill_stalls: the longest gap
between two chunks of any decoder among the gaps ending between the arrival and its first token); beside, the
median gap of the decoders' other steps (a decode step and its streaming). Arms, one
server start each (DeepSeek-V2-Lite-shaped base, `bench serve`'s engine arguments, CUDA graphs, two DeepSeek-sized
adapters): `plain`, and `esftctl`, which runs the phase twice, every request on the base, then every request on
one adapter (as the grid's 1-adapter runs). `--rounds 2` runs the arms twice in turn (plain, esftctl, plain,
esftctl), so that a drift of the host shows. `--profile` starts the last round's servers with vLLM's torch profiler
(`--profiler-config`) and traces the engine and the API server over the last `--profile-arrivals` arrivals of each
of its phases (their times are left out of its stalls and TTFTs, so an earlier round shows whether the profiler's
set-up alone moves them). It prints the engine's steps by kind (a prompt beside decodes, decodes alone), each
one's host span against its GPU kernels, and the CPU ops, CUDA runtime calls and kernels whose time per arrival
differs most between phases (traces in OUT/trace/ARM-PHASE). Every server records its engine's step times without
a profiler (ESFTCTL_STEP_TIMES, esftctl.runtime.vllm.profiling; in OUT/steps/ARM-rN): per arrival, the stall
between the engine core's outputs and the host span of the step that prefilled the prompt; the decode steps away
from the arrivals (`decode_steps`: their period, and the host span of each part of them); and the kernels
Triton compiled in each phase (before the arrivals, in the first, later). `--capture-sizes 0,512` runs the arms
at vLLM's default capture sizes (up to 256 tokens here) and again capturing CUDA graphs up to 512 (in steps of 16
past 256), so that the mixed step is graphed too, alternating within each round (arms named ARM-cSIZE). On an H100
(2026-11-28) the client's stall was the engine's to within 1 ms and the prefill step's host span to within 3 ms,
in every arm; that span varied 54-113 ms within one run. On an H200 (2026-11-29) captured up to 512 the step
stalled the decodes 10-14 ms by the median in both servers, against 61-76 ms eager, so `bench serve`'s profile
now captures up to 512 (here 0 is still vLLM's default). Writes OUT/mixed_step.json.
Usage (device, after ../shared/gpu/README.md's install; about 2.5 min a start, 40 s a phase):
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/lab/mixed_step.py --out $OUT/ms
The decode step at low load (the grid's 1 request/s, where esftctl's decode steps took 0.10-0.13 ms more than plain
vLLM's on one H200, 2026-11-29): `--decoders 2 --arrivals 6 --gap 1.5 --capture-sizes 512 --rounds 2` (about 2,500
such steps a phase). There, in the twenty-fourth session, the period was 4.09-4.10 ms in plain vLLM and 4.15 in
esftctl, base and adapter phases alike, with 2.2 ms of host spans: the GPU bounds the step. Since
2026-12-01 esftctl folds the reroute into vLLM's compiled top-k (esftctl.runtime.vllm.topk); the arm
`esftctl-unfolded` is esftctl without the fold (ESFTCTL_FOLD_REROUTE=0, the reroute's own kernel a layer):
`--arms plain,esftctl,esftctl-unfolded` measures what the fold removes.
A smoke run on vLLM's CPU build (the tiny world's 256-token context): `--model tiny --length 8 --decoders 2
--arrivals 3 --gap 0.05 --decode 180 --profile --profile-arrivals 2`, 85 s on 2 cores.
"""

import bisect
import collections
import gzip
import http.client
import itertools
import json
import os
import random
import re
import statistics
import threading
import time
import urllib.parse
from pathlib import Path

from ttft_alone import arm_plan, first_chunk_ms, prepare, probe_parser, quartiles, steps_so_far

from esftctl.bench.load import STALL_AFTER_S, longest_gap
from esftctl.bench.serve import PROFILES, with_capture_size
from esftctl.runtime.vllm.profiling import STEP_TIMES_ENV
from esftctl.runtime.vllm.topk import FOLD_ENV
from esftctl.serve import Server
from esftctl.serve_client import request


class Decoder(threading.Thread):
    """One streamed completion that decodes until `stop` is set; `times` holds each chunk's arrival."""

    def __init__(self, url: str, model: str, prompt: list[int], tokens: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.model, self.prompt, self.tokens, self.stop = url, model, prompt, tokens, stop
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
        body = json.dumps({"model": self.model, "prompt": self.prompt, "max_tokens": self.tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            self.error = f"{self.model}: HTTP {response.status}: {response.read()[:300]!r}"
            return
        for line in response:
            if line.startswith(b"data: {"):
                self.times.append(time.perf_counter())
            if self.stop.is_set():
                break
        conn.close()  # vLLM aborts the request


def arrival_windows(arrivals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per arrival (sent at, TTFT ms), its window (s): from its sending to its first token, and the others of that
    step (load.STALL_AFTER_S)."""
    return [(sent, sent + ttft / 1e3 + STALL_AFTER_S) for sent, ttft in arrivals]


def stalls(decoders: list[Decoder], arrivals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Per arrival (sent at, TTFT ms), its stall (load.longest_gap over the decoders); and the decoders' gaps that
    end in no arrival's window (decode steps), all in ms."""
    windows = arrival_windows(arrivals)
    worst = [longest_gap([d.times for d in decoders], start, end) * 1e3 for start, end in windows]
    others = [(after - before) * 1e3 for d in decoders for before, after in zip(d.times, d.times[1:])
              if not any(start < after <= end for start, end in windows)]
    return worst, others


def engine_side(steps: dict, arrivals: list[tuple[float, float]], length: int) -> dict:
    """Per arrival, as the engine saw it: the stall as the client measures it but between the ends of the engine's
    `update_from_output` calls (when a step's tokens leave the engine core), and the host span of the step that
    prefilled the prompt (`execute_model` with at least `length` tokens). The client's stall minus the first is
    what lies outside the engine core: its output thread, the API server, the socket."""
    outputs = [end for _, end, _ in steps.get("output", [])]
    mixed = [(start, end) for start, end, tokens in steps.get("execute", []) if tokens >= length]
    stall, span = [], []
    for sent, end in arrival_windows(arrivals):
        stall.append(longest_gap([outputs], sent, end) * 1e3)
        span += [(e - s) * 1e3 for s, e in mixed if sent < s < end][:1]
    return {"engine_stall_ms": stall, "engine_stall_median_ms": statistics.median(stall) if stall else None,
            "prefill_step_host_ms": span, "prefill_step_host_median_ms": statistics.median(span) if span else None}


def decode_steps(steps: dict, arrivals: list[tuple[float, float]], decoders: int) -> dict:
    """The engine's decode steps away from every arrival, as the engine saw them: the median period between the
    ends of consecutive `update_from_output` calls, and each part's median host span (schedule, execute, sample,
    output). Kept: the steps whose `execute_model` scheduled exactly `decoders` tokens and started outside each
    arrival's window (arrival_windows), with the parts that follow such an execute. A period longer than the parts'
    spans together is the step waiting on the GPU; two servers' difference in period against their difference in
    spans says whether what one adds per decode step is host time or GPU time."""
    windows = arrival_windows(arrivals)

    def quiet(t: float) -> bool:
        return not any(start <= t <= end for start, end in windows)

    executes = steps.get("execute", [])
    starts = [start for start, _, _ in executes]

    def after_decode(t: float) -> bool:  # the last execute started before t was a quiet decode step
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and executes[i][2] == decoders and quiet(executes[i][0])

    def kept(part: str, start: float, tokens: int) -> bool:
        return quiet(start) and (tokens == decoders if part in ("schedule", "execute") else after_decode(start))

    spans = {part: [(end - start) * 1e3 for start, end, tokens in steps.get(part, []) if kept(part, start, tokens)]
             for part in ("schedule", "execute", "sample", "output")}
    ends = [end for start, end, _ in steps.get("output", []) if quiet(start) and after_decode(start)]
    periods = [(b - a) * 1e3 for a, b in zip(ends, ends[1:]) if b - a < 0.1]  # consecutive steps of one stretch
    out = {"decode_steps": len(periods),
           "decode_period_median_ms": statistics.median(periods) if periods else None}
    out |= {f"decode_{part}_host_median_ms": statistics.median(v) if v else None for part, v in spans.items()}
    return out


def compiled(since: float) -> list[tuple[float, str]]:
    """(when, name) of each kernel Triton compiled since `since` (time.time()), in vLLM's compile cache, where
    vLLM points Triton (its folders named triton_cache), and in Triton's own default (a kernel found in a disk
    cache writes nothing there)."""
    roots = (Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")),
             Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")))
    found = ((path.stat().st_mtime, path.stem) for root in roots if root.is_dir() for path in root.rglob("*.json")
             if not path.name.startswith("__grp__") and path.with_suffix(".cubin").exists())
    return sorted(k for k in found if k[0] >= since)


def phase(url: str, model: str, args, vocab: int, rng: random.Random, profile: bool,
          steps_dir: Path | None = None) -> dict:
    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab // 4, vocab) for _ in range(length)]

    stamps = [time.time()]  # Triton's compiles: in the warm-up and the decoders' prefills, the first arrival, after
    first_chunk_ms(url, model, prompt(args.length), args.output)  # warm-up
    stop = threading.Event()
    decoders = [Decoder(url, model, prompt(64), args.decode, stop) for _ in range(args.decoders)]
    for decoder in decoders:
        decoder.start()
    deadline = time.perf_counter() + 120
    while not all(d.times or d.error for d in decoders) and time.perf_counter() < deadline:
        time.sleep(0.01)  # every decoder past its prefill: in steady decode
    stamps.append(time.time())
    arrivals = []
    profiled_from = args.arrivals - args.profile_arrivals if profile else args.arrivals
    for i in range(args.arrivals):
        if i == profiled_from:
            traced_from = time.perf_counter()
            request(url, "/start_profile", {})
        time.sleep(args.gap)
        sent = time.perf_counter()
        arrivals.append((sent, first_chunk_ms(url, model, prompt(args.length), args.output)))
        if i == 0:
            stamps.append(time.time())
    if profile:
        request(url, "/stop_profile", {})
    stamps.append(time.time())
    stop.set()
    for decoder in decoders:
        decoder.join(timeout=60)
        if decoder.error or not decoder.times:
            raise SystemExit(decoder.error or f"{model}: a decoder streamed nothing")
    last = arrivals[-1][0] + arrivals[-1][1] / 1e3
    if any(d.times[-1] < last for d in decoders):  # max_tokens, or the context, ended it early
        raise SystemExit(f"{model}: a decoder finished before the last arrival's first token: raise --decode (its "
                         "prompt is 64 tokens of the model's context) or lower --arrivals")
    if profile:  # the traced arrivals pay the profiler's cost: time only those before it started
        arrivals = arrivals[:profiled_from]
        for decoder in decoders:
            decoder.times = [t for t in decoder.times if t < traced_from]
    worst, others = stalls(decoders, arrivals)
    kernels = compiled(stamps[0])
    ttft = [t for _, t in arrivals]
    out = {"stall_ms": worst, "ttft_ms": ttft, "decode_gap_median_ms": statistics.median(others),
           "stall_median_ms": statistics.median(worst), "ttft_median_ms": statistics.median(ttft),
           "stall_quartiles_ms": quartiles(worst),
           "compiled": {when: [name for t, name in kernels if start <= t < end]
                        for when, start, end in zip(("before", "first arrival", "later"), stamps, stamps[1:])}}
    if steps_dir is not None:
        steps = steps_so_far(url, model, prompt(8), steps_dir)
        out |= engine_side(steps, arrivals, args.length) | decode_steps(steps, arrivals, args.decoders)
    return out


STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def trace_events(folder: Path):
    """(file kind, event) for every complete event of the traces in `folder`: kind "engine" or "front"."""
    for path in sorted(folder.rglob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        kind = "engine" if "rank" in path.name.lower() or "worker" in path.name.lower() else "front"
        for e in events:
            if e.get("ph") == "X":
                yield kind, e


def trace_totals(folder: Path) -> dict[str, dict[str, float]]:
    """Per trace file kind (engine or front end) and `cat/name`: total ms and count over the traced events."""
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for kind, e in trace_events(folder):
        if e.get("cat") in ("cpu_op", "cuda_runtime", "kernel", "user_annotation", "python_function", "gpu_memcpy",
                            "cuda_driver"):
            key = f"{kind}:{e['cat']}/{e['name'][:80]}"
            totals[key]["ms"] += e.get("dur", 0) / 1e3
            totals[key]["n"] += 1
    return totals


def step_table(folder: Path) -> dict[str, dict[str, float]]:
    """The engine's steps by kind (mixed: a prompt beside decodes; decode; prefill alone), from vLLM's step
    annotations: how many, and the median ms of the annotated host span, of the GPU kernels that start between
    one step's start and the next's, and of that step-to-step interval. Host span against kernels says whether a
    step waits on the host or on the GPU."""
    steps, kernels = [], []
    for kind, e in trace_events(folder):
        if kind != "engine":
            continue
        if e.get("cat") == "user_annotation" and (m := STEP.search(e["name"])):
            prompts, decodes = int(m.group(1)), int(m.group(3))
            label = "mixed" if prompts and decodes else "prefill" if prompts else "decode"
            steps.append((e["ts"], e.get("dur", 0), label))
        elif e.get("cat") == "kernel":
            kernels.append((e["ts"], e.get("dur", 0)))
    steps.sort()
    kernels.sort()
    starts = [k for k, _ in kernels]
    busy = list(itertools.accumulate((d for _, d in kernels), initial=0))  # busy[i]: the first i kernels' time
    rows: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for (ts, dur, label), nxt in zip(steps, steps[1:]):
        gpu = busy[bisect.bisect_left(starts, nxt[0])] - busy[bisect.bisect_left(starts, ts)]
        rows[label].append((dur / 1e3, gpu / 1e3, (nxt[0] - ts) / 1e3))
    return {label: {"n": len(r), "host_ms": statistics.median(x[0] for x in r),
                    "kernels_ms": statistics.median(x[1] for x in r),
                    "interval_ms": statistics.median(x[2] for x in r)} for label, r in rows.items()}


def compare_traces(phases: dict[str, Path], arrivals: int, top: int) -> dict:
    """The events whose time per arrival differs most from the first phase's (the plain base)."""
    per = {name: trace_totals(folder) for name, folder in phases.items() if folder.is_dir()}
    if len(per) < 2:
        return {}
    names = list(per)
    keys = set().union(*[set(t) for t in per.values()])
    rows = []
    for key in keys:
        ms = [per[n].get(key, {}).get("ms", 0.0) / arrivals for n in names]
        counts = [per[n].get(key, {}).get("n", 0) / arrivals for n in names]
        rows.append((max(abs(m - ms[0]) for m in ms[1:]), key, ms, counts))
    rows.sort(reverse=True)
    print(f"traced events per arrival (ms, count), the {top} that differ most from {names[0]}:")
    print(f"{'event':70s} " + " ".join(f"{n:>22s}" for n in names))
    for _, key, ms, counts in rows[:top]:
        print(f"{key[:70]:70s} " + " ".join(f"{m:12.3f} {c:9.1f}" for m, c in zip(ms, counts)))
    return {key: {"ms": ms, "count": counts} for _, key, ms, counts in rows[:top]}


def main() -> None:
    parser = probe_parser(__doc__, "mixed", arms="plain,esftctl")
    parser.add_argument("--rounds", type=int, default=1, help="times the arms run, in turn")
    parser.add_argument("--decoders", type=int, default=6, help="requests decoding while the prompts arrive")
    parser.add_argument("--decode", type=int, default=3800, help="tokens each decoder may stream (max_tokens)")
    parser.add_argument("--length", type=int, default=256, help="tokens of each arriving prompt")
    parser.add_argument("--output", type=int, default=4, help="tokens each arriving prompt streams")
    parser.add_argument("--arrivals", type=int, default=30, help="prompts per phase")
    parser.add_argument("--gap", type=float, default=0.4, help="seconds between one arrival's end and the next")
    parser.add_argument("--profile", action="store_true",
                        help="trace the last --profile-arrivals of each phase of the last round")
    parser.add_argument("--profile-arrivals", type=int, default=3)
    parser.add_argument("--top", type=int, default=40, help="traced events listed")
    parser.add_argument("--capture-sizes", default="0",
                        help="comma-separated values of vLLM's --max-cudagraph-capture-size, each run with every arm "
                             "in each round (0: vLLM's default, here 256, in place of the profile's 512): a mixed "
                             "step up to it runs as a CUDA graph")
    args = parser.parse_args()
    served, vocab = prepare(args)
    adapter = next(iter(served.bundles))
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": {}}
    traces: dict[str, Path] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.capture_sizes.split(",")]
    for round_ in range(args.rounds):
        for size, arm in itertools.product(sizes, args.arms.split(",")):
            esft = arm in ("esftctl", "esftctl-unfolded")
            label = arm if len(sizes) == 1 else f"{arm}-c{size}"  # (a file name $OUT brings back)
            profile = args.profile and round_ == args.rounds - 1
            engine_args = list(with_capture_size(PROFILES[args.model].engine_args, size))
            trace = args.out / "trace" / f"{label}-r{round_}"
            if profile:
                engine_args += ["--profiler-config", json.dumps({
                    "profiler": "torch", "torch_profiler_dir": str(trace.resolve()),
                    "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True})]
            steps_dir = (args.out / "steps" / f"{label}-r{round_}").resolve()
            steps_dir.mkdir(parents=True, exist_ok=True)
            os.environ[STEP_TIMES_ENV] = str(steps_dir)  # the server's processes inherit it
            os.environ.pop(FOLD_ENV, None)
            if arm == "esftctl-unfolded":
                os.environ[FOLD_ENV] = "0"
            server = arm_plan(served, esft, engine_args)
            with Server(server) as running:
                start = time.perf_counter()
                running.wait_ready(timeout=1200)
                rows = f", {server.slots} slots x {server.experts_per_slot} expert rows past the base's" if esft else ""
                print(f"{label}: ready in {time.perf_counter() - start:.0f} s{rows}", flush=True)
                for model in (["base", adapter] if esft else ["base"]):
                    name = f"{label} {'adapter' if model == adapter else 'base'} r{round_}"
                    before = set(trace.rglob("*")) if trace.is_dir() else set()
                    out = phase(server.url, model, args, vocab, random.Random(round_), profile, steps_dir)
                    result["phases"][name] = out
                    if profile:  # each phase's files in a folder of its own
                        folder = trace.parent / name.replace(" ", "-")
                        folder.mkdir(parents=True, exist_ok=True)
                        time.sleep(2)  # the engine writes its trace after stop_profile returns
                        for path in set(trace.rglob("*")) - before:
                            if path.is_file():
                                path.rename(folder / path.name)
                        traces[name] = folder
                    q1, q3 = out["stall_quartiles_ms"]
                    engine = (f"; engine: stall {out['engine_stall_median_ms']:7.2f} ms, prefill step host "
                              f"{out['prefill_step_host_median_ms'] or 0:7.2f} ms"
                              if out.get("engine_stall_median_ms") is not None else "; engine: no step times")
                    print(f"{name:24s} stall median {out['stall_median_ms']:7.2f} ms (quartiles {q1:.2f} {q3:.2f}), "
                          f"TTFT median {out['ttft_median_ms']:7.2f} ms, decode gap median "
                          f"{out['decode_gap_median_ms']:6.2f} ms{engine}", flush=True)
                    if out.get("decode_period_median_ms") is not None:
                        host = ", ".join(f"{part} {out[f'decode_{part}_host_median_ms'] or 0:.3f}"
                                         for part in ("schedule", "execute", "sample", "output"))
                        print(f"{'':24s} decode steps of {args.decoders} away from the arrivals: "
                              f"{out['decode_steps']}, period median {out['decode_period_median_ms']:.3f} ms; "
                              f"host spans, median ms: {host}",
                              flush=True)
                    spans = out.get("prefill_step_host_ms") or [0]
                    print(f"{'':24s} first arrival: stall {out['stall_ms'][0]:.2f} ms, prefill step host {spans[0]:.2f}"
                          f" ms; Triton compiled: " + "; ".join(f"{when}: {', '.join(names) or 'nothing'}"
                                                                for when, names in out["compiled"].items()), flush=True)
            (args.out / "mixed_step.json").write_text(json.dumps(result, indent=1))
    if args.profile:
        result["steps"] = {name: step_table(folder) for name, folder in traces.items()}
        print("engine steps in the traced arrivals, median ms (host span / kernels / step to step):")
        for name, table in result["steps"].items():
            print(f"  {name:24s} " + "; ".join(f"{label} x{row['n']}: {row['host_ms']:.2f} / {row['kernels_ms']:.2f}"
                                              f" / {row['interval_ms']:.2f}" for label, row in sorted(table.items())))
        result["trace_diff"] = compare_traces(traces, args.profile_arrivals, args.top)
        (args.out / "mixed_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
