"""`esftctl pack`: a fine-tuned checkpoint (plus its base, plus optionally an expert config) -> an adapter bundle.

The fine-tune is verified against the base tensor by tensor: same architecture and shapes, and no change
outside the routed experts unless told to include such changes. Without an expert config, the adapter is
exactly the experts that changed; with one, every changed expert must be listed in it. A DeepSeek ESFT adapter
folder (expert_cfg.json beside the trained parameters only) is imported instead: esftctl/formats/esft_adapter.py.
An FP8 base (block-quantized experts) takes fine-tunes in its own FP8 form or in bf16: esftctl/pack_fp8.py.
An expert config whose layer keys fit the base both 0- and 1-based is read the way under which exactly the listed
experts changed (esftctl.selection.decide_reading), and the report says so.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from esftctl.errors import EsftError
from esftctl.formats.architectures import MODULE_RENAMES, memory_name
from esftctl.formats.bundle import PackReport, base_identity, write_bundle
from esftctl.formats.checkpoint import MoECheckpoint, finite_expert
from esftctl.formats.esft_adapter import CONFIG_FILE, import_adapter, is_esft_adapter
from esftctl.names import check_name
from esftctl.pack_fp8 import plain_over_fp8
from esftctl.selection import LAYER_BASES, ExpertConfig, decide_reading


class StoredBytes:
    """Whether two checkpoints store a tensor bit for bit alike: its stored bytes read in chunks into two reused
    buffers (the second checkpoint's on a thread of its own, so both files are read at once) and compared, no
    tensors made. On a 4-layer DeepSeek-V2-Lite fine-tune and its base (8.6 GB in the page cache, 2 cores) the
    expert comparison takes 0.59 s against 1.53 s for read_tensor and torch.equal; and it is bit for bit, where
    torch.equal takes -0.0 for 0.0 and a NaN for a change."""

    CHUNK = 16 << 20

    def __init__(self, a: MoECheckpoint, b: MoECheckpoint):
        self.a, self.b = a, b
        self.buffers = (bytearray(self.CHUNK), bytearray(self.CHUNK))
        self.reader = ThreadPoolExecutor(1)  # reads b's bytes while this thread reads a's

    def __enter__(self) -> "StoredBytes":
        return self

    def __exit__(self, *exc) -> None:
        self.reader.shutdown()

    def same(self, name: str, first: int = 0, nbytes: int | None = None) -> bool:
        """Whether bytes [first, first + nbytes) of tensor `name` (default: all of it) are alike in both."""
        end = first + (self.a.tensors[name].nbytes - first if nbytes is None else nbytes)
        for start in range(first, end, self.CHUNK):
            n = min(self.CHUNK, end - start)
            x, y = (memoryview(buffer)[:n] for buffer in self.buffers)
            other = self.reader.submit(self.b.read_bytes, name, y, start)
            self.a.read_bytes(name, x, start)
            other.result()
            words = np.uint64 if n % 8 == 0 else np.uint8
            if not np.array_equal(np.frombuffer(x, words), np.frombuffer(y, words)):
                return False
        return True


def same_layout(a: MoECheckpoint, b: MoECheckpoint) -> bool:
    """Whether two checkpoints of one model store their experts alike (one tensor per expert, or fused the same
    way): then they have the same tensors, and experts compare as stored bytes; else expert by expert."""
    return a.arch.fused == b.arch.fused


def counterpart(name: str, other: MoECheckpoint) -> str:
    """A non-expert tensor's name as `other` holds it: the same, or under transformers' module names where one of
    the two is a state dict saved as transformers holds it (Mixtral's router)."""
    if name in other.tensors:
        return name
    spelled = (memory_name(name), *(name.replace(memory, hub) for hub, memory in MODULE_RENAMES))
    return next((n for n in spelled if n in other.tensors), name)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0 and a NaN for a change)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def changed_experts(base: MoECheckpoint, tuned: MoECheckpoint,
                    on_layer: Callable[[int], None] = lambda l: None) -> dict[int, list[int]]:
    """{layer: expert ids whose stored weights differ from the base's}, every MoE layer present (the two have
    the same tensors, shapes and dtypes, or the same experts in another layout: _check_same_model)."""
    if not same_layout(base, tuned):  # expert by expert, each read out of its layout
        changed = {}
        for layer in base.moe_layers:
            changed[layer] = [e for e in range(base.num_experts) if not all(
                _bits_equal(x, y) for (_, x), (_, y) in zip(base.read_expert(layer, e).items(),
                                                            tuned.read_expert(layer, e).items()))]
            on_layer(layer)
        return changed
    changed = {}
    layers = base.moe_layers
    for ckpt in (base, tuned):
        ckpt.prefetch(base.routed_tensor_names(layers[0]))
    with StoredBytes(base, tuned) as compare:
        for k, layer in enumerate(layers):
            for ckpt in (base, tuned):  # the disk reads the next layer while this one is compared
                ckpt.prefetch(base.routed_tensor_names(layers[k + 1]) if k + 1 < len(layers) else [])
            changed[layer] = [e for e in range(base.num_experts)
                              if not all(compare.same(*r) for r in base.expert_ranges(layer, e))]
            on_layer(layer)
    return changed


def changed_non_expert(base: MoECheckpoint, tuned: MoECheckpoint) -> list[str]:
    """The base's names of the tensors outside the routed experts that the fine-tune changed."""
    if not same_layout(base, tuned):
        return [n for n in base.tensors if not base.is_routed_expert_tensor(n)
                and not _bits_equal(base.read_tensor(n), tuned.read_tensor(counterpart(n, tuned)))]
    with StoredBytes(base, tuned) as compare:
        return [n for n in base.tensors if not base.is_routed_expert_tensor(n) and not compare.same(n)]


# An ESFT fine-tune trains a few experts per layer (DeepSeek's: 5-15% of them) and leaves the others
# bit-identical; a model of other weights differs in nearly every expert. Beyond half, it is another model.
MOST_EXPERTS = 0.5


def check_comes_from(base: MoECheckpoint, tuned: MoECheckpoint, changed: dict[int, list[int]]) -> None:
    """Refuse a fine-tune whose routed experts mostly differ from the base's: it is not a fine-tune of it (and
    --include-non-expert must not turn it into a bundle of the whole model bound to the wrong base)."""
    total = len(base.moe_layers) * base.num_experts
    count = sum(len(ids) for ids in changed.values())
    if count > MOST_EXPERTS * total:
        raise EsftError(f"this fine-tune does not come from this base: {count} of its {total} routed experts differ "
                        f"(an ESFT fine-tune leaves most of them bit-identical); check the base folder", tuned.path)


def _check_same_model(base: MoECheckpoint, tuned: MoECheckpoint) -> None:
    b, t = base_identity(base), base_identity(tuned)
    mismatch = [k for k in b if k != "fingerprint" and b[k] != t[k]]
    if mismatch:
        raise EsftError(f"fine-tuned model does not match the base ({', '.join(mismatch)} differ)", tuned.path)
    names = {n: n for n in base.tensors}
    if not same_layout(base, tuned):  # the experts in another layout (each checkpoint checked its own): the rest
        names = {n: counterpart(n, tuned) for n in base.tensors if not base.is_routed_expert_tensor(n)}
        theirs = {n for n in tuned.tensors if not tuned.is_routed_expert_tensor(n)}
        if set(names.values()) != theirs:
            extra = sorted(set(names.values()) ^ theirs)
            raise EsftError(f"fine-tuned model has other tensors than the base outside the experts (e.g. "
                            f"{extra[:3]})", tuned.path)
    elif set(base.tensors) != set(tuned.tensors):
        extra = sorted(set(base.tensors) ^ set(tuned.tensors))[:3]
        raise EsftError(f"fine-tuned model has other tensors than the base (e.g. {extra})", tuned.path)
    for name, other in names.items():
        info, theirs = base.tensors[name], tuned.tensors[other]
        if theirs.shape != info.shape or theirs.dtype != info.dtype:
            raise EsftError(f"tensor {other!r} is {theirs.dtype} {list(theirs.shape)} here, {info.dtype} "
                            f"{list(info.shape)} in the base", theirs.file)


def pack(base_dir: Path, tuned_dir: Path, out: Path, name: str, config_file: Path | None = None, *,
         include_non_expert: bool = False, overwrite: bool = False, layer_base: int | None = None,
         on_layer: Callable[[int], None] = lambda l: None) -> PackReport:
    """`layer_base`: how the expert config numbers layers (0 or 1; None: as only one fits the base)."""
    check_name(name)  # before any reading: a bad name or option costs nothing
    if layer_base not in (None, *LAYER_BASES):
        raise EsftError(f"--layer-base must be 0 or 1, not {layer_base}")
    if is_esft_adapter(tuned_dir):
        if config_file is not None:
            raise EsftError(f"an ESFT adapter folder brings its own {CONFIG_FILE}: drop --config", config_file)
        return import_adapter(base_dir, tuned_dir, out, name=name, include_non_expert=include_non_expert,
                              overwrite=overwrite, layer_base=layer_base, on_layer=on_layer)
    if layer_base is not None and config_file is None:
        raise EsftError("--layer-base says how an expert config numbers layers: give the config too (--config)")
    base, tuned = MoECheckpoint(base_dir, fp8=True), MoECheckpoint(tuned_dir, fp8=True)
    plain = plain_over_fp8(base, tuned)  # a bf16 fine-tune of an FP8 base: compared and quantized as such
    if plain is None:
        _check_same_model(base, tuned)
    config = used_base = None
    readings = {}
    if config_file is not None:  # read before the long comparison; of two numberings, the fine-tune decides
        readings = ExpertConfig.load(config_file).readings(base.moe_layers, base.num_experts, layer_base=layer_base,
                                                           path=config_file)
    if out.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", out)

    changed = changed_experts(base, tuned, on_layer) if plain is None else plain.changed_experts(on_layer)
    check_comes_from(base, tuned, changed)
    decided = False
    if readings:
        config, used_base, decided = decide_reading(readings, changed, base.moe_layers, config_file)
    non_expert = changed_non_expert(base, tuned) if plain is None else plain.changed_non_expert()
    if non_expert and not include_non_expert:
        routers = {base.arch.router_tensor(l) for l in base.moe_layers}
        changed_routers = [n for n in non_expert if n in routers]
        if len(changed_routers) == len(non_expert):
            what = f"the router ({len(non_expert)} tensors, e.g. {non_expert[0]!r})"
        else:
            others = [n for n in non_expert if n not in routers]
            what = (f"non-expert weights ({len(non_expert)} tensors, e.g. {others[0]!r}"
                    + (f"; {len(changed_routers)} of them routers)" if changed_routers else ")"))
        raise EsftError(f"the fine-tune changed {what}; ESFT adapters change routed experts only: pass "
                        "--include-non-expert to pack them anyway", tuned.path)
    report = PackReport(name, out, {}, non_expert_changed=non_expert, layer_base=used_base,
                        layer_base_decided=decided)
    if config is None:
        report.experts = {l: ids for l, ids in changed.items() if ids}
    else:
        listed = {l: list(ids) for l, ids in config.experts.items()}
        unlisted = [(l, e) for l, ids in changed.items() for e in ids if e not in listed.get(l, [])]
        if unlisted:
            raise EsftError(f"experts changed that the expert config does not list (layer, expert): {unlisted[:5]}",
                            config_file)
        report.unchanged_listed = [(l, e) for l, ids in listed.items() for e in ids if e not in changed[l]]
        report.experts = {l: ids for l, ids in listed.items() if ids}
    if not report.experts and not non_expert:
        raise EsftError("the fine-tuned model is identical to the base: nothing to pack", tuned.path)
    if plain is None:
        experts = {l: {e: finite_expert(tuned, l, e, tuned.read_expert(l, e)) for e in ids}
                   for l, ids in report.experts.items()}
    else:
        experts = {l: {e: plain.adapter_expert(l, e, e in changed[l]) for e in ids}
                   for l, ids in report.experts.items()}
    write_bundle(out, name, base, experts, {n: tuned.read_tensor(counterpart(n, tuned)) for n in non_expert},
                 overwrite=overwrite)
    return report
