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
