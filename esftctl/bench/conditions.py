"""The machine's state over a measured run: the GPUs' clocks, power, temperature and slowdown reasons (nvidia-smi
sampled every 100 ms), and the host's CPU busy and steal shares (/proc/stat before and after).

Why: esftctl's TTFT moved from 1.02x to 1.15x plain vLLM's between runs of one server start on one H200
(benchmarks/RESULTS.md, Adapters against the base), and within a run the excess was even: over each sixth of the run's
minute and over its adapters alike (benchmarks/lab/ttft_runs.py). A shift that holds a whole run and changes between
runs of one process is not made by the code served (the same kernels and graphs all along), but something the machine
does from minute to minute can make it: a GPU's SM clock drops far below its clock under load while the card idles, at
1-2 requests/s the card idles between prompts, and the host may be a virtual machine whose other tenants take CPU time
(steal). Each run records these next to its numbers, so that a shift can be set beside them. The card's settings are
read, never changed.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import statistics
import subprocess
import threading
from pathlib import Path

# nvidia-smi's query fields, in its order; older drivers name the reasons field clocks_throttle_reasons.active
FIELDS = ("index", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
IDLE = 0x1  # nvmlClocksEventReasonGpuIdle
# software power cap, hardware slowdown, software and hardware thermal slowdown, hardware power brake
SLOWDOWN = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
# nvidia-smi's sampling period; ESFTCTL_WATCH_MS=0 turns the GPU's sampling off (to check that it moves nothing:
# both sides of every comparison are sampled alike; slices written before this sampling existed were not sampled)
PERIOD_MS = int(os.environ.get("ESFTCTL_WATCH_MS", "100"))
KEYS = ("gpu_sm_mhz", "gpu_sm_mhz_p10", "gpu_mem_mhz", "gpu_power_w", "gpu_temp_c", "gpu_util", "gpu_idle_share",
        "gpu_slowdown_share", "gpu_samples", "host_busy", "host_steal")


def cpu_times(text: str) -> tuple[int, int, int]:
    """(busy, steal, total) jiffies of all CPUs from /proc/stat's text; busy leaves out idle, iowait and steal."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:9]] + [0] * (8 - len(parts[1:9]))
            user, nice, system, idle, iowait, irq, softirq, steal = values
            return user + nice + system + irq + softirq, steal, sum(values)
    raise ValueError("no 'cpu' line")


def read_cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int, int] | None:
    try:
        return cpu_times(stat.read_text())
    except (OSError, ValueError):
        return None


def gpu_sample(line: str) -> dict | None:
    """One GPU's row of `nvidia-smi --format=csv,noheader,nounits` over FIELDS + a reasons field; None for a line
    that is not one (a message). Fields the card does not report ([N/A]) are None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) + 1:
        return None
    out: dict = {}
    for name, value in zip(FIELDS + ("reasons",), parts):
        try:
            out[name] = int(value, 16) if name == "reasons" else int(value) if name == "index" else float(value)
        except ValueError:
            if name == "index":
                return None
            out[name] = None
    return out


@functools.lru_cache(maxsize=None)
def query(smi: str) -> str | None:
    """The --query-gpu argument this nvidia-smi answers (the reasons field under its new or old name); None where
    there is no nvidia-smi or it answers neither."""
    if not shutil.which(smi):
        return None
    for reasons in REASONS:
        fields = ",".join(FIELDS + (reasons,))
        try:
            done = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0 and any(gpu_sample(line) for line in done.stdout.splitlines()):
            return fields
    return None


def gpu_processes(smi: str = "nvidia-smi") -> dict[int, int] | None:
    """MiB each process holds on the GPUs, by pid (nvidia-smi's compute apps; a process on two cards, summed); None
    where there is no nvidia-smi or it does not answer. Read where a run failed beside another server: whether each
    held what its share gave it."""
    if not shutil.which(smi):
        return None
    try:
        done = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode:
        return None
    held: dict[int, int] = {}
    for line in done.stdout.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and mib.isdigit():
            held[int(pid)] = held.get(int(pid), 0) + int(mib)
    return held


def visible_gpus() -> set[int] | None:
    """The GPU indices CUDA_VISIBLE_DEVICES names where it names them by number; None: every GPU."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return {int(p) for p in parts} if parts and all(p.isdigit() for p in parts) else None


def summarize(samples: list[dict], before: tuple | None, after: tuple | None) -> dict[str, float | None]:
    """A run's KEYS: the GPU samples' means (the SM clock also its 10th percentile; temperature its maximum), the
    shares of samples whose reasons say idle or slowed down, and the host's busy and steal shares of all CPU time
    between `before` and `after` (read_cpu_times)."""

    def values(name: str) -> list[float]:
        return [s[name] for s in samples if s.get(name) is not None]

    def mean(name: str) -> float | None:
        v = values(name)
        return statistics.fmean(v) if v else None

    sm, reasons = values("clocks.sm"), values("reasons")
    low = statistics.quantiles(sm, n=10, method="inclusive")[0] if len(sm) > 1 else (sm[0] if sm else None)
    out = {"gpu_sm_mhz": mean("clocks.sm"), "gpu_sm_mhz_p10": low,
           "gpu_mem_mhz": mean("clocks.mem"), "gpu_power_w": mean("power.draw"),
           "gpu_temp_c": max(values("temperature.gpu"), default=None), "gpu_util": mean("utilization.gpu"),
           "gpu_idle_share": sum(r & IDLE != 0 for r in reasons) / len(reasons) if reasons else None,
           "gpu_slowdown_share": sum(r & SLOWDOWN != 0 for r in reasons) / len(reasons) if reasons else None,
           "gpu_samples": len(samples) or None, "host_busy": None, "host_steal": None}
    if before and after and after[2] > before[2]:
        total = after[2] - before[2]
        out["host_busy"] = (after[0] - before[0]) / total
        out["host_steal"] = (after[1] - before[1]) / total
    return out


class Watch:
    """`with Watch() as w: ...` samples the visible GPUs every `period_ms` and reads the host's CPU times at both
    ends; `w.result` (KEYS) after the block. Without nvidia-smi (the CPU build), or with `period_ms` 0, the GPU keys
    are None."""

    stop_wait_s = 5.0  # how long nvidia-smi gets to end after each signal (SIGINT, SIGTERM, then SIGKILL)

    def __init__(self, *, period_ms: int = PERIOD_MS, smi: str = "nvidia-smi", stat: Path = Path("/proc/stat"),
                 gpus: set[int] | None = None):
        self.period_ms, self.smi, self.stat = period_ms, smi, stat
        self.gpus = gpus if gpus is not None else visible_gpus()
        self.samples: list[dict] = []
        self.result: dict[str, float | None] = {}
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._before = read_cpu_times(self.stat)
        fields = query(self.smi) if self.period_ms > 0 else None
        if fields:
            # line-buffered where coreutils' stdbuf is there: nvidia-smi's output goes to a pipe, which C's stdio
            # buffers by the block, and a sample held back in the buffer at the end would be lost
            line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
            self._proc = subprocess.Popen([*line_buffered, self.smi, f"--query-gpu={fields}",
                                           "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = gpu_sample(line)
            if sample and (self.gpus is None or sample["index"] in self.gpus):
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc:
            for stop in (lambda p: p.send_signal(signal.SIGINT), subprocess.Popen.terminate, subprocess.Popen.kill):
                stop(self._proc)  # Ctrl-C first: nvidia-smi ends its loop and exits, flushing what it printed
                try:
                    self._proc.wait(timeout=self.stop_wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self._reader.join(timeout=10)
        self.result = summarize(self.samples, self._before, read_cpu_times(self.stat))
