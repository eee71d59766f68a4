"""`esftctl bench serve`: whole-model serving of ESFT adapters against what a user would run instead, in
ExpertWeave's protocol (5.2-5.3).

Servers, one after another on one machine, every load run made by vLLM's own serving benchmark
(esftctl.bench.load: TTFT, TPOT, ITL, end-to-end latency; mean, median, p99; per-request prefill and decode
speed):
- `vLLM base`: plain vLLM serving the base alone, the anchor of every ratio (taken round by round on the same
  machine: esftctl.bench.serve_slices runs it first on every machine);
- `vLLM merged`: plain vLLM serving merged models (a fine-tune served today), as many copies side by side on
  the device as fit (each with its share of the memory; counted, and the count recorded), the requests of
  adapter i going to copy i mod copies, at the largest count and every alpha; one copy serves the base's
  traffic;
- `esftctl`: `esftctl serve` as a user runs it (queued requests admitted by adapter within 10 s, its default:
  esftctl.runtime.serve_config.ADMIT_BY_ADAPTER_S), with every adapter loaded; its runs spread requests over the
  first N adapters (N = 0: all to the base through the ESFT runtime) by S-LoRA's power law (esftctl.bench.traffic:
  alpha 1 uniform, 0.6 / 0.3 / 0.1 more and more skewed; the first alpha at every N, the others at the largest N);
  with the Table 1 shapes, also a run over adapters of DeepSeek's published size at the highest rate;
- `esftctl, groups of G` (`group_adapters`): the same with `esftctl serve --group-adapters G`, at most G
  adapters per engine step (esftctl.runtime.adapter_groups); `esftctl, --max-loras K` (`max_loras`): the same
  with vLLM's own bound, at most K adapters among the running requests, both in vLLM's first-come-first-served
  order (`--admit-by-adapter 0`), so each measures its own lever; `esftctl, admitted by adapter`
  (`admit_by_adapter` S): the same with `esftctl serve --admit-by-adapter S`, queued requests of running adapters
  admitted first, or with S = 0 `esftctl, vLLM's order` (vLLM's first-come-first-served admission): the three
  ways to read fewer rows, and the order without any;
- `vLLM multi-LoRA`, the peer: rank-16 LoRA on every routed expert and on attention (bench.lora_peer),
  `--max-loras` = the largest adapter count, the same runs. GPU only: vLLM's CPU build sends MoE LoRA to its
  Triton kernel, which needs a GPU.

Traffic: at a finite rate, `duration` seconds of Gamma arrivals of coefficient of variation `cv` (1: Poisson;
ExpertWeave: 1 to 5 requests/s over 100 s), at inf `prompts` requests at once. Every server of a run gets the
same requests: same prompts and arrival times (vLLM's seed: the round), same adapter draw (our seed: the run),
each request to that server's i-th adapter (or merged copy). Every server runs its scenarios `repeats` rounds,
started anew for each (its scenarios in an order rotated by the round, the servers too: interleaved) and warmed
up first (serve_runs.warm_up: a burst over every model name, then up to 10 s of the busiest finite rate; the
kernel compiles vLLM's JIT monitor logs during the measured runs are counted and flagged); the median over
rounds is reported, with the ranges and TTFT's spread over them ((max - min) / median of the
rounds' median TTFT), the drawn shares against alpha (chi-square p-value, worst share in standard errors, over
all rounds) and the arrivals' measured cv.

Slices (esftctl.bench.serve_slices, the paging bench's machinery in esftctl.bench.slices): one server started
for one round, or with `slice_by` "adapters" for one adapter count of its round (a DeepSeek-V2-Lite round of
esftctl at 5 counts x 3 rates of 60 s is 15 runs, 17 minutes: an interruption would lose all of them), is one
slice, its JSON written as it ends (the counts of one round share one server start: every count is served by the same
server); a rerun skips what is there, `budget_s` passes over a slice that would overrun, and the report merges
whatever slices there are, saying what is missing.

Microbenchmarks (ExpertWeave 5.3), each server's own slice (once: round 0, and at the first parallel size):
batch-1 median TTFT over prompt lengths (`micro_runs` requests each, one at a time) and median TPOT over
`decode_steps` steps after a `decode_prompt`-token prompt at each batch size, all to the first adapter; on
`esftctl` and multi-LoRA at each count of adapters loaded (the others unloaded in turn: 20, then 5, then 1).

Every server also reports its KV-cache room (vLLM's /metrics), set against the room N merged copies would leave
(computed: each copy is the base's bytes again), and the `esftctl` server times `esftctl adapters load` of one
adapter, cold (its file evicted from the page cache) and warm (in host memory), against bytes / the
host-to-device copy bandwidth measured here.

`parallel` (e.g. 1,2) measures every server at each tensor-parallel size in turn (labels "TP=2", or "EP=2"
with `expert_parallel`), each size's ratios against plain vLLM's base at that size, and the throughput of
every server and scenario against its own run at the first size ("tok/s vs first"): what a second GPU buys.

Models: `tiny` (the tiny world's base and synthetic adapters; CI-sized, on the CPU build) or
`deepseek-v2-lite` (bench.synthetic_model: generated on demand into --work, 31 GB; adapters with ExpertWeave
Table 1's per-layer counts, or DeepSeek's published sizes). Big files go where they fit: the merged copy is
written just before its servers and deleted after them; at most `distinct` bundles (LoRA adapters) are written
and served under several names, each name its own slot with its own memory, so N names cost what N distinct
adapters cost. Routing is the generated model's (about uniform): trained adapters' tokens prefer the experts
their adapter replaced, which this bench does not model (see esftctl.bench.serve_runs).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from esftctl import serve_client
from esftctl.bench import serve_models
from esftctl.bench.disk import evict, read_bandwidth
from esftctl.bench.load import request_ratios
from esftctl.bench.serve_models import Served, adapter_bytes, bundle_experts
from esftctl.bench.serve_report import plot, tables  # noqa: F401  (the CLI finds them here)
from esftctl.bench.serve_runs import Scenario, base_runs, measure_server, part_of, rate_label, scenarios, slug
from esftctl.bench.slices import clustered_median, pair_by_machine, pair_by_round, ratio_by_run
from esftctl.bench.traffic import SLORA_ALPHAS
from esftctl.errors import EsftError, one_line
from esftctl.serve import free_port, plan

INF = math.inf
SERVERS = ("base", "merged", "esftctl", "lora")  # plain vLLM base (always), merged, esftctl serve, multi-LoRA
SLICE_BY = ("server", "adapters")  # a slice: a server's whole round, or one adapter count of it
MICRO = "micro"  # the part of a server's microbenchmarks (and esftctl's adapter load times)
MERGED_HEADROOM = 5 << 30  # bytes each merged copy needs beside its weights: activations, CUDA graphs, some KV


@dataclass(frozen=True)
class Profile:
    """What one model's bench runs: servers' engine arguments, traffic, adapter counts, microbenchmarks."""

    model: str
    counts: tuple[int, ...]  # adapters requests are spread over (0: the base)
    rates: tuple[float, ...]  # requests per second (inf: all at once)
    prompts: int  # requests per run at rate inf
    duration: float  # seconds of arrivals per run at a finite rate: rate x duration requests
    input_len: int
    output_len: int
    repeats: int  # rounds: each server started anew for each
    engine_args: tuple[str, ...]
    alphas: tuple[float, ...] = (1.0,)  # S-LoRA's; the first at every count, the others at the largest
    cv: float = 1.0  # of the gaps between arrivals
    esft_sized: int = 0  # adapters of DeepSeek's published size, served beside the Table 1 ones
    distinct: int = 10  # bundles (and LoRA adapters) actually written; more names reuse them
    shape: str = "table1"  # the grid's adapters: ExpertWeave's Table 1 or "deepseek" (published sizes)
    micro_lengths: tuple[int, ...] = ()  # prompt lengths of the batch-1 TTFT microbenchmark
    micro_batches: tuple[int, ...] = (1,)  # batch sizes of the TPOT microbenchmark
    micro_loaded: tuple[int, ...] = ()  # adapters loaded while esftctl and multi-LoRA run them
    micro_runs: int = 10  # requests per length or batch (0: no microbenchmarks)
    decode_prompt: int = 1024
    decode_steps: int = 128
    slice_by: str = "server"  # SLICE_BY: what one slice runs of a server's round

    def requests(self, rate: float) -> int:
        """Requests in one run at `rate`."""
        return self.prompts if math.isinf(rate) else max(2, round(rate * self.duration))


# Every server runs without vLLM's prefix cache. A server runs several loads (rates, counts, alphas; the
# microbenchmarks' prompt lengths), and the same seed draws the same prompts in each, so the cache served later
# runs' prompts from earlier ones: plain vLLM's base hit it for a large share of its prompt tokens at 2 and 5
# requests/s, esftctl for almost none (a cached block is keyed by its adapter too), which flattered the base's TTFT
# and TPOT. Random prompts share no prefix a user's would, so no server should gain from the cache here.
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)

# vLLM's CUDA graphs cover steps of up to twice --max-num-seqs tokens (256 at 128); a step that prefills a 256-token
# prompt beside a few decodes is past that and runs eagerly, host-bound: it stalls the decodes beside it in plain
# vLLM and esftctl alike, and its host time drifts between runs by more than the few percent this bench resolves.
# Captured up to 512 tokens, the same step stalls them several times less in both servers
# (benchmarks/lab/mixed_step.py measures both). So the GPU profile captures up to 512 for every server (`bench serve
# --capture-size`, which is part of the grid's key through the engine arguments; 0 is vLLM's default).
CAPTURE_SIZE = "--max-cudagraph-capture-size"


def with_flag(engine_args: tuple[str, ...], flag: str, value: str | None) -> tuple[str, ...]:
    """`engine_args` with `flag` set to `value`, last (None: the flag and its value left out)."""
    flagged = {i for i, a in enumerate(engine_args) if a == flag}
    args = tuple(a for i, a in enumerate(engine_args) if i not in flagged and i - 1 not in flagged)
    return args if value is None else (*args, flag, value)


def with_capture_size(engine_args: tuple[str, ...], size: int) -> tuple[str, ...]:
    """`engine_args` capturing CUDA graphs up to `size` tokens (0: vLLM's default, the flag left out)."""
    return with_flag(engine_args, CAPTURE_SIZE, str(size) if size else None)


PROFILES = {
    "tiny": Profile("tiny", counts=(0, 1, 2), rates=(8.0, INF), prompts=12, duration=1.5, input_len=24, output_len=8,
                    repeats=2, alphas=(1.0, 0.3),
                    engine_args=("--max-model-len", "256", "--max-num-seqs", "32", *NO_PREFIX_CACHE),
                    micro_lengths=(16, 64), micro_batches=(1, 4), micro_loaded=(2, 1), micro_runs=3,
                    decode_prompt=64, decode_steps=16),
    "deepseek-v2-lite": Profile(
        "deepseek-v2-lite", counts=(0, 1, 5, 10, 20), rates=(1.0, 2.0, 5.0, INF), prompts=256, duration=60.0,
        input_len=256, output_len=128, repeats=3, alphas=SLORA_ALPHAS, esft_sized=5, distinct=10,
        engine_args=("--max-model-len", "4096", "--max-num-seqs", "128", "--gpu-memory-utilization", "0.92",
                     *NO_PREFIX_CACHE, CAPTURE_SIZE, "512"),  # 4096: the microbenchmarks' 2,048-token prompts and
        # their output fit (issue 15's runs had 2048)
        micro_lengths=(128, 512, 1024, 2048), micro_batches=(1, 8, 32), micro_loaded=(20, 5, 1),
        slice_by="adapters"),  # a whole round of esftctl is too long to lose to an interruption (the module says why)
}


def parallel_args(ranks: int, expert_parallel: bool) -> tuple[str, ...]:
    """vLLM's flags for `ranks`-way tensor (or expert) parallelism."""
    if ranks == 1:
        return ()
    return ("--tensor-parallel-size", str(ranks), *(("--enable-expert-parallel",) if expert_parallel else ()))


def parallel_label(ranks: int, expert_parallel: bool) -> str:
    return "" if ranks == 1 else f" {'EP' if expert_parallel else 'TP'}={ranks}"


@contextlib.contextmanager
def cpu_ranks_bound(ranks: int, gpu: bool):
    """vLLM's CPU build runs tensor parallelism only with each rank's OpenMP threads bound by hand (its own
    binding wants a NUMA node per rank): while a server of `ranks` > 1 starts on the CPU, one core per rank,
    unless the environment binds them already. One rank keeps vLLM's own binding (every core)."""
    if gpu or ranks == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    with environ(VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, cores[:ranks])), VLLM_CPU_NUM_OF_RESERVED_CPU="0"):
        yield


@contextlib.contextmanager
def environ(**values: str):
    """These environment variables while it lasts (a server started inside inherits them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Options:
    """The run's choices beyond the profile: which servers, the three row-saving settings, merged copies."""

    servers: tuple[str, ...]
    parallel: tuple[int, ...] = (1,)
    expert_parallel: bool = False
    group_adapters: int = 0  # > 0: also measure esftctl serve --group-adapters this
    group_wait: int = 8
    max_loras: int = 0  # > 0: also measure esftctl serve with vLLM's --max-loras this
    admit_by_adapter: float | None = None  # also measure esftctl serve --admit-by-adapter this (s; 0: vLLM's order)
    merged_copies: int = 0  # 0: as many as fit
    load_repeats: int = 3


def configure(model: str = "tiny", *, gpu: bool, counts: tuple[int, ...] | None = None,
              rates: tuple[float, ...] | None = None, prompts: int | None = None, duration: float | None = None,
              repeats: int | None = None, alphas: tuple[float, ...] | None = None, cv: float | None = None,
              shape: str | None = None, micro_runs: int | None = None, slice_by: str | None = None,
              capture_size: int | None = None, servers: tuple[str, ...] | None = None,
              **options) -> tuple[Profile, Options]:
    """The profile (the model's, with the choices given) and the options of one `bench serve`; without
    `servers`, every server there is (multi-LoRA only on a GPU)."""
    given = dict(counts=counts, rates=rates, prompts=prompts, duration=duration, repeats=repeats, alphas=alphas,
                 cv=cv, shape=shape, micro_runs=micro_runs, slice_by=slice_by)
    profile = replace(PROFILES[model], **{k: v for k, v in given.items() if v is not None})
    if capture_size is not None:
        profile = replace(profile, engine_args=with_capture_size(profile.engine_args, capture_size))
    return profile, Options(servers=servers or (SERVERS if gpu else SERVERS[:-1]), **options)


@dataclass(frozen=True)
class BenchServer:
    """One server of the bench as its slices know it: `key` names its folder of slices, `kind` its rows."""

    key: str  # base, merged, esftctl, grouped-G-W, admitted-S, max-loras-K, lora; -tp2 (or -ep2) past one rank
    kind: str  # vLLM base, vLLM merged, esftctl, "esftctl, groups of G", "esftctl, admitted by adapter",
    # "esftctl, vLLM's order", "esftctl, --max-loras K", vLLM multi-LoRA
    role: str  # what it serves and runs: base, merged, esftctl or lora
    ranks: int = 1
    serve: tuple[tuple[str, float], ...] = ()  # esftctl serve's settings of this kind (--group-adapters, ...)
    vllm_extra: tuple[str, ...] = ()  # vLLM arguments of this kind (--max-loras K)

    @property
    def scheduling_stats(self) -> bool:
        """Whether its runs report what the grouping scheduler did: the servers that set grouping or admission
        explicitly. Those counts run from a server's start, so each of its slices starts its own
        (serve_slices.shares_start). The plain `esftctl` server admits by adapter too, its default, but reports
        nothing, so that its counts share one start as before; side_by_side.py measures the order's effect."""
        return any(value for key, value in self.serve if key in ("group_adapters", "admit_by_adapter"))


def bench_servers(profile: Profile, options: Options) -> list[BenchServer]:
    """The servers the options ask for, each at every parallel size: plain vLLM's base (always, the anchor),
    merged copies, esftctl (plain, grouped, admitted by adapter, under --max-loras), multi-LoRA (when some count
    has adapters)."""
    o = options
    kinds = [BenchServer("base", "vLLM base", "base")]
    if "merged" in o.servers:
        kinds.append(BenchServer("merged", "vLLM merged", "merged"))
    if "esftctl" in o.servers:
        kinds.append(BenchServer("esftctl", "esftctl", "esftctl"))
    fcfs = ("admit_by_adapter", 0.0)  # the grouped and --max-loras servers: one lever each, in vLLM's order
    if o.group_adapters:
        kinds.append(BenchServer(f"grouped-{o.group_adapters}-{o.group_wait}", f"esftctl, groups of {o.group_adapters}",
                                 "esftctl", serve=(("group_adapters", o.group_adapters), ("group_wait", o.group_wait),
                                                   fcfs)))
    if o.admit_by_adapter is not None:
        kinds.append(BenchServer(f"admitted-{o.admit_by_adapter:g}", "esftctl, admitted by adapter"
                                 if o.admit_by_adapter else "esftctl, vLLM's order", "esftctl",
                                 serve=(("admit_by_adapter", o.admit_by_adapter),)))
    if o.max_loras:
        kinds.append(BenchServer(f"max-loras-{o.max_loras}", f"esftctl, --max-loras {o.max_loras}", "esftctl",
                                 serve=(fcfs,), vllm_extra=("--max-loras", str(o.max_loras))))
    if "lora" in o.servers and max(profile.counts):
        kinds.append(BenchServer("lora", "vLLM multi-LoRA", "lora"))
    suffix = "ep" if o.expert_parallel else "tp"
    return [replace(k, key=k.key if ranks == 1 else f"{k.key}-{suffix}{ranks}", ranks=ranks)
            for k in kinds for ranks in o.parallel]


def adapter_runs(profile: Profile, role: str) -> list[Scenario]:
    """The scenarios of esftctl's servers or multi-LoRA's, as write_adapters and write_loras will name them:
    the largest count's grid names (and, beside Table 1's, DeepSeek-sized ones on esftctl)."""
    extra = profile.esft_sized if role == "esftctl" and profile.shape == "table1" and profile.model != "tiny" else 0
    return scenarios(profile, max(profile.counts), extra)


@dataclass
class Job:
    """One server ready to start: its plans (label, vLLM's parallel flags -> plans), every scenario of its round,
    the model names each pool maps to, and what runs after: `after` in a runs slice, `micro` in a micro slice."""

    plans: Callable[[str, tuple[str, ...]], list]
    runs: list[Scenario]
    names: dict = field(default_factory=dict)
    routes: Callable[[list], dict | None] | None = None
    after: Callable[[str], dict] | None = None
    micro: Callable[[str], dict] | None = None
    env: dict = field(default_factory=dict)


class Bench:
    """What `bench serve` measures, a slice at a time (esftctl.bench.serve_slices decides which): one server
    started for one round of its scenarios (or of one part of them: an adapter count), or for its
    microbenchmarks (part MICRO)."""

    def __init__(self, profile: Profile, options: Options, *, served: Served, work: Path, scratch: Path, out: Path,
                 gpu: bool, on_step: Callable[[str], None]):
        self.profile, self.options, self.served = profile, options, served
        self.work, self.scratch, self.out, self.gpu, self.on_step = work, scratch, out, gpu, on_step

    def label(self, kind: str, ranks: int) -> str:
        return kind + parallel_label(ranks, self.options.expert_parallel)

    def measure(self, server: BenchServer, *, round: int, parts: tuple[str, ...] = ("",),
                copies: int = 0) -> Iterator[dict]:
        """Start `server` once and run round `round` of its scenarios, part by part (a part: "" all of them, an
        adapter count's, or MICRO: its microbenchmarks instead), yielding each part's result; the server stops
        when the last is taken or the generator is closed. `copies`: merged copies to start with (0: the
        option's, else as many as fit); merged copies run one part."""
        if server.role == "merged":
            (part,) = parts
            yield self.merged(server, round=round, part=part, copies=copies)
            return
        label = self.label(server.kind, server.ranks)
        job = {"base": self.base_job, "esftctl": self.esftctl_job, "lora": self.lora_job}[server.role](server, label)
        for result in self.start(server, job, label, round=round, parts=parts):
            yield {**result, "kind": server.kind}

    def start(self, server: BenchServer, job: Job, label: str, *, round: int, parts: tuple[str, ...]
              ) -> Iterator[dict]:
        runs = [[] if part == MICRO else [s for s in job.runs if not part or part_of(s) == part] for part in parts]
        with environ(**job.env), cpu_ranks_bound(server.ranks, self.gpu):  # held while the server runs
            plans = job.plans(label, parallel_args(server.ranks, self.options.expert_parallel))
            yield from measure_server(label, plans, served=self.served, profile=self.profile, parts=runs,
                                      names=job.names, routes=job.routes(plans) if job.routes else None,
                                      out=self.out, round=round, on_step=self.on_step,
                                      after=job.micro if MICRO in parts else job.after, order=job.runs)

    def plain(self, label: str, model_dir: Path, name: str, args: tuple[str, ...]):
        return plan(model_dir, [], name=name, esft=False, state_dir=self.work / "state" / slug(label),
                    port=free_port(), vllm_args=[*self.profile.engine_args, *args])

    def micro_after(self, model: str, loaded: Callable | None = None, available: int = 0) -> Callable[[str], dict]:
        from esftctl.bench.serve_micro import microbench

        def after(url: str) -> dict:
            return {"micro": microbench(url, model=model, tokenizer=self.served.base, profile=self.profile,
                                        out=self.out, on_step=self.on_step, loaded=loaded, available=available)}
        return after if self.profile.micro_runs else (lambda url: {})

    def base_job(self, server: BenchServer, label: str) -> Job:
        return Job(lambda label, par: [self.plain(label, self.served.base, "base", par)], base_runs(self.profile),
                   micro=self.micro_after("base"))

    def merged(self, server: BenchServer, *, round: int, part: str, copies: int) -> dict:
        """Merged copies side by side: `copies` (0: the option's, else as many as fit), one fewer after a failed
        start (each failure kept in the result). The copy is written for the slice and removed after it: the disk
        holds it or the adapters, not both."""
        copies = copies or self.options.merged_copies or merged_fit(self.served.base, self.profile.engine_args,
                                                                    self.gpu)
        failed: dict[str, str] = {}
        try:
            model_dir = serve_models.merged_copy(self.served, self.profile.model, self.scratch, self.on_step)
            while True:
                kind = f"vLLM merged x{copies}" if copies > 1 else "vLLM merged"
                job = Job(lambda label, par, m=copies: self.merged_plans(label, model_dir, m, par),
                          self.merged_runs(copies),
                          names={"grid": [f"merged-{j % copies}" for j in range(max(self.profile.counts))]},
                          routes=lambda plans: {p.name: p.url for p in plans} if len(plans) > 1 else None,
                          micro=self.micro_after("merged" if copies == 1 else "merged-0"))
                try:
                    (result,) = self.start(server, job, self.label(kind, server.ranks), round=round, parts=(part,))
                    return {**result, "kind": kind, "copies": copies, "failed_copies": failed}
                except Exception as e:
                    if copies == 1:
                        raise
                    failed[str(copies)] = one_line(e, 500)
                    self.on_step(f"{kind}: FAILED, one copy fewer: {failed[str(copies)]}")
                    copies -= 1
        finally:
            serve_models.drop(self.scratch, "merged")

    def merged_runs(self, copies: int) -> list[Scenario]:
        """One copy takes every request: the base's traffic. Several: the largest count at every alpha (the count
        only changes how the requests split over the copies; the skew unbalances them, ExpertWeave's Figure 6)."""
        if copies == 1:
            return [replace(s, name=s.name.replace("base", "merged")) for s in base_runs(self.profile)]
        largest = max(self.profile.counts)
        return [s for s in scenarios(self.profile, largest, 0) if s.adapters == largest > 1]

    def merged_plans(self, label: str, model_dir: Path, copies: int, par: tuple[str, ...]) -> list:
        if copies == 1:
            return [self.plain(label, model_dir, "merged", par)]
        share = share_memory(self.profile.engine_args, copies)
        return [plan(model_dir, [], name=f"merged-{j}", esft=False, port=free_port(), vllm_args=[*share, *par],
                     state_dir=self.work / "state" / slug(f"{label}-{j}")) for j in range(copies)]

    def esftctl_job(self, server: BenchServer, label: str) -> Job:
        served, profile = self.served, self.profile
        serve_models.write_adapters(served, profile.model, self.scratch, max(profile.counts), distinct=profile.distinct,
                                    esft_sized=profile.esft_sized if profile.shape == "table1" else 0,
                                    shape=profile.shape, on_step=self.on_step)
        settings = dict(server.serve)
        job = Job(lambda label, par: [self.esftctl_plan(label, par, server.vllm_extra, **settings)],
                  scenarios(profile, len(served.grid), len(served.esft_sized)),
                  names={"grid": served.grid, "esft_sized": served.esft_sized},
                  after=self.group_stats(label) if server.scheduling_stats else None)
        if server.kind == "esftctl" and served.grid:  # only here: microbenchmarks (batch 1 groups nothing) and loads
            job.micro = _chain(lambda url: {"adapter_load": adapter_load_times(
                url, served, self.options.load_repeats, self.on_step)},
                self.micro_after(served.grid[0], loaded=self.unloader(served.grid, served.esft_sized),
                                 available=len(served.grid)))
        return job

    def group_stats(self, label: str) -> Callable[[str], dict]:
        """What the grouping scheduler did over the runs, held steps or reordered queues
        (esftctl.runtime.vllm.adapter_groups writes it)."""
        from esftctl.jsonfile import read_json
        from esftctl.runtime.adapter_groups import stats_file

        path = stats_file(self.work / "state" / slug(label) / "status.json")
        return lambda url: {"groups": read_json(path)}

    def esftctl_plan(self, label: str, par: tuple[str, ...], vllm_extra: tuple[str, ...] = (), **settings):
        specs = [f"{n}={p}" for n, p in self.served.bundles.items()]
        memory = adapter_bytes(self.served.base, self.served.bundles.values())
        return plan(self.served.base, specs, name="base", adapter_memory=memory,
                    state_dir=self.work / "state" / slug(label), port=free_port(),
                    vllm_args=[*self.profile.engine_args, *par, *vllm_extra], **settings)

    def unloader(self, grid: list[str], others: list[str]) -> Callable[[str, int], None]:
        """unload(url, k): leave the first k grid adapters loaded (vLLM's /v1/unload_lora_adapter); a refused unload
        stops the microbenchmarks (its numbers would be labelled with a count not loaded)."""
        gone: set[str] = set()

        def unload(url: str, k: int) -> None:
            for name in [*grid[k:], *others]:
                if name not in gone:
                    serve_client.unload(url, name)
                    gone.add(name)
        return unload

    def lora_job(self, server: BenchServer, label: str) -> Job:
        served, n_max = self.served, max(self.profile.counts)
        serve_models.write_loras(served, self.scratch, n_max, distinct=self.profile.distinct, on_step=self.on_step)
        lora_args = ("--enable-lora", "--max-loras", str(n_max), "--max-cpu-loras", str(n_max), "--max-lora-rank",
                     "16", "--lora-modules", *(f"{n}={p}" for n, p in served.loras.items()))
        names = list(served.loras)
        return Job(lambda label, par: [self.plain(label, served.base, "base", (*lora_args, *par))],
                   scenarios(self.profile, len(names), 0), names={"grid": names},
                   micro=self.micro_after(names[0], loaded=self.unloader(names, []), available=len(names)),
                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # the microbenchmarks unload adapters


def _chain(first: Callable[[str], dict], then: Callable[[str], dict]) -> Callable[[str], dict]:
    return lambda url: {**first(url), **then(url)}


def merged_fit(base: Path, engine_args: tuple[str, ...], gpu: bool) -> int:
    """Merged copies that fit the device side by side: its memory at vLLM's utilization over the model's bytes and
    MERGED_HEADROOM each (an H100: 2, an H200: 3); 1 on the CPU build."""
    if not gpu:
        return 1
    import torch

    from esftctl.formats.checkpoint import MoECheckpoint

    total = torch.cuda.mem_get_info()[1]
    return max(1, int(utilization(engine_args) * total // (MoECheckpoint(base).total_nbytes + MERGED_HEADROOM)))


MEMORY_FLAG = "--gpu-memory-utilization"


def utilization(engine_args: tuple[str, ...] | list[str]) -> float:
    """The share of the card the engine arguments give vLLM (its default, 0.9, without the flag)."""
    args = list(engine_args)
    return float(args[args.index(MEMORY_FLAG) + 1]) if MEMORY_FLAG in args else 0.9


def share_memory(engine_args: tuple[str, ...], copies: int) -> list[str]:
    """The engine arguments with each of `copies` like servers given its share of the device's memory (the CPU
    build's KV cache is sized by VLLM_CPU_KVCACHE_SPACE per server instead)."""
    return split_memory(engine_args, [0] * copies, card=1)[0]  # nothing set aside: the card's size cancels out


def split_memory(engine_args: tuple[str, ...], aside: list[int], *, card: int) -> list[list[str]]:
    """The engine arguments of servers sharing one card of `card` bytes, server i setting aside `aside[i]` bytes
    inside its share (esftctl's adapter experts; 0 for plain vLLM): each gets an equal part of the profile's share
    less every set-aside, plus its own, so all keep the same room for weights, activations and KV cache. Halving
    the share instead leaves esftctl beside plain vLLM no KV cache at all on an H200 (half the card is less than a
    DeepSeek-V2-Lite base and 20 adapters' experts). The CPU build sizes each server's KV cache itself."""
    if MEMORY_FLAG not in engine_args:
        return [list(engine_args) for _ in aside]
    each = (utilization(engine_args) * card - sum(aside)) / len(aside)
    if each <= 0:
        raise EsftError(f"{sum(aside) / 2**30:.1f} GiB set aside leave the {len(aside)} servers no memory of a "
                        f"{card / 2**30:.1f} GiB card's share")
    return [list(with_flag(engine_args, MEMORY_FLAG, f"{(each + a) / card:.3f}")) for a in aside]


RATIOS = (("ttft_ratio", "mean_ttft_ms"), ("tpot_ratio", "mean_tpot_ms"), ("throughput_ratio", "output_throughput"),
          ("median_ttft_ratio", "median_ttft_ms"), ("median_tpot_ratio", "median_tpot_ms"),
          ("p99_ttft_ratio", "p99_ttft_ms"), ("p99_tpot_ratio", "p99_tpot_ms"),
          ("prefill_ratio", "median_prefill_tps"), ("decode_ratio", "median_decode_tps"),
          ("ttft_alone_ratio", "median_ttft_alone_ms"), ("ttft_beside_ratio", "median_ttft_beside_ms"),
          ("stall_ratio", "median_stall_ms"), ("decode_time_ratio", "server_decode_ms"),
          ("p10_tpot_ratio", "p10_tpot_ms"), ("p10_ttft_alone_ratio", "p10_ttft_alone_ms"))
BY_ROUND = ("ttft_ratio", "median_tpot_ratio", "throughput_ratio")  # the main table's TTFT mean x, TPOT x, tok/s x


@dataclass(frozen=True)
class ModelFacts:
    """What the report needs of the base and the adapters, read where a slice ran (the report may be built where
    neither is: the dev machine): bytes, KV bytes per token, each grid adapter's experts."""

    base: str
    model_bytes: int
    expert_bytes: int
    kv_bytes_per_token: int
    grid_experts: tuple[int, ...] = ()  # experts of the grid's adapters, in order (empty before they were written)
    all_experts: int = 0  # of every bundle served (the grid's and the DeepSeek-sized ones beside)

    @classmethod
    def of(cls, served: Served) -> ModelFacts:
        from esftctl.formats.checkpoint import MoECheckpoint

        base = MoECheckpoint(served.base)
        return cls(str(served.base), base.total_nbytes, base.expert_nbytes, _kv_bytes_per_token(base),
                   tuple(bundle_experts(served.bundles[n]) for n in served.grid),
                   sum(bundle_experts(p) for p in served.bundles.values()))

    @classmethod
    def from_json(cls, data: dict) -> ModelFacts:
        return cls(**{**data, "grid_experts": tuple(data.get("grid_experts", ()))})


def finish(profile: Profile, facts: ModelFacts | None, results: list[dict], errors: dict, *, device: str,
           options: Options) -> dict:
    """Ratios against plain vLLM's base at the same rate (and parallel size), and the KV-cache comparison."""
    anchors = {(res["ranks"], r["rate"]): r for res in results if res["kind"] == "vLLM base" for r in res["rows"]}
    first = {}  # (server, scenario) -> its row at the first parallel size measured
    for res in results:
        for r in res["rows"]:
            first.setdefault((res["kind"], r["scenario"]), r)
            if (a := anchors.get((res["ranks"], r["rate"]))) is not None:
                paired_ratios(r, a)
                request_paired(r, a, profile.output_len)
            r["throughput_vs_first"] = r["output_throughput"] / first[res["kind"], r["scenario"]]["output_throughput"]
    for res in results:
        for r in res["rows"]:
            r.pop("per_request", None)  # the slices keep them; the report keeps what they gave
    micro_ratios(results)
    settings = {**asdict(profile), "rates": [rate_label(r) for r in profile.rates],
                "high_rate": rate_label(max(profile.rates))}
    parallel = list(dict.fromkeys(res["ranks"] for res in results))  # in the order measured
    return {"benchmark": "serve", "config": {**settings, **asdict(options), "servers": list(options.servers),
                                             "parallel": parallel, "base": facts.base if facts else None,
                                             "model_bytes": facts.model_bytes if facts else None, "device": device},
            "servers": results, "errors": errors, "kv_cache": kv_room(results, facts)}


def paired_ratios(r: dict, base: dict) -> None:
    """A row's RATIOS against plain vLLM's base row at the same rate, like with like: each round against the
    base's runs of the same round (the same traffic) on its machine (esftctl.bench.slices.ratio_by_run),
    the median of those ratios with their range; a round with no such base run is left out. A row with none is
    paired by round across machines where it can be (`paired_across`: the same traffic on another card; a run's
    TPOT follows its traffic more than its card), else its median against the base's median, across
    machines and rounds (`paired_rounds` 0)."""
    where, base_where = _where(r), _where(base)
    r["paired_rounds"] = len(pair_by_machine(where, base_where))
    pairs, across = pair_by_machine, None if r["paired_rounds"] else pair_by_round(where, base_where)
    if across:
        pairs, r["paired_across"] = pair_by_round, len(across)
    by_run = {}  # BY_ROUND's ratios, run index -> ratio
    for key, metric in RATIOS:
        per_run = ratio_by_run([(*w, rep.get(metric)) for w, rep in zip(where, r.get("repeats", []))],
                               [(*w, b.get(metric)) for w, b in zip(base_where, base.get("repeats", []))], pairs)
        if values := [v for v in per_run.values() if v is not None]:
            r[key], r[f"{key}_range"] = statistics.median(values), [min(values), max(values)]
        elif not r["paired_rounds"] and r.get(metric) is not None and base.get(metric):
            r[key] = r[metric] / base[metric]
        if key in BY_ROUND:
            by_run[key] = per_run
    if r is not base:
        r["by_round"] = round_ratios(r, base, pairs, by_run)


def round_ratios(r: dict, base: dict, pairs: Callable, by_run: dict[str, dict[int, float | None]]) -> list[dict]:
    """Each paired run's main ratios (`by_run`: BY_ROUND's, from paired_ratios) and both sides' GPU busy share
    (nvidia-smi's utilization over the run, esftctl.bench.conditions): what one start moves, where a median over
    rounds hides it: over 20 adapters on two H100s, esftctl's throughput was 0.802x the base's in the one round
    whose first runs had kept the GPU busy 65-71% of the time, against 84-91% in every other run
    (benchmarks/RESULTS.md, Adapters against the base)."""
    where, reps = _where(r), r.get("repeats", [])
    out = []
    for i, js in pairs(where, _where(base)):
        busy = [base["repeats"][j].get("gpu_util") for j in js]
        out.append({"round": where[i][0], "machine": where[i][1], **{key: by_run[key][i] for key in BY_ROUND},
                    "gpu_util": reps[i].get("gpu_util"),
                    "base_gpu_util": statistics.median(busy) if None not in busy else None})
    return out


def request_paired(r: dict, base: dict, output_len: int) -> None:
    """`request_ratios`: a row's requests against the same requests (the same prompt sent at the same time) in the
    base's run of their round on their machine (esftctl.bench.load.request_ratios), each kind's median with its 95%
    interval over rounds and requests (esftctl.bench.slices.clustered_median), and how many rounds and requests
    paired. For plain vLLM's base row itself: its run of a round on a later machine over its first run of that
    round, plain vLLM against itself (`against`: another machine), the yardstick for what a start and a card move."""
    where = _where(r)
    pairs = _same_round_elsewhere(where) if r is base else pair_by_machine(where, _where(base))
    groups: dict[str, list[list[float]]] = {}
    for i, js in pairs:
        for kind, values in request_ratios(r["per_request"][i], base["per_request"][js[0]], output_len).items():
            groups.setdefault(kind, []).append(values)
    medians = {kind: clustered_median(g) for kind, g in groups.items()}
    if medians.get("ttft"):
        r["request_ratios"] = {**{k: list(m) for k, m in medians.items() if m},
                               "rounds": sum(1 for g in groups["ttft"] if g),
                               "requests": sum(len(g) for g in groups["ttft"]),
                               "against": "another machine" if r is base else "same machine"}


def _same_round_elsewhere(where: list[tuple[int, str | None]]) -> list[tuple[int, list[int]]]:
    """Each run (round, machine) with the first earlier run of its round on another machine, as pair_by_round
    gives them."""
    out = []
    for i, (rnd, machine) in enumerate(where):
        j = next((j for j, (r, m) in enumerate(where[:i]) if r == rnd and m != machine), None)
        if j is not None:
            out.append((i, [j]))
    return out


def _where(row: dict) -> list[tuple[int, str | None]]:
    """A row's runs as (round, machine), the pairing's key (a row without its rounds pairs with nothing)."""
    reps = row.get("repeats", [])
    return list(zip(row.get("rounds", range(len(reps))), row.get("machines") or [None] * len(reps)))


def micro_ratios(results: list[dict]) -> None:
    """Each microbenchmark number against plain vLLM's base's (same size, same length or batch); `micro_across`
    where the two ran on different machines (slices run on different machines or after a restart)."""
    anchors = {res["ranks"]: res for res in results if res["kind"] == "vLLM base" and res.get("micro")}
    for res in results:
        base = anchors.get(res["ranks"])
        anchor = next(iter(base["micro"].values())) if base else None
        if base and res.get("micro"):
            res["micro_across"] = res.get("micro_machine") != base.get("micro_machine")
        for row in (res.get("micro") or {}).values() if anchor else ():
            for what in ("ttft_ms", "tpot_ms"):
                row[f"{what}_ratio"] = {k: v / anchor[what][k] for k, v in row[what].items()
                                        if v and anchor[what].get(k)}


def device_name(gpu: bool) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})"


def kv_room(results: list[dict], facts: ModelFacts | None) -> dict:
    """KV tokens vLLM reported per server, and per adapter count N: the room esftctl leaves with the first N
    grid adapters (the base's room less their experts' bytes, at the model's KV bytes per token; checked
    against the esftctl server's own report with every adapter loaded) against N merged copies on one GPU
    (each copy after the first takes the base's bytes again; 0: they do not fit)."""
    kv = {r["server"]: r["kv_cache_tokens"] for r in results}
    out: dict = {"reported": kv}
    alone = next((r["kv_cache_tokens"] for r in results if r["kind"] == "vLLM base"), None)  # first parallel size
    if not alone or not facts or not facts.grid_experts:
        return out
    per_token = facts.kv_bytes_per_token

    def esft_room(experts: int) -> int:
        return alone - experts * facts.expert_bytes // per_token

    counts = {}
    for n in (1, 2, 4, 5, 10, 20):  # 4: as many merged copies as an H200 holds
        if n <= len(facts.grid_experts):
            esft = esft_room(sum(facts.grid_experts[:n]))
            merged = max(alone - (n - 1) * facts.model_bytes // per_token, 0)
            counts[n] = {"esftctl": esft, "merged_copies": merged, "ratio": esft / merged if merged else None}
    out.update({"kv_bytes_per_token": per_token, "by_adapters": counts,
                "esftctl_all_loaded_computed": esft_room(facts.all_experts)})
    return out


def _kv_bytes_per_token(base) -> int:
    """KV-cache bytes one token takes in vLLM (a bf16 cache: an fp8 one takes half): MLA keeps kv_lora_rank +
    rope dims per layer, others K and V."""
    c = base.config
    if c.get("kv_lora_rank"):
        per_layer = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    else:
        head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        per_layer = 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head
    return per_layer * c["num_hidden_layers"] * 2


def adapter_load_times(url: str, served: Served, repeats: int, on_step: Callable[[str], None]) -> dict:
    """`esftctl adapters load` of the largest adapter: cold (from disk: its file touched, so the server's host
    cache misses, and evicted from the page cache) and warm (again at once: from the server's host cache),
    against its bytes over the host-to-device copy bandwidth (and, cold, over the disk's read bandwidth); with
    the engine's own seconds of each load by phase (runtime.engine_status.LOAD_PHASES) and whence it came."""
    from esftctl.formats.bundle import DATA_FILE

    name = max(served.grid, key=lambda n: bundle_experts(served.bundles[n]))
    path = served.bundles[name]
    data = path / DATA_FILE
    nbytes = data.stat().st_size
    times, engine = {"cold": [], "warm": []}, {"cold": [], "warm": []}
    for rep in range(repeats):
        for kind in ("cold", "warm"):
            on_step(f"esftctl: adapter load, {kind} ({rep + 1}/{repeats})")
            serve_client.unload(url, name)
            if kind == "cold":  # a changed file misses the server's host cache; its pages leave the page cache
                os.utime(data)
                evict(path)
            start = time.perf_counter()
            serve_client.load(url, name, path)
            times[kind].append(time.perf_counter() - start)
            loaded = next(a for a in serve_client.engine_status(url).adapters if a.name == name)
            engine[kind].append({"from": loaded.loaded_from, **loaded.load_s})  # the engine's phases of it
    hits = serve_client.engine_status(url).host_cache_hits
    evict(path)
    disk = read_bandwidth(data)
    copy = serve_models.copy_bandwidth()
    return {"adapter": name, "bytes": nbytes, "seconds": times, "engine": engine, "host_cache_hits": hits,
            "disk_read_bytes_per_s": disk,
            "copy_bytes_per_s": copy, "floor_s": nbytes / copy, "cold_floor_s": max(nbytes / copy, nbytes / disk),
            "warm_over_floor": statistics.median(times["warm"]) / (nbytes / copy),
            "cold_over_floor": statistics.median(times["cold"]) / max(nbytes / copy, nbytes / disk)}
