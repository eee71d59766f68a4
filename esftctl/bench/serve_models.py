"""What `esftctl bench serve` serves, made on demand: the base, adapter bundles, a merged copy, peer LoRAs.

`tiny`: the tiny world's base (built once, cached) and synthetic bundles of 4 experts per layer.
`deepseek-v2-lite`: a generated base (bench.synthetic_model; on the GPU when there is one: about a minute
for 31 GB, most of it disk writes), ExpertWeave's Table 1 adapters (per-layer counts matching its max and
mean; 100-247 experts, 1.7-4.3 GB each) and adapters of DeepSeek's published size (83-153 experts, 2-9 per
layer). Only `distinct` files of each kind are written; served names beyond them reuse a file (name i takes
file i mod distinct), which costs the server exactly what a distinct adapter would: one slot and its own
copy of the experts each. Files are written just before the server that needs them, in `scratch`, and the
merged copy is deleted after its server, so that a 64 GB disk holds the merged copy (with the one bundle
merged into it) and later the adapters, but not both at once.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from esftctl.bench.shapes import TABLE1_ADAPTERS

ESFT_SIZED_TOTALS = (83, 153)  # experts per adapter, as DeepSeek's published ESFT adapters (theirs: 2-9 per layer)
ESFT_SIZED_MOST = 9


@dataclass
class Served:
    """What the servers serve: the base, bundles and peer LoRAs by served name (Table 1 names first)."""

    base: Path
    bundles: dict[str, Path] = field(default_factory=dict)
    esft_sized: list[str] = field(default_factory=list)
    loras: dict[str, Path] = field(default_factory=dict)

    @property
    def table1(self) -> list[str]:
        return [n for n in self.bundles if n not in self.esft_sized]


def default_work(model: str) -> Path:
    return Path.home() / ".cache" / "esftctl" / f"bench-serve-{model}"


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _release_gpu() -> None:
    """Hand back the generator's cached GPU memory before a server sizes itself by what is free."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def prepare_base(model: str, work: Path, on_step: Callable[[str], None]) -> Served:
    if model == "tiny":
        from esftctl.world.build import build_world

        return Served(build_world(log=on_step).base_dir)
    from esftctl.bench.synthetic_model import deepseek_v2_lite_config, write_model

    base = work / "base"
    shown = [-1]

    def progress(done: int, total: int) -> None:  # every 5%, not every one of its 5,000 tensors
        if (pct := 100 * done // total // 5 * 5) != shown[0]:
            shown[0] = pct
            on_step(f"generating the base: {pct}% of {total / 1e9:.1f} GB")

    if not (base / "config.json").exists():
        write_model(base, deepseek_v2_lite_config(), device=_device(), on_progress=progress)
        _release_gpu()
    return Served(base)


def write_adapters(served: Served, model: str, scratch: Path, n: int, *, distinct: int, esft_sized: int = 0,
                   on_step: Callable[[str], None] = lambda msg: None) -> None:
    """Bundles for `n` names (+ `esft_sized` DeepSeek-sized ones), each file written once into scratch/adapters."""
    from esftctl.formats.checkpoint import MoECheckpoint

    base = MoECheckpoint(served.base)
    folder = scratch / "adapters"
    if model == "tiny":
        from esftctl.world.synthetic import write_synthetic_adapter

        def make(i: int) -> Path:
            path = folder / f"a{i:02d}"
            return path if path.exists() else write_synthetic_adapter(base.path, path, path.name, seed=i)
        files = [make(i) for i in range(min(n, distinct))]
        served.bundles = {f"a{i:02d}": files[i % len(files)] for i in range(n)}
        return
    from esftctl.bench.synthetic_model import write_adapter

    def lite(name: str, most: int, mean: float, seed: int) -> Path:
        path = folder / name
        if not path.exists():
            on_step(f"writing adapter bundle {name} ({round(mean * len(base.moe_layers))} experts)")
            write_adapter(base, path, name, most=most, mean=mean, seed=seed, device=_device())
        return path

    distinct = min(n, distinct, len(TABLE1_ADAPTERS))
    table1 = [lite(f"t1-{row}", most, mean, seed=row) for row, (_, most, mean) in enumerate(TABLE1_ADAPTERS[:distinct])]
    served.bundles = {f"t1-{i:02d}": table1[i % distinct] for i in range(n)}
    low, high = ESFT_SIZED_TOTALS
    k = esft_sized
    for i in range(k):
        total = low + (high - low) * i // max(k - 1, 1)
        served.bundles[f"ds-{i}"] = lite(f"ds-{i}", ESFT_SIZED_MOST, total / len(base.moe_layers), seed=100 + i)
    served.esft_sized = [f"ds-{i}" for i in range(k)]
    _release_gpu()


def write_loras(served: Served, scratch: Path, n: int, *, distinct: int,
                on_step: Callable[[str], None] = lambda msg: None) -> None:
    from esftctl.bench.lora_peer import write_lora
    from esftctl.formats.checkpoint import MoECheckpoint

    base = MoECheckpoint(served.base)
    files = []
    for i in range(min(n, distinct)):
        path = scratch / "lora" / f"lora-{i}"
        if not path.exists():
            on_step(f"writing LoRA adapter {path.name}")
            write_lora(base, path, seed=i, device=_device())
        files.append(path)
    served.loras = {f"lora-{i:02d}": files[i % len(files)] for i in range(n)}
    _release_gpu()


def merged_copy(served: Served, model: str, scratch: Path, on_step: Callable[[str], None]) -> Path:
    """The base with the first adapter merged in (only that bundle is written for it)."""
    from esftctl.merge import merge

    first = Served(served.base)
    write_adapters(first, model, scratch, 1, distinct=1, on_step=on_step)
    on_step("writing the merged model")
    return merge(served.base, next(iter(first.bundles.values())), scratch / "merged", overwrite=True)


def drop(scratch: Path, what: str) -> None:
    shutil.rmtree(scratch / what, ignore_errors=True)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second into the serving device: pinned host to GPU, or host memcpy on the CPU build."""
    import torch

    gpu = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if gpu else "cpu")
    best = 0.0
    for _ in range(repeats):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if gpu:
            torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - start))
    return best
