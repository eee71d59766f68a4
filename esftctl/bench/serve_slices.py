"""`esftctl bench serve` in slices: its servers x rounds (x adapter counts), a long run that resumes where it stopped.

Why: the DeepSeek-V2-Lite grid (servers x adapter counts x rates x rounds) takes about 4 hours of GPU time, and a
run interrupted before its end (a Ctrl-C, a crash, a machine that goes away) would keep nothing. With slices, a
rerun with the same options skips what is written and goes on, and `--budget` runs as much as fits a time the user
gives. esftctl.bench.slices (shared with `bench paging --serve`) runs slices in order, skips those already written
and passes over one that would overrun the budget; this module says what the slices of `bench serve` are, how long
each should take, and how their files merge back into the one result esftctl.bench.serve_report prints.

Layout: OUT/slices/MODEL/GRID/DEVICE/SERVER/[PART.]rROUND.json.
- GRID names the traffic (adapter shape, counts, rates, alphas), then a hash of every setting of the profile
  but the round count (grid_key): two grids never mix, and more rounds of a grid add to it.
- DEVICE is the card's name: an H100's and an H200's numbers never share a median (a run resumed on the other
  kind of card starts a grid of its own).
- SERVER is bench.serve.BenchServer.key: base, merged, esftctl, grouped-G-W, max-loras-K, lora (-tp2 past one
  rank).
- PART: with `slice_by` "adapters", one adapter count of esftctl's and multi-LoRA's scenarios (n0, n5; ds5: the
  DeepSeek-sized adapters beside Table 1's), so that a run interrupted mid-round keeps the counts it finished
  (and a slice is short enough for a short `--budget`); plain vLLM's base and the merged copies run one count
  and are never cut. MICRO: a server's microbenchmarks (round 0 only, after every server's first round).
Machines and rounds: a resumed run may go on on another machine, and two cards of a kind differ by a few percent, as
much as the 3% the low-load target resolves; and a round is its traffic, whose draw moves a 60-request run by more than
that. So every slice records its machine (slices.machine_id), a slice runs after plain vLLM's base ran its round on its
machine (esftctl.bench.slices.anchored: the base's slice of that round if it is still to run, else the round once more,
part `on-<machine>`; rounds whose base slice is still to run go first), and each ratio is taken against that run
(bench.serve.paired_ratios). The base thus runs each round once per machine that measures it.
A slice that fails is written too, with its error and the time it took, so that a rerun does not spend that time
again; the report lists it, and deleting the file runs it again. The merged server starts with as many copies as
its earlier slices ran (else as many as fit) and drops one after a failed start, within the slice.

One start per round: the adapter counts of one round of esftctl or multi-LoRA (every count served by the same
server, all adapters loaded) run one after another on one server start, each count's slice written as it ends
(shares_start; each part warmed up anew). With four counts that saves 3 of 4 server starts (minutes each for
DeepSeek-V2-Lite) per round.

Estimates (the budget): a part's own seconds (warm-up, runs, what follows them) as measured in the longest slice
of the same server and part, else PART_WARM_UP_S plus its runs at their defaults; on a server not started yet, plus
that server's longest measured start-up (else START_S), and ADAPTERS_S more while this machine has not written
the adapters yet (the first slice of a fresh one).

The report: per device, every slice of the grid there merged, each scenario's numbers the median over its rounds
with their ranges and TTFT's spread (serve_runs.merge_rounds), the ratios against plain vLLM's base
(bench.serve.finish), the rounds each row has, the slices still missing, and the failed ones.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Generator

from esftctl.bench import serve_models
from esftctl.bench.serve import (
    MICRO,
    Bench,
    BenchServer,
    ModelFacts,
    Options,
    Profile,
    adapter_runs,
    base_runs,
    bench_servers,
    device_name,
    finish,
)
from esftctl.bench.serve_runs import merge_rounds, part_of, rate_label, slug
from esftctl.bench.slices import (
    PREPARE_S,
    Slice,
    anchor_runs,
    anchored,
    load_slices,
    machine_id,
    measured_part,
    pending,
    read_slice,
    run_pending,
    slice_order,
)
from esftctl.errors import one_line

# Seconds a server takes to start before one was measured here, from `bench serve` runs capturing CUDA graphs.
# An H200 (ready_s in benchmarks/data/serve/2026-11-23-h200-serve/*.json): plain vLLM 101-158 s, one merged copy
# 125 s, esftctl with 25 adapters 191 s, multi-LoRA 164 s; an H100: plain vLLM 159 s, esftctl with 20 adapters 207 s
# (77 s of it loading them). Merged: two copies one after the other (an 80 GB card holds two) and the 31 GB copy
# written first (about a minute).
START_S = {"base": 180, "merged": 420, "esftctl": 240, "lora": 240}
PART_WARM_UP_S = 30  # a part's warm-up: a burst over every model name, then up to 10 s of the busiest finite rate
RUN_TAIL_S = 15  # a finite-rate run past its `duration`: the last requests' decode and vLLM's bench starting
INF_RUN_S = 30  # a run of `prompts` requests at once: 256 of 256 -> 128 tokens take under 10 s on an H200
MICRO_S = 300  # microbenchmarks: esftctl's 3 counts loaded x (40 batch-1 prefills + 30 x 128 decode steps at
#                about 20 ms), and its 6 adapter loads; plain servers run one count
ADAPTERS_S = 90  # writing the adapters on a fresh machine: 10 DeepSeek-sized bundles (20 GB) and 10 LoRAs


def grid_key(profile: Profile) -> str:
    """The grid's folder: readable (shape, counts, rates, alphas) and a hash of every setting but the rounds."""
    settings = {k: v for k, v in asdict(profile).items() if k != "repeats"}
    settings.update(rates=[float(r) for r in profile.rates], alphas=[float(a) for a in profile.alphas],
                    duration=float(profile.duration), cv=float(profile.cv))  # 1 and 1.0: the same grid
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]

    def join(values) -> str:
        return ".".join(f"{v:g}" for v in values)
    rates = ".".join(rate_label(r).split()[0] for r in profile.rates)
    return f"{profile.shape}-n{join(profile.counts)}-r{rates}-a{join(profile.alphas)}-{digest}"


def parts(profile: Profile, server: BenchServer) -> tuple[str, ...]:
    """The parts one round of `server` is cut into: its adapter counts (slice_by "adapters", esftctl's and
    multi-LoRA's servers), largest first, else the whole round (""). Largest first in round 0 (20 adapters is the
    targets' hardest case, issue 29: 5 to 20 within 3% of the base), then rotated round by round
    (slices.slice_order)."""
    if profile.slice_by != "adapters" or server.role not in ("esftctl", "lora"):
        return ("",)
    found = dict.fromkeys(part_of(s) for s in adapter_runs(profile, server.role))
    return tuple(sorted(found, key=lambda part: -int(part.lstrip("nds"))))


def has_micro(profile: Profile, options: Options, server: BenchServer) -> bool:
    """Microbenchmarks run on plain vLLM's base, merged copies, esftctl (with adapters) and multi-LoRA, at the
    first parallel size (grouping and --max-loras change nothing at batch 1)."""
    if not profile.micro_runs or server.ranks != options.parallel[0]:
        return False
    return server.role in ("base", "merged", "lora") or (server.kind == "esftctl" and max(profile.counts) > 0)


def slice_plan(profile: Profile, options: Options, group: str) -> list[Slice]:
    """Every slice of the grid in the order they run: round by round, the servers rotated per round, each
    server's parts in turn; the microbenchmarks after the first round."""
    servers = {s.key: s for s in bench_servers(profile, options)}
    order = slice_order({group: tuple(servers)}, profile.repeats, parts=lambda key: parts(profile, servers[key]))
    first = sum(len(parts(profile, s)) for s in servers.values())
    micro = [Slice(group, s.key, 0, MICRO) for s in servers.values() if has_micro(profile, options, s)]
    return order[:first] + micro + order[first:]


def _run_s(profile: Profile, rate: float) -> float:
    return INF_RUN_S if math.isinf(rate) else profile.duration + RUN_TAIL_S


def default_runs_s(profile: Profile, server: BenchServer, part: str) -> float:
    """The default seconds of a part's runs (merged: the larger of one copy's runs and several copies')."""
    if part == MICRO:
        return MICRO_S
    if server.role == "base":
        runs = base_runs(profile)
    elif server.role == "merged":
        largest = [s for s in adapter_runs(profile, "lora") if s.adapters == max(profile.counts) > 1]
        runs = max(base_runs(profile), largest, key=len)
    else:
        runs = [s for s in adapter_runs(profile, server.role) if not part or part_of(s) == part]
    return sum(_run_s(profile, s.rate) for s in runs)


def shares_start(a: Slice, b: Slice, server: BenchServer) -> bool:
    """Whether slice b can follow a on a's server start: two adapter counts of one round of one server (every
    count is served by the same server, all adapters loaded). Not the microbenchmarks (they unload adapters),
    nor a server that reports the grouping scheduler's statistics (they count from its start)."""
    return (a.group, a.server, a.round) == (b.group, b.server, b.round) and MICRO not in (a.part, b.part) \
        and bool(a.part and b.part) and not server.scheduling_stats


def estimate_s(sl: Slice, server: BenchServer, *, warm: bool = False, out: Path, profile: Profile,
               scratch: Path) -> float:
    """Seconds the slice should take (the module says how); `warm`: on a server already started."""
    done = [d for d in (read_slice(p) for p in sorted(sl.path(out, profile.model).parent.glob("*.json")))
            if not d.get("error")]
    part = measured_part(sl.part)
    own = [_own_s(d) for d in done if measured_part(d.get("part", "")) == part]
    part_s = max(own) if own else PART_WARM_UP_S + default_runs_s(profile, server, part)
    if warm:
        return part_s
    starts = [d["ready_s"] for d in done if not d.get("parts_before") and d.get("ready_s") is not None]
    fresh = ADAPTERS_S if not adapters_written(profile, server, scratch) else 0
    return max(starts, default=START_S[server.role]) + part_s + fresh


def _own_s(d: dict) -> float:
    """A slice's seconds beside its server's start-up (its warm-up, runs, and what follows them); slices written
    before they recorded it: their wall time less the start-up's, if theirs."""
    if "own_s" in d:
        return d["own_s"]
    return max(0.0, d["wall_s"] - (0.0 if d.get("parts_before") else d.get("ready_s", 0.0)))


def adapters_written(profile: Profile, server: BenchServer, scratch: Path) -> bool:
    """Whether this machine holds the files the server's start would write first (its bundles or LoRAs)."""
    folder = {"esftctl": "adapters", "lora": "lora"}.get(server.role)
    if folder is None or profile.model == "tiny":
        return True
    wanted = min(max(profile.counts), profile.distinct)
    found = Path(scratch) / folder
    return found.is_dir() and sum(1 for _ in found.iterdir()) >= wanted


def run(profile: Profile, options: Options, *, out: Path, work: Path, scratch: Path, gpu: bool,
        budget_s: float = math.inf, rounds: tuple[int, ...] | None = None,
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    """Run the grid's pending slices on this device that fit `budget_s` seconds (of `rounds` only, if given: the
    cards of one host each take their own); what ran and what is left."""
    device, machine = device_name(gpu), machine_id()
    group = f"{grid_key(profile)}/{slug(device)}"
    servers = {s.key: s for s in bench_servers(profile, options)}
    planned = [sl for sl in slice_plan(profile, options, group) if rounds is None or sl.round in rounds]
    anchors = {group: tuple(k for k, s in servers.items() if s.role == "base")}
    todo = anchored(pending(planned, out, profile.model), out=out, model=profile.model, machine=machine,
                    anchors=anchors, needs_anchor=needs_anchor)
    bench = functools.cache(lambda: Bench(profile, options, served=serve_models.prepare_base(profile.model, work,
                                                                                             on_step),
                                          work=work, scratch=scratch, out=out, gpu=gpu, on_step=on_step))
    generated = profile.model == "tiny" or (Path(work) / "base" / "config.json").exists()
    ran = run_pending(todo, out=out, model=profile.model, budget_s=budget_s, on_step=on_step,
                      setup_s=0 if generated else PREPARE_S,
                      estimate_s=lambda sl, warm: estimate_s(sl, servers[sl.server], warm=warm, out=out,
                                                             profile=profile, scratch=scratch),
                      run=lambda batch: run_slices(bench(), batch, servers[batch[0].server], device=device,
                                                   machine=machine, out=out),
                      together=lambda a, b: shares_start(a, b, servers[a.server]),
                      after=anchor_runs(todo, anchors, needs_anchor))
    return {"grid": group, "ran": [s.label for s in ran], "left": [s.label for s in pending(todo, out, profile.model)]}


def needs_anchor(sl: Slice) -> bool:
    """A slice runs after the base's run of its round on its machine, but the microbenchmarks (set against the
    base's own, whatever its round)."""
    return sl.part != MICRO


def earlier_copies(folder: Path) -> int:
    """The merged copies the server's earlier slices ran (the fewest), 0 before any."""
    copies = [d["copies"] for d in (read_slice(p) for p in sorted(Path(folder).glob("*.json"))) if "copies" in d]
    return min(copies, default=0)


def run_slices(bench: Bench, batch: list[Slice], server: BenchServer, *, device: str, machine: str,
               out: Path) -> Generator[dict, None, None]:
    """The JSON of each slice of `batch` (parts of one round of one server, run on one start), as each ends: what
    it is, the settings, the server's result (bench.serve.Bench.measure) or its error, the model's facts for the
    report, where it ran and its wall time (the first's includes the start). A failure is its slice's JSON and
    ends the batch (slices.run_pending gives the rest a start of their own)."""
    def head(sl: Slice) -> dict:
        return {"model": bench.profile.model, "grid": sl.group, "device": device, "machine": machine,
                "server": sl.server, "round": sl.round, "part": sl.part, "role": server.role, "kind": server.kind,
                "ranks": server.ranks, "label": bench.label(server.kind, server.ranks),
                "profile": asdict(bench.profile), "options": asdict(bench.options)}
    done, started = 0, time.monotonic()
    try:
        first = batch[0]
        copies = earlier_copies(first.path(out, bench.profile.model).parent) if server.role == "merged" else 0
        parts = tuple(measured_part(s.part) for s in batch)  # a copy of the base's round runs all of it
        with contextlib.closing(bench.measure(server, round=first.round, parts=parts,
                                              copies=copies)) as results:  # closed: the server stops
            for sl, result in zip(batch, results):
                label = result.pop("server")
                yield {**head(sl), **result, "label": label, "facts": asdict(ModelFacts.of(bench.served)),
                       "wall_s": time.monotonic() - started, "finished": time.time()}
                done, started = done + 1, time.monotonic()
    except Exception as e:  # written as failed: the report says so, and a rerun does not spend the time again
        sl = batch[done]
        bench.on_step(f"{sl.label}: FAILED: {one_line(e, 500)}")
        yield {**head(sl), "error": one_line(e, 500), "wall_s": time.monotonic() - started, "finished": time.time()}


# ---- the report ------------------------------------------------------------------------------------------------
def report(out: Path, profile: Profile, options: Options) -> list[dict]:
    """The grid's merged result on each device that has slices of it (one for each)."""
    root = Path(out) / "slices" / profile.model / grid_key(profile)
    found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [merge(load_slices(d, "*/*.json"), profile=profile, options=options, out=out,
                  group=f"{grid_key(profile)}/{d.name}") for d in found]


def merge(slices: list[dict], *, profile: Profile, options: Options, out: Path, group: str) -> dict:
    """bench.serve.finish's result from slice files: each server's rows merged over its rounds and parts, its
    microbenchmarks and adapter loads, grouping statistics summed; failed slices as errors; `missing`: the
    planned slices not there."""
    order = {s.key: i for i, s in enumerate(bench_servers(profile, options))}
    servers: dict[str, dict] = {}
    errors: dict[str, str] = {}
    facts: ModelFacts | None = None
    for s in sorted(slices, key=lambda s: (s["round"], s.get("part", ""))):
        where = f"{s['label']} {Slice(group, s['server'], s['round'], s.get('part', '')).name}"
        if s.get("error"):
            errors[where] = s["error"]
            continue
        errors.update({f"{where}: x{k} copies": e for k, e in (s.get("failed_copies") or {}).items()})
        if s.get("after_error"):
            errors[f"{where}: after the runs"] = s["after_error"]
        if s.get("facts") and (facts is None or len(s["facts"]["grid_experts"]) > len(facts.grid_experts)):
            facts = ModelFacts.from_json(s["facts"])
        _add(servers.setdefault(s["label"], {"key": s["server"], "kind": s["kind"], "ranks": s["ranks"],
                                             "slices": []}), s)
    results = [_result(label, res, profile) for label, res in
               sorted(servers.items(), key=lambda kv: (order.get(kv[1]["key"], len(order)), kv[0]))]
    device = next((s["device"] for s in slices), group.split("/")[-1])
    result = finish(profile, facts, results, errors, device=device, options=options)
    planned = slice_plan(profile, options, group)
    missing = [f"{sl.server} {sl.name}" for sl in planned if not sl.path(out, profile.model).exists()]
    return {**result, "grid": group, "slices": {"planned": len(planned), "present": len(slices),
                                               "failed": sum(1 for s in slices if s.get("error"))},
            "missing": missing}


def _add(res: dict, s: dict) -> None:
    res["slices"].append(s)
    for key in ("micro", "adapter_load", "copies"):
        if key in s:
            res[key] = s[key]
    if "micro" in s:
        res["micro_machine"] = s.get("machine")


def _result(label: str, res: dict, profile: Profile) -> dict:
    """One server's entry of bench.serve.finish's `servers`: rows merged over its slices, the median start-up
    and KV room of its starts, and what only some slices measure."""
    got = res.pop("slices")
    kv = [s["kv_cache_tokens"] for s in got if s.get("kv_cache_tokens") is not None]
    groups = [s["groups"] for s in got if s.get("groups")]
    compiled = [s["jit_compiles_in_runs"] for s in got if s.get("jit_compiles_in_runs") is not None]
    return {"server": label, **res, "ready_s": statistics.median(s["ready_s"] for s in got),
            "kv_cache_tokens": statistics.median_low(kv) if kv else None,
            "jit_compiles_in_runs": sum(compiled) if compiled else None,
            "rounds": sorted({s["round"] for s in got if s.get("part") != MICRO}),
            "rows": merge_rounds(label, [{**r, "machine": s.get("machine")} for s in got for r in s.get("runs", [])],
                                 profile),
            **({"groups": merge_groups(groups)} if groups else {})}


def merge_groups(stats: list[dict]) -> dict:
    """The grouping scheduler's statistics of several starts: steps summed, the most and the longest the largest;
    with --admit-by-adapter, the steps whose queue it reordered summed."""
    out: dict = {}
    if "most" in stats[0]:
        out = {"most": stats[0]["most"], "wait": stats[0]["wait"], "held": {}}
        for key in ("steps", "grouped_steps"):
            out[key] = sum(g[key] for g in stats)
        for key in ("most_groups_scheduled", "longest_wait"):
            out[key] = max(g[key] for g in stats)
        for g in stats:
            for name, steps in (g.get("held") or {}).items():
                out["held"][name] = out["held"].get(name, 0) + steps
    if "admit_by_adapter" in stats[0]:
        out |= {"admit_by_adapter": stats[0]["admit_by_adapter"], "reordered": sum(g["reordered"] for g in stats)}
    return out
