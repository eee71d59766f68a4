"""`esftctl bench offline`: every offline command on a DeepSeek-V2-Lite-shaped checkpoint, against the disk.

The checkpoint is generated on demand (`esftctl.bench.synthetic_model`, trained-like bf16, sharded with an
index) with `layers` of the real model's 27 (the first dense, the rest MoE with 64 routed experts of
2048 x 1408): 27 is the real size, 31.4 GB a checkpoint; fewer keep the shapes every command streams (one
shard, one layer's experts at a time) in less disk. Beside it: an ESFT fine-tune (6 routed experts per MoE
layer changed) for `pack`, and three full fine-tunes (every non-expert tensor changed too) for `consolidate`.
All are cached under `root` and built once.

Each command runs as a user runs it (`esftctl ...`, a child process), with its inputs evicted from the page
cache first (fsync, then POSIX_FADV_DONTNEED: a 24 GiB machine would otherwise read a 4.5 GB checkpoint it
just wrote from memory). Per command: wall seconds, peak resident memory (the child's VmHWM, which counts the
pages of checkpoint files it maps while they stay cached, so it moves with the page cache), peak anonymous
memory (RssAnon: what the command itself holds), both sampled every 50 ms, the bytes it
must read (its inputs' sizes; `inspect` reads headers only, `materialize` one checkpoint's worth from the three
variants, counted as what it writes; `consolidate` reads the variants' experts, less than their sizes) and write
(its output's size), and the floor those
bytes set at the disk's speed, measured in the same run (a fresh file written with fsync, then read cold):
floor = read / read speed + written / write speed. "x floor" is seconds over that floor (issue 19's target for
I/O-bound commands: at most 2); compress is bound by the Huffman encoder instead, so its row also extrapolates
its rate to the whole 31.4 GB base (target: 3 minutes).
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from esftctl.bench.disk import evict, read_bandwidth

GB = 1e9
FULL_LAYERS = 27  # DeepSeek-V2-Lite
FULL_BYTES = 31.4 * GB  # its bf16 checkpoint
VARIANTS = 3  # full fine-tunes consolidated
ESFT_EXPERTS = 6  # routed experts per MoE layer the ESFT fine-tune changes (of 64)
PROBE_BYTES = 2 << 30  # the disk-speed file
IO_BOUND = ("pack", "merge", "decompress", "consolidate", "materialize")
KEEP = ("bundle", "base.store", "map")  # outputs a later command reads
WORK_CHECKPOINTS = 2.2  # the commands' outputs at their largest: a kept store and map beside one checkpoint


def tree_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_speed(folder: Path, nbytes: int = PROBE_BYTES) -> dict:
    """Sequential write (fsync'd) and cold read speed of the disk under `folder`, in bytes per second."""
    probe = Path(folder) / ".esftctl-disk-probe"
    block = os.urandom(64 << 20)
    try:
        start = time.perf_counter()
        with open(probe, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        read_Bps = read_bandwidth(probe, chunk=len(block))
    finally:
        probe.unlink(missing_ok=True)
    return {"bytes": nbytes, "write_Bps": nbytes / write_s, "read_Bps": read_Bps}


def _memory(pid: int) -> tuple[int, int]:
    """(VmHWM, RssAnon) of a process in bytes: its peak resident memory so far (file pages it maps included) and
    its resident anonymous memory now (heap and arrays, not file pages the kernel can drop); zeros once gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields.get("VmHWM", 0), fields.get("RssAnon", 0)


def run_command(argv: list[str]) -> dict:
    """Run `esftctl argv` as a child; its wall seconds, peak RSS (VmHWM, which also counts pages of files it
    maps) and peak anonymous memory (RssAnon), both sampled every 50 ms. Not ru_maxrss: Linux carries it over fork
    and exec, so a child reported the bench's own peak (3.37 GiB for `inspect`, after the bench had generated
    the checkpoints in its own process). A failure raises with its stderr."""
    import threading

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "esftctl", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak, done = [0, 0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[:] = map(max, peak, _memory(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read()
    done.set()
    sampler.join()
    proc.wait()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"esftctl {' '.join(argv)} failed ({proc.returncode}): {stderr.strip()[-500:]}")
    return {"seconds": seconds, "peak_rss": peak[0], "peak_anon": peak[1]}


def prepare(root: Path, layers: int, on_step: Callable[[str], None], overrides: dict | None = None
            ) -> dict[str, Path]:
    """The generated base and its fine-tunes under `root` (each written once, then reused). Refuses, before
    writing anything, when the disk cannot hold the missing ones plus the commands' outputs."""
    import shutil

    from esftctl.bench.synthetic_model import checkpoint_tensors, deepseek_v2_lite_config, write_finetune, write_model
    from esftctl.errors import EsftError

    folder = Path(root) / f"deepseek-v2-lite-{layers}l"
    paths = {"base": folder / "base", "esft": folder / "esft-finetune",
             **{f"full{i}": folder / f"full-finetune-{i}" for i in range(1, VARIANTS + 1)}}
    config = deepseek_v2_lite_config(**{"num_hidden_layers": layers, **(overrides or {})})
    size = sum(2 * math.prod(shape) for _, shape in checkpoint_tensors(config))
    need = (sum(not p.exists() for p in paths.values()) + WORK_CHECKPOINTS) * size
    free = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free
    if need > free:
        raise EsftError(f"needs {need / GB:.1f} GB free for {layers} layers ({size / GB:.1f} GB a checkpoint), "
                        f"has {free / GB:.1f} GB (fewer --layers, or another --root)", folder)
    if not paths["base"].exists():
        on_step(f"generating the base ({layers} layers)")
        write_model(paths["base"], config, seed=0)
    for key, path in paths.items():
        if key != "base" and not path.exists():
            on_step(f"writing {path.name}")
            kind, seed = ("esft", 100) if key == "esft" else ("full", int(key[4:]))
            write_finetune(paths["base"], path, kind=kind, seed=seed,
                           experts_per_layer=min(ESFT_EXPERTS, config.n_routed_experts // 4))
    return paths


def commands(paths: dict[str, Path], work: Path, capacity: int) -> list[tuple[str, list[str], list[Path], Path | None]]:
    """(label, esftctl argv, inputs, output) of every measured command, in an order where each output exists
    before a later command reads it."""
    w = Path(work)
    fulls = [paths[f"full{i}"] for i in range(1, VARIANTS + 1)]
    return [
        ("inspect", ["inspect", str(paths["base"]), "--json"], [], None),
        ("pack", ["pack", str(paths["base"]), str(paths["esft"]), "--out", str(w / "bundle"), "--name", "ft"],
         [paths["base"], paths["esft"]], w / "bundle"),
        ("merge", ["merge", str(paths["base"]), str(w / "bundle"), "--out", str(w / "merged")],
         [paths["base"], w / "bundle"], w / "merged"),
        ("compress base", ["compress", str(paths["base"]), "--out", str(w / "base.store")], [paths["base"]],
         w / "base.store"),
        ("compress bundle", ["compress", str(w / "bundle"), "--out", str(w / "bundle.store")], [w / "bundle"],
         w / "bundle.store"),
        ("decompress", ["decompress", str(w / "base.store"), "--out", str(w / "decompressed")],
         [w / "base.store"], w / "decompressed"),
        ("consolidate", ["consolidate", *map(str, fulls), "--capacity", str(capacity), "--out", str(w / "map")],
         fulls, w / "map"),
        ("materialize", ["materialize", str(w / "map"), "--variant", "1", "--out", str(w / "materialized")],
         [w / "map", *fulls], w / "materialized"),
    ]


def run(*, layers: int = FULL_LAYERS, root: Path, work: Path, on_step: Callable[[str], None] = lambda msg: None,
        overrides: dict | None = None, probe_bytes: int = PROBE_BYTES) -> dict:
    """Measure every offline command; outputs no later command reads are deleted once measured, so the run needs
    the inputs plus about two checkpoints of free disk. `overrides` change the generated config (tests)."""
    import shutil

    from esftctl.formats.checkpoint import MoECheckpoint

    paths = prepare(root, layers, on_step, overrides)
    base = MoECheckpoint(paths["base"])
    capacity = len(base.moe_layers) * base.num_experts // 2
    Path(work).mkdir(parents=True, exist_ok=True)
    on_step("measuring the disk")
    disk = disk_speed(Path(work), probe_bytes)
    rows = []
    for label, argv, inputs, output in commands(paths, work, capacity):
        evict(*inputs)
        on_step(f"esftctl {label}")
        measured = run_command(argv)
        written = tree_bytes(output) if output is not None else 0
        read = {"inspect": 0, "materialize": written}.get(label, sum(tree_bytes(p) for p in inputs))
        floor = read / disk["read_Bps"] + written / disk["write_Bps"]
        row = {"command": label, **measured, "read_bytes": read, "written_bytes": written,
               "MBps": (read + written) / measured["seconds"] / 1e6, "floor_s": floor,
               "x_floor": measured["seconds"] / floor if floor else None, "io_bound": label in IO_BOUND}
        if label == "compress base":
            row["full_model_s"] = measured["seconds"] * FULL_BYTES / read
        rows.append(row)
        if output is not None and output.name not in KEEP:
            shutil.rmtree(output) if output.is_dir() else output.unlink()
    return {"layers": layers, "checkpoint_bytes": tree_bytes(paths["base"]), "moe_layers": len(base.moe_layers),
            "capacity": capacity, "disk": disk, "cpus": os.cpu_count(),
            "host_memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "rows": rows,
            "self_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def table(result: dict):
    from rich.table import Table

    from esftctl.units import format_bytes

    disk = result["disk"]
    t = Table(title=f"Offline commands on a DeepSeek-V2-Lite-shaped checkpoint, {result['layers']} layers "
                    f"({format_bytes(result['checkpoint_bytes'])}); disk: read {disk['read_Bps'] / 1e6:.0f} MB/s, "
                    f"write {disk['write_Bps'] / 1e6:.0f} MB/s", header_style="bold")
    for col in ("command", "seconds", "peak RSS", "peak anon", "read", "written", "MB/s", "disk floor s", "x floor",
                "note"):
        t.add_column(col, justify="left" if col in ("command", "note") else "right")
    for r in result["rows"]:
        note = f"whole 31.4 GB base: {r['full_model_s']:.0f} s" if "full_model_s" in r else \
            ("I/O-bound" if r["io_bound"] else "")
        t.add_row(r["command"], f"{r['seconds']:.1f}", format_bytes(r["peak_rss"]), format_bytes(r["peak_anon"]),
                  format_bytes(r["read_bytes"]),
                  format_bytes(r["written_bytes"]), f"{r['MBps']:.0f}", f"{r['floor_s']:.1f}",
                  f"{r['x_floor']:.1f}" if r["x_floor"] else "-", note)
    return t


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["floor_s"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["command"] for r in rows]
    a.barh(names, [r["seconds"] for r in rows], label="measured")
    a.barh(names, [r["floor_s"] for r in rows], height=0.4, label="disk floor")
    a.set_xlabel("seconds")
    a.legend()
    b.barh([r["command"] for r in result["rows"]], [r["peak_rss"] / 2**30 for r in result["rows"]])
    b.axvline(4, color="red", linestyle="--", label="4 GiB target")
    b.set_xlabel("peak RSS (GiB)")
    b.legend()
    fig.suptitle(f"esftctl offline commands, DeepSeek-V2-Lite shapes, {result['layers']} layers")
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
