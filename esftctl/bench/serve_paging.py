"""`esftctl bench paging --serve`: FluxMoE's evaluation end to end (issue 28, item 4), whole servers driven by
vLLM's own load generator, in slices that resume: an interrupted run keeps every slice it finished.

Why under `bench paging` and not `bench serve`: what it reuses of `bench serve` is below its options (starting
servers: esftctl.serve.plan and Server; vLLM's `bench serve` runs: esftctl.bench.load; generated models and
adapters: esftctl.bench.serve_models; the KV room from /metrics: serve_runs.kv_cache_tokens; medians and ranges:
serve_runs.median_of), while that command's options (adapter counts, S-LoRA skews, merged copies, multi-LoRA,
ExpertWeave's microbenchmarks) mean nothing here; `bench paging` is the same pager's layer-stack microbenchmark,
and this is its end-to-end counterpart.

Regimes (REGIMES), each a set of servers and of traffic points; every server of a regime gets the same requests
(vLLM's random dataset seeded by the round, the adapters drawn by esftctl.bench.traffic from the run's seed):
- memory-bound: a 48 GB card (FluxMoE's A40) emulated on both sides with `--gpu-memory-utilization` = 48 GB / the
  device's memory; 256 requests of 3,584 tokens in and 512 out, all at once, at most 256 in flight. The resident
  DeepSeek-V2-Lite (31.4 GB) leaves plain vLLM about 13 GiB of KV cache (about 110 such requests), so vLLM
  queues and preempts; paging gives the experts' memory to the KV cache. The Qwen3-30B-A3B-shaped model (32
  layers, 41.1 GB; GQA: 64 KiB of KV per token against MLA's 31) leaves it much less.
- spare: memory to spare (vLLM's default utilization), CUDA graphs on both sides: batch 1 (4 requests one at a
  time) and batch 32 (32 at once), 1,024 tokens in and 256 out.
- machinery: the spare regime's traffic on esftctl resident against `--paging-window` = every MoE layer: each
  layer keeps its own memory and the pager runs in the path with nothing to fetch (with and without the store
  tier's masked decoder): the paging machinery alone (target: within 3% of resident).
Servers (SERVERS): plain vLLM (its own preemption), esftctl resident, paged with the compressed GPU tier (every
base expert Huffman-coded on the GPU, `--store-experts` = all), paged with the fixed-rate tier (every base expert
in the fixed-rate code on the GPU, `--paging-codec fixed`: 75% of bf16 against 68%, and in the layer-stack bench the
faster of the two at every batch), paged from host memory, adaptive (the planner, with
the store split by measured speeds), each also `+adapters` (ADAPTERS DeepSeek-sized adapters loaded, the requests
spread over them uniformly). Plain vLLM has no `+adapters`: an adapter is served there as a merged model of the
base's exact shape, whose speed is the base's.

Per server and point: output tok/s, TTFT and TPOT (median, p99), the KV-cache tokens vLLM reports (/metrics, else
its log's "GPU KV cache size"), vLLM's preemptions during the run (/metrics), the GPU memory of each tier and the
KV tokens paging bought (GET /esftctl/status), the rows fetched per paged layer and step (the pager's counters:
bytes a step loads), and where the adaptive planner timed eager steps its compute and load milliseconds per
layer (steps replayed from CUDA graphs time nothing: the pager's counters give rows, not times).

Slices. One slice is one server started for one round of one regime: its points run once, its JSON is written
to OUT/slices/MODEL/REGIME/SERVER/rROUND.json, and existing slice files are skipped, so a run resumes where the
last stopped (on another machine too, with the folder carried). Slices go round by round, the servers of a round
in a rotated order (interleaved repeats); `budget_s` passes over a slice its estimate would overrun (the wall
time of this server's slice measured before, else SLICE_ESTIMATE_S). A slice runs after the regime's anchor (the
server its target is set against: plain vLLM where memory binds, esftctl resident otherwise) ran its round on
the same machine (esftctl.bench.slices.anchored: the anchor's slice of the round, else the round once more,
`on-<machine>.rROUND.json`), and each slice records its machine: ratios set across machines would put a server
against the anchor's rounds on other cards of the same kind, which differ by a few percent among themselves.
`report` merges every slice file into medians over rounds with ranges, ratios to plain vLLM and to esftctl
resident (round by round on the same machine where the slices say so, else the medians'), and the targets of
issue 28. The
slices' machinery (order, resumption, budget, atomic writes) is esftctl.bench.slices, shared with `bench serve`.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from esftctl.bench.conditions import Watch
from esftctl.bench.slices import (
    PREPARE_S,
    Slice,
    anchor_runs,
    anchored,
    machine_id,
    measured_walls,
    pending,
    ratios_within_machines,
    run_pending,
    slice_order,
)
from esftctl.bench.slices import load_slices as _load_slices
from esftctl.jsonfile import write_json
from esftctl.runtime.engine_status import STATUS_EVERY_S

CARD_BYTES = 48 * 10**9  # the memory-bound regime's card: FluxMoE's A40
ADAPTERS = 4  # DeepSeek-sized adapters (83-153 experts) loaded by the `+adapters` servers
WINDOW = 2  # layers' blocks of the paged servers: the least that fetches the next layer while one computes
# Seconds of a slice before one was measured (H100, DeepSeek-V2-Lite): a start with CUDA graphs 100-150 s, a
# warm-up 20 s, then the points: memory-bound 1.5 (resident) to 6.5 min (host: 512 steps of a 28.7 GB fetch at
# 47 GB/s), spare and machinery under a minute (host at batch 32: 256 steps of 0.6 s, 2.5 min).
SLICE_ESTIMATE_S = {"memory-bound": 480, "spare": 200, "machinery": 180}


@dataclass(frozen=True)
class Point:
    """One traffic point: `prompts` requests of `input_len` -> `output_len` tokens, at most `concurrency` in
    flight, all sent at once."""

    name: str
    concurrency: int
    prompts: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Regime:
    name: str
    points: tuple[Point, ...]
    servers: tuple[str, ...]  # the default servers, first the anchors
    anchor: str  # what its target is set against: run first on every machine, ratios taken within a machine
    card_bytes: int | None = None  # emulate a card of this much memory (None: vLLM's default utilization)
    max_num_seqs: int = 64


SPARE_POINTS = (Point("batch 1", 1, 4, 1024, 256), Point("batch 32", 32, 32, 1024, 256))
PAGED = ("compressed", "fixed", "host", "adaptive")
REGIMES = {
    "memory-bound": Regime("memory-bound", (Point("256 in flight", 256, 256, 3584, 512),),
                           ("vllm", "resident", *PAGED, *(f"{s}+adapters" for s in ("resident", *PAGED))), "vllm",
                           card_bytes=CARD_BYTES, max_num_seqs=256),
    "spare": Regime("spare", SPARE_POINTS, ("vllm", "resident", *PAGED), "resident"),
    "machinery": Regime("machinery", SPARE_POINTS, ("resident", "machinery", "machinery-store"), "resident"),
}


@dataclass(frozen=True)
class ServerSpec:
    """A server of the bench: plain vLLM or `esftctl serve` with these paging settings."""

    name: str
    esft: bool = True
    window: int | str = 0  # 0: resident; "all": every MoE layer (the machinery alone); else WINDOW
    store: bool = False  # the compressed tier (a Huffman store of the base on the GPU)
    store_experts: str = "all"  # "all" base experts from the store, or "split" by measured speeds
    codec: str | None = None  # "fixed": the fixed-rate tier, encoded at start-up (no store file)
    adaptive: bool = False
    adapters: int = 0


SERVERS = {
    "vllm": ServerSpec("vllm", esft=False),
    "resident": ServerSpec("resident"),
    "compressed": ServerSpec("compressed", window=WINDOW, store=True),
    "fixed": ServerSpec("fixed", window=WINDOW, codec="fixed"),
    "host": ServerSpec("host", window=WINDOW),
    "adaptive": ServerSpec("adaptive", window=WINDOW, store=True, store_experts="split", adaptive=True),
    "machinery": ServerSpec("machinery", window="all"),
    "machinery-store": ServerSpec("machinery-store", window="all", store=True),
}


def server_spec(name: str) -> ServerSpec:
    """A server by name; `NAME+adapters` is NAME with ADAPTERS adapters loaded and the requests spread over them."""
    base, _, extra = name.partition("+")
    if base not in SERVERS or extra not in ("", "adapters") or (extra and not SERVERS[base].esft):
        raise ValueError(f"unknown server {name!r}: one of {', '.join(SERVERS)}, or an esftctl one with +adapters")
    return replace(SERVERS[base], name=name, adapters=ADAPTERS if extra else 0)


def engine_args(regime: Regime, *, total_bytes: int | None) -> list[str]:
    """vLLM's arguments, the same for every server of the regime: 4,096 tokens of context, the regime's
    concurrency, CUDA graphs (vLLM's default), and the emulated card's share of `total_bytes` (the device's)."""
    args = ["--max-model-len", "4096", "--max-num-seqs", str(regime.max_num_seqs)]
    if regime.card_bytes and total_bytes:
        args += ["--gpu-memory-utilization", f"{min(0.95, regime.card_bytes / total_bytes):.4f}"]
    return args


def serve_settings(spec: ServerSpec, *, moe_layers: int, experts: int, store: Path | None) -> dict:
    """esftctl.serve.plan's paging options for `spec` (empty for a resident or plain server)."""
    if not spec.window:
        return {}
    window = moe_layers if spec.window == "all" else spec.window
    out: dict = {"paging_window": window, "paging_adaptive": spec.adaptive}
    if spec.codec:
        out.update(paging_codec=spec.codec, store_experts=experts)
    if spec.store:
        if store is None:
            raise ValueError(f"{spec.name} needs a store of the base")
        out["paging_store"] = store
        if spec.store_experts == "all":
            out["store_experts"] = experts
    return out


def plan_server(spec: ServerSpec, *, base: Path, bundles: dict[str, Path], store: Path | None, args: list[str],
                state: Path, port: int):
    """The checked serve plan of one server (esftctl.serve.plan: plain vLLM when not esft). Adapter memory is
    exactly what the loaded adapters take (none without adapters), so that a resident server's KV room is plain
    vLLM's and every difference in it is paging's."""
    from esftctl.bench.serve_models import adapter_bytes
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.serve import plan

    if not spec.esft:
        return plan(base, [], name="base", esft=False, state_dir=state, port=port, vllm_args=args)
    ckpt = MoECheckpoint(base)
    loaded = dict(list(bundles.items())[:spec.adapters])
    return plan(base, [f"{n}={p}" for n, p in loaded.items()], name="base", state_dir=state, port=port,
                vllm_args=args, adapter_memory=adapter_bytes(base, loaded.values()),
                **serve_settings(spec, moe_layers=len(ckpt.moe_layers), experts=ckpt.num_experts, store=store))


# ---- what a server reports -------------------------------------------------------------------------------------
def kv_tokens_from_log(text: str) -> int | None:
    """The KV-cache room vLLM logs at start-up ("GPU KV cache size: 123,456 tokens"; the last one logged)."""
    found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
    return int(found[-1].replace(",", "")) if found else None


def preemptions(metrics: str) -> int:
    """vLLM's cumulative preemptions from its /metrics text, over every engine."""
    return int(sum(float(v) for v in re.findall(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})? ([\d.eE+-]+)$",
                                                metrics, flags=re.M)))


def _status(url: str) -> dict | None:
    from esftctl.serve_client import status

    try:
        return status(url)
    except Exception:  # plain vLLM has none
        return None


def nudge(url: str) -> None:
    """A request that decodes longer than the worker's STATUS_SETTLE_S (64 tokens: 0.25 s and more on a GPU), so that
    the worker refreshes its status during it (runtime.engine_status.StatusFile: never in a waking prompt's prefill)."""
    from esftctl.serve_client import request

    request(url, "/v1/completions", {"model": "base", "prompt": "a", "max_tokens": 64, "ignore_eos": True})


def settled_status(url: str, nudge: Callable[[], None], *, pause: Callable[[float], None] = time.sleep
                   ) -> dict | None:
    """esftctl's status once its pager counters hold every step so far. The worker publishes them only between
    steps, at most once a second, and each time the copy it started the time before (PagedExperts.counters: serving
    never waits for them), so after a run its last second or two of fetches reach the status only after two more
    publications: `nudge` (`nudge` above: a request long enough to be refreshed in) twice, more than a second
    apart. Without this, a point's fetch counts take in up to two seconds of the point before it."""
    status = _status(url)
    if not status or "paging_fetches" not in status:
        return status
    for _ in range(2):
        pause(STATUS_EVERY_S + 0.2)
        nudge()
    return _status(url)


TIER_KEYS = ("expert_device_bytes", "paging_window_bytes", "paging_resident_bytes", "paging_adapter_bytes",
             "paging_store_bytes", "paging_host_bytes", "paging_host_base_rows", "paging_freed_bytes",
             "paging_freed_kv_tokens",
             "paging_store_experts", "paging_resident_layers", "paging_parked_layers", "paging_held_rows",
             "kv_cache_tokens")


def tiers(status: dict | None) -> dict:
    """The GPU memory of each tier (and the host tier's), and the KV tokens paging bought, from esftctl's status."""
    return {k: status.get(k) for k in TIER_KEYS if k in status} if status else {}


def fetch_delta(before: dict | None, after: dict | None) -> dict:
    """Rows fetched per paged layer and step over a run, from the pager's counters (and the planner's last timed
    decisions: compute and load ms of a paged layer, eager steps only)."""
    if not before or not after or "paging_fetches" not in after:
        return {}
    fetches = after["paging_fetches"] - before["paging_fetches"]
    rows = after["paging_fetched_rows"] - before["paging_fetched_rows"]
    timed = [d for d in after.get("paging_decisions") or [] if d.get("timed")]
    return {"fetches": fetches, "fetched_rows": rows, "rows_per_fetch": rows / fetches if fetches else 0.0,
            "held_rows": after.get("paging_held_rows"),
            "planner_compute_ms": timed[-1]["compute_ms"] if timed else None,
            "planner_load_ms": timed[-1]["load_ms"] if timed else None}


# ---- running slices --------------------------------------------------------------------------------------------
def ensure_store(base: Path, folder: Path, on_step: Callable[[str], None]) -> Path:
    """A Huffman store of the base (`esftctl compress BASE`), written once (the folder appears only complete)."""
    from esftctl.formats.store import source_tensors, write_store

    if not folder.exists():
        on_step(f"compressing the base into {folder}")
        origin, tensors = source_tensors(base)
        write_store(origin, tensors, folder)
    return folder


def run(model: str, *, out: Path, work: Path, scratch: Path | None = None, regimes: tuple[str, ...] = tuple(REGIMES),
        servers: tuple[str, ...] | None = None, rounds: int = 3, budget_s: float = 540, layers: int | None = None,
        prompts: int | None = None, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    """Run the pending slices of `model` that fit `budget_s` seconds; returns what ran and what is left.
    `servers` limits every regime to those of its servers; `prompts` overrides the memory-bound point's count."""
    from esftctl.bench import serve_models

    chosen = {r: tuple(s for s in REGIMES[r].servers if servers is None or s in servers) for r in regimes}
    machine = machine_id()
    anchors = {r: (REGIMES[r].anchor,) for r, v in chosen.items() if REGIMES[r].anchor in v}
    todo = anchored(pending(slice_order({r: v for r, v in chosen.items() if v}, rounds), out, model), out=out,
                    model=model, machine=machine, anchors=anchors)
    served = functools.cache(lambda: serve_models.prepare_base(model, work, on_step, layers=layers))
    ran = run_pending(todo, out=out, model=model, budget_s=budget_s, on_step=on_step,
                      estimate_s=lambda sl, warm: estimate_s(sl, out, model),
                      setup_s=0 if (Path(work) / "base").exists() else PREPARE_S,
                      run=lambda batch: (run_slice(sl, model=model, served=served(), work=work,
                                                   scratch=scratch or work, prompts=prompts, machine=machine,
                                                   on_step=on_step) for sl in batch),
                      after=anchor_runs(todo, anchors))
    return {"model": model, "ran": [asdict(s) for s in ran], "left": [asdict(s) for s in pending(todo, out, model)]}


def estimate_s(sl: Slice, out: Path, model: str) -> float:
    """Seconds a slice should take: the longest measured slice of this server and regime, else the default."""
    walls = measured_walls(sl.path(out, model).parent)
    return max(walls) if walls else SLICE_ESTIMATE_S[sl.group]


def regime_points(regime: Regime, prompts: int | None) -> tuple[Point, ...]:
    if prompts is None or regime.name != "memory-bound":
        return regime.points
    return tuple(replace(p, prompts=prompts) for p in regime.points)


def run_slice(sl: Slice, *, model: str, served, work: Path, scratch: Path, prompts: int | None, machine: str,
              on_step: Callable[[str], None]) -> dict:
    """Start the slice's server, warm it up, run every point of its regime once, stop it."""
    import torch

    from esftctl.bench import serve_models
    from esftctl.bench.load import Load, run_load, summary
    from esftctl.bench.serve_runs import kv_cache_tokens, metrics_text, slug
    from esftctl.bench.traffic import draw_adapters, run_seed
    from esftctl.serve import Server, free_port

    regime, spec = REGIMES[sl.group], server_spec(sl.server)
    label = sl.label
    t0 = time.monotonic()
    # The store on scratch (a disk), not in /dev/shm beside the base: host memory holds the base (31-41 GB), the host
    # tier's pinned rows (29-39 GB) and the serving processes, and with the store in /dev/shm too the machinery-store
    # server ran out of host memory at start-up.
    store = ensure_store(served.base, scratch / "store", on_step) if spec.store else None
    if spec.adapters and len(served.bundles) < spec.adapters:
        serve_models.write_adapters(served, model, scratch, spec.adapters, distinct=spec.adapters, shape="deepseek",
                                    on_step=on_step)
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
    args = engine_args(regime, total_bytes=total)
    p = plan_server(spec, base=served.base, bundles=served.bundles, store=store, args=args,
                    state=work / "state" / slug(f"{model}-{sl.group}-{sl.server}"), port=free_port())
    on_step(f"{label}: starting")
    points = {}
    with Server(p) as server:
        server.wait_ready(timeout=1800)
        ready_s = time.monotonic() - t0
        kv, kv_log = kv_cache_tokens(p.url), kv_tokens_from_log(_read(p.log_file))
        names = list(served.bundles)[:spec.adapters]

        def load(point: Point, seed: int, name: str) -> dict:
            drawn = draw_adapters(len(names), 1.0, point.prompts, run_seed(repeat=seed, adapters=len(names),
                                                                            alpha=1.0, rate=math.inf)) if names else []
            return run_load(p.url, model="base", tokenizer=served.base,
                            load=Load(math.inf, point.prompts, point.input_len, point.output_len, seed=seed,
                                      concurrency=point.concurrency),
                            models=[names[i] for i in drawn], result_dir=work / "vllm-results" / model,
                            name=slug(f"{label} {name}"))

        on_step(f"{label}: warm-up")  # CUDA graphs, kernels, the planner's first decisions stay out of the numbers
        load(Point("warm-up", regime.max_num_seqs, min(32, regime.max_num_seqs), 512, 32), 99, "warm-up")
        before = settled_status(p.url, lambda: nudge(p.url))  # each point's counts from the last one's settled status
        for point in regime_points(regime, prompts):
            on_step(f"{label}: {point.name}")
            pre = preemptions(metrics_text(p.url))
            with Watch() as conditions:  # the machine's state over the point (esftctl.bench.conditions)
                raw = load(point, sl.round, point.name)
            result = summary(raw) | conditions.result
            after = settled_status(p.url, lambda: nudge(p.url))
            points[point.name] = {**result, "point": asdict(point),
                                  "preemptions": preemptions(metrics_text(p.url)) - pre,
                                  "fetch": fetch_delta(before, after)}
            before = after
        status = _status(p.url)
    return {"model": model, "regime": sl.group, "server": sl.server, "round": sl.round, "spec": asdict(spec),
            "device": _device(), "machine": machine, "vllm_args": args, "command": p.command(), "ready_s": ready_s,
            "kv_cache_tokens": kv if kv is not None else kv_log,
            "kv_cache_tokens_log": kv_log, "tiers": tiers(status), "points": points,
            "wall_s": time.monotonic() - t0, "finished": time.time()}


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


# ---- the report ------------------------------------------------------------------------------------------------
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
TARGETS = {  # (regime, point, what it is set against, the least ratio of output tok/s): issue 28's targets
    "memory-bound": ("256 in flight", "vllm", 2.0),
    "spare/batch 32": ("batch 32", "resident", 0.7),
    "spare/batch 1": ("batch 1", "resident", 0.5),
    "machinery/batch 1": ("batch 1", "resident", 0.97),
    "machinery/batch 32": ("batch 32", "resident", 0.97),
}


def load_slices(out: Path) -> list[dict]:
    return _load_slices(Path(out) / "slices", "*/*/*/*.json")  # planned rounds and anchors' copies (on-*)


def report(out: Path) -> dict:
    """Every slice under OUT merged: per (model, regime, server, point) the median over rounds of each metric with
    its range, the KV tokens, preemptions, tiers and fetches; ratios of output tok/s to plain vLLM and to esftctl
    resident of the same point (where both ran on the same cards: none across an H100 and an H200); and the
    targets, met or not."""
    groups: dict[tuple, list[dict]] = {}
    for s in load_slices(out):
        for name, pt in s["points"].items():
            groups.setdefault((s["model"], s["regime"], s["server"], name), []).append({**pt, "_slice": s})
    rows = []
    for (model, regime, server, point), reps in groups.items():
        last = max(reps, key=lambda r: r["_slice"]["round"])["_slice"]
        row = {"model": model, "regime": regime, "server": server, "point": point, "rounds": len(reps),
               "device": sorted({r["_slice"]["device"] for r in reps}), "kv_cache_tokens": last["kv_cache_tokens"],
               "tiers": last["tiers"], "fetch": reps[-1]["fetch"],
               "preemptions": statistics.median(r["preemptions"] for r in reps)}
        for m in METRICS:
            values = [r[m] for r in reps if r.get(m) is not None]
            row[m] = statistics.median(values) if values else None
            row[f"{m}_range"] = [min(values), max(values)] if values else None
        rows.append(row)
    index = {(r["model"], r["regime"], r["server"], r["point"]): r for r in rows}
    for r in rows:
        for anchor in ("vllm", "resident"):
            key = (r["model"], r["regime"], anchor, r["point"])
            r[f"vs_{anchor}"], r[f"vs_{anchor}_range"], r[f"vs_{anchor}_paired"] = versus(
                groups[(r["model"], r["regime"], r["server"], r["point"])], groups.get(key, []), r, index.get(key))
    targets = []
    for key, (point, anchor, least) in TARGETS.items():
        regime = key.split("/")[0]
        for r in rows:
            if r["regime"] == regime and r["point"] == point and r["server"] not in ("vllm", "resident"):
                ratio = r[f"vs_{anchor}"]
                targets.append({"model": r["model"], "target": key, "server": r["server"], "against": anchor,
                                "least": least, "ratio": ratio, "met": None if ratio is None else ratio >= least})
    result = {"benchmark": "paging-serve", "rows": sorted(rows, key=_order), "targets": targets}
    write_json(Path(out) / "paging_serve.json", result)
    return result


def versus(reps: list[dict], anchors: list[dict], row: dict, anchor: dict | None
           ) -> tuple[float | None, list[float] | None, int]:
    """Output tok/s against the anchor server's at the same point: round by round against the anchor's runs on
    the same machine (esftctl.bench.slices.ratios_within_machines), their median and range, and how many rounds
    had one; where none did (slices from before machines were recorded), the medians' ratio between rounds of one
    card."""
    def where(runs: list[dict]) -> list[tuple[int, str | None, float | None]]:
        return [(x["_slice"]["round"], x["_slice"].get("machine"), x.get("output_throughput")) for x in runs]
    ratios = ratios_within_machines(where(reps), where(anchors))
    if ratios:
        return statistics.median(ratios), [min(ratios), max(ratios)], len(ratios)
    ok = bool(anchor and anchor["device"] == row["device"] and anchor["output_throughput"]
              and row["output_throughput"] is not None)
    return (row["output_throughput"] / anchor["output_throughput"] if ok else None), None, 0


def _order(r: dict) -> tuple:
    regimes, servers = list(REGIMES), [*SERVERS]
    base = r["server"].split("+")[0]
    return (r["model"], regimes.index(r["regime"]) if r["regime"] in regimes else 9, r["point"],
            servers.index(base) if base in servers else 99, r["server"])


def tables(result: dict) -> list:
    from rich.table import Table

    from esftctl.units import format_bytes

    def gb(v) -> str:
        return "-" if v is None else format_bytes(v)

    t = Table(title="FluxMoE's evaluation end to end (vLLM bench serve): medians over rounds \\[range]; x vLLM / x "
                    "resident: output tok/s against plain vLLM / esftctl resident at the same point, round by round "
                    "on the same machine ('*': across machines, slices from before machines were recorded)",
              title_justify="left")
    for col in ("model", "regime", "point", "server", "rounds", "tok/s \\[range]", "x vLLM", "x resident", "TTFT ms",
                "TTFT p99", "TPOT ms", "TPOT p99", "KV tokens", "preempt", "experts on GPU", "store tier",
                "KV bought", "rows / fetch", "planner compute / load ms"):
        t.add_column(col, justify="left" if col in ("model", "regime", "point", "server") else "right")
    for r in result["rows"]:
        rng, tr, f = r["output_throughput_range"], r["tiers"], r["fetch"]
        timed = f.get("planner_load_ms")
        t.add_row(r["model"], r["regime"], r["point"], r["server"], str(r["rounds"]),
                  f"{r['output_throughput']:,.0f} [{rng[0]:,.0f}-{rng[1]:,.0f}]",
                  *(_versus(r, anchor) for anchor in ("vllm", "resident")),
                  *(f"{r[m]:,.1f}" if r[m] is not None else "-" for m in METRICS[1:]),
                  f"{r['kv_cache_tokens']:,}" if r["kv_cache_tokens"] else "-", f"{r['preemptions']:g}",
                  gb(tr.get("expert_device_bytes")), gb(tr.get("paging_store_bytes")),
                  f"{tr['paging_freed_kv_tokens']:,}" if tr.get("paging_freed_kv_tokens") else "-",
                  f"{f['rows_per_fetch']:.1f} of {f['held_rows']}" if f.get("fetches") else "-",
                  f"{f['planner_compute_ms']:.2f} / {timed:.2f}" if timed else "-")
    out = [t]
    if result["targets"]:
        g = Table(title="issue 28's targets (output tok/s ratio)", title_justify="left")
        for col in ("model", "target", "server", "against", "ratio", "least", "met"):
            g.add_column(col)
        for x in result["targets"]:
            g.add_row(x["model"], x["target"], x["server"], x["against"],
                      "-" if x["ratio"] is None else f"{x['ratio']:.2f}", f"{x['least']:g}",
                      {True: "yes", False: "NO", None: "-"}[x["met"]])
        out.append(g)
    return out


def _versus(r: dict, anchor: str) -> str:
    ratio = r[f"vs_{anchor}"]
    return "-" if ratio is None else f"{ratio:.2f}" + ("" if r.get(f"vs_{anchor}_paired") else "*")


def plot(result: dict, path) -> None:
    """Output tok/s against plain vLLM (memory-bound) or esftctl resident (the others), one bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["regime"], r["point"]) for r in result["rows"]}, key=lambda k: _order(
        {"model": k[0], "regime": k[1], "point": k[2], "server": ""}))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 4), squeeze=False)
    for ax, (model, regime, point) in zip(axes[0], panels):
        key = "vs_vllm" if regime == "memory-bound" else "vs_resident"
        rows = [r for r in result["rows"] if (r["model"], r["regime"], r["point"]) == (model, regime, point)
                and r[key] is not None]
        ax.bar([r["server"] for r in rows], [r[key] for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{model}\n{regime}, {point}", fontsize=8)
        ax.set_ylabel(f"output tok/s {key.replace('_', ' ')}", fontsize=8)
        ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
