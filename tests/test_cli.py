"""`esftctl --help` and `esftctl inspect` as a user runs them."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from test_checkpoint import EXPECTED


def test_help_lists_commands():
    proc = run_cli("--help", check=True)
    assert "inspect" in proc.stdout
    proc = run_cli("inspect", "--help", check=True)
    assert "--json" in proc.stdout


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_inspect_json(tiny_models, arch):
    d = json.loads(run_cli("inspect", tiny_models[arch], "--json", check=True).stdout)
    assert d["num_moe_layers"] == len(EXPECTED[arch]["moe_layers"])
    assert d["routed_experts_per_layer"] == EXPECTED[arch]["experts"]
    assert d["expert_bytes"] == 3 * 256 * EXPECTED[arch]["inter"] * 2


def test_inspect_table_on_tiny_world(world):
    out = run_cli("inspect", world.base_dir, check=True).stdout
    assert "deepseek_v2" in out
    row = next(line for line in out.splitlines() if "routed experts per layer" in line)
    assert row.split("│")[2].strip() == "32"
    d = json.loads(run_cli("inspect", world.base_dir, "--json", check=True).stdout)
    assert (d["num_layers"], d["moe_layers"], d["routed_experts_per_layer"], d["top_k"]) == (4, [1, 2, 3], 32, 4)
    assert d["shared_experts_per_layer"] == 2
    assert d["expert_bytes"] == 3 * 256 * 64 * 2


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    proc = run_cli("inspect", tmp_path / "missing")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "missing: no such file or folder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_adapters_with_a_url_that_is_not_one_is_one_line(tmp_path):
    for args in (("adapters", "list"), ("adapters", "load", "a", tmp_path), ("adapters", "unload", "a")):
        proc = run_cli(*args, "--url", "notaurl")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == "error: notaurl: not a server URL (expected http://HOST:PORT)", proc.stderr


def test_compress_of_a_float32_model_names_the_model(tiny_models, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "fp32"
    shutil.copytree(tiny_models["mixtral"], model)
    for file in model.glob("*.safetensors"):
        save_file({k: t.float() for k, t in load_file(file).items()}, file, metadata={"format": "pt"})
    assert next(iter(load_file(next(model.glob("*.safetensors"))).values())).dtype == torch.float32
    proc = run_cli("compress", model, "--out", tmp_path / "store")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {model}: tensor ") and "only bf16 expert weights" in proc.stderr
    assert not (tmp_path / "store").exists() and list(tmp_path.iterdir()) == [model]


def test_one_name_rule_for_pack_serve_and_load(world, tmp_path):
    """Issue 18, item 5: a name with a space is refused alike by pack, serve and adapters load, in one line."""
    for args in (("pack", world.base_dir, world.base_dir, "--out", tmp_path / "b", "--name", "a b"),
                 ("serve", world.base_dir, "--adapter", f"a b={tmp_path}"),
                 ("serve", world.base_dir, "--name", "my base"),
                 ("adapters", "load", "a b", tmp_path, "--url", "http://127.0.0.1:9")):
        proc = run_cli(*args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert "use 1-128 letters, digits, '.', '_' and '-'" in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "b").exists()
