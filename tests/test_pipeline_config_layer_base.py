"""Expert configs of other tools: layer keys read 0- or 1-based, checked against the model (esftctl/selection.py).

A config whose keys fit the model's MoE layers only one way is read that way; one that fits both is read, for a full
fine-tune, the way under which exactly the listed experts changed, and refused where the fine-tune does not decide
(or for an adapter folder) until `--layer-base` says which; an explicit base is honoured, and refused where the keys
do not fit it. Through `pack --config` with a full fine-tune and through an ESFT adapter folder's expert_cfg.json:
exit 1, one line, nothing written. The tiny Qwen3-MoE has 4 layers, all MoE (as the AWS sample's Qwen3 models: its
1-based keys run 1-4).
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from test_formats_esft_adapter import assert_nothing_written, cli, expert_tensors, manifest, write_adapter

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.selection import ExpertConfig
from esftctl.world.synthetic import synthetic_experts

ALL_MOE = [0, 1, 2, 3]  # 4 layers, all MoE (Qwen3-MoE, Mixtral, OLMoE)
FIRST_DENSE = [1, 2, 3]  # DeepSeek-V2's first_k_dense_replace 1
EVERY_OTHER = [1, 3]  # Qwen2-MoE's decoder_sparse_step 2


@pytest.mark.parametrize("keys, moe_layers, base", [
    ([0, 1, 2], ALL_MOE, 0),  # key 0: no layer counted from 1
    ([1, 2, 3, 4], ALL_MOE, 1),  # key 4 = the layer count: no layer counted from 0
    ([1, 2], FIRST_DENSE, 0),  # counted from 1, key 1 is the dense layer 0
    ([2], EVERY_OTHER, 1),  # counted from 0, key 2 is a dense layer
    ([], ALL_MOE, 0),  # nothing listed: nothing to number
])
def test_keys_that_fit_one_way_are_read_that_way(keys, moe_layers, base):
    config, used = ExpertConfig({k: [k] for k in keys}, True, False, {"note": 1}).numbered_from_zero(moe_layers)
    assert used == base
    assert config.experts == {k - base: [k] for k in keys}
    assert (config.shared_experts, config.non_expert_modules, config.extra) == (True, False, {"note": 1})


def test_ambiguous_refused_explicit_honoured_and_checked(tmp_path):
    where = tmp_path / "cfg.json"
    both = ExpertConfig({1: [0], 2: [1], 3: [2]})
    with pytest.raises(EsftError, match=r"^\S*cfg.json: the expert config's layer keys 1-3 fit the model both "
                                        r"0-based and 1-based \(MoE layers counted from 0: 0-3\): pass --layer-base 0 "
                                        r"or --layer-base 1$"):
        both.numbered_from_zero(ALL_MOE, path=where)
    assert both.numbered_from_zero(ALL_MOE, layer_base=1)[0].experts == {0: [0], 1: [1], 2: [2]}
    assert both.numbered_from_zero(ALL_MOE, layer_base=0)[0].experts == both.experts
    with pytest.raises(EsftError, match="with --layer-base 0 the expert config does not fit the model: layer 4 is "
                                        "not a MoE layer"):
        ExpertConfig({4: [0]}).numbered_from_zero(ALL_MOE, layer_base=0, path=where)
    with pytest.raises(EsftError, match="with --layer-base 1 the expert config does not fit the model: key 0 would "
                                        "be layer -1, not a MoE layer"):
        ExpertConfig({0: [0]}).numbered_from_zero(ALL_MOE, layer_base=1, path=where)
    neither = (r"fit the model neither 0-based \(layer 0 is not a MoE layer\) nor 1-based \(key 0 would be layer -1, "
               r"not a MoE layer\); MoE layers counted from 0: 1-3")
    with pytest.raises(EsftError, match=neither):
        ExpertConfig({0: [0], 1: [1]}).numbered_from_zero(FIRST_DENSE, path=where)
    with pytest.raises(EsftError, match="--layer-base must be 0 or 1, not 2"):
        both.numbered_from_zero(ALL_MOE, layer_base=2)


@pytest.mark.parametrize("config, match", [
    ({"experts": {"1": [False]}}, r"experts\['1'\] must be a list of expert ids"),  # was read as expert 0
    ({"experts": {"1": [True, 2]}}, r"experts\['1'\] must be a list of expert ids"),
    ({"experts": {"\u00b2": [0]}}, r"experts\['\u00b2'\] must be a list of expert ids"),  # was a ValueError
    ({"experts": {}, "shared_experts": "false"}, r'shared_experts must be true or false, not "false"'),
    ({"experts": {}, "non_expert_modules": 0}, "non_expert_modules must be true or false, not 0"),
])
def test_expert_config_types_are_json_types(tmp_path, config, match):
    """What the ESFT adapter fuzz (tests/test_formats_esft_adapter.py) found: ids and flags must be JSON's own types."""
    where = tmp_path / "expert_cfg.json"
    where.write_text(json.dumps(config))
    with pytest.raises(EsftError, match=rf"^\S*expert_cfg.json: {match}"):
        ExpertConfig.load(where)
    where.write_text(json.dumps({"experts": {"1": [0, 3]}, "shared_experts": True}))
    assert ExpertConfig.load(where) == ExpertConfig({1: [0, 3]}, True, False)


@pytest.fixture
def qwen3(tiny_models, tmp_path):
    """The tiny Qwen3-MoE, a full fine-tune of it changing experts in layers 0-2, and those experts."""
    base = MoECheckpoint(tiny_models["qwen3_moe"])
    experts = synthetic_experts(base, seed=4, experts_per_layer=[2, 1, 2, 0], scale=2.0)
    tuned = write_checkpoint(base, tmp_path / "tuned", expert_replacements(
        base, {(l, e): w for l, per in experts.items() for e, w in per.items()}))
    return base, tuned, experts


def _config(path, listed: dict[int, list[int]], shift: int):
    path.write_text(json.dumps({"experts": {str(l + shift): ids for l, ids in listed.items()},
                                "shared_experts": False, "non_expert_modules": False}))
    return path


def test_pack_reads_a_configs_numbering_and_refuses_to_guess(qwen3, tmp_path, capsys):
    base, tuned, experts = qwen3
    listed = {l: sorted(per) for l, per in experts.items()}  # layers 0-3, layer 3 empty
    code, _ = cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "zero", "--name", "t", "--config",
                  _config(tmp_path / "zero.json", listed, 0))
    assert code == 0
    want = manifest(tmp_path / "zero")
    assert want["experts"] == {"0": listed[0], "1": listed[1], "2": listed[2]}
    # keys 1-4 of 4 layers: only 1-based fits, and the CLI says that it read them so
    one = _config(tmp_path / "one.json", listed, 1)
    assert cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "one", "--name", "t", "--config", one)[0] == 0
    assert manifest(tmp_path / "one") == want
    proc = run_cli("pack", base.path, tuned, "--out", tmp_path / "one-json", "--name", "t", "--config", one, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["config_layer_base"] == 1
    # keys 1-3 (the empty layer left out) fit both ways: the fine-tune decides (only 1-based lists what changed)
    short = _config(tmp_path / "short.json", {l: ids for l, ids in listed.items() if ids}, 1)
    proc = run_cli("pack", base.path, tuned, "--out", tmp_path / "short", "--name", "t", "--config", short, "--json")
    assert proc.returncode == 0 and manifest(tmp_path / "short") == want, proc.stderr
    assert json.loads(proc.stdout)["config_layer_base"] == 1
    assert json.loads(proc.stdout)["config_layer_base_decided_by_finetune"] is True
    code, _ = cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "short0", "--name", "t", "--config", short,
                  "--layer-base", "0")
    assert code == 1  # told 0-based: layer 0's changed experts are not listed
    refusals = [(["--config", short, "--layer-base", "0"], "short.json: experts changed that the expert config does "
                                                          "not list"),
                (["--config", one, "--layer-base", "0"], "one.json: with --layer-base 0 the expert config does not "
                                                         "fit the model: layer 4 is not a MoE layer"),
                (["--config", _config(tmp_path / "z.json", listed, 0), "--layer-base", "1"],
                 "z.json: with --layer-base 1 the expert config does not fit the model: key 0 would be layer -1"),
                (["--layer-base", "1"], "--layer-base says how an expert config numbers layers: give the config "
                                        "too (--config)"),
                (["--config", one, "--layer-base", "2"], "--layer-base must be 0 or 1, not 2")]
    for options, message in refusals:
        code, err = cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "refused", "--name", "t", *options)
        assert code == 1 and err.count("\n") == 1 and message in err, (options, err)
        assert_nothing_written(tmp_path, tmp_path / "refused")
    # both readings list every changed expert and neither exactly: the fine-tune cannot decide, refused
    f = sorted(experts[1])[0]
    doubled = {(layer, f): ExpertWeights(*(t * 2 for _, t in base.read_expert(layer, f).items())) for layer in (1, 2)}
    tuned_both = write_checkpoint(base, tmp_path / "tuned-both", expert_replacements(base, doubled))
    both = _config(tmp_path / "both.json", {0: [f], 1: [f], 2: [f]}, 1)  # keys 1-3 list expert f
    code, err = cli(capsys, "pack", base.path, tuned_both, "--out", tmp_path / "refused", "--name", "t", "--config",
                    both)
    assert code == 1 and err.count("\n") == 1 and "the fine-tune does not decide between them" in err, err
    assert_nothing_written(tmp_path, tmp_path / "refused")
    assert cli(capsys, "pack", base.path, tuned, "--out", tmp_path / "told", "--name", "t", "--config", short,
               "--layer-base", "1")[0] == 0
    assert manifest(tmp_path / "told") == want


def test_adapter_folders_numbered_from_one(qwen3, tmp_path, capsys):
    base, _, experts = qwen3
    listed = {l: sorted(per) for l, per in experts.items()}
    tensors = expert_tensors(base, experts)
    zero = write_adapter(tmp_path / "zero", base, tensors, listed)
    assert cli(capsys, "pack", base.path, zero, "--out", tmp_path / "b0", "--name", "t")[0] == 0
    one = write_adapter(tmp_path / "one", base, tensors, {l + 1: ids for l, ids in listed.items()})
    assert cli(capsys, "pack", base.path, one, "--out", tmp_path / "b1", "--name", "t")[0] == 0
    assert manifest(tmp_path / "b1") == manifest(tmp_path / "b0")
    short = write_adapter(tmp_path / "short", base, tensors, {l + 1: ids for l, ids in listed.items() if ids})
    code, err = cli(capsys, "pack", base.path, short, "--out", tmp_path / "b2", "--name", "t")
    assert code == 1 and err.count("\n") == 1 and "short/expert_cfg.json: the expert config's layer keys 1-3 fit the " \
                                                  "model both 0-based and 1-based" in err
    assert_nothing_written(tmp_path, tmp_path / "b2")
    assert cli(capsys, "pack", base.path, short, "--out", tmp_path / "b2", "--name", "t", "--layer-base", "1")[0] == 0
    assert manifest(tmp_path / "b2") == manifest(tmp_path / "b0")
    code, err = cli(capsys, "pack", base.path, one, "--out", tmp_path / "b3", "--name", "t", "--layer-base", "0")
    assert code == 1 and err.count("\n") == 1 and "layer 4 is not a MoE layer" in err
    assert_nothing_written(tmp_path, tmp_path / "b3")
