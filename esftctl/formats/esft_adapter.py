"""DeepSeek's ESFT adapter folders, both ways: `esftctl pack BASE ADAPTER_DIR` imports one into a bundle,
`esftctl export BUNDLE --format esft` writes a bundle as one.

The format is what DeepSeek's public ESFT code (github.com/deepseek-ai/ESFT) writes and loads:

- `esft.py`: `to_esft(model, config)` turns every parameter into a non-persistent buffer except the trained
  ones (the listed routed experts of each DeepseekV2MoE layer, looked up as `config["experts"][str(i)]` with
  i the decoder-layer index from `enumerate(model.model.layers)`; every MoE layer's `mlp.shared_experts` if
  `shared_experts`; every other parameter if `non_expert_modules`), so a saved state dict holds exactly the
  trained parameters. `load_state_dict(dir)` merges every `*.safetensors` file of the folder and adds `model.`
  to keys starting with `layers` (its first adapters were keyed relative to the inner model); `add_adapter` /
  `load_esft_model` read `expert_cfg.json` beside them and call the model's strict `load_state_dict`.
- `train.py`, `train_ep.py`: the trainer saves the model after `to_esft` (`save_pretrained`: causal-LM keys,
  `model.` prefix, a config.json beside them).
- `scripts/expert/generate_expert_config.py`: writes the expert config (esftctl select writes the same).

An adapter folder is therefore

    expert_cfg.json    {"experts": {"<decoder layer>": [expert ids]}, "shared_experts": bool,
                        "non_expert_modules": bool}
    *.safetensors      the trained parameters: `model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`
                       (or the same without `model.`), with shared_experts every MoE layer's
                       `model.layers.{L}.mlp.shared_experts.*`, with non_expert_modules every other parameter
                       (embeddings, attention, norms, routers `mlp.gate.weight`, dense MLPs, and, among keys
                       with `model.` only, `lm_head.weight`: the inner model has no head).

Other architectures esftctl reads follow the same rule (their own checkpoint names, shared experts as
architectures.py names them), though DeepSeek's loader itself handles DeepSeek-V2 MoE layers only. Where a layer's
experts are one fused tensor per projection (GPT-OSS), that tensor is the trained parameter: the folder holds the
fused tensors of every layer with listed experts, whole, and import takes the listed experts from them and
refuses a change to any other (export writes them so, the other experts from the base).

Import checks what DeepSeek's strict loader would refuse, and what a bundle would otherwise drop or bind
wrongly, before anything is written: keys must be tensors of the base (one spelling per adapter: a mix means
files of two runs in one folder, which their loader would merge), shapes the base's, the experts present
exactly the ones listed (each with its three weights), shared/non-expert tensors present exactly when their
flag says so (all of them, as their loader needs), and a dtype other than the base's only if every value
converts exactly (their loader rounds silently). A MoE layer missing from expert_cfg.json has no experts
(their to_esft would stop at it). Shared-expert and non-expert tensors that differ from the
base go into the bundle's non-expert part with --include-non-expert and are refused without it, as `pack`
does for full checkpoints; unchanged ones are dropped, so the bundle equals what `pack` makes of the
equivalent full checkpoint. Export writes causal-LM keys (what esft.py loads today), every MoE layer in
expert_cfg.json (to_esft indexes each one), and, for a bundle with non-expert tensors, the unchanged rest of
their modules from the base (its strict load needs them), so `--base` is needed only then.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from esftctl.atomic import atomic_dir
from esftctl.errors import EsftError
from esftctl.formats.architectures import EXPERT_WEIGHTS, architecture_for
from esftctl.formats.bundle import Bundle, PackReport, write_bundle
from esftctl.formats.checkpoint import (
    ExpertWeights,
    MoECheckpoint,
    TensorInfo,
    _read_header,
    expert_replacements,
    read_stored,
    unfuse,
)
from esftctl.selection import ExpertConfig

CONFIG_FILE = "expert_cfg.json"
WEIGHTS_FILE = "model.safetensors"  # the name DeepSeek's trainer (save_pretrained) gives it; their loader reads any
PREFIX = "model."


def is_esft_adapter(path: str | Path) -> bool:
    """A folder with expert_cfg.json that is not a whole model: no config.json, or one beside the trained
    parameters only (what DeepSeek's train.py saves, with the expert config copied in)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        return False
    if not (path / "config.json").is_file():
        return True
    try:
        MoECheckpoint(path, quantized=True)
    except EsftError:
        return True
    return False


def _names(base: MoECheckpoint) -> tuple[dict[str, tuple[int, int | None, str | None]], set[str]]:
    """({routed expert tensor: (layer, expert, weight)}, {shared-expert tensors}) of the base (a fused layer's
    tensors hold every expert: (layer, None, None))."""
    if base.arch.fused is not None:
        routed = {n: (l, None, None) for l in base.moe_layers for n in base.routed_tensor_names(l)}
    else:
        routed = {base.arch.expert_tensor(l, e, w): (l, e, w)
                  for l in base.moe_layers for e in range(base.num_experts) for w in EXPERT_WEIGHTS}
    prefixes = tuple(p.format(layer=l) + "." for p in base.arch.shared_prefixes for l in base.moe_layers)
    shared = {n for n in base.tensors if prefixes and n.startswith(prefixes)}
    return routed, shared


def _read_tensors(entries: dict[str, tuple[str, TensorInfo]], base: MoECheckpoint) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor in the base's dtype} for entries {checkpoint name: (adapter key, its info)}."""
    out = {}
    for name, (key, info) in sorted(entries.items()):
        t = read_stored(info, name=key)
        want = base.tensors[name]
        if info.dtype != want.dtype:
            converted = t.to(want.torch_dtype)
            inexact = int((converted.to(t.dtype) != t).sum())
            if inexact:
                raise EsftError(f"tensor {key!r} is {info.dtype} and {inexact} of its {t.numel()} values do not "
                                f"convert exactly to the base's {want.dtype}: convert it yourself if rounding "
                                "is intended", info.file)
            t = converted
        out[name] = t
    return out


Entries = dict[str, tuple[str, TensorInfo]]  # checkpoint name -> (adapter key, its info)


def _separate_experts(base: MoECheckpoint, entries: Entries, listed: set[tuple[int, int]], config_file: Path,
                      key_of: Callable[[str], str], on_layer: Callable[[int], None]
                      ) -> dict[int, dict[int, ExpertWeights]]:
    """The listed experts of an adapter of one tensor per expert and weight: each present exactly as listed and
    whole."""
    routed, _ = _names(base)
    present: dict[tuple[int, int], dict[str, str]] = {}
    for n in entries:
        if n in routed:
            l, e, w = routed[n]
            present.setdefault((l, e), {})[w] = n
    for (l, e), weights in sorted(present.items()):
        if len(weights) < len(EXPERT_WEIGHTS):
            missing = next(base.arch.expert_tensor(l, e, w) for w in EXPERT_WEIGHTS if w not in weights)
            raise EsftError(f"expert {e} of layer {l} is incomplete: {key_of(missing)!r} is missing",
                            entries[next(iter(weights.values()))][1].file)
    unlisted = sorted(set(present) - listed)
    if unlisted:
        where = entries[next(iter(present[unlisted[0]].values()))][1].file
        raise EsftError(f"holds experts that {CONFIG_FILE} does not list (layer, expert): {unlisted[:5]}", where)
    absent = sorted(listed - set(present))
    if absent:
        raise EsftError(f"lists experts that no safetensors file of the folder holds (layer, expert): {absent[:5]}",
                        config_file)
    experts: dict[int, dict[int, ExpertWeights]] = {}
    for layer in base.moe_layers:
        ids = sorted(e for l, e in listed if l == layer)
        if ids:
            tensors = _read_tensors({n: entries[n] for e in ids for n in present[(layer, e)].values()}, base)
            experts[layer] = {e: ExpertWeights(**{w: tensors[n] for w, n in present[(layer, e)].items()}) for e in ids}
        on_layer(layer)
    return experts


def _fused_experts(base: MoECheckpoint, entries: Entries, listed: set[tuple[int, int]], config_file: Path,
                   key_of: Callable[[str], str], on_layer: Callable[[int], None]
                   ) -> dict[int, dict[int, ExpertWeights]]:
    """The listed experts of an adapter of a fused architecture (GPT-OSS), whose trained parameters are a layer's
    fused tensors, every expert in them: all of a layer's fused tensors present where it lists experts, and every
    expert it does not list equal to the base's."""
    experts: dict[int, dict[int, ExpertWeights]] = {}
    for layer in base.moe_layers:
        names, ids = base.arch.fused.tensors(layer), sorted(e for l, e in listed if l == layer)
        held = [n for n in names if n in entries]
        if held and len(held) < len(names):
            missing = next(n for n in names if n not in entries)
            raise EsftError(f"the experts of layer {layer} are incomplete: {key_of(missing)!r} is missing",
                            entries[held[0]][1].file)
        if ids and not held:
            raise EsftError(f"lists experts that no safetensors file of the folder holds (layer, expert): "
                            f"{[(layer, e) for e in ids][:5]}", config_file)
        if held:
            tensors = [t for _, t in sorted(_read_tensors({n: entries[n] for n in names}, base).items(),
                                            key=lambda item: names.index(item[0]))]
            bases = [base.read_tensor(n) for n in names]
            unlisted = [(layer, e) for e in range(base.num_experts) if e not in ids
                        and not all(torch.equal(t[e], b[e]) for t, b in zip(tensors, bases))]
            if unlisted:
                raise EsftError(f"changes experts that {CONFIG_FILE} does not list (layer, expert): {unlisted[:5]}",
                                entries[held[0]][1].file)
            experts[layer] = {e: unfuse(base.arch.fused, [t[e] for t in tensors]) for e in ids}
        on_layer(layer)
    return experts


def import_adapter(base_dir: Path, adapter_dir: Path, out: Path, *, name: str, include_non_expert: bool = False,
                   overwrite: bool = False, layer_base: int | None = None,
                   on_layer: Callable[[int], None] = lambda l: None) -> PackReport:
    """A DeepSeek ESFT adapter folder of `base_dir` -> an adapter bundle at `out`, verified (module docstring);
    `layer_base`: how its expert_cfg.json numbers layers (0 or 1; None: as only one fits the base)."""
    base, adapter_dir = MoECheckpoint(base_dir), Path(adapter_dir)
    config_file = adapter_dir / CONFIG_FILE
    config, used_base = ExpertConfig.read_for(config_file, base.moe_layers, base.num_experts, layer_base=layer_base)
    if out.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", out)
    files = sorted(adapter_dir.glob("*.safetensors"))
    if not files:
        raise EsftError(f"no *.safetensors file beside {CONFIG_FILE}", adapter_dir)

    # adapter key -> checkpoint tensor name, one spelling per adapter
    entries: dict[str, tuple[str, TensorInfo]] = {}
    spelled: dict[bool, str] = {}  # with the prefix? -> first such key
    seen: dict[str, Path] = {}
    for file in files:
        for key, info in sorted(_read_header(file).items()):
            if key in seen:
                raise EsftError(f"tensor {key!r} is also in {seen[key].name}", file)
            seen[key] = file
            tname = key if key in base.tensors else PREFIX + key if PREFIX + key in base.tensors else None
            if tname is None:
                raise EsftError(f"unknown tensor {key!r}: the base has no tensor of that name, with or without "
                                f"{PREFIX!r}", file)
            if tname.startswith(PREFIX):
                prefixed = key == tname
                spelled.setdefault(prefixed, key)
                if len(spelled) > 1:
                    raise EsftError(f"keys with and without the {PREFIX!r} prefix in one adapter ({spelled[True]!r}, "
                                    f"{spelled[False]!r}): files of two adapters in one folder?", file)
            want = base.tensors[tname]
            if info.shape != want.shape:
                raise EsftError(f"tensor {key!r} has shape {list(info.shape)}, the base's has {list(want.shape)}",
                                file)
            entries[tname] = (key, info)
    with_prefix = True in spelled or not spelled

    def key_of(n: str) -> str:
        return n if with_prefix or not n.startswith(PREFIX) else n[len(PREFIX):]

    # routed experts: present exactly as listed, whole
    routed, shared = _names(base)
    listed = {(l, e) for l, ids in config.experts.items() for e in ids}
    read = _fused_experts if base.arch.fused is not None else _separate_experts
    experts = read(base, entries, listed, config_file, key_of, on_layer)

    # shared experts and the rest: present exactly when their flag says so, all of them (DeepSeek's strict load)
    # (keys relative to the inner model cannot hold lm_head.weight: their loader leaves it to the base)
    others = {n for n in base.tensors if n not in routed and n not in shared}
    flags = (("shared_experts", "shared-expert", shared), ("non_expert_modules", "non-expert", others))
    for flag, what, group in flags:
        held = sorted(n for n in entries if n in group)
        if held and not getattr(config, flag):
            raise EsftError(f"holds {what} tensors (e.g. {key_of(held[0])!r}) but {CONFIG_FILE} sets {flag}: false",
                            entries[held[0]][1].file)
        lacking = sorted(n for n in group - set(held) if with_prefix or n.startswith(PREFIX))
        if getattr(config, flag) and lacking:
            raise EsftError(f"{CONFIG_FILE} sets {flag}: true but {len(lacking)} {what} tensors are missing "
                            f"(e.g. {key_of(lacking[0])!r})", adapter_dir)

    outside = _read_tensors({n: entries[n] for n in entries if n not in routed}, base)
    changed = {n: t for n, t in outside.items() if not torch.equal(t, base.read_tensor(n))}
    if changed and not include_non_expert:
        first = min(changed)
        raise EsftError(f"the adapter changes {len(changed)} tensor{'s' * (len(changed) > 1)} outside the routed "
                        f"experts (e.g. {key_of(first)!r}); ESFT adapters change routed experts only: pass "
                        "--include-non-expert to pack them anyway", entries[first][1].file)
    if not listed and not changed:
        raise EsftError("the adapter lists no expert and changes nothing else: nothing to pack", config_file)
    write_bundle(out, name, base, experts, changed, overwrite=overwrite)
    return PackReport(name, out, {l: ids for l, ids in sorted(config.experts.items()) if ids},
                      unchanged_listed=[(l, e) for l, per in experts.items() for e, w in per.items()
                                        if w.equal(base.read_expert(l, e))],
                      non_expert_changed=sorted(changed), layer_base=used_base)


def export_adapter(bundle_dir: Path, out: Path, *, base_dir: Path | None = None,
                   overwrite: bool = False) -> ExpertConfig:
    """An adapter bundle -> a DeepSeek ESFT adapter folder (expert_cfg.json + model.safetensors) at `out`.

    `base_dir` is needed only for a bundle with non-expert tensors: DeepSeek's loader takes every tensor of the
    modules an adapter trains, and the bundle holds only the changed ones.
    """
    bundle = Bundle.open(bundle_dir)
    if out.exists() and not overwrite:
        raise EsftError("output already exists (choose another path or pass --overwrite)", out)
    arch = architecture_for(bundle.base["model_type"])
    if arch is None:
        raise EsftError(f"bundle's base has unsupported architecture {bundle.base['model_type']!r}", bundle.path)
    base = MoECheckpoint(base_dir) if base_dir is not None else None
    if base is not None:
        bundle.check_base(base)
    if arch.fused is not None:
        if base is None:
            raise EsftError(f"{arch.name} keeps a layer's experts in one tensor per projection, which the folder holds "
                            "whole, the untrained experts taken from the base: pass --base BASE (the bundle's base)",
                            bundle.path)
        tensors = expert_replacements(base, {(l, e): w for l, per in bundle.read_experts().items()
                                             for e, w in per.items()})
    else:
        tensors = {arch.expert_tensor(l, e, w): t for l, per in bundle.read_experts().items()
                   for e, weights in per.items() for w, t in weights.items()}
    non_expert = bundle.read_non_expert()
    with_shared = with_others = False
    if non_expert:
        if base is None:
            raise EsftError(f"bundle {bundle.name!r} also changes {len(non_expert)} non-expert tensors, and DeepSeek's "
                            "loader needs every tensor of the modules an adapter trains: pass --base BASE (the "
                            "bundle's base) for the unchanged ones", bundle.path)
        routed, shared = _names(base)
        with_shared = any(n in shared for n in non_expert)
        with_others = any(n not in shared for n in non_expert)
        for n in base.tensors:
            if n not in routed and (with_shared if n in shared else with_others):
                tensors[n] = non_expert[n] if n in non_expert else base.read_tensor(n)
    config = ExpertConfig({l: bundle.experts.get(l, []) for l in bundle.base["moe_layers"]}, with_shared, with_others)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, tmp / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config.to_json()))  # one line, as DeepSeek writes it
    return config
