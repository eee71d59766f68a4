"""`esftctl bench serve` in slices (esftctl.bench.serve_slices, on esftctl.bench.slices) without a GPU or vLLM: the
slices' order, resumption, the budget, failed slices, the merged report over a partial grid, atomic writes.
A fake bench stands in for the servers: each run's numbers are a function of its server, scenario and round."""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict

import numpy as np
import pytest
from conftest import run_cli
from rich.console import Console

from esftctl.bench import serve as bench
from esftctl.bench import serve_slices as ss
from esftctl.bench import slices
from esftctl.bench.serve_models import Served

SPEED = {"base": 100.0, "esftctl": 90.0, "lora": 60.0}  # tok/s of round 0; each round adds 10%


def grid(**over):
    settings = dict(counts=(0, 2), rates=(8.0,), alphas=(1.0,), repeats=3, slice_by="adapters",
                    servers=("base", "esftctl", "lora"))
    return bench.configure("tiny", gpu=True, **{**settings, **over})


class FakeBench:
    """bench.serve.Bench's face to serve_slices: measure() returns made-up runs, and a `fail` server raises."""

    calls: list = []  # (server, round, part) of each part measured
    starts: list = []  # (server, round, parts) of each server start
    fail: set = set()
    machine = "m0"  # the machine the slices run on (serve_slices.machine_id), and how fast its card is
    speed = 1.0

    def __init__(self, profile, options, *, served, work, scratch, out, gpu, on_step):
        self.profile, self.options, self.served, self.on_step = profile, options, served, on_step

    def label(self, kind, ranks):
        return kind + bench.parallel_label(ranks, False)

    def measure(self, server, *, round, parts=("",), copies=0):
        FakeBench.starts.append((server.key, round, parts))
        for part in parts:
            FakeBench.calls.append((server.key, round, part))
            if server.key in FakeBench.fail:
                raise RuntimeError("the server did not start\nsecond line")
            yield self.result(server, round, part, first=part == parts[0])

    def result(self, server, round, part, first):
        head = {"server": server.kind, "kind": server.kind, "ready_s": 4.0 + round, "kv_cache_tokens": 1000,
                "parts_before": 0 if first else 1, "own_s": 2.0}
        if part == bench.MICRO:
            return {**head, "ready_s": 5.0, "kv_cache_tokens": 900, "runs": [],
                    "micro": {"all": {"ttft_ms": {"16": 10.0 + round}, "tpot_ms": {"1": 2.0}}}}
        order = bench.base_runs(self.profile) if server.role == "base" else bench.adapter_runs(self.profile,
                                                                                              server.role)
        runs = [s for s in order if not part or bench.part_of(s) == part]
        speed = SPEED[server.role] * (1 + 0.1 * round) * FakeBench.speed
        tokens = self.profile.output_len - 1
        entries = [{"scenario": asdict(s), "index": order.index(s), "round": round, "drawn": s.draw(round, 12),
                    "seconds": 1.0, "result": {"output_throughput": speed - s.adapters, "mean_ttft_ms": 20.0 + round,
                                               "median_ttft_ms": 20.0 + round, "p99_ttft_ms": 40.0,
                                               "mean_tpot_ms": 5.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 9.0,
                                               "arrival_cv": 1.0, "gpu_util": SPEED[server.role] - 10 * round},
                    # the requests a slice keeps (load.per_request): TPOT 500 / speed ms, TTFT as the round's
                    "requests": {"start_s": [0.0, 1.0, 2.0, 3.0], "ttft_ms": [20.0 + round] * 4,
                                 "alone": [True, True, False, False],
                                 "latency_ms": [20.0 + round + tokens * 500 / speed] * 4}} for s in runs]
        return {**head, "runs": entries}


@pytest.fixture
def fake(monkeypatch, tmp_path):
    FakeBench.calls, FakeBench.starts, FakeBench.fail, FakeBench.machine, FakeBench.speed = [], [], set(), "m0", 1.0
    monkeypatch.setattr(ss, "Bench", FakeBench)
    monkeypatch.setattr(ss, "machine_id", lambda: FakeBench.machine)
    monkeypatch.setattr(ss.serve_models, "prepare_base", lambda model, work, on_step: Served(tmp_path / "base"))
    facts = bench.ModelFacts("base", model_bytes=1 << 30, expert_bytes=1 << 10, kv_bytes_per_token=1 << 10,
                             grid_experts=(4, 6), all_experts=10)
    monkeypatch.setattr(ss.ModelFacts, "of", classmethod(lambda cls, served: facts))

    def run(profile, options, out, budget_s=math.inf, rounds=None):
        return ss.run(profile, options, out=out, work=tmp_path / "work", scratch=tmp_path / "work", gpu=False,
                      budget_s=budget_s, rounds=rounds)
    return run


def test_slices_rotate_the_servers_per_round_and_cut_rounds_by_adapter_count():
    profile, options = grid(group_adapters=2)
    plan = ss.slice_plan(profile, options, "g")
    names = [f"{s.server} {s.name}" for s in plan]
    assert names[:11] == ["base r0", "esftctl n2.r0", "esftctl n0.r0", "grouped-2-8 n2.r0", "grouped-2-8 n0.r0",
                          "lora n2.r0", "lora n0.r0",  # the largest count first
                          "base micro.r0", "esftctl micro.r0", "lora micro.r0",  # microbenchmarks: once, not grouped
                          "esftctl n0.r1"]  # round 1 starts one server further, its counts rotated too
    assert [s.server for s in plan if s.round == 2 and s.part != bench.MICRO][0] == "grouped-2-8"
    for server in ("esftctl", "lora"):  # no count is always the first after its server's start
        assert [[s.part for s in plan if (s.server, s.round) == (server, r) and s.part != bench.MICRO]
                for r in range(3)] == [["n2", "n0"], ["n0", "n2"], ["n2", "n0"]]
    assert len(plan) == 3 * 7 + 3 and len(set(plan)) == len(plan)
    whole, _ = grid(slice_by="server", micro_runs=0)
    assert [f"{s.server} {s.name}" for s in ss.slice_plan(whole, options, "g")][:4] == [
        "base r0", "esftctl r0", "grouped-2-8 r0", "lora r0"]
    path = plan[1].path("OUT", "tiny")
    assert path.as_posix() == "OUT/slices/tiny/g/esftctl/n2.r0.json"
    parallel = [s.key for s in bench.bench_servers(profile, bench.Options(servers=("base",), parallel=(1, 2)))]
    assert parallel == ["base", "base-tp2"]


def test_grid_key_keeps_grids_apart_but_not_rounds():
    profile, _ = grid()
    key = ss.grid_key(profile)
    assert key.startswith("table1-n0.2-r8-a1-") and ss.grid_key(grid(repeats=5)[0]) == key
    assert ss.grid_key(grid(rates=(8.0, math.inf))[0]).startswith("table1-n0.2-r8.inf-a1-")
    assert len({key, ss.grid_key(grid(duration=3.0)[0]), ss.grid_key(grid(slice_by="server")[0])}) == 3
    assert ss.grid_key(grid(rates=(8,), alphas=(1,))[0]) == key  # however the numbers were written


def test_the_capture_size_names_its_own_grid_and_zero_finds_the_old_one():
    """deepseek-v2-lite's servers capture CUDA graphs up to 512 tokens; --capture-size 0 gives back vLLM's default and
    the key of the grid measured with it (benchmarks/serve-bench/slices), so its slices stay reachable."""
    options = dict(counts=(1, 5, 10, 20), rates=(1.0, 2.0, 5.0), alphas=(1.0,), duration=60.0, repeats=3,
                   shape="deepseek")
    default, _ = bench.configure("deepseek-v2-lite", gpu=True, **options)
    assert default.engine_args[-2:] == ("--max-cudagraph-capture-size", "512")
    old, _ = bench.configure("deepseek-v2-lite", gpu=True, capture_size=0, **options)
    assert "--max-cudagraph-capture-size" not in old.engine_args
    assert ss.grid_key(old) == "deepseek-n1.5.10.20-r1.2.5-a1-5434421a"
    again, _ = bench.configure("deepseek-v2-lite", gpu=True, capture_size=512, **options)
    assert again.engine_args == default.engine_args and ss.grid_key(default) != ss.grid_key(old)
    assert bench.with_capture_size(old.engine_args, 1024)[-1] == "1024"
    assert bench.with_capture_size(default.engine_args, 1024).count("--max-cudagraph-capture-size") == 1


def test_a_rerun_resumes_and_failed_slices_are_kept(fake, tmp_path):
    profile, options = grid(repeats=2)
    FakeBench.fail = {"lora"}
    first = fake(profile, options, tmp_path / "out")
    assert len(first["ran"]) == 2 * 5 + 3 and first["left"] == []
    assert len(FakeBench.calls) == 13
    assert [p for k, r, p in FakeBench.starts if k == "lora"] == [("n2", "n0"), ("n0",), ("micro",), ("n0", "n2"),
                                                                  ("n2",)]  # after a failure, a start of its own
    failed = slices.read_slice(tmp_path / "out" / "slices" / "tiny" / first["grid"] / "lora" / "n0.r1.json")
    assert failed["error"] == "the server did not start second line" and failed["wall_s"] >= 0
    FakeBench.calls = []
    again = fake(profile, options, tmp_path / "out")  # everything there, the failed slices too: nothing runs
    assert again["ran"] == [] and FakeBench.calls == []
    more = fake(grid(repeats=3)[0], options, tmp_path / "out")  # one more round adds to the grid
    assert [c[1] for c in FakeBench.calls] == [2] * 5 and len(more["ran"]) == 5


def test_the_budget_stops_before_a_slice_that_would_overrun(fake, tmp_path):
    profile, options = grid(repeats=1, micro_runs=0)
    out = tmp_path / "out"
    first = fake(profile, options, out, budget_s=60)
    assert first["ran"] == [] and len(first["left"]) == 5 and FakeBench.calls == []  # base: START_S alone
    order = ss.slice_plan(profile, options, first["grid"])  # base, esftctl n2 and n0, lora n2 and n0
    servers = {s.key: s for s in bench.bench_servers(profile, options)}

    def estimate(sl, warm=False):
        return ss.estimate_s(sl, servers[sl.server], warm=warm, out=out, profile=profile, scratch=tmp_path)
    runs = ss.PART_WARM_UP_S + profile.duration + ss.RUN_TAIL_S
    assert estimate(order[0]) == ss.START_S["base"] + runs
    assert estimate(order[2], warm=True) == runs  # n0 on the server n2 started
    done = fake(profile, options, out, budget_s=math.inf)
    assert len(done["ran"]) == 5
    assert estimate(order[1]) == 4.0 + 2.0 and estimate(order[2], warm=True) == 2.0  # measured: start-up, own
    order[2].path(out, "tiny").unlink()
    assert estimate(order[2]) == 4.0 + runs  # the server's start measured by n2, the part's defaults


def test_the_cards_of_a_host_each_take_their_own_rounds(fake, tmp_path):
    """`--only-rounds`: each card runs the base's round first, then its own round of every server, and pairs with
    that base; the cards' slices together are the grid (benchmarks/lab/gpu_cards.sh merges them)."""
    profile, options = grid(repeats=3, micro_runs=0)
    out = tmp_path / "out"
    for card, rounds in (("card1", (1,)), ("card2", (0, 2))):
        FakeBench.machine, FakeBench.calls = card, []
        done = fake(profile, options, out, rounds=rounds)
        assert {c[1] for c in FakeBench.calls} == set(rounds) and FakeBench.calls[0] == ("base", rounds[0], "")
    assert done["left"] == []
    (result,) = ss.report(out, profile, options)
    assert result["missing"] == []
    row = next(r for s in result["servers"] if s["kind"] == "esftctl" for r in s["rows"] if r["adapters"] == 2)
    assert row["paired_rounds"] == 3  # every round against the base on its own card
    proc = run_cli("bench", "serve", "--out", out, "--only-rounds", "2")  # the tiny grid's default: 2 rounds
    assert proc.returncode == 1 and "--only-rounds 2: the grid has rounds 0 to 1" in proc.stderr


def test_the_counts_of_a_round_share_one_start(fake, tmp_path):
    profile, options = grid(repeats=2, micro_runs=0, group_adapters=2)
    done = fake(profile, options, tmp_path / "out")
    assert done["left"] == [] and len(done["ran"]) == 2 * 7
    assert [(k, p) for k, r, p in FakeBench.starts if r == 0] == [
        ("base", ("",)), ("esftctl", ("n2", "n0")),
        ("grouped-2-8", ("n2",)), ("grouped-2-8", ("n0",)),  # its statistics count from its start: one count each
        ("lora", ("n2", "n0"))]
    folder = tmp_path / "out" / "slices" / "tiny" / done["grid"] / "esftctl"
    first, second = (slices.read_slice(folder / f"{p}.r1.json") for p in ("n0", "n2"))  # round 1: rotated
    assert (first["parts_before"], second["parts_before"]) == (0, 1) and first["ready_s"] == second["ready_s"]


def test_the_report_merges_a_partial_grid(fake, tmp_path):
    profile, options = grid()
    out = tmp_path / "out"
    done = fake(profile, options, out)
    for name in ("lora/n2.r1", "lora/n2.r2", "esftctl/n0.r2"):  # a partial grid
        (out / "slices" / "tiny" / done["grid"] / f"{name}.json").unlink()
    (result,) = ss.report(out, profile, options)
    assert result["missing"] == ["lora n2.r1", "lora n2.r2", "esftctl n0.r2"]
    assert result["slices"] == {"planned": 3 * 5 + 3, "present": 15, "failed": 0}
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    base = rows[("vLLM base", "base @ 8 rps")]
    assert base["rounds"] == [0, 1, 2] and base["output_throughput"] == pytest.approx(110)
    assert base["output_throughput_range"] == pytest.approx([100, 120])
    assert base["ttft_spread"] == pytest.approx(2 / 21)
    lora = rows[("vLLM multi-LoRA", "2 adapters, alpha 1 @ 8 rps")]
    assert lora["rounds"] == [0] and lora["output_throughput"] == pytest.approx(58)
    esft = rows[("esftctl", "base @ 8 rps")]
    assert esft["rounds"] == [0, 1] and esft["throughput_ratio"] == pytest.approx(0.9)  # 90 / 100, 99 / 110
    assert len(rows[("esftctl", "2 adapters, alpha 1 @ 8 rps")]["shares"]["counts"]) == 2  # drawn over rounds
    servers = {s["server"]: s for s in result["servers"]}
    assert servers["esftctl"]["micro"]["all"]["ttft_ms_ratio"] == {"16": 1.0}
    assert result["kv_cache"]["by_adapters"][2]["esftctl"] == 1000 - (4 + 6)  # an expert: one KV token's bytes
    text = io.StringIO()
    for table in bench.tables(result):
        Console(file=text, width=250).print(table)
    assert "missing: lora: n2.r1, n2.r2; esftctl: n0.r2" in text.getvalue()
    bench.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_every_machine_measures_the_base_first(fake, tmp_path):
    profile, options = grid(repeats=2)
    out = tmp_path / "out"
    done = fake(profile, options, out)
    folder = out / "slices" / "tiny" / done["grid"]

    def drop(*names):
        for name in names:
            (folder / f"{name}.json").unlink()

    def calls_on(machine):
        FakeBench.calls, FakeBench.machine = [], machine
        fake(profile, options, out)
        return FakeBench.calls
    drop("esftctl/n2.r1", "lora/n2.r1")
    assert calls_on("B") == [("base", 1, ""), ("esftctl", 1, "n2"), ("lora", 1, "n2")]  # round 1's traffic on B
    again = slices.read_slice(folder / "base" / f"{slices.copy_part('B')}.r1.json")  # beside m0's base/r1
    assert (again["machine"], again["round"]) == ("B", 1) and again["runs"][0]["round"] == 1
    drop("lora/n0.r1")
    assert calls_on("B") == [("lora", 1, "n0")]  # B has its base's round 1: no other
    drop("lora/n0.r0")
    assert calls_on("B") == [("base", 0, ""), ("lora", 0, "n0")]  # round 0 is other traffic: its base once more
    drop("base/r1", "esftctl/n0.r1", "lora/n2.r0")
    assert calls_on("C") == [("base", 1, ""), ("esftctl", 1, "n0"),  # the base's own round 1, first: it runs anyway
                             ("base", 0, ""), ("lora", 0, "n2")]
    assert slices.read_slice(folder / "base" / "r1.json")["machine"] == "C"
    assert calls_on("D") == []  # nothing left to run: no base either
    drop("esftctl/micro.r0")
    assert calls_on("E") == [("esftctl", 0, bench.MICRO)]  # microbenchmarks compare with the base's own: no anchor
    drop("base/micro.r0")
    assert calls_on("E") == [("base", 0, bench.MICRO)]
    drop("lora/n2.r0")
    assert calls_on("E") == [("base", 0, ""), ("lora", 0, "n2")]  # E's base microbenchmarks are not round 0's traffic


def test_ratios_are_taken_within_one_machine(fake, tmp_path):
    profile, options = grid(repeats=2)
    out = tmp_path / "out"
    done = fake(profile, options, out)  # machine m0: every slice, the card at full speed
    folder = out / "slices" / "tiny" / done["grid"]
    (folder / "esftctl" / "n2.r1.json").unlink()
    (folder / "esftctl" / "micro.r0.json").unlink()
    FakeBench.machine, FakeBench.speed = "slow", 0.8  # another lease, a card 20% slower
    FakeBench.calls = []
    fake(profile, options, out)
    assert FakeBench.calls == [("esftctl", 0, bench.MICRO),  # the plan's order: it needs no base run here
                               ("base", 1, ""), ("esftctl", 1, "n2")]  # round 1 once more, on this card
    (result,) = ss.report(out, profile, options)
    servers = {s["server"]: s for s in result["servers"]}
    assert servers["esftctl"]["micro_across"] and not servers["vLLM multi-LoRA"]["micro_across"]
    text = io.StringIO()
    Console(file=text, width=250).print(*bench.tables(result))
    assert "esftctl (other machine)" in text.getvalue() and "multi-LoRA (other" not in text.getvalue()
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    esft = rows[("esftctl", "2 adapters, alpha 1 @ 8 rps")]
    # round 0 on m0 against the base's round 0 there; round 1 on the slow card against the base's round 1 there
    within = [88 / 100, (90 * 1.1 * 0.8 - 2) / (100 * 1.1 * 0.8)]
    assert esft["machines"] == ["m0", "slow"] and esft["paired_rounds"] == 2
    assert esft["throughput_ratio"] == pytest.approx(sum(within) / 2)
    assert esft["throughput_ratio_range"] == pytest.approx(sorted(within))
    assert esft["output_throughput"] / rows[("vLLM base", "base @ 8 rps")]["output_throughput"] == pytest.approx(
        (88 + 77.2) / 2 / 100)  # what the medians across machines would have said instead
    # the fastest tenth, from each run's kept requests (load.floors), paired like every ratio: TPOT 500 / speed
    assert esft["p10_tpot_ratio"] == pytest.approx(100 / 90) and esft["p10_tpot_ratio_range"] == pytest.approx(
        [100 / 90] * 2)
    assert esft["p10_ttft_alone_ratio"] == pytest.approx(1.0)
    text = io.StringIO()
    Console(file=text, width=250).print(bench.tables(result)[1])  # right after the main table
    assert "the fastest tenth" in text.getvalue() and "1.111" in text.getvalue()
    # request by request (bench.serve.request_paired): each request against the same one in the base's run of its
    # round on its machine, both rounds pooled; TPOT 500 / speed a request, TTFT as the round's
    by_request = esft["request_ratios"]
    assert by_request["tpot"] == pytest.approx([100 / 90] * 3) and by_request["ttft"] == pytest.approx([1.0] * 3)
    assert (by_request["rounds"], by_request["requests"], by_request["against"]) == (2, 8, "same machine")
    assert not any("per_request" in r for s in result["servers"] for r in s["rows"])  # the slices keep them
    base = rows[("vLLM base", "base @ 8 rps")]
    # plain vLLM against itself: its round 1 on the slow card (speed x0.8) over its round 1 on m0
    assert base["request_ratios"]["against"] == "another machine"
    assert base["request_ratios"]["tpot"] == pytest.approx([1 / 0.8] * 3)
    text = io.StringIO()
    Console(file=text, width=250).print(bench.tables(result)[2])
    assert "request by request" in text.getvalue() and "1.111 [1.111-1.111]" in text.getvalue()
    (folder / "esftctl" / "n0.r1.json").unlink()
    FakeBench.machine, FakeBench.fail = "broken", {"base"}  # its base fails: its rounds pair with nothing
    fake(profile, options, out)
    (result,) = ss.report(out, profile, options)
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    alone = rows[("esftctl", "base @ 8 rps")]
    assert alone["machines"] == ["m0", "broken"] and alone["paired_rounds"] == 1
    assert alone["throughput_ratio"] == pytest.approx(90 / 100)
    text = io.StringIO()
    Console(file=text, width=250).print(bench.tables(result)[0])
    assert "2 (1 paired)" in text.getvalue()


def test_the_rounds_table_shows_what_each_start_moved(fake, tmp_path):
    """A median over rounds hides the one start that differed (H100, 20 adapters, 2026-12-06: 0.802x the base's
    throughput on one machine, 0.846x and 0.823x on another), so each round's ratios are kept, in round order, with
    the GPU busy share of the run and of its base run."""
    from esftctl.bench.serve_report import rounds_table

    profile, options = grid(repeats=2, micro_runs=0)
    out = tmp_path / "out"
    done = fake(profile, options, out)
    (out / "slices" / "tiny" / done["grid"] / "esftctl" / "n2.r1.json").unlink()
    FakeBench.machine, FakeBench.speed = "slow", 0.8
    fake(profile, options, out)  # esftctl's round 1 at 2 adapters, and the base's round 1 once more, on "slow"
    (result,) = ss.report(out, profile, options)
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    esft = rows[("esftctl", "2 adapters, alpha 1 @ 8 rps")]["by_round"]
    assert [(r["round"], r["machine"]) for r in esft] == [(0, "m0"), (1, "slow")]
    assert [r["throughput_ratio"] for r in esft] == pytest.approx([88 / 100, (90 * 1.1 * 0.8 - 2) / (100 * 1.1 * 0.8)])
    assert [r["ttft_ratio"] for r in esft] == pytest.approx([1.0, 1.0])
    assert [(r["gpu_util"], r["base_gpu_util"]) for r in esft] == [(90.0, 100.0), (80.0, 90.0)]
    assert "by_round" not in rows[("vLLM base", "base @ 8 rps")]  # the base against itself says nothing
    text = io.StringIO()
    Console(file=text, width=250).print(rounds_table(result))
    line = next(x for x in text.getvalue().splitlines() if "esftctl" in x and "2 adapters" in x)
    assert [c.strip() for c in line.split("│")[3:-1]] == ["0 1", "A B", "1.000 / 1.000", "1.000 / 1.000",
                                                           "0.880 / 0.877", "90 / 80", "100 / 90"]
    assert rounds_table({"servers": [{"server": "esftctl", "rows": [{"by_round": esft[:1]}]}]}) is None  # one round


def test_a_row_with_no_base_on_its_machine_pairs_by_round(fake, tmp_path):
    """Rounds whose machine has no base run are set against the base's same rounds elsewhere (the same traffic),
    not against the medians of other rounds' traffic."""
    profile, options = grid(repeats=2, micro_runs=0)
    out = tmp_path / "out"
    done = fake(profile, options, out)
    folder = out / "slices" / "tiny" / done["grid"]
    for r in (0, 1):
        (folder / "esftctl" / f"n2.r{r}.json").unlink()
    FakeBench.machine, FakeBench.speed, FakeBench.fail = "B", 0.8, {"base"}  # B's base runs fail
    fake(profile, options, out)
    (result,) = ss.report(out, profile, options)
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    esft = rows[("esftctl", "2 adapters, alpha 1 @ 8 rps")]
    assert esft["machines"] == ["B", "B"] and esft["paired_rounds"] == 0 and esft["paired_across"] == 2
    by_round = [(90 * 0.8 - 2) / 100, (99 * 0.8 - 2) / 110]  # each against m0's base of its round
    assert esft["throughput_ratio_range"] == pytest.approx(by_round)
    assert esft["throughput_ratio"] == pytest.approx(sum(by_round) / 2)
    text = io.StringIO()
    Console(file=text, width=300).print(bench.tables(result)[0])
    assert "2 (2 by round)" in text.getvalue()
    assert "paired_across" not in rows[("esftctl", "base @ 8 rps")]  # paired on m0


def one_by_one(result):
    return lambda batch: (result(sl) for sl in batch)


def test_a_slice_too_long_for_what_is_left_is_passed_over_for_shorter_ones(tmp_path):
    todo = [slices.Slice("g", s, 0) for s in ("a", "b", "c")]
    need = {"a": 100, "b": 1000, "c": 50}
    steps = []
    ran = slices.run_pending(todo, out=tmp_path, model="m", budget_s=200, estimate_s=lambda sl, warm: need[sl.server],
                             run=one_by_one(lambda sl: {"wall_s": 1}), setup_s=20, on_step=steps.append)
    assert [sl.server for sl in ran] == ["a", "c"] and steps == ["passed over: g/b r0 needs about 1000 s, 200 s left"]
    assert slices.pending(todo, tmp_path, "m") == [todo[1]]  # the next run resumes with it
    ran = slices.run_pending(todo[1:], out=tmp_path / "2", model="m", budget_s=60,
                             estimate_s=lambda sl, warm: need[sl.server], run=one_by_one(lambda sl: {"wall_s": 1}),
                             setup_s=20)
    assert ran == []  # the first slice to run carries the set-up: c needs 70 s of 60


def test_a_slice_waits_while_its_anchor_run_of_the_round_was_passed_over(tmp_path):
    """2026-12-04: an H200 passed over the base's run of round 1 (369 s of 340 left), then ran esftctl's round 1 at
    10 adapters, which then paired with no base run on its machine. Now it waits for the anchor, and the
    microbenchmarks (set against the base's own) still run."""
    todo = [slices.Slice("g", "base", 1, slices.copy_part("m1")), slices.Slice("g", "esftctl", 1, "n10"),
            slices.Slice("g", "esftctl", 0, "micro")]
    need = {"base": 369, "esftctl": 200}
    needs_anchor = lambda sl: sl.part != "micro"  # noqa: E731
    after = slices.anchor_runs(todo, {"g": ("base",)}, needs_anchor)
    assert after(todo[1]) == (todo[0],) and after(todo[2]) == () and after(todo[0]) == ()
    steps = []
    ran = slices.run_pending(todo, out=tmp_path, model="m", budget_s=340, estimate_s=lambda sl, warm: need[sl.server],
                             run=one_by_one(lambda sl: {"wall_s": 1}), on_step=steps.append, after=after)
    assert ran == [todo[2]]
    assert steps[1] == f"passed over: g/esftctl n10.r1 waits for {todo[0].label}, which did not run"
    ran = slices.run_pending(todo[:2], out=tmp_path, model="m", budget_s=math.inf, estimate_s=lambda sl, warm: 0,
                             run=one_by_one(lambda sl: {"wall_s": 1}), after=after)
    assert ran == todo[:2]  # the next machine with the time runs the anchor, then the count


def test_slices_of_one_start_run_on_it_until_one_does_not_fit(tmp_path):
    todo = [slices.Slice("g", "s", 0, p) for p in ("n3", "n2", "n1")] + [slices.Slice("g", "t", 0)]
    log = []

    def run(batch):
        log.append(("start", [sl.name for sl in batch]))
        try:
            for sl in batch:
                yield {"wall_s": 1, "part": sl.part}
        finally:
            log.append(("stop", batch[0].server))
    need = {"n3": 100, "n2": 10, "n1": 200, "": 100}  # n1 needs more than is left even on a started server
    warmth = []

    def estimate(sl, warm):
        warmth.append((sl.name, warm))
        return need[sl.part]
    ran = slices.run_pending(todo, out=tmp_path, model="m", budget_s=150, estimate_s=estimate, run=run,
                             together=lambda a, b: a.server == b.server)
    assert [sl.name for sl in ran] == ["n3.r0", "n2.r0", "r0"]
    assert warmth == [("n3.r0", False), ("n2.r0", True), ("n1.r0", True), ("r0", False)]
    assert log == [("start", ["n3.r0", "n2.r0", "n1.r0"]), ("stop", "s"), ("start", ["r0"]), ("stop", "t")]
    assert slices.read_slice(todo[1].path(tmp_path, "m"))["part"] == "n2"


def test_a_start_that_ends_early_leaves_the_rest_a_start_of_their_own(tmp_path):
    todo = [slices.Slice("g", "s", 0, p) for p in ("n3", "n2", "n1")]
    starts = []

    def run(batch):  # every start serves one slice, then stops (as after a failure written as that slice)
        starts.append([sl.part for sl in batch])
        yield {"wall_s": 1}
    ran = slices.run_pending(todo, out=tmp_path, model="m", budget_s=math.inf, estimate_s=lambda sl, warm: 0,
                             run=run, together=lambda a, b: True)
    assert ran == todo and starts == [["n3", "n2", "n1"], ["n2", "n1"], ["n1"]]
    never = slices.run_pending([slices.Slice("g", "s", 1, p) for p in ("a", "b")], out=tmp_path, model="m",
                               budget_s=math.inf, estimate_s=lambda sl, warm: 0, run=lambda batch: (r for r in ()),
                               together=lambda a, b: True)
    assert never == []  # a start that serves nothing is not tried again


def test_slices_are_written_whole_or_not_at_all(tmp_path):
    todo = [slices.Slice("g", "s", r) for r in range(3)]

    def run(sl):
        if sl.round == 1:
            return {"wall_s": 1, "bad": object()}  # cannot be written: the write fails midway
        return {"wall_s": 1}
    with pytest.raises(TypeError):
        slices.run_pending(todo, out=tmp_path, model="m", budget_s=math.inf, estimate_s=lambda sl, warm: 0,
                           run=one_by_one(run))
    folder = todo[0].path(tmp_path, "m").parent
    assert sorted(p.name for p in folder.iterdir()) == ["r0.json"]  # no half file, no temporary left
    assert slices.pending(todo, tmp_path, "m") == todo[1:]
    folder.joinpath("r1.json").write_text("{half")
    with pytest.raises(Exception, match="r1.json: not valid JSON"):  # one line naming the file
        slices.measured_walls(folder)


def test_report_only_from_the_command_line(fake, tmp_path):
    profile, options = grid(repeats=1)
    fake(profile, options, tmp_path / "out")
    args = ("bench", "serve", "--report", "--out", tmp_path / "out", "--adapters", "0,2", "--rates", "8", "--alphas",
            "1", "--slice-by", "adapters", "--servers", "base,esftctl,lora")
    proc = run_cli(*args, "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    assert "8 of 13 slices" in proc.stdout and "missing: esftctl: n0.r1, n2.r1" in proc.stdout
    (report,) = (tmp_path / "out").glob("serve-*.json")
    assert json.loads(report.read_text())["grid"].startswith(ss.grid_key(profile))
    proc = run_cli(*args, "--cv", "2")  # another grid: none of its slices are there
    assert proc.returncode == 1 and "no slices of grid" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_the_median_of_paired_requests_carries_an_interval_over_rounds_then_requests():
    """slices.clustered_median: the pooled median, with a 95% interval that narrows with more requests and widens
    when the rounds disagree (a round's requests share their servers' starts)."""
    rng = np.random.default_rng(1)
    one = [list(1.02 + 0.05 * rng.standard_normal(60))]
    median, low, high = slices.clustered_median(one)
    assert median == pytest.approx(np.median(one[0])) and low < median < high and high - low < 0.04
    more = slices.clustered_median([list(1.02 + 0.05 * rng.standard_normal(600))])
    assert more[2] - more[1] < (high - low) / 2  # ten times the requests: about a third as wide
    apart = slices.clustered_median([[1.0] * 60, [1.1] * 60])  # two rounds that each agree within but not across
    assert apart[1] == pytest.approx(1.0) and apart[2] == pytest.approx(1.1)
    assert slices.clustered_median([[1.05] * 10]) == (1.05, 1.05, 1.05)
    assert slices.clustered_median([[], []]) is None and slices.clustered_median(one) == (median, low, high)


def test_the_admitted_server_is_esftctl_with_its_bound_and_its_statistics_merge_beside_the_grouped_ones():
    from esftctl.bench.serve_report import groups_table

    profile, options = grid(admit_by_adapter=30.0, group_adapters=2, max_loras=2)
    servers = {s.key: s for s in bench.bench_servers(profile, options)}
    assert servers["admitted-30"].serve == (("admit_by_adapter", 30.0),) and servers["admitted-30"].role == "esftctl"
    assert servers["esftctl"].serve == ()  # esftctl as a user runs it: admitted by adapter, its default
    for lever in ("grouped-2-8", "max-loras-2"):  # each measures its own lever, in vLLM's order
        assert ("admit_by_adapter", 0.0) in servers[lever].serve
    fcfs = {s.key: s for s in bench.bench_servers(*grid(admit_by_adapter=0.0))}["admitted-0"]
    assert (fcfs.kind, fcfs.serve) == ("esftctl, vLLM's order", (("admit_by_adapter", 0.0),))
    assert "admitted-0" not in {s.key for s in bench.bench_servers(*grid())}  # none asked for
    # statistics, and so a start per count, only where grouping or admission is set explicitly
    assert {k for k, s in servers.items() if s.scheduling_stats} == {"admitted-30", "grouped-2-8"}
    assert not fcfs.scheduling_stats
    assert [s.server for s in ss.slice_plan(profile, options, "g")].count("admitted-30") == 6  # a start per count
    admitted = ss.merge_groups([{"admit_by_adapter": 30.0, "reordered": 4}, {"admit_by_adapter": 30.0, "reordered": 1}])
    assert admitted == {"admit_by_adapter": 30.0, "reordered": 5}
    one = {"most": 2, "wait": 8, "steps": 10, "grouped_steps": 3, "most_groups_scheduled": 2, "longest_wait": 4,
           "held": {"1": 3}}
    grouped = ss.merge_groups([one, one | {"longest_wait": 6}])
    assert (grouped["steps"], grouped["longest_wait"], grouped["held"]) == (20, 6, {"1": 6})
    assert "reordered" not in grouped
    table = groups_table({"servers": [{"server": "grouped-2-8", "groups": grouped},
                                      {"server": "admitted-30", "groups": admitted}]})
    assert table.row_count == 2 and table.columns[-1].header == "reordered"


def test_the_main_table_shows_the_mean_ttft_ratio_beside_the_medians():
    """All at once, past --max-num-seqs, the median TTFT lies between the first wave of prompts and the rest, one or
    two requests deciding it (H100, 20 adapters, 2026-12-06: 1.61x the base's median, 1.30x its mean), so the
    main table shows the mean's ratio too."""
    from esftctl.bench.serve_report import runs_table

    config = {"device": "card", "model": "tiny", "input_len": 8, "output_len": 4, "duration": 1.0, "cv": 1.0,
              "prompts": 4, "repeats": 1}
    row = {"scenario": "2 adapters, alpha 1 @ inf rps", "requests": 4, "median_ttft_ms": 30.0, "p99_ttft_ms": 40.0,
           "median_tpot_ms": 5.0, "p99_tpot_ms": 6.0, "output_throughput": 100.0, "median_ttft_ratio": 1.609,
           "ttft_ratio": 1.298, "median_tpot_ratio": 1.218, "throughput_ratio": 0.802}
    table = runs_table({"config": config, "servers": [{"server": "esftctl", "rows": [row]}]})
    headers = [c.header for c in table.columns]
    cells = {h: next(iter(c.cells)) for h, c in zip(headers, table.columns)}
    assert headers.index("TTFT mean x") == headers.index("TTFT x") + 1
    assert (cells["TTFT x"], cells["TTFT mean x"], cells["TPOT x"]) == ("1.609", "1.298", "1.218")
