"""benchmarks/lab/tpot_rows.py: the expert rows a decode step reads in closed form, averaged over each request's
decode, set beside its TPOT over plain vLLM's same request."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import load_script


def _drawn_rows(counts: dict, replaced: list, E: int, top_k: int, trials: int = 4000) -> float:
    """The rows a layer reads, drawn: each file's replaced experts at random (its names share them), each name's
    copies its own, each sequence's top-k at random."""
    rng, total = random.Random(0), 0
    for _ in range(trials):
        files = {swap.file: set(rng.sample(range(E), int(swap.experts))) for swap in replaced}
        rows = set()
        for name, n in counts.items():
            for _ in range(n):
                for e in rng.sample(range(E), top_k):
                    mine = name is not None and e in files[replaced[name].file]
                    rows.add((name, e) if mine else (None, e))
        total += len(rows)
    return total / trials


def test_the_closed_form_counts_the_rows_a_draw_counts():
    script = load_script("tpot_rows")
    replaced = [script.Swap(0, 4), script.Swap(1, 9), script.Swap(1, 9)]  # names 1 and 2 on one file
    for counts in ({None: 3}, {0: 2, 1: 1}, {None: 2, 0: 3, 1: 2}, {1: 3, 2: 3}, {None: 1, 1: 2, 2: 2}):
        want = _drawn_rows(counts, replaced, script.E, script.TOP_K)
        assert script.rows(counts, replaced) == pytest.approx(want, rel=0.01), counts
    assert script.excess({0: 5}, replaced) == pytest.approx(0.0)  # one adapter's requests only swap rows
    assert all(script.excess({0: n}, replaced) >= 0.0 for n in range(1, 300))  # rounding never goes below
    assert script.excess({None: 1, 0: 1}, replaced) > 0 and script.excess({}, replaced) == 0.0
    # two names on one file skip the base's copies of the same experts: fewer rows than two files would read
    apart = [script.Swap(0, 9), script.Swap(1, 9)]
    assert script.rows({1: 3, 2: 3}, replaced) < script.rows({0: 3, 1: 3}, apart)


def test_each_request_averages_the_rows_over_its_own_decode():
    script = load_script("tpot_rows")
    replaced = [script.Swap(0, 5.0), script.Swap(1, 5.0)]
    # request 0 decodes 1.0-3.0 s, request 1 (another adapter) 2.0-4.0 s: they share half of each decode
    requests = {"start_s": [0.0, 1.5], "ttft_ms": [1000.0, 500.0], "latency_ms": [3000.0, 2500.0]}
    shared = script.excess({0: 1, 1: 1}, replaced)
    (first, seqs0), (second, seqs1) = script.decode_excess(requests, [0, 1], replaced)
    assert first == pytest.approx(shared / 2) and second == pytest.approx(shared / 2)
    assert seqs0 == pytest.approx(1.5) and seqs1 == pytest.approx(1.5)
    same = script.decode_excess(requests, [0, 0], replaced)  # one adapter: no extra rows
    assert [e for e, _ in same] == pytest.approx([0.0, 0.0])
    requests["ttft_ms"][1] = 0.0  # not completed: no span, and no sequence beside the other
    assert script.decode_excess(requests, [0, 1], replaced) == [(0.0, 1.0), None]


def test_a_prompt_is_set_beside_the_sequences_decoding_halfway_through_its_wait():
    script = load_script("tpot_rows")
    replaced = [script.Swap(0, 5.0), script.Swap(1, 5.0)]
    # request 0 waits 0-1.0 s and decodes 1.0-3.0 s; request 1 (the other adapter) waits 1.5-2.0 s, beside it
    requests = {"start_s": [0.0, 1.5], "ttft_ms": [1000.0, 500.0], "latency_ms": [3000.0, 2500.0]}
    (first, seqs0), (second, seqs1) = script.prefill_excess(requests, [0, 1], replaced, prompt_len=256)
    assert (first, seqs0) == (0.0, 1)  # alone: its prompt reads its copies instead of the base's rows
    assert seqs1 == 2 and second == pytest.approx(script.excess({1: 256, 0: 1}, replaced))
    assert second > script.excess({1: 1, 0: 1}, replaced) > 0  # a prompt reads every expert: the base rows stay
    assert script.prefill_excess(requests, [0, 0], replaced, prompt_len=256)[1] == (pytest.approx(0.0), 2)


def _run(rate: float, ttft: list[float], latency: list[float], drawn: list[int], rnd: int = 0) -> dict:
    return {"scenario": {"name": f"x @ {rate:g} rps", "rate": rate, "adapters": 2 if drawn else 0}, "round": rnd,
            "drawn": drawn, "requests": {"start_s": [0.0, 0.05], "ttft_ms": ttft, "latency_ms": latency,
                                         "alone": [True, True]}}


def _slice(path: Path, machine: str, runs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "profile": {"output_len": 11}, "runs": runs}))


def test_runs_pair_with_the_base_of_their_round_on_their_machine_and_the_share_is_fitted(tmp_path):
    script = load_script("tpot_rows")
    _slice(tmp_path / "base" / "r0.json", "card", [_run(2.0, [10.0, 10.0], [110.0, 110.0], [])])
    _slice(tmp_path / "base" / "on-other.r1.json", "other", [_run(2.0, [10.0, 10.0], [50.0, 50.0], [], rnd=1)])
    _slice(tmp_path / "esftctl" / "n2.r0.json", "card", [_run(2.0, [10.0, 10.0], [120.0, 130.0], [0, 1])])
    _slice(tmp_path / "esftctl" / "n2.r1.json", "card", [_run(2.0, [10.0, 10.0], [120.0, 130.0], [0, 1], rnd=1)])
    (run,) = script.paired(tmp_path)  # round 1's base ran on another machine
    assert run["ratios"] == pytest.approx([1.1, 1.2]) and run["round"] == 0
    assert all(x > 0 for x in run["excess"])  # the two adapters' decodes overlap
    _slice(tmp_path / "admitted-0" / "n2.r0.json", "card", [_run(2.0, [10.0, 10.0], [132.0, 143.0], [0, 1])])
    (fcfs,) = script.load_runs(tmp_path, server="admitted-0")  # another server of the grid, as bench serve names it
    assert fcfs["ratios"] == pytest.approx([1.22, 1.33])
    with pytest.raises(SystemExit, match="needs base/ and max-loras-4/ folders"):
        script.load_runs(tmp_path, server="max-loras-4")
    runs = [{"excess": [0.01, 0.02, 0.04], "ratios": [1.005, 1.01, 1.02]}]
    assert script.fit(runs) == pytest.approx(0.5)
    assert script.fit([{"excess": [0.0, 0.0], "ratios": [1.01, 0.99]}]) == 0.0  # nothing read extra rows
    (low, high) = script.buckets([{"excess": [0.001, 0.06], "ratios": [1.0, 1.03]}])
    assert (low["requests"], low["ratio"], high["ratio"]) == (1, 1.0, 1.03)


def _requests(latency: list[float]) -> dict:
    # two requests, one after the other: each decodes alone
    return {"start_s": [0.0, 1.0], "ttft_ms": [10.0, 10.0], "latency_ms": latency, "alone": [True, True]}


def test_side_by_side_runs_pair_with_both_plain_runs_and_requests_that_decoded_alone_are_told_apart(tmp_path):
    script = load_script("tpot_rows")
    side = tmp_path / "side_by_side.json"
    rounds = [{"plain": _requests([80.0, 80.0]), "esftctl": _requests([87.0, 94.0]),
               "plain again": _requests([94.0, 108.0])}]
    side.write_text(json.dumps({"args": {"model": "tiny", "adapters": "2", "alpha": "1.0"}, "rounds": {"2": rounds}}))
    (run,) = script.load_runs(side)
    # tiny's 8 tokens, 7 after the first: TPOT 11 and 12 ms against plain's 10, then plain again's 12 and 14
    assert run["ratios"] == pytest.approx([1.1, 1.2, 11 / 12, 12 / 14]) and run["rate"] == 2.0
    assert run["excess"] == pytest.approx([0.0] * 4) and run["seqs"] == pytest.approx([1.0] * 4)
    assert script.alone([run]) == {"requests": 4, "ratio": pytest.approx((1.1 + 11 / 12) / 2)}
    (ttft,) = script.load_runs(side, "ttft")  # TTFT 10 ms everywhere
    assert ttft["ratios"] == pytest.approx([1.0] * 4) and ttft["seqs"] == [1] * 4
    overlapping = {**run, "seqs": [1.5] * 4}
    assert script.alone([overlapping]) is None
    side.write_text("{}")
    with pytest.raises(SystemExit, match="not side_by_side.py's JSON"):
        script.load_runs(side)


def test_side_by_side_runs_are_set_beside_the_adapters_they_kept(tmp_path):
    """A run's kept "drawn" names its requests' adapters: two sequences decoding together read no extra rows on one
    adapter (its copies only swap rows) and read extra on two."""
    script = load_script("tpot_rows")
    together = {"start_s": [0.0, 0.0], "ttft_ms": [10.0, 10.0], "latency_ms": [80.0, 80.0], "alone": [True, True]}
    excess = {}
    for drawn in ([0, 0], [0, 1]):
        rounds = [{"plain": together, "esftctl": together | {"drawn": drawn}, "plain again": together}]
        side = {"args": {"model": "tiny", "adapters": "2", "alpha": "1.0"}, "rounds": {"2": rounds}}
        (tmp_path / "side.json").write_text(json.dumps(side))
        (run,) = script.load_runs(tmp_path / "side.json")
        excess[tuple(drawn)] = run["excess"]
    assert excess[(0, 0)] == pytest.approx([0.0, 0.0, 0.0, 0.0])
    two = script.excess({0: 1, 1: 1}, script.adapter_experts(2))  # each reads its own copies where it replaced one
    assert two > 0.005 and excess[(0, 1)] == pytest.approx([two] * 4)
