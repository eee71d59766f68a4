"""benchmarks/lab/ttft_runs.py's cuts: each run against plain vLLM's base run of its round on its machine,
request by request, by sixth of the run and by adapter, each adapter's first request apart, prompts prefilled alone
apart from those that met others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script


def _run(ttft: list[float], drawn: list[int], rate: float = 2.0, rnd: int = 0, alone: list[bool] | None = None) -> dict:
    n = len(ttft)
    return {"scenario": {"name": f"x @ {rate:g} rps", "rate": rate}, "round": rnd, "drawn": drawn,
            "result": {"gpu_sm_mhz": 1800.0},
            "requests": {"start_s": [0.5 * i for i in range(n)], "ttft_ms": ttft,
                         "latency_ms": [t + 100 for t in ttft], "alone": alone or [True] * n}}


def _slice(path: Path, machine: str, runs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "profile": {"output_len": 8}, "finished": 1.0, "runs": runs}))


def test_an_even_excess_shows_in_every_cut_and_a_first_request_one_apart(tmp_path):
    script = load_script("ttft_runs")
    n = 24
    _slice(tmp_path / "base" / "r0.json", "card", [_run([20.0] * n, [])])
    _slice(tmp_path / "base" / "on-other.r0.json", "other", [_run([10.0] * n, [])])  # another card: not its base
    drawn = [i % 3 for i in range(n)]
    slow = [22.0] * n  # 1.1x throughout
    first = [40.0 if i < 3 else 20.0 for i in range(n)]  # each adapter's first request 2x, the rest equal
    _slice(tmp_path / "esftctl" / "n3.r0.json", "card", [_run(slow, drawn), _run(first, drawn, rate=5.0)])
    _slice(tmp_path / "esftctl" / "n1.r1.json", "card", [_run(slow, [0] * n, rnd=1)])  # no base run of round 1
    rows = script.lines(tmp_path)
    assert [r["scenario"] for r in rows] == ["x @ 2 rps"]  # rate 5 has no base run either
    (even,) = rows
    assert even["median"] == pytest.approx(1.1) and even["sixths"] == pytest.approx([1.1] * 6)
    assert even["adapters"] == pytest.approx([1.1, 1.1]) and even["first"] == pytest.approx(1.1)
    assert even["requests"] == n and even["sm_mhz"] == 1800.0
    assert even["alone"] == pytest.approx(1.1) and even["alone_requests"] == n and even["beside"] is None
    _slice(tmp_path / "base" / "r0.json", "card", [_run([20.0] * n, []), _run([20.0] * n, [], rate=5.0)])
    at_first = script.lines(tmp_path)[1]
    assert at_first["first"] == pytest.approx(2.0) and at_first["later"] == pytest.approx(1.0)
    assert at_first["sixths"][0] == pytest.approx(2.0) and at_first["sixths"][1:] == pytest.approx([1.0] * 5)
    assert script.table(script.lines(tmp_path)).row_count == 2
    lost = _run(slow, drawn)
    lost["requests"]["ttft_ms"][1] = 0.0  # a request esftctl did not complete: left out, the others keep their adapters
    _slice(tmp_path / "esftctl" / "n3.r0.json", "card", [lost])
    (kept,) = script.lines(tmp_path)
    assert kept["requests"] == n - 1 and kept["median"] == pytest.approx(1.1)


def test_an_excess_that_other_requests_bring_leaves_the_prompts_prefilled_alone_out(tmp_path):
    script = load_script("ttft_runs")
    n = 12
    met = [i % 2 == 0 for i in range(n)]  # every other prompt met others, in both runs
    lone = [not m for m in met]
    _slice(tmp_path / "base" / "r0.json", "card", [_run([20.0] * n, [], alone=lone)])
    slow_beside = [22.0 if m else 20.0 for m in met]
    alone_here_only = [lone[0], False, *lone[2:]]  # the second prompt: alone in the base's run only, so "beside"
    _slice(tmp_path / "esftctl" / "n2.r0.json", "card", [_run(slow_beside, [i % 2 for i in range(n)],
                                                              alone=alone_here_only)])
    (row,) = script.lines(tmp_path)
    assert row["alone"] == pytest.approx(1.0) and row["alone_requests"] == n // 2 - 1
    assert row["beside"] == pytest.approx(1.1)
    assert "1.000 (5)" in _rendered(script.table([row]))


def _rendered(table) -> str:
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()
