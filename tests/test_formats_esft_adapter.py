"""DeepSeek's ESFT adapter folders: `esftctl pack BASE ADAPTER_DIR` imports one, `esftctl export --format esft`
writes one; what import refuses (one line, exit 1, nothing written); and an imported adapter served exactly."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_formats_untrusted_bundles import deadline, mutate_data, mutate_manifest

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.formats.esft_adapter import import_adapter
from esftctl.pack import pack
from esftctl.world.synthetic import experts_used_by, synthetic_experts, write_synthetic_adapter

PREFIX = "model."


def cli(capsys, *args) -> tuple[int, str]:
    """`esftctl ARGS` in this process, through the same entry point as the console command: (status, stderr)."""
    from esftctl.cli import main

    capsys.readouterr()
    with mock.patch.object(sys, "argv", ["esftctl", *map(str, args)]):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return code, capsys.readouterr().err


def expert_tensors(base: MoECheckpoint, experts: dict[int, dict[int, ExpertWeights]]) -> dict[str, torch.Tensor]:
    """{checkpoint tensor name: tensor} of experts {layer: {expert: weights}}."""
    return {base.arch.expert_tensor(l, e, w): t for l, per in experts.items() for e, ws in per.items()
            for w, t in ws.items()}


def write_adapter(folder: Path, base: MoECheckpoint, tensors: dict[str, torch.Tensor], experts: dict[int, list[int]],
                  *, prefix: bool = True, shared: bool = False, non_expert: bool = False) -> Path:
    """An ESFT adapter folder as DeepSeek's code writes it: keys with `model.` (its trainer) or relative to the
    inner model (its first released adapters)."""
    folder.mkdir(parents=True)
    keyed = {n if prefix or not n.startswith(PREFIX) else n[len(PREFIX):]: t for n, t in tensors.items()}
    save_file(keyed, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "expert_cfg.json").write_text(json.dumps({"experts": {str(l): ids for l, ids in experts.items()},
                                                         "shared_experts": shared, "non_expert_modules": non_expert}))
    return folder


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def assert_nothing_written(root: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]


@pytest.fixture
def base(tiny_models) -> MoECheckpoint:
    return MoECheckpoint(tiny_models["deepseek_v2"])


@pytest.fixture
def experts(base) -> dict[int, dict[int, ExpertWeights]]:
    """Synthetic fine-tuned experts of the tiny DeepSeek-V2: 1, 3 and 2 in its MoE layers 1, 2, 3."""
    return synthetic_experts(base, seed=5, experts_per_layer=[1, 3, 2], scale=2.0)


# ---- import -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [True, False], ids=["model-prefix", "inner-model-keys"])
def test_import_equals_pack_of_the_full_checkpoint(base, experts, tmp_path, capsys, prefix):
    listed = {l: sorted(per) for l, per in experts.items()}
    tuned = write_checkpoint(base, tmp_path / "tuned", expert_replacements(
        base, {(l, e): w for l, per in experts.items() for e, w in per.items()}))
    adapter = write_adapter(tmp_path / "adapter", base, expert_tensors(base, experts), listed, prefix=prefix)
    pack(base.path, tuned, tmp_path / "packed", "task", config_file=adapter / "expert_cfg.json")
    assert cli(capsys, "pack", base.path, adapter, "--out", tmp_path / "imported", "--name", "task") == (0, "")
    # same experts, same bytes (the manifest's checksum covers every tensor), same base
    assert manifest(tmp_path / "imported") == manifest(tmp_path / "packed")
    assert Bundle.open(tmp_path / "imported").experts == listed
    if prefix:  # what DeepSeek's train.py saves: a config.json beside the trained parameters, expert config copied in
        shutil.copy(base.path / "config.json", adapter)
        assert cli(capsys, "pack", base.path, adapter, "--out", tmp_path / "imported2", "--name", "task")[0] == 0
        assert manifest(tmp_path / "imported2") == manifest(tmp_path / "packed")
        # a whole checkpoint that carries an expert_cfg.json stays a checkpoint (its changed experts are found)
        shutil.copy(adapter / "expert_cfg.json", tuned)
        assert cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "packed2", "--name", "task")[0] == 0
        assert manifest(tmp_path / "packed2") == manifest(tmp_path / "packed")


def test_float32_experts_are_converted_only_when_exact(base, experts, tmp_path, capsys):
    tensors = expert_tensors(base, experts)
    listed = {l: sorted(per) for l, per in experts.items()}
    write_adapter(tmp_path / "bf16", base, tensors, listed)
    write_adapter(tmp_path / "f32", base, {n: t.float() for n, t in tensors.items()}, listed)
    for kind in ("bf16", "f32"):
        assert cli(capsys, "pack", base.path, tmp_path / kind, "--out", tmp_path / f"b_{kind}", "--name", "t")[0] == 0
    assert manifest(tmp_path / "b_f32") == manifest(tmp_path / "b_bf16")
    inexact = {n: t.float() for n, t in tensors.items()}
    name = min(inexact)
    inexact[name] = inexact[name] + 1e-4  # below bf16's resolution at these magnitudes: rounding would drop it
    write_adapter(tmp_path / "f32_inexact", base, inexact, listed)
    code, err = cli(capsys, "pack", base.path, tmp_path / "f32_inexact", "--out", tmp_path / "b_bad", "--name", "t")
    assert code == 1 and err.count("\n") == 1
    assert f"model.safetensors: tensor {name!r} is F32 and " in err and "convert exactly to the base's BF16" in err
    assert_nothing_written(tmp_path, tmp_path / "b_bad")


def _bad_adapters(base: MoECheckpoint, experts, root: Path) -> list[tuple[str, Path, list[str], str]]:
    """(case, adapter folder, extra pack options, expected error text) for every refusal of an adapter."""
    tensors = expert_tensors(base, experts)
    listed = {l: sorted(per) for l, per in experts.items()}
    l1, e1 = 1, listed[1][0]
    free = {l: next(e for e in range(base.num_experts) if e not in ids) for l, ids in listed.items()}
    shared = {n: base.read_tensor(n) for n in base.tensors if ".mlp.shared_experts." in n}
    attn = "model.layers.1.self_attn.o_proj.weight"
    others = {n: base.read_tensor(n) for n in base.tensors if ".mlp.experts." not in n and n not in shared}
    others[attn] = others[attn] + 1
    cases = []

    def case(what, tensors_, listed_=listed, options=(), **kw):
        cases.append((what, write_adapter(root / what, base, tensors_, listed_, **kw), list(options)))

    case("listed-missing", tensors, {**listed, 1: [*listed[1], free[1]]})
    case("unlisted", {**tensors, **expert_tensors(base, {2: {free[2]: base.read_expert(2, free[2])}})})
    case("incomplete", {n: t for n, t in tensors.items() if n != base.arch.expert_tensor(l1, e1, "down")})
    case("unknown", {**tensors, "model.layers.1.mlp.adapter_scale": torch.ones(1)})
    case("mixed", {**{n: t for n, t in tensors.items() if ".layers.1." not in n},
                   **{n[len(PREFIX):]: t for n, t in tensors.items() if ".layers.1." in n}})
    case("shape", {**tensors, base.arch.expert_tensor(l1, e1, "up"): torch.zeros(3, 3, dtype=torch.bfloat16)})
    case("shared-not-flagged", {**tensors, **shared})
    case("shared-incomplete", {**tensors, **dict(list(shared.items())[:3])}, shared=True)
    case("non-expert-changed", {**tensors, **others}, non_expert=True)
    case("not-moe-layer", tensors, {0: [1], **listed})
    case("config-too", tensors, options=["--config", root / "config-too" / "expert_cfg.json"])
    case("twice", tensors)
    save_file({base.arch.expert_tensor(l1, e1, "gate"): tensors[base.arch.expert_tensor(l1, e1, "gate")]},
              root / "twice" / "more.safetensors")
    case("no-weights", tensors)
    (root / "no-weights" / "model.safetensors").unlink()
    want = {
        "listed-missing": f"expert_cfg.json: lists experts that no safetensors file of the folder holds (layer, "
                          f"expert): [(1, {free[1]})]",
        "unlisted": f"model.safetensors: holds experts that expert_cfg.json does not list (layer, expert): "
                    f"[(2, {free[2]})]",
        "incomplete": f"model.safetensors: expert {e1} of layer {l1} is incomplete: "
                      f"'model.layers.{l1}.mlp.experts.{e1}.down_proj.weight' is missing",
        "unknown": "model.safetensors: unknown tensor 'model.layers.1.mlp.adapter_scale': the base has no tensor "
                   "of that name, with or without 'model.'",
        "mixed": "model.safetensors: keys with and without the 'model.' prefix in one adapter",
        "shape": f"tensor 'model.layers.{l1}.mlp.experts.{e1}.up_proj.weight' has shape [3, 3], the base's has "
                 "[64, 256]",
        "shared-not-flagged": "model.safetensors: holds shared-expert tensors (e.g. "
                              "'model.layers.1.mlp.shared_experts.down_proj.weight') but expert_cfg.json sets "
                              "shared_experts: false",
        "shared-incomplete": "shared-incomplete: expert_cfg.json sets shared_experts: true but 6 shared-expert "
                             "tensors are missing",
        "non-expert-changed": f"model.safetensors: the adapter changes 1 tensor outside the routed experts (e.g. "
                              f"{attn!r}); ESFT adapters change routed experts only: pass --include-non-expert",
        "not-moe-layer": "expert_cfg.json: the expert config's layer keys fit the model neither 0-based (layer 0 is "
                         "not a MoE layer) nor 1-based (key 0 would be layer -1, not a MoE layer)",
        "config-too": "expert_cfg.json: an ESFT adapter folder brings its own expert_cfg.json: drop --config",
        "twice": f"more.safetensors: tensor 'model.layers.{l1}.mlp.experts.{e1}.gate_proj.weight' is also in "
                 "model.safetensors",
        "no-weights": "no-weights: no *.safetensors file beside expert_cfg.json",
    }
    return [(what, folder, options, want[what]) for what, folder, options in cases]


def test_bad_adapters_are_refused_with_one_line(base, experts, tmp_path, capsys):
    cases = _bad_adapters(base, experts, tmp_path / "adapters")
    for what, folder, options, want in cases:
        out = tmp_path / f"bundle-{what}"
        code, err = cli(capsys, "pack", base.path, folder, "--out", out, "--name", "t", *options)
        assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, (what, err)
        assert want in err, (what, err)
        assert_nothing_written(tmp_path, out)
    # the console command itself, once
    what, folder, options, want = cases[0]
    proc = run_cli("pack", base.path, folder, "--out", tmp_path / "b", "--name", "t")
    assert proc.returncode == 1 and want in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an adapter folder as the safetensors library reads it (its own checks, not ours)."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


def test_fuzz_esft_adapters(base, experts, tmp_path):
    """Mutated expert_cfg.json and safetensors files of an ESFT adapter folder (what users download), fixed seed,
    about 10 s: import refuses each in one line naming a file of the folder, writing nothing, or packs a bundle
    whose experts are exactly the folder's tensors of those names as the safetensors library reads them; never
    another exception or a hang."""
    listed = {l: sorted(per) for l, per in experts.items()}
    src = write_adapter(tmp_path / "src", base, expert_tensors(base, experts), listed)
    config = json.loads((src / "expert_cfg.json").read_text())
    rng = random.Random(29)
    outcomes = {"refused": 0, "accepted": 0}
    start, n = time.monotonic(), 0
    while time.monotonic() - start < 10 and n < 1000:
        case, out = tmp_path / f"case{n}", tmp_path / f"bundle{n}"
        shutil.copytree(src, case)
        op = rng.random()
        if op < 0.45:
            (case / "expert_cfg.json").write_text(json.dumps(mutate_manifest(config, rng)))
        elif op < 0.55:
            text = (case / "expert_cfg.json").read_text()
            (case / "expert_cfg.json").write_text(text[:rng.randrange(len(text))])
        else:
            mutate_data(case / "model.safetensors", rng)
        try:
            with deadline(20):
                import_adapter(base.path, case, out, name="t")
        except EsftError as e:
            assert "\n" not in str(e) and str(case) in str(e), str(e)
            assert_nothing_written(tmp_path, out)
            outcomes["refused"] += 1
        else:
            reference, bundle = _reference(case), Bundle.open(out)
            for layer, per in bundle.read_experts().items():
                for e, weights in per.items():
                    for w, t in weights.items():
                        key = base.arch.expert_tensor(layer, e, w)
                        want = reference.get(key, reference.get(key.removeprefix(PREFIX)))
                        assert want is not None and torch.equal(t, want.to(t.dtype)), (n, key)
            outcomes["accepted"] += 1
            shutil.rmtree(out)
        shutil.rmtree(case)
        n += 1
    assert n >= 50 and min(outcomes.values()) > 0, outcomes


# ---- export -------------------------------------------------------------------------------------------------

def test_exported_folder_is_pinned(base, tmp_path, capsys):
    """File names, expert_cfg.json byte for byte, and the safetensors keys DeepSeek's esft.py loads."""
    g = torch.Generator().manual_seed(1)
    chosen = {1: [3], 2: [0, 15]}
    from esftctl.formats.bundle import write_bundle

    experts = {l: {e: ExpertWeights(*(torch.randn(t.shape, generator=g).to(t.dtype)
                                       for _, t in base.read_expert(l, e).items())) for e in ids}
               for l, ids in chosen.items()}
    write_bundle(tmp_path / "bundle", "task", base, experts)
    assert cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", tmp_path / "esft")[0] == 0
    out = tmp_path / "esft"
    assert sorted(p.name for p in out.iterdir()) == ["expert_cfg.json", "model.safetensors"]
    assert (out / "expert_cfg.json").read_text() == (
        '{"experts": {"1": [3], "2": [0, 15], "3": []}, "shared_experts": false, "non_expert_modules": false}')
    with safe_open(out / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
        got = {(l, e): ExpertWeights(*(f.get_tensor(f"model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")
                                       for p in ("gate", "up", "down"))) for l, ids in chosen.items() for e in ids}
    assert keys == {f"model.layers.{l}.mlp.experts.{e}.{p}_proj.weight"
                    for l, ids in chosen.items() for e in ids for p in ("gate", "up", "down")}
    assert all(got[(l, e)].equal(experts[l][e]) for l, ids in chosen.items() for e in ids)


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_export_import_round_trip(tiny_models, tmp_path, capsys, architecture):
    base = tiny_models[architecture]
    write_synthetic_adapter(base, tmp_path / "bundle", "task", seed=2, experts_per_layer=3)
    assert cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", tmp_path / "esft")[0] == 0
    assert cli(capsys, "pack", base, tmp_path / "esft", "--out", tmp_path / "again", "--name", "task")[0] == 0
    assert manifest(tmp_path / "again") == manifest(tmp_path / "bundle")  # its checksum covers every tensor
    again, first = Bundle.open(tmp_path / "again").read_experts(), Bundle.open(tmp_path / "bundle").read_experts()
    assert all(w.equal(again[l][e]) for l, per in first.items() for e, w in per.items())


def test_shared_and_non_expert_tensors_both_ways(base, experts, tmp_path, capsys):
    """A fine-tune that also changed a shared expert and an attention weight: packed with --include-non-expert,
    exported (with --base: DeepSeek's strict loader wants every tensor of the trained modules) with both flags,
    imported back to the same bundle."""
    shared = "model.layers.2.mlp.shared_experts.up_proj.weight"
    attn = "model.layers.1.self_attn.o_proj.weight"
    changes = {**expert_tensors(base, experts), shared: base.read_tensor(shared) * 2, attn: base.read_tensor(attn) + 1}
    tuned = write_checkpoint(base, tmp_path / "tuned", changes)
    pack(base.path, tuned, tmp_path / "bundle", "task", include_non_expert=True)
    assert Bundle.open(tmp_path / "bundle").non_expert_tensors == sorted([shared, attn])

    out = tmp_path / "esft"
    code, err = cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", out)
    assert code == 1 and err.count("\n") == 1 and "changes 2 non-expert tensors" in err and "--base BASE" in err
    assert_nothing_written(tmp_path, out)
    other = write_checkpoint(base, tmp_path / "other_base", {base.arch.router_tensor(1): base.read_router(1) * 2})
    code, err = cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", out, "--base", other)
    assert code == 1 and "packed for another base model" in err
    assert_nothing_written(tmp_path, out)

    assert cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", out, "--base", base.path)[0] == 0
    config = json.loads((out / "expert_cfg.json").read_text())
    assert (config["shared_experts"], config["non_expert_modules"]) == (True, True)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor(attn), changes[attn]) and torch.equal(f.get_tensor(shared), changes[shared])
    # every parameter but the routed experts not listed: what to_esft leaves trainable with both flags
    assert keys == {n for n in base.tensors if ".mlp.experts." not in n} | set(expert_tensors(base, experts))

    code, err = cli(capsys, "pack", base.path, out, "--out", tmp_path / "again", "--name", "task")
    assert code == 1 and "changes 2 tensors outside the routed experts" in err and "--include-non-expert" in err
    assert_nothing_written(tmp_path, tmp_path / "again")
    assert cli(capsys, "pack", base.path, out, "--out", tmp_path / "again", "--name", "task",
               "--include-non-expert")[0] == 0
    assert manifest(tmp_path / "again") == manifest(tmp_path / "bundle")

    # a bundle changing a shared expert only: shared_experts alone, with every MoE layer's shared experts
    tuned2 = write_checkpoint(base, tmp_path / "tuned2", {**expert_tensors(base, experts),
                                                          shared: changes[shared]})
    pack(base.path, tuned2, tmp_path / "bundle2", "task", include_non_expert=True)
    assert cli(capsys, "export", tmp_path / "bundle2", "--format", "esft", "--out", tmp_path / "esft2",
               "--base", base.path)[0] == 0
    config = json.loads((tmp_path / "esft2" / "expert_cfg.json").read_text())
    assert (config["shared_experts"], config["non_expert_modules"]) == (True, False)
    with safe_open(tmp_path / "esft2" / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == {n for n in base.tensors if ".mlp.shared_experts." in n} | \
            set(expert_tensors(base, experts))


def test_export_refusals(base, tmp_path, capsys):
    write_synthetic_adapter(base.path, tmp_path / "bundle", "task", seed=2)
    code, err = cli(capsys, "export", tmp_path / "bundle", "--format", "lora", "--out", tmp_path / "x")
    assert code == 1 and "unknown format 'lora' (choose esft)" in err
    (tmp_path / "taken").mkdir()
    code, err = cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", tmp_path / "taken")
    assert code == 1 and "taken: output already exists" in err and not list((tmp_path / "taken").iterdir())
    code, err = cli(capsys, "export", tmp_path / "taken", "--format", "esft", "--out", tmp_path / "x")
    assert code == 1 and "not an adapter bundle" in err and err.count("\n") == 1
    assert_nothing_written(tmp_path, tmp_path / "x")


# ---- serving ------------------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_imported_adapter_served_equals_its_merged_model(world, tmp_path):
    """An adapter folder in the spelling of DeepSeek's released adapters, imported, served by `esftctl serve`
    beside the base: the greedy tokens of its merged model served alone by plain vLLM."""
    from test_serve_adapters import ADAPTER_SCALE, ENGINE_ARGS, complete, prompts_of, reference, serve_concurrently

    from esftctl.merge import merge
    from esftctl.serve import Server, free_port, plan

    base = MoECheckpoint(world.base_dir)
    prompts = prompts_of(world)[:4]
    experts = synthetic_experts(base, seed=41, experts_per_layer=8, scale=ADAPTER_SCALE,
                                prefer=experts_used_by(base.path, prompts))
    adapter = write_adapter(tmp_path / "adapter", base, expert_tensors(base, experts),
                            {l: sorted(per) for l, per in experts.items()}, prefix=False)
    pack(base.path, adapter, tmp_path / "bundle", "imported")
    merged = merge(base.path, tmp_path / "bundle", tmp_path / "merged")
    ref = reference({"imported": merged}, prompts, tmp_path)
    serve_plan = plan(base.path, [f"imported={tmp_path / 'bundle'}"], name="base", port=free_port(),
                      state_dir=tmp_path / "state", vllm_args=ENGINE_ARGS)
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, ["imported"], prompts, ref)
        base_answers = [complete(serve_plan.url, "base", p)["token_ids"] for p in prompts]
    # the adapter really changes the answers, or the comparison would prove nothing
    assert base_answers != [r["token_ids"] for r in ref["imported"]]
