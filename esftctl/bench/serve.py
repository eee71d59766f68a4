"""`esftctl bench serve`: whole-model serving of ESFT adapters against what a user would run instead.

Servers, one after another on one machine, every load run made by vLLM's own serving benchmark
(esftctl.bench.load: TTFT, TPOT, ITL, end-to-end latency, throughput; mean, median, p99):
- `vLLM base`: plain vLLM serving the base alone, the anchor of every ratio;
- `vLLM merged`: plain vLLM serving one adapter merged into a full model (a fine-tune served today);
- `esftctl`: `esftctl serve` with every adapter loaded; its runs spread requests over the first N adapters
  (N = 0: all to the base through the ESFT runtime), uniformly or by a power law (share of the i-th adapter
  ~ 1 / i^alpha, ExpertWeave 5.2), at a low and a high request rate, plus runs over adapters of the size
  DeepSeek published (83-153 experts each, where ExpertWeave's Table 1 adapters have 100-247);
- `vLLM multi-LoRA`, the peer: rank-16 LoRA on every routed expert and on attention (bench.lora_peer),
  `--max-loras` = the largest adapter count, the same runs. GPU only: vLLM's CPU build sends MoE LoRA to its
  Triton kernel, which needs a GPU.
The runs of one server are repeated `repeats` times, interleaved (a rotated order each round); the median
over repeats is reported with the range of the means. Every server also reports its KV-cache room (vLLM's
/metrics), set against the room N merged copies would leave (computed: each copy is the base's bytes again),
and the `esftctl` server times `esftctl adapters load` of one adapter, cold (its file evicted from the page
cache) and warm (in host memory), against bytes / the host-to-device copy bandwidth measured here.

`parallel` (e.g. 1,2) measures every server at each tensor-parallel size in turn (labels "TP=2", or "EP=2"
with `expert_parallel`), each size's ratios against plain vLLM's base at that size, and the throughput of
every server and scenario against its own run at the first size ("tok/s vs first"): what a second GPU buys.

Models: `tiny` (the tiny world's base and synthetic adapters; CI-sized, on the CPU build) or
`deepseek-v2-lite` (bench.synthetic_model: generated on demand into --work, 31 GB; adapters with ExpertWeave
Table 1's per-layer counts). Big files go where they fit: the merged copy is written just before its server
and deleted after it; at most `distinct` bundles (LoRA adapters) are written and served under several names,
each name its own slot with its own memory, so N names cost what N distinct adapters cost.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from esftctl import serve_client
from esftctl.bench import serve_models
from esftctl.bench.disk import evict, read_bandwidth
from esftctl.bench.load import Load, run_load, shares, summary, weighted_names
from esftctl.bench.serve_models import Served
from esftctl.jsonfile import write_json
from esftctl.serve import Server, free_port, plan

INF = math.inf
SERVERS = ("base", "merged", "esftctl", "lora")  # plain vLLM base (always), merged, esftctl serve, multi-LoRA


@dataclass(frozen=True)
class Profile:
    """What one model's bench runs: servers' engine arguments, traffic, adapter counts."""

    model: str
    counts: tuple[int, ...]  # adapters requests are spread over (0: the base)
    rates: tuple[float, ...]  # requests per second: a low one, and inf (all at once)
    prompts: int
    input_len: int
    output_len: int
    repeats: int
    engine_args: tuple[str, ...]
    esft_sized: int = 0  # adapters of DeepSeek's published size, served beside the Table 1 ones
    distinct: int = 10  # bundles (and LoRA adapters) actually written; more names reuse them


PROFILES = {
    "tiny": Profile("tiny", counts=(0, 1, 2), rates=(8.0, INF), prompts=12, input_len=24, output_len=8, repeats=2,
                    engine_args=("--max-model-len", "256", "--max-num-seqs", "32")),
    "deepseek-v2-lite": Profile(
        "deepseek-v2-lite", counts=(0, 1, 5, 10, 20), rates=(4.0, INF), prompts=64, input_len=256, output_len=128,
        repeats=3, esft_sized=5, distinct=10,
        engine_args=("--max-model-len", "2048", "--max-num-seqs", "128", "--gpu-memory-utilization", "0.92")),
}


@dataclass
class Scenario:
    name: str
    models: list[str]  # vLLM's --lora-modules list (names repeated by share); empty: every request to the base
    rate: float
    adapters: int


def scenarios(names: list[str], profile: Profile, alpha: float, extra: list[str] = ()) -> list[Scenario]:
    """Per rate: 0..N adapters uniform; skewed shares too at the highest rate (at a low rate a batch rarely
    holds more than a few requests, so shares barely change it); `extra` adapters at the highest rate."""
    out = []
    for rate in profile.rates:
        for n in profile.counts:
            if n > len(names):
                continue
            label = "base" if n == 0 else f"{n} adapter{'s' * (n > 1)}"
            out.append(Scenario(f"{label}, uniform @ {_rate(rate)}" if n > 1 else f"{label} @ {_rate(rate)}",
                                weighted_names(names[:n], None), rate, n))
            if n > 1 and rate == max(profile.rates):
                out.append(Scenario(f"{label}, skewed @ {_rate(rate)}", weighted_names(names[:n], alpha), rate, n))
    if extra:
        rate = max(profile.rates)
        out.append(Scenario(f"{len(extra)} DeepSeek-sized adapters, uniform @ {_rate(rate)}",
                            weighted_names(list(extra), None), rate, len(extra)))
    return out


def _rate(rate: float) -> str:
    return "inf rps" if math.isinf(rate) else f"{rate:g} rps"


def kv_cache_tokens(url: str) -> int | None:
    """The KV-cache room vLLM reports (its cache_config_info gauge), any server: plain or esftctl."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    m = re.search(r'kv_cache_size_tokens="(\d+)"', text)
    return int(m.group(1)) if m else None


def measure_server(label: str, serve_plan, *, served: Served, profile: Profile, runs: list[Scenario], out: Path,
                   on_step: Callable[[str], None], after: Callable[[str], dict] | None = None) -> dict:
    """Start one server, warm it up, run every scenario `repeats` times interleaved, stop it."""
    on_step(f"{label}: starting vLLM")
    started = time.perf_counter()
    with Server(serve_plan) as server:
        server.wait_ready(timeout=1800)
        ready_s = time.perf_counter() - started
        kv = kv_cache_tokens(serve_plan.url)
        names = list(dict.fromkeys(n for s in runs for n in s.models))
        warm = Load(INF, max(16, 2 * len(names)), profile.input_len, profile.output_len, seed=99)
        on_step(f"{label}: warm-up")  # every name once: first-use costs (kernels, slots) stay out of the numbers
        run_load(serve_plan.url, model=serve_plan.name, tokenizer=served.base, load=warm, models=names,
                 result_dir=out / "warmup", name=_slug(label))
        measured: dict[str, list[dict]] = {s.name: [] for s in runs}
        for rep in range(profile.repeats):
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]
            for s in order:
                on_step(f"{label}: {s.name} ({rep + 1}/{profile.repeats})")
                load = Load(s.rate, profile.prompts, profile.input_len, profile.output_len, seed=rep)
                result = run_load(serve_plan.url, model=serve_plan.name, tokenizer=served.base, load=load,
                                  models=s.models, result_dir=out / "vllm-results",
                                  name=_slug(f"{label} {s.name} r{rep}"))
                measured[s.name].append(summary(result))
        try:  # a failure here keeps the runs measured above
            extra = after(serve_plan.url) if after else {}
        except Exception as e:
            extra = {"after_error": " ".join(str(e).split())[:500]}
            on_step(f"{label}: FAILED after the runs: {extra['after_error']}")
    rows = [{"server": label, "scenario": s.name, "adapters": s.adapters, "rate": _rate(s.rate),
             "shares": shares(s.models) if s.models else {}, **_median(measured[s.name]),
             "repeats": measured[s.name]} for s in runs]
    return {"server": label, "ready_s": ready_s, "kv_cache_tokens": kv, "rows": rows, **extra}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_")


def _median(reps: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    for k in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput"):
        out[f"{k}_range"] = [min(r[k] for r in reps), max(r[k] for r in reps)]
    return out


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
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores[:ranks])), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    before = {k: os.environ.get(k) for k in binding}
    os.environ.update(binding)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(model: str = "tiny", *, work: Path | None = None, scratch: Path | None = None,
        counts: tuple[int, ...] | None = None, rates: tuple[float, ...] | None = None, prompts: int | None = None,
        repeats: int | None = None, alpha: float = 1.0, servers: tuple[str, ...] | None = None, load_repeats: int = 3,
        parallel: tuple[int, ...] = (1,), expert_parallel: bool = False, results_dir: Path = Path("bench-results"),
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    import torch

    profile = PROFILES[model]
    profile = replace(profile, **{k: v for k, v in dict(counts=counts, rates=rates, prompts=prompts,
                                                          repeats=repeats).items() if v is not None})
    gpu = torch.cuda.is_available()
    servers = servers or (SERVERS if gpu else SERVERS[:-1])
    work = Path(work) if work else serve_models.default_work(model)
    scratch = Path(scratch) if scratch else work
    out = Path(results_dir)
    n_max = max(profile.counts)
    served = serve_models.prepare_base(model, work, on_step)
    results, errors = [], {}

    def attempt(server: str, make_plan: Callable, runs: list[Scenario], after=None) -> None:
        """Measure `server` at every parallel size (make_plan(label, vLLM's parallel flags) -> its plan)."""
        for ranks in parallel:
            label = server + parallel_label(ranks, expert_parallel)
            try:
                with cpu_ranks_bound(ranks, gpu):
                    result = measure_server(label, make_plan(label, parallel_args(ranks, expert_parallel)),
                                            served=served, profile=profile, runs=runs, out=out, on_step=on_step,
                                            after=after if ranks == parallel[0] else None)
                results.append({**result, "kind": server, "ranks": ranks})
            except Exception as e:  # one failing server does not lose the others' numbers
                errors[label] = " ".join(str(e).split())[:500]
                on_step(f"{label}: FAILED: {errors[label]}")
            write_json(out / "serve.partial.json", finish(profile, served, results, errors, alpha=alpha, gpu=gpu,
                                                          servers=servers))

    def plain(label: str, model_dir: Path, name: str, args: tuple[str, ...]):
        return plan(model_dir, [], name=name, esft=False, state_dir=work / "state" / _slug(label), port=free_port(),
                    vllm_args=[*profile.engine_args, *args])

    base_runs = [Scenario(f"base @ {_rate(r)}", [], r, 0) for r in profile.rates]
    attempt("vLLM base", lambda label, par: plain(label, served.base, "base", par), base_runs)  # the anchor: always
    if "merged" in servers:
        merged = functools.cache(lambda: serve_models.merged_copy(served, model, scratch, on_step))  # at first use
        attempt("vLLM merged", lambda label, par: plain(label, merged(), "merged", par),
                [replace(s, name=s.name.replace("base", "merged")) for s in base_runs])
        serve_models.drop(scratch, "merged")
    if "esftctl" in servers:
        serve_models.write_adapters(served, model, scratch, n_max, distinct=profile.distinct,
                                    esft_sized=profile.esft_sized, on_step=on_step)
        specs = [f"{n}={p}" for n, p in served.bundles.items()]
        budget = _bundle_bytes(served)
        attempt("esftctl", lambda label, par: plan(served.base, specs, name="base", adapter_memory=budget,
                                                   state_dir=work / "state" / _slug(label), port=free_port(),
                                                   vllm_args=[*profile.engine_args, *par]),
                scenarios(served.table1, profile, alpha, served.esft_sized),
                after=(lambda url: {"adapter_load": adapter_load_times(url, served, load_repeats, on_step)})
                if served.table1 else None)
    if "lora" in servers and n_max:
        serve_models.write_loras(served, scratch, n_max, distinct=profile.distinct, on_step=on_step)
        lora_args = ("--enable-lora", "--max-loras", str(n_max), "--max-cpu-loras", str(n_max), "--max-lora-rank",
                     "16", "--lora-modules", *(f"{n}={p}" for n, p in served.loras.items()))
        attempt("vLLM multi-LoRA", lambda label, par: plain(label, served.base, "base", (*lora_args, *par)),
                scenarios(list(served.loras), profile, alpha))
    return finish(profile, served, results, errors, alpha=alpha, gpu=gpu, servers=servers)


def _bundle_bytes(served: Served) -> int:
    """The adapters' expert bytes together: the memory budget reserved for them (the default reserves the
    largest adapter for every slot, which at 20 Table 1 adapters is more than an H200 holds)."""
    from esftctl.formats.checkpoint import MoECheckpoint

    return sum(_experts(p) for p in served.bundles.values()) * MoECheckpoint(served.base).expert_nbytes


def _experts(bundle: Path) -> int:
    """A bundle's expert count from its manifest (the server verifies the checksum; no need to here)."""
    from esftctl.formats.bundle import MANIFEST, Bundle
    from esftctl.jsonfile import read_json

    return Bundle(bundle, read_json(bundle / MANIFEST)).num_experts


def finish(profile: Profile, served: Served, results: list[dict], errors: dict, *, alpha: float, gpu: bool,
           servers: tuple[str, ...]) -> dict:
    """Ratios against plain vLLM's base at the same rate, and the KV-cache comparison."""
    from esftctl.formats.checkpoint import MoECheckpoint

    base = MoECheckpoint(served.base)
    anchors = {(res["ranks"], r["rate"]): r for res in results if res["kind"] == "vLLM base" for r in res["rows"]}
    first = {}  # (server, scenario) -> its row at the first parallel size measured
    for res in results:
        for r in res["rows"]:
            first.setdefault((res["kind"], r["scenario"]), r)
            a = anchors.get((res["ranks"], r["rate"]))
            if a:
                r["ttft_ratio"] = r["mean_ttft_ms"] / a["mean_ttft_ms"]
                r["tpot_ratio"] = r["mean_tpot_ms"] / a["mean_tpot_ms"]
                r["throughput_ratio"] = r["output_throughput"] / a["output_throughput"]
            r["throughput_vs_first"] = r["output_throughput"] / first[res["kind"], r["scenario"]]["output_throughput"]
    settings = {**asdict(profile), "rates": [_rate(r) for r in profile.rates], "high_rate": _rate(max(profile.rates))}
    parallel = list(dict.fromkeys(res["ranks"] for res in results))  # in the order measured
    return {"benchmark": "serve", "config": {**settings, "alpha": alpha, "servers": list(servers), "parallel": parallel,
                                             "base": str(served.base), "model_bytes": base.total_nbytes,
                                             "device": _device_name(gpu)},
            "servers": results, "errors": errors, "kv_cache": kv_room(results, base, served)}


def _device_name(gpu: bool) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})"


def kv_room(results: list[dict], base, served: Served) -> dict:
    """KV tokens vLLM reported per server, and per adapter count N: the room esftctl leaves with the first N
    Table 1 adapters (the base's room less their experts' bytes, at the model's KV bytes per token; checked
    against the esftctl server's own report with every adapter loaded) against N merged copies on one GPU
    (each copy after the first takes the base's bytes again; 0: they do not fit)."""
    kv = {r["server"]: r["kv_cache_tokens"] for r in results}
    out: dict = {"reported": kv}
    alone = next((r["kv_cache_tokens"] for r in results if r["kind"] == "vLLM base"), None)  # first parallel size
    if not alone or not served.bundles:
        return out
    per_token = _kv_bytes_per_token(base)

    def esft_room(names: list[str]) -> int:
        return alone - sum(_experts(served.bundles[n]) for n in names) * base.expert_nbytes // per_token

    counts = {}
    for n in (1, 2, 4, 5, 10, 20):  # 4: as many merged copies as an H200 holds
        if n <= len(served.table1):
            esft, merged = esft_room(served.table1[:n]), max(alone - (n - 1) * base.total_nbytes // per_token, 0)
            counts[n] = {"esftctl": esft, "merged_copies": merged, "ratio": esft / merged if merged else None}
    out.update({"kv_bytes_per_token": per_token, "by_adapters": counts,
                "esftctl_all_loaded_computed": esft_room(list(served.bundles))})
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
    against its bytes over the host-to-device copy bandwidth (and, cold, over the disk's read bandwidth)."""
    from esftctl.formats.bundle import DATA_FILE

    name = max(served.table1, key=lambda n: _experts(served.bundles[n]))
    path = served.bundles[name]
    data = path / DATA_FILE
    nbytes = data.stat().st_size
    times = {"cold": [], "warm": []}
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
    hits = serve_client.engine_status(url).host_cache_hits
    evict(path)
    disk = read_bandwidth(data)
    copy = serve_models.copy_bandwidth()
    return {"adapter": name, "bytes": nbytes, "seconds": times, "host_cache_hits": hits, "disk_read_bytes_per_s": disk,
            "copy_bytes_per_s": copy, "floor_s": nbytes / copy, "cold_floor_s": max(nbytes / copy, nbytes / disk),
            "warm_over_floor": statistics.median(times["warm"]) / (nbytes / copy),
            "cold_over_floor": statistics.median(times["cold"]) / max(nbytes / copy, nbytes / disk)}


def tables(result: dict) -> list:
    from rich.table import Table

    from esftctl.units import format_bytes

    c = result["config"]
    out = []
    t = Table(title=f"serving on {c['device']}: {c['model']}, {c['prompts']} requests of {c['input_len']} -> "
                    f"{c['output_len']} tokens per run, vLLM bench serve; median of {c['repeats']} interleaved runs; "
                    "ratios against plain vLLM serving the base alone at the same rate", title_justify="left")
    several = len(c.get("parallel", [1])) > 1
    for col in ("server", "scenario", "TTFT ms", "TTFT p99", "TPOT ms", "TPOT p99", "TPOT range", "ITL p99",
                "E2EL ms", "tok/s", "TTFT x", "TPOT x", "tok/s x", *(["tok/s vs first"] if several else [])):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for res in result["servers"]:
        for r in res["rows"]:
            low, high = r["mean_tpot_ms_range"]
            ratios = [f"{r[k]:.3f}" if k in r else "-" for k in ("ttft_ratio", "tpot_ratio", "throughput_ratio")]
            t.add_row(res["server"], r["scenario"], f"{r['mean_ttft_ms']:.1f}", f"{r['p99_ttft_ms']:.1f}",
                      f"{r['mean_tpot_ms']:.2f}", f"{r['p99_tpot_ms']:.2f}", f"{low:.2f}-{high:.2f}",
                      f"{r['p99_itl_ms']:.1f}", f"{r['mean_e2el_ms']:.0f}", f"{r['output_throughput']:.0f}", *ratios,
                      *([f"{r['throughput_vs_first']:.2f}"] if several else []))
    out.append(t)
    kv = result["kv_cache"]
    t = Table(title="KV-cache room: tokens vLLM reports, and per adapter count (esftctl: the base's room less the "
                    "adapters' bytes; merged copies: bound on one GPU)", title_justify="left")
    for col in ("what", "KV tokens", "N merged copies", "esftctl / merged"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for server, tokens in kv["reported"].items():
        t.add_row(f"{server} (reported)", f"{tokens:,}" if tokens else "-", "", "")
    if "esftctl_all_loaded_computed" in kv:
        t.add_row("esftctl, every adapter loaded (computed: checks the report)",
                  f"{kv['esftctl_all_loaded_computed']:,}", "", "")
    for n, row in kv.get("by_adapters", {}).items():
        merged = f"{row['merged_copies']:,}" if row["merged_copies"] else "do not fit"
        t.add_row(f"{n} adapter{'s' * (int(n) > 1)}", f"{row['esftctl']:,}", merged,
                  f"{row['ratio']:.2f}x" if row["ratio"] else "-")
    out.append(t)
    load = next((res["adapter_load"] for res in result["servers"] if "adapter_load" in res), None)
    if load:
        t = Table(title=f"`esftctl adapters load` of {load['adapter']} ({format_bytes(load['bytes'])})",
                  title_justify="left")
        for col in ("from", "median s", "runs", "floor s", "x floor"):
            t.add_column(col, justify="left" if col == "from" else "right")
        for kind, floor in (("cold", load["cold_floor_s"]), ("warm", load["floor_s"])):
            secs = load["seconds"][kind]
            t.add_row(f"{kind} ({'disk' if kind == 'cold' else 'host memory'})", f"{statistics.median(secs):.3f}",
                      " ".join(f"{x:.3f}" for x in secs), f"{floor:.3f}", f"{statistics.median(secs) / floor:.1f}")
        out.append(t)
    for server, error in result["errors"].items():
        out.append(f"[red]{server} failed:[/red] {error}")
    return out


def plot(result: dict, path) -> None:
    """TPOT and TTFT against adapters spread over, per server and share, at the highest rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    high = result["config"]["high_rate"]
    for res in result["servers"]:
        for share in ("uniform", "skewed"):
            rows = [r for r in res["rows"] if r["rate"] == high and "DeepSeek" not in r["scenario"]
                    and (share in r["scenario"] or (r["adapters"] <= 1 and share == "uniform"))]
            if not rows or "tpot_ratio" not in rows[0]:
                continue
            style = "o-" if share == "uniform" else "s--"
            for ax, key in zip(axes, ("tpot_ratio", "ttft_ratio")):
                ax.plot([r["adapters"] for r in rows], [r[key] for r in rows], style, label=f"{res['server']}, {share}")
    for ax, what in zip(axes, ("TPOT", "TTFT")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("adapters the requests are spread over")
        ax.set_ylabel(f"mean {what} / plain vLLM base")
        ax.set_title(f"{what} at {high}, {result['config']['device']}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
