"""benchmarks/lab/ttft_waves.py: all-at-once runs cut into waves (prefilled before any request finished) and
deliveries (one engine step's first tokens), times from the run's first send."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def _burst(sends: list[float], first_tokens_ms: list[float], finish_ms: list[float]) -> dict:
    """Requests sent at `sends` (s), first tokens and finishes at these times (ms) from the first send."""
    return {"start_s": sends, "ttft_ms": [f - 1000 * s for s, f in zip(sends, first_tokens_ms)],
            "latency_ms": [e - 1000 * s for s, e in zip(sends, finish_ms)], "alone": [False] * len(sends)}


def test_the_first_wave_is_what_came_before_any_finish_and_deliveries_are_counted_from_the_first_send():
    script = load_script("ttft_waves")
    # four slots' worth: three prompts in one step (sent 0-40 ms apart, first tokens within 2 ms), a fourth a step
    # later, then two that waited for slots freed at 500 ms
    sends = [0.0, 0.02, 0.04, 0.0, 0.01, 0.03]
    first = [100.0, 101.0, 102.0, 180.0, 620.0, 640.0]
    w = script.waves(_burst(sends, first, [500.0, 510.0, 520.0, 530.0, 900.0, 910.0]))
    assert w["wave"] == {"count": 4, "from": 100.0, "to": 180.0, "mean": pytest.approx(120.75)}
    assert (w["rest"]["count"], w["rest"]["from"]) == (2, 620.0)
    assert w["deliveries"] == [{"at": 100.0, "spread": 2.0, "count": 3}, {"at": 180.0, "spread": 0.0, "count": 1}]
    ttft = [100.0, 81.0, 62.0, 180.0, 610.0, 610.0]  # each from its own send: 40 ms of sending would spread the step
    assert w["ttft_mean"] == pytest.approx(sum(ttft) / 6) and w["ttft_median"] == pytest.approx((100 + 180) / 2)
    assert w["first_sent"] == pytest.approx(100.0)  # the request sent first, at 0 s (ties: the first listed)
    assert script.waves({"start_s": [0.0], "ttft_ms": [0.0], "latency_ms": [0.0]}) is None  # nothing completed


def test_runs_come_from_a_grids_servers_at_inf_or_side_by_sides_rounds_and_a_bad_file_is_one_line(tmp_path):
    script = load_script("ttft_waves")
    burst = _burst([0.0, 0.0], [100.0, 300.0], [200.0, 400.0])
    for server in ("base", "admitted-0"):
        (tmp_path / server).mkdir()
        runs = [{"scenario": {"name": n, "rate": rate}, "round": 0, "requests": burst}
                for n, rate in (("x @ inf rps", float("inf")), ("x @ 5 rps", 5.0))]
        (tmp_path / server / "r0.json").write_text(json.dumps({"runs": runs}))
    assert [(s, label) for s, label, _ in script.runs_of(tmp_path)] == [("admitted-0", "x @ inf rps r0"),
                                                                        ("base", "x @ inf rps r0")]
    side = tmp_path / "side.json"
    side.write_text(json.dumps({"rounds": {"inf": [{"plain": burst, "esftctl": burst, "plain again": burst}],
                                           "5": [{"plain": burst, "esftctl": burst, "plain again": burst}]}}))
    assert [(s, label) for s, label, _ in script.runs_of(side)] == [
        ("plain", "round 0"), ("esftctl", "round 0"), ("plain again", "round 0")]
    for text, error in (("[]", "TypeError"), ('{"rounds": []}', "AttributeError"), ("{", "JSONDecodeError")):
        (tmp_path / "notes.json").write_text(text)
        with pytest.raises(SystemExit, match=rf"notes\.json: not side_by_side\.py's JSON \({error}"):
            script.runs_of(tmp_path / "notes.json")
