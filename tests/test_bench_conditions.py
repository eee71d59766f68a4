"""The machine's state over a run (esftctl.bench.conditions): /proc/stat's CPU times, nvidia-smi's rows, the
run's summary, and the watch end to end against a stand-in nvidia-smi that answers only the reasons field's old
name, with two GPUs of which one is visible."""

from __future__ import annotations

import stat
import sys
import time

import pytest

from esftctl.bench import conditions
from esftctl.bench.conditions import KEYS, Watch, cpu_times, gpu_sample, summarize

STAT = """cpu  1000 10 300 5000 40 0 20 30 0 0
cpu0 500 5 150 2500 20 0 10 15 0 0
intr 12345
"""


def test_cpu_times_are_busy_steal_and_total_jiffies():
    # busy = user + nice + system + irq + softirq; idle, iowait and steal are not busy
    assert cpu_times(STAT) == (1000 + 10 + 300 + 0 + 20, 30, 1000 + 10 + 300 + 5000 + 40 + 0 + 20 + 30)
    with pytest.raises(ValueError):
        cpu_times("intr 1\n")


def test_a_gpu_row_is_parsed_and_anything_else_is_not():
    row = gpu_sample("0, 1980, 3201, 121.53, 41, 87, 0x0000000000000004")
    assert row == {"index": 0.0, "clocks.sm": 1980.0, "clocks.mem": 3201.0, "power.draw": 121.53,
                   "temperature.gpu": 41.0, "utilization.gpu": 87.0, "reasons": 4}
    assert gpu_sample("1, 345, 3201, [N/A], 30, 0, 0x0000000000000001")["power.draw"] is None
    assert gpu_sample('Field "clocks_event_reasons.active" is not a valid field to query.') is None
    assert gpu_sample("x, 1, 2, 3, 4, 5, 0x1") is None


def test_a_runs_summary():
    samples = [gpu_sample(f"0, {mhz}, 3201, {w}, {t}, {u}, {r}")
               for mhz, w, t, u, r in ((345, 70, 30, 0, "0x1"), (1980, 300, 45, 90, "0x0"), (1755, 400, 50, 95, "0x4"),
                                       (1980, 290, 44, 92, "0x0"))]
    out = summarize(samples, (100, 10, 1000), (400, 60, 2000))
    assert set(out) == set(KEYS)
    assert out["gpu_sm_mhz"] == pytest.approx((345 + 1980 + 1755 + 1980) / 4)
    assert 345 < out["gpu_sm_mhz_p10"] < 1755  # the idle sample pulls the low tail down, within the samples
    assert out["gpu_power_w"] == pytest.approx(265) and out["gpu_temp_c"] == 50
    assert out["gpu_idle_share"] == 0.25 and out["gpu_slowdown_share"] == 0.25 and out["gpu_samples"] == 4
    assert out["host_busy"] == pytest.approx(0.3) and out["host_steal"] == pytest.approx(0.05)
    empty = summarize([], None, (1, 1, 1))
    assert all(v is None for v in empty.values())


FAKE_SMI = """#!{python}
import signal, sys, time
if {deaf}:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one that does not hear Ctrl-C is terminated
args = sys.argv[1:]
query = next(a for a in args if a.startswith("--query-gpu="))
if "clocks_event_reasons" in query:  # a driver older than 535 knows only the old name
    print('Field "clocks_event_reasons.active" is not a valid field to query.')
    sys.exit(2)
loop = any(a.startswith("--loop-ms") for a in args)
i = 0
while True:
    print("0, 345, 3201, 75.5, 30, 0, 0x0000000000000001", flush=True)
    print(f"1, {{1980 - i}}, 3201, 120.25, {{40 + min(i, 5)}}, 50, 0x0000000000000004", flush=True)
    i += 1
    if not loop:
        break
    time.sleep(0.01)
"""


@pytest.mark.parametrize("deaf", [False, True])
def test_the_watch_samples_the_visible_gpus_and_the_host(tmp_path, monkeypatch, deaf):
    monkeypatch.setattr(Watch, "stop_wait_s", 0.5)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, deaf=deaf))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    assert conditions.query(str(smi)).endswith("clocks_throttle_reasons.active")
    proc = tmp_path / "stat"
    proc.write_text("cpu  100 0 0 900 0 0 0 0 0 0\n")
    with Watch(smi=str(smi), stat=proc, gpus={1}) as watch:
        deadline = time.monotonic() + 30
        while len(watch.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.write_text("cpu  400 0 0 1500 0 0 0 100 0 0\n")
    out = watch.result
    assert out["gpu_samples"] >= 3 and out["gpu_samples"] == len(watch.samples)
    assert all(s["index"] == 1 for s in watch.samples)  # GPU 0 is not visible
    assert out["gpu_power_w"] == pytest.approx(120.25) and out["gpu_sm_mhz"] <= 1980
    assert out["gpu_slowdown_share"] == 1.0 and out["gpu_idle_share"] == 0.0
    assert out["host_busy"] == pytest.approx(300 / 1000) and out["host_steal"] == pytest.approx(100 / 1000)
    assert watch._proc.poll() is not None  # the sampler stopped with the block
    with Watch(smi=str(smi), stat=proc, period_ms=0) as off:  # ESFTCTL_WATCH_MS=0: the host only
        pass
    assert off._proc is None and off.result["gpu_samples"] is None and off.result["host_busy"] is None  # no change


def test_without_nvidia_smi_only_the_host_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")  # by UUID: every GPU counts
    assert conditions.visible_gpus() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert conditions.visible_gpus() == {2, 3}
    with Watch(smi=str(tmp_path / "no-such-smi")) as watch:
        sum(range(100000))
    out = watch.result
    assert all(out[k] is None for k in KEYS if k.startswith("gpu_"))
    assert out["host_busy"] is None or 0 <= out["host_busy"] <= 1  # /proc/stat where there is one


def test_the_report_shows_the_machine_over_each_run():
    import io

    from rich.console import Console

    from esftctl.bench.serve_report import machine_table

    row = {"scenario": "base @ 2 rps", "gpu_sm_mhz": 1432.4, "gpu_sm_mhz_p10": 345.0, "gpu_power_w": 151.2,
           "gpu_temp_c": 44.0, "gpu_util": 64.6, "gpu_idle_share": 0.31, "gpu_slowdown_share": 0.0, "host_busy": 0.12,
           "host_steal": 0.004}
    assert machine_table({"servers": [{"server": "vLLM base", "rows": [{"scenario": "x"}]}]}) is None  # none kept
    text = io.StringIO()
    Console(file=text, width=250).print(machine_table({"servers": [{"server": "vLLM base", "rows": [row]}]}))
    line = next(x for x in text.getvalue().splitlines() if "base @ 2 rps" in x)
    assert [c for c in line.replace("│", " ").split()][-9:] == ["1432", "345", "151", "44", "65%", "31%", "0%",
                                                                  "12%", "0.4%"]
