"""The offline pipeline on the architectures of issue 31 (OLMoE, GLM-4.5 MoE, DeepSeek-V3), as a user runs it:
inspect, relevance, select, pack from a full fine-tune and from an ESFT adapter folder, merge, compress and
decompress, consolidate and materialize; each output checked against what it must equal."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_esft_adapter import cli, expert_tensors, manifest, write_adapter

from esftctl.consolidate import ExpertMap
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.jsonl import read_jsonl
from esftctl.world.synthetic import write_synthetic_variant
from esftctl.world.tasks import TASKS

NEW = ["olmoe", "glm4_moe", "deepseek_v3"]


def assert_same_checkpoint(a, b) -> None:
    a, b = MoECheckpoint(a), MoECheckpoint(b)
    assert set(a.tensors) == set(b.tensors)
    assert all(torch.equal(a.read_tensor(n), b.read_tensor(n)) for n in a.tensors)


def tuned_experts(base: MoECheckpoint, chosen: dict[int, list[int]]) -> dict[int, dict[int, ExpertWeights]]:
    g = torch.Generator().manual_seed(3)
    return {l: {e: ExpertWeights(*(t + torch.randn(t.shape, generator=g).to(t.dtype) * t.float().std().to(t.dtype)
                                   for _, t in base.read_expert(l, e).items())) for e in ids}
            for l, ids in chosen.items()}


@pytest.mark.parametrize("arch", NEW)
def test_offline_pipeline(arch, world, tmp_path, capsys):
    from transformers import AutoTokenizer

    from esftctl.world.models import make_random_model

    base_dir = make_random_model(arch, tmp_path / "base", seed=3,
                                 tokenizer=AutoTokenizer.from_pretrained(world.tokenizer_dir))
    base = MoECheckpoint(base_dir)
    described = json.loads(run_cli("inspect", base_dir, "--json", check=True).stdout)
    assert described["architecture"] == arch and described["quantization"] is None

    data = tmp_path / "task.jsonl"
    examples = list(read_jsonl(world.data_file(TASKS[0].name, "train")))[:8]
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    assert cli(capsys, "relevance", base_dir, data, "--out", tmp_path / "scores.json")[0] == 0
    assert cli(capsys, "select", tmp_path / "scores.json", "--out", tmp_path / "experts.json", "-p", "0.2")[0] == 0
    chosen = {int(l): ids for l, ids in json.loads((tmp_path / "experts.json").read_text())["experts"].items()}
    assert sorted(chosen) == base.moe_layers and all(chosen.values())

    experts = tuned_experts(base, chosen)
    tuned = write_checkpoint(base, tmp_path / "tuned", expert_replacements(
        base, {(l, e): w for l, per in experts.items() for e, w in per.items()}))
    assert cli(capsys, "pack", base_dir, tuned, "--out", tmp_path / "bundle", "--name", "task", "--config",
               tmp_path / "experts.json")[0] == 0
    adapter = write_adapter(tmp_path / "adapter", base, expert_tensors(base, experts), chosen)
    assert cli(capsys, "pack", base_dir, adapter, "--out", tmp_path / "imported", "--name", "task")[0] == 0
    assert manifest(tmp_path / "imported") == manifest(tmp_path / "bundle")
    assert manifest(tmp_path / "bundle")["base"]["architecture"] == arch

    assert cli(capsys, "merge", base_dir, tmp_path / "bundle", "--out", tmp_path / "merged")[0] == 0
    assert_same_checkpoint(tmp_path / "merged", tuned)
    for source in ("bundle", "base"):
        src = tmp_path / source if source == "bundle" else base_dir
        assert cli(capsys, "compress", src, "--out", tmp_path / f"{source}.store")[0] == 0
        assert cli(capsys, "decompress", tmp_path / f"{source}.store", "--out", tmp_path / f"{source}.back")[0] == 0
    assert manifest(tmp_path / "bundle.back") == manifest(tmp_path / "bundle")
    back = load_file(tmp_path / "base.back" / "experts.safetensors")
    routed = [n for n in base.tensors if base.is_routed_expert_tensor(n)]
    assert sorted(back) == sorted(routed) and all(torch.equal(back[n], base.read_tensor(n)) for n in routed)

    variants = [write_synthetic_variant(base_dir, tmp_path / f"v{i}", seed=i, experts_per_layer=2) for i in (1, 2)]
    assert cli(capsys, "consolidate", *variants, "--out", tmp_path / "map", "--capacity", "20")[0] == 0
    assert cli(capsys, "materialize", tmp_path / "map", "--variant", "1", "--out", tmp_path / "m1")[0] == 0
    m1, models = MoECheckpoint(tmp_path / "m1"), [MoECheckpoint(v) for v in variants]
    owner = ExpertMap.load(tmp_path / "map" / "expert_map.json").owner
    assert (owner >= 0).sum() == 20
    for li, layer in enumerate(m1.moe_layers):
        for e in range(m1.num_experts):
            source = models[owner[li, e] if owner[li, e] >= 0 else 1]
            assert m1.read_expert(layer, e).equal(source.read_expert(layer, e))
