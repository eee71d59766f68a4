"""`esftctl bench esft`'s parts on the tiny world, each at a few steps: expert selection with both ESFT metrics,
LoRA fine-tuning (peft, experts included), the whole comparison with every method, and the CLI's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from esftctl.bench import esft as bench
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_selection_gives_experts_per_layer_for_both_metrics(world):
    from esftctl.relevance import compute_relevance

    base = MoECheckpoint(world.base_dir)
    train = list(read_jsonl(world.data_file(world.task_names[0], "train")))[:64]
    rel = compute_relevance(world.base_dir, train, scored="completion")
    for method, (metric, p) in bench.SELECTION.items():
        experts = bench.select(rel, method)
        assert list(experts) == base.moe_layers
        for layer, ids in experts.items():
            assert ids and len(set(ids)) == len(ids) and all(0 <= e < base.num_experts for e in ids)
            scores = rel.scores[metric][layer]
            assert sum(scores[e] for e in ids) >= p - 1e-9  # reaches p ...
            assert sum(scores[e] for e in ids[:-1]) < p  # ... and no expert fewer does


def test_lora_targets_attention_experts_and_mlps(world):
    from esftctl.world.lora import lora_model, lora_parameters

    model = lora_model(world.base_dir)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in lora_parameters(model)) == sum(model.get_parameter(n).numel() for n in trainable)
    adapted = {n.split(".lora_")[0].replace("base_model.model.", "").replace(".base_layer", "") for n in trainable}
    for leaf in ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                 "mlp.experts", "mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj", "layers.0.mlp.up_proj"):
        assert any(a.endswith(leaf) for a in adapted), leaf
    # each fused experts tensor (gate_up_proj, down_proj) has its own wrapper
    experts = model.get_submodule("base_model.model.model.layers.1.mlp.experts")
    assert {experts.parameter_name, experts.base_layer.parameter_name} == {"gate_up_proj", "down_proj"}


def test_lora_finetune_trains_lora_only_and_writes_a_small_adapter(world, tmp_path):
    from esftctl.world.esft import FINETUNE
    from esftctl.world.lora import lora_finetune

    task = world.task_names[0]
    train_set = list(read_jsonl(world.data_file(task, "train")))[:64]
    general = list(read_jsonl(world.general_file("train")))[:64]
    losses = lora_finetune(world.base_dir, train_set, tmp_path / "lora", general=general, steps=3, batch_size=8,
                           replay=FINETUNE["replay"], lr=1e-2)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    adapter, merged = tmp_path / "lora" / "adapter", tmp_path / "lora" / "merged"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    lora = _tensors(adapter)
    assert lora and all("lora_" in k and t.dtype == torch.bfloat16 for k, t in lora.items())
    base_bytes = sum(f.stat().st_size for f in world.base_dir.glob("*.safetensors"))
    assert bench.stored_bytes(adapter) < base_bytes / 5
    base, tuned = _tensors(world.base_dir), _tensors(merged)
    assert {k: (t.shape, t.dtype) for k, t in base.items()} == {k: (t.shape, t.dtype) for k, t in tuned.items()}
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert any(".mlp.experts." in k for k in changed) and any("self_attn" in k for k in changed)  # experts too
    untouched = [k for k in base if "norm" in k or "embed" in k or "lm_head" in k or k.endswith("mlp.gate.weight")]
    assert untouched and not changed & set(untouched)  # only LoRA-adapted weights moved


def test_run_reports_every_metric_for_every_method(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from esftctl.formats.bundle import Bundle
    from esftctl.world.lora import lora_model, lora_parameters

    task = world.task_names[0]
    result = bench.run(world, tasks=[task], methods=bench.METHODS, steps=2, work_dir=tmp_path / "work",
                       replay=0.5, eval_examples=3)
    assert result["recipe"]["replay"] == 0.5 and result["recipe"]["steps"] == 2
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["base", *bench.METHODS]
    for r in rows.values():
        assert 0 <= r["task_exact"] <= 1 and 0 <= r["general_exact"] <= 1
        assert r["task_loss"] > 0 and r["general_loss"] > 0 and math.isfinite(r["general_loss"])
        assert isinstance(r["trainable_params"], int) and isinstance(r["stored_bytes"], int)
        assert (r["train_s"] > 0) == (r["method"] != "base")
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(world.base_dir).parameters())
    assert rows["fft"]["trainable_params"] == result["base_params"] == total
    for method in bench.SELECTION:
        bundle = Bundle.open(tmp_path / "work" / task / method / "bundle")
        assert {str(l): sorted(ids) for l, ids in bundle.experts.items()} == {
            l: sorted(ids) for l, ids in rows[method]["experts"].items()}
        assert rows[method]["trainable_params"] == bench.tensor_params(bundle.path)  # the selected experts exactly
        assert rows[method]["stored_bytes"] < rows["fft"]["stored_bytes"] / 3
    assert rows["lora"]["trainable_params"] == sum(p.numel() for p in lora_parameters(lora_model(world.base_dir)))
    assert rows["lora"]["stored_bytes"] < rows["fft"]["stored_bytes"] / 3
    assert rows["fft"]["stored_bytes"] >= MoECheckpoint(world.base_dir).total_nbytes
    assert [c["verdict"] in ("agrees", "partly agrees", "disagrees") for c in result["agreement"]] == [True] * 3
    assert set(result["averages"]) == set(rows)
    json.dumps(result)  # JSON-ready
    from rich.console import Console

    console = Console(record=True, width=200)
    for t in bench.tables(result):
        console.print(t)
    text = console.export_text()
    assert "Averages over 1 task" in text and "(3) ESFT storage ~10x smaller than FFT" in text
    assert "2 steps per fine-tune, 50% of each batch replayed" in text
    bench.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--tasks", "arithmetic,nope"], "--tasks: unknown 'nope'"),
    (["--methods", "esft-gate,qlora"], "--methods: unknown 'qlora'"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--fft-lr", "-1"], "--fft-lr -1.0: must be above 0"),
    (["--replay", "1"], "--replay 1.0: must be at least 0 and below 1"),
])
def test_cli_refuses_bad_options_in_one_line(args, message, tmp_path):
    proc = run_cli("bench", "esft", "--out", tmp_path, *args)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
