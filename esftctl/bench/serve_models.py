"""What `esftctl bench serve` serves, made on demand: the base, adapter bundles, a merged copy, peer LoRAs.

`tiny`: the tiny world's base (built once, cached) and synthetic bundles of 4 experts per layer.
`deepseek-v2-lite`: a generated base (bench.synthetic_model; on the GPU when there is one: about a minute
for 31 GB, most of it disk writes), ExpertWeave's Table 1 adapters (per-layer counts matching its max and
mean; 100-247 experts, 1.7-4.3 GB each) and adapters of DeepSeek's published size (83-153 experts, 2-9 per
layer, 1.4-2.6 GB each). The grid's adapters (`shape`) are Table 1's, with DeepSeek-sized ones beside them,
or DeepSeek-sized ones only: 20 of those (41 GB) fit an 80 GB GPU beside the 31 GB base, 20 of Table 1's
(55 GB) do not. Only `distinct` files of each kind are written; served names beyond them reuse a file (name i takes
file i mod distinct), which costs the server exactly what a distinct adapter would: one slot and its own
copy of the experts each. Files are written just before the server that needs them, in `scratch`, and the
merged copy is deleted after its server, so that a 64 GB disk holds the merged copy (with the one bundle
merged into it) and later the adapters, but not both at once.
`qwen3-30b-a3b` (bench.serve_paging): a generated Qwen3-30B-A3B-shaped base, 32 of its 48 layers by default
(41 GB; bench.synthetic_model.qwen3_30b_a3b_config says why).
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
SHAPES = ("table1", "deepseek")  # the grid's adapters: ExpertWeave's Table 1, or DeepSeek's published size


@dataclass
class Served:
    """What the servers serve: the base, bundles and peer LoRAs by served name (the grid's names first)."""

    base: Path
    bundles: dict[str, Path] = field(default_factory=dict)
    esft_sized: list[str] = field(default_factory=list)  # DeepSeek-sized adapters served beside the grid's
    loras: dict[str, Path] = field(default_factory=dict)

    @property
    def grid(self) -> list[str]:
        """The adapters the runs spread requests over, in order (N adapters: the first N)."""
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


def generated_config(model: str, layers: int | None = None):
    """The config of a generated model: `deepseek-v2-lite` (27 layers) or `qwen3-30b-a3b` (32 of its 48 layers
    by default: bench.synthetic_model.qwen3_30b_a3b_config says why); `layers` overrides the count."""
    from esftctl.bench import synthetic_model as sm

    if model == "deepseek-v2-lite":
        return sm.deepseek_v2_lite_config(**({"num_hidden_layers": layers} if layers else {}))
    if model == "qwen3-30b-a3b":
        return sm.qwen3_30b_a3b_config(num_hidden_layers=layers or sm.QWEN3_SERVED_LAYERS)
    raise ValueError(f"no generated model {model!r}: deepseek-v2-lite or qwen3-30b-a3b")


def prepare_base(model: str, work: Path, on_step: Callable[[str], None], *, layers: int | None = None) -> Served:
    if model == "tiny":
        from esftctl.world.build import build_world

        return Served(build_world(log=on_step).base_dir)
    from esftctl.bench.synthetic_model import write_model

    base = work / "base"
    shown = [-1]

    def progress(done: int, total: int) -> None:  # every 5%, not every one of its 5,000 tensors
        if (pct := 100 * done // total // 5 * 5) != shown[0]:
            shown[0] = pct
            on_step(f"generating the base: {pct}% of {total / 1e9:.1f} GB")

    if not (base / "config.json").exists():
        write_model(base, generated_config(model, layers), device=_device(), on_progress=progress)
        _release_gpu()
    return Served(base)


def write_adapters(served: Served, model: str, scratch: Path, n: int, *, distinct: int, esft_sized: int = 0,
                   shape: str = "table1", on_step: Callable[[str], None] = lambda msg: None) -> None:
    """Bundles for `n` grid names (+ `esft_sized` DeepSeek-sized ones beside Table 1's), each file written once
    into scratch/adapters."""
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
    if shape == "deepseek":
        files = _esft_sized(base, folder, min(n, distinct), on_step)
        served.bundles = {f"ds-{i:02d}": files[i % len(files)] for i in range(n)}
    else:
        files = _table1(base, folder, min(n, distinct, len(TABLE1_ADAPTERS)), on_step)
        served.bundles = {f"t1-{i:02d}": files[i % len(files)] for i in range(n)}
        extra = _esft_sized(base, folder, esft_sized, on_step)
        served.bundles.update({f"ds-{i}": path for i, path in enumerate(extra)})
        served.esft_sized = [f"ds-{i}" for i in range(len(extra))]
    _release_gpu()


def _lite(base, path: Path, *, most: int, mean: float, seed: int, on_step: Callable[[str], None]) -> Path:
    """One generated adapter of the DeepSeek-V2-Lite-shaped base (kept if written before)."""
    from esftctl.bench.synthetic_model import write_adapter

    if not path.exists():
        on_step(f"writing adapter bundle {path.name} ({round(mean * len(base.moe_layers))} experts)")
        write_adapter(base, path, path.name, most=most, mean=mean, seed=seed, device=_device())
    return path


def _table1(base, folder: Path, k: int, on_step: Callable[[str], None]) -> list[Path]:
    return [_lite(base, folder / f"t1-{row}", most=most, mean=mean, seed=row, on_step=on_step)
            for row, (_, most, mean) in enumerate(TABLE1_ADAPTERS[:k])]


def esft_sized_totals(k: int) -> list[int]:
    """The expert counts of k adapters of DeepSeek's published sizes: 83 to 153 in even steps."""
    low, high = ESFT_SIZED_TOTALS
    return [low + (high - low) * i // max(k - 1, 1) for i in range(k)]


def _esft_sized(base, folder: Path, k: int, on_step: Callable[[str], None]) -> list[Path]:
    """k adapters of DeepSeek's published sizes (esft_sized_totals; at most 9 experts in a layer); each file is
    named by its expert count, so every k shares the files of the counts it has in common."""
    return [_lite(base, folder / f"ds-{total}e", most=ESFT_SIZED_MOST, mean=total / len(base.moe_layers),
                  seed=100 + total, on_step=on_step) for total in esft_sized_totals(k)]


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


def bundle_experts(bundle: Path) -> int:
    """A bundle's expert count from its manifest (the server verifies the checksum; no need to here)."""
    from esftctl.formats.bundle import MANIFEST, Bundle
    from esftctl.jsonfile import read_json

    return Bundle(bundle, read_json(bundle / MANIFEST)).num_experts


def adapter_bytes(base: Path, bundles) -> int:
    """The expert bytes of these bundles together: what a bench sets aside for them (`--adapter-memory`), exactly
    what they take (serve's default reserves the largest adapter for every slot, which at 20 Table 1 adapters is
    more than an H200 holds, and with none given room for two)."""
    from esftctl.formats.checkpoint import MoECheckpoint

    return sum(bundle_experts(p) for p in bundles) * MoECheckpoint(base).expert_nbytes
