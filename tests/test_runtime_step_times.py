"""Step times without a profiler (esftctl.runtime.vllm.profiling.StepTimes, ESFTCTL_STEP_TIMES): what a wrapped
scheduler and worker record, and when the lines reach the file (benchmarks/lab/mixed_step.py reads them)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from esftctl.runtime.vllm import profiling


class Engine:  # stands in for vLLM's Scheduler and Worker: the same call shapes
    def schedule(self):
        return SimpleNamespace(total_num_scheduled_tokens=262)

    def execute_model(self, scheduler_output):
        time.sleep(0.002)
        return None

    def update_from_output(self, scheduler_output, model_output):
        return {}


def _lines(path):
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_calls_are_timed_and_written_after_a_pause(tmp_path, monkeypatch):
    recorder = profiling.StepTimes(tmp_path / "steps-1.tsv")
    cls = type("Wrapped", (Engine,), {})
    for method, part in (("schedule", "schedule"), ("execute_model", "execute"), ("update_from_output", "output")):
        setattr(cls, method, recorder.timed(getattr(Engine, method), part))
    engine = cls()
    batch = engine.schedule()
    engine.execute_model(batch)
    engine.update_from_output(batch, None)
    assert not _lines(recorder.path)  # kept in memory while steps follow each other
    time.sleep(profiling.FLUSH_AFTER_IDLE_S + 0.05)
    engine.schedule()  # the first call after a pause writes what came before it
    rows = _lines(recorder.path)
    assert [r[0] for r in rows] == ["schedule", "execute", "output"]
    assert [int(r[3]) for r in rows] == [262, 262, 0]  # execute: its scheduler output's tokens
    starts, ends = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert all(s <= e for s, e in zip(starts, ends)) and starts == sorted(starts)
    assert ends[1] - starts[1] >= 0.002  # the wrapped call's own time
    assert abs(starts[0] - time.perf_counter()) < 5  # the clock a client on the machine reads
    monkeypatch.setattr(profiling, "FLUSH_ROWS", 2)
    engine.execute_model(batch)
    engine.execute_model(batch)  # a full batch is written too, without a pause
    assert len(_lines(recorder.path)) == 5


def test_nothing_is_wrapped_without_the_variable(monkeypatch):
    monkeypatch.delenv(profiling.STEP_TIMES_ENV, raising=False)
    assert profiling.install_step_times() == []
