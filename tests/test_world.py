"""The tiny world: data, tokenizer and base exist, tasks route to different experts, the cache holds."""

from __future__ import annotations

import itertools
import json

from esftctl.checkpoint import MoECheckpoint
from esftctl.world.build import SPLITS, build_world
from esftctl.world.report import routing_distance
from esftctl.jsonl import read_jsonl
from esftctl.world.tasks import TASKS


def test_data_files(world):
    for task in TASKS:
        for split, n in SPLITS.items():
            examples = list(read_jsonl(world.data_file(task.name, split)))
            assert len(examples) == n
    # splits are different draws, not copies
    train = {e["prompt"] for e in read_jsonl(world.data_file("translation", "train"))}
    test = {e["prompt"] for e in read_jsonl(world.data_file("translation", "test"))}
    assert len(test - train) > len(test) // 2


def test_tasks_prefer_different_experts(world):
    usage = world.expert_usage()
    ckpt = MoECheckpoint(world.base_dir)
    assert usage["moe_layers"] == ckpt.moe_layers
    for task in usage["usage"]:
        for layer in map(str, ckpt.moe_layers):
            assert abs(sum(usage["usage"][task][layer]) - 1) < 1e-5
    for a, b in itertools.combinations(usage["usage"], 2):
        assert routing_distance(usage, a, b) > 0.15, (a, b)


def test_tokenizer_round_trip(world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world.base_dir)
    text = "translate: red cat => " + " ".join(["biva", "zudi"])
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == text
    assert len(tok) <= 512


def test_base_learned_the_mixture(world):
    """Pre-training was real: the base predicts intent labels (the easiest task) far above chance."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world.base_dir)
    model = AutoModelForCausalLM.from_pretrained(world.base_dir, dtype=torch.float32).eval()
    examples = list(read_jsonl(world.data_file("intent", "test")))[:40]
    correct = 0
    for e in examples:
        ids = tok(e["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax().item()
        correct += tok.decode([next_id]) == tok.decode(tok(e["completion"])["input_ids"][1:2])
    assert correct / len(examples) > 0.5  # 4 labels: chance is 0.25


def test_build_is_cached_and_rebuilds_only_what_is_missing(world):
    base_mtime = (world.base_dir / "model.safetensors").stat().st_mtime_ns
    marker = world.root / "world.json"
    assert build_world(world.root).root == world.root
    assert (world.base_dir / "model.safetensors").stat().st_mtime_ns == base_mtime
    # losing the usage file and the marker rebuilds those two only
    usage_before = json.loads(world.usage_file.read_text())
    world.usage_file.unlink()
    marker.unlink()
    build_world(world.root)
    assert (world.base_dir / "model.safetensors").stat().st_mtime_ns == base_mtime
    assert json.loads(world.usage_file.read_text()) == usage_before


def test_training_is_reproducible(world):
    """Same seed, same weights: the world's pre-training and ESFT runs repeat exactly."""
    import torch
    from transformers import AutoTokenizer

    from esftctl.world.models import build_model, tiny_config
    from esftctl.world.training import train

    tok = AutoTokenizer.from_pretrained(world.tokenizer_dir)
    examples = list(read_jsonl(world.data_file("reversal", "pretrain")))[:64]
    runs = []
    for _ in range(2):
        model = build_model(tiny_config("deepseek_v2", vocab_size=len(tok)), seed=4)
        train(model, tok, examples, steps=3, batch_size=8, lr=3e-3, seed=4)
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not torch.are_deterministic_algorithms_enabled()  # the global flag is restored
