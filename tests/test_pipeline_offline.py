"""The ESFT offline pipeline: relevance, selection, ESFT fine-tuning, pack, merge, bundle inspection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.merge import merge
from esftctl.pack import pack
from esftctl.relevance import Relevance, compute_relevance
from esftctl.selection import ExpertConfig, select_experts, select_layer

# ---- relevance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scored", ["all", "completion"])
def test_relevance_matches_hand_computation(world, tmp_path, scored):
    """With attention outputs and expert outputs zeroed, every MoE layer's gate sees rmsnorm(embedding) of
    the token, so the scores follow from the embeddings and the routers the test sets, by hand: over every
    token, or at the positions that predict a completion token (the last prompt token up to the last one)."""
    from transformers import AutoTokenizer

    from esftctl.world.models import build_model, save_model, tiny_config

    tok = AutoTokenizer.from_pretrained(world.tokenizer_dir)
    model = build_model(tiny_config("deepseek_v2", vocab_size=len(tok)), seed=3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            if i == 0:
                layer.mlp.down_proj.weight.zero_()
            else:
                layer.mlp.experts.down_proj.zero_()
                layer.mlp.shared_experts.down_proj.weight.zero_()
                layer.mlp.gate.weight.copy_(torch.randn(16, 256, generator=g) * 0.15)  # logits of std ~2
    save_model(model, tmp_path / "m", tok)
    examples = [{"prompt": "calc 1 + 2 =", "completion": " 3"},
                {"prompt": "translate: red cat =>", "completion": " biva"},
                {"prompt": "reverse: a b c ->", "completion": " c b a"}]
    rel = compute_relevance(tmp_path / "m", examples, scored=scored, batch_size=2)
    assert rel.scored == scored

    ckpt = MoECheckpoint(tmp_path / "m")
    embed = ckpt.read_tensor("model.embed_tokens.weight").double()
    ids = []
    for e in examples:
        text = tok(e["prompt"] + e["completion"])["input_ids"]
        ids += text[len(tok(e["prompt"])["input_ids"]) - 1:-1] if scored == "completion" else text
    ids = torch.tensor(ids)
    assert len(ids) == (22 if scored == "all" else 5)
    assert rel.tokens == len(ids)
    for layer in ckpt.moe_layers:
        h = embed[ids]
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + ckpt.config["rms_norm_eps"])
        h = h * ckpt.read_tensor(f"model.layers.{layer}.post_attention_layernorm.weight").double()
        scores = torch.softmax(h @ ckpt.read_router(layer).double().T, -1)
        torch.testing.assert_close(torch.tensor(rel.scores["gate"][layer]), scores.mean(0).float(),
                                   rtol=2e-3, atol=1e-4)
        picks = torch.bincount(scores.topk(4).indices.reshape(-1), minlength=16).double() / (len(ids) * 4)
        torch.testing.assert_close(torch.tensor(rel.scores["token"][layer]).double(), picks, rtol=0, atol=1e-7)
        for metric in ("gate", "token"):
            assert abs(sum(rel.scores[metric][layer]) - 1) < 1e-6


def test_relevance_file_round_trip_and_errors(tmp_path):
    rel = Relevance("m", "d", 2, 10, 4, [1, 2], {"gate": {1: [0.5, 0.5], 2: [1.0, 0.0]},
                                                  "token": {1: [0.25, 0.75], 2: [0.0, 1.0]}})
    rel.save(tmp_path / "s.json")
    assert Relevance.load(tmp_path / "s.json") == rel
    rel.scored = "completion"
    rel.save(tmp_path / "s.json")
    assert Relevance.load(tmp_path / "s.json") == rel
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(EsftError, match="bad.json: not an esftctl relevance scores file"):
        Relevance.load(tmp_path / "bad.json")
    # counts equal to shapes, scores JSON numbers: `select` picks expert ids from these lists
    good = rel.to_json()
    for scores, why in (({"gate": {"1": [0.5, 0.5]}, "token": good["scores"]["token"]}, "same experts of every"),
                        ({"gate": {"1": [0.5, 0.5], "2": [1.0]}, "token": good["scores"]["token"]}, "same experts"),
                        ({"gate": {"1": ["0.5", 0.5], "2": [1, 0]}, "token": good["scores"]["token"]}, "'0.5'"),
                        ({"gate": {"1": [True, 0.5], "2": [1, 0]}, "token": good["scores"]["token"]}, "True"),
                        ({"gate": {"1": [-0.5, 0.5], "2": [1, 0]}, "token": good["scores"]["token"]}, "-0.5"),
                        ({"gate": {"1": [10 ** 400, 0], "2": [1, 0]}, "token": good["scores"]["token"]}, "Overflow"),
                        ({"gate": [], "token": good["scores"]["token"]}, "AttributeError")):
        (tmp_path / "bad.json").write_text(json.dumps(good | {"scores": scores}))
        with pytest.raises(EsftError, match=rf"bad.json: malformed scores file \(.*{why}"):
            Relevance.load(tmp_path / "bad.json")


# ---- selection ---------------------------------------------------------------------------------------

def test_selection_boundaries():
    assert select_layer([0.25, 0.25, 0.25, 0.25], 0.5) == [0, 1]  # ties: lower id first
    assert select_layer([0.1, 0.4, 0.4, 0.1], 0.45) == [1, 2]
    assert select_layer([0.0, 1.0, 0.0], 0.99) == [1]  # one expert holds all the mass
    assert select_layer([0.0, 1.0, 0.0], 1.0) == [1]
    thirds = [1 / 3] * 3  # sums to 1 - 1e-16 in floating point: p = 1 still stops at the third
    assert select_layer(thirds, 1.0) == [0, 1, 2]
    assert select_layer([0.7, 0.2, 0.1, 0.0], 1.0) == [0, 1, 2]
    assert select_layer([0.3, 0.7], 0.3) == [1]
    for p in (0, -0.1, 1.01):
        with pytest.raises(EsftError, match="threshold p"):
            select_layer([0.5, 0.5], p)
    assert select_experts({2: [0.1, 0.9], 1: [0.6, 0.4]}, 0.5) == {1: [0], 2: [1]}


def test_expert_config_is_deepseek_layout(tmp_path):
    (tmp_path / "esft.json").write_text(json.dumps(
        {"experts": {"1": [8, 3], "2": [5]}, "shared_experts": False, "non_expert_modules": False, "note": "x"}))
    config = ExpertConfig.load(tmp_path / "esft.json")
    assert config.experts == {1: [8, 3], 2: [5]}  # order of relevance kept
    config.save(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads((tmp_path / "esft.json").read_text())
    config.validate([1, 2], 16)
    with pytest.raises(EsftError, match="expert ids \\[16\\] out of range"):
        ExpertConfig({1: [16]}).validate([1, 2], 16, tmp_path / "c.json")
    with pytest.raises(EsftError, match="layer 0 is not a MoE layer"):
        ExpertConfig({0: [1]}).validate([1, 2], 16)
    (tmp_path / "dup.json").write_text(json.dumps({"experts": {"1": [2, 2]}}))
    with pytest.raises(EsftError, match="dup.json: experts\\['1'\\] lists an expert twice"):
        ExpertConfig.load(tmp_path / "dup.json")


# ---- pack and merge -----------------------------------------------------------------------------------

def _random_like(w: ExpertWeights, seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(*(torch.randn(t.shape, generator=g).to(t.dtype) for _, t in w.items()))


@pytest.fixture
def finetune(tiny_models, tmp_path):
    """A synthetic ESFT fine-tune of the tiny DeepSeek-V2: experts (1,3), (2,0), (2,15), (3,7) changed."""
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    changed = {(1, 3): 1, (2, 0): 2, (2, 15): 3, (3, 7): 4}
    new = {key: _random_like(base.read_expert(*key), seed) for key, seed in changed.items()}
    tuned = write_checkpoint(base, tmp_path / "tuned", expert_replacements(base, new))
    return base.path, tuned, {1: [3], 2: [0, 15], 3: [7]}


def _assert_same_checkpoint(a, b):
    a, b = MoECheckpoint(a), MoECheckpoint(b)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.read_tensor(name), b.read_tensor(name)), name


def test_pack_finds_changed_experts_and_merge_is_bit_exact(finetune, tmp_path):
    base, tuned, changed = finetune
    report = pack(base, tuned, tmp_path / "bundle", "task")
    assert report.experts == changed
    bundle = Bundle.open(tmp_path / "bundle")
    assert bundle.experts == changed and bundle.name == "task"
    merged = merge(base, tmp_path / "bundle", tmp_path / "merged")
    _assert_same_checkpoint(merged, tuned)


def test_pack_with_config(finetune, tmp_path):
    base, tuned, changed = finetune
    ExpertConfig({1: [3, 9], 2: [15, 0], 3: [7]}).save(tmp_path / "esft.json")
    report = pack(base, tuned, tmp_path / "bundle", "task", config_file=tmp_path / "esft.json")
    assert report.unchanged_listed == [(1, 9)]
    assert Bundle.open(tmp_path / "bundle").experts == {1: [3, 9], 2: [0, 15], 3: [7]}
    _assert_same_checkpoint(merge(base, tmp_path / "bundle", tmp_path / "merged"), tuned)
    ExpertConfig({1: [3], 2: [0]}).save(tmp_path / "short.json")
    with pytest.raises(EsftError,
                       match=r"short.json: experts changed that the expert config does not list .*\(2, 15\)"):
        pack(base, tuned, tmp_path / "b2", "task", config_file=tmp_path / "short.json")
    ExpertConfig({1: [3, 99]}).save(tmp_path / "range.json")
    with pytest.raises(EsftError, match="range.json: layer 1: expert ids \\[99\\] out of range"):
        pack(base, tuned, tmp_path / "b3", "task", config_file=tmp_path / "range.json")
    assert not (tmp_path / "b2").exists() and not (tmp_path / "b3").exists()


def test_pack_refuses_router_and_non_expert_changes(tiny_models, tmp_path):
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    router = base.arch.router_tensor(2)
    tuned = write_checkpoint(base, tmp_path / "t1", {router: base.read_router(2) * 2})
    with pytest.raises(EsftError, match="changed the router"):
        pack(base.path, tuned, tmp_path / "b", "x")
    attn = "model.layers.1.self_attn.o_proj.weight"
    tuned2 = write_checkpoint(base, tmp_path / "t2", {attn: base.read_tensor(attn) + 1})
    with pytest.raises(EsftError, match="changed non-expert weights"):
        pack(base.path, tuned2, tmp_path / "b", "x")
    assert not (tmp_path / "b").exists()
    # told to include them: they travel in the bundle and merge puts them back
    pack(base.path, tuned2, tmp_path / "b", "x", include_non_expert=True)
    assert Bundle.open(tmp_path / "b").non_expert_tensors == [attn]
    _assert_same_checkpoint(merge(base.path, tmp_path / "b", tmp_path / "m"), tuned2)
    with pytest.raises(EsftError, match="identical to the base"):
        pack(base.path, base.path, tmp_path / "b0", "x")


def test_wrong_base_is_refused(finetune, tiny_models, tmp_path):
    base, tuned, _ = finetune
    pack(base, tuned, tmp_path / "bundle", "task")
    # same architecture and shapes, other weights: the fingerprint tells them apart
    from esftctl.world.models import make_random_model

    other = make_random_model("deepseek_v2", tmp_path / "other", seed=99)
    with pytest.raises(EsftError, match="packed for another base model .*other router weights"):
        merge(other, tmp_path / "bundle", tmp_path / "merged")
    with pytest.raises(EsftError, match="does not match the base"):
        pack(tiny_models["qwen3_moe"], tuned, tmp_path / "b2", "task")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "b2").exists()


def test_corrupted_and_truncated_bundles(finetune, tmp_path):
    base, tuned, _ = finetune
    pack(base, tuned, tmp_path / "bundle", "task")
    for how in ("flip", "truncate"):
        copy = shutil.copytree(tmp_path / "bundle", tmp_path / how)
        data = copy / "experts.safetensors"
        raw = bytearray(data.read_bytes())
        if how == "flip":
            raw[len(raw) // 2] ^= 0x40
        else:
            raw = raw[: len(raw) - 100]
        data.write_bytes(bytes(raw))
        with pytest.raises(EsftError, match="experts.safetensors: (checksum mismatch: )?.*corrupted or truncated"):
            Bundle.open(copy)
        with pytest.raises(EsftError, match="corrupted or truncated"):
            merge(base, copy, tmp_path / f"merged-{how}")
        assert not (tmp_path / f"merged-{how}").exists()
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    manifest["version"] = 7
    (tmp_path / "flip" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EsftError, match="format version 7 is not supported"):
        Bundle.open(tmp_path / "flip")


def test_output_exists_and_no_partial_output(finetune, tmp_path):
    base, tuned, _ = finetune
    (tmp_path / "out").mkdir()
    with pytest.raises(EsftError, match="output already exists"):
        pack(base, tuned, tmp_path / "out", "task")
    pack(base, tuned, tmp_path / "bundle", "task")
    with pytest.raises(EsftError, match="output already exists"):
        merge(base, tmp_path / "bundle", tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cli_pack_merge_inspect(finetune, tmp_path):
    base, tuned, changed = finetune
    d = json.loads(run_cli("pack", base, tuned, "--out", tmp_path / "a", "--name", "a", "--json", check=True).stdout)
    assert d["experts_per_layer"] == [1, 2, 1] and d["max_experts_per_layer"] == 2
    assert abs(d["sparsity_factor"] - (1 - (4 / 3) / 2)) < 1e-9
    ExpertConfig({1: [3, 4, 5], 2: [0, 15], 3: [7]}).save(tmp_path / "c.json")
    run_cli("pack", base, tuned, "--out", tmp_path / "b", "--name", "b", "--config", tmp_path / "c.json", check=True)
    s = json.loads(run_cli("inspect", tmp_path / "a", tmp_path / "b", "--json", check=True).stdout)
    # fragmentation: 2 adapters x 3 layers x E_max 3 = 18 padded rows for 4 + 6 experts
    assert (s["e_max"], s["total_experts"], s["padded_experts"]) == (3, 10, 18)
    assert abs(s["fragmentation_factor"] - 1.8) < 1e-9
    proc = run_cli("merge", base, tmp_path / "a", "--out", tmp_path / "a")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "output already exists" in proc.stderr
    run_cli("merge", base, tmp_path / "a", "--out", tmp_path / "m", check=True)
    _assert_same_checkpoint(tmp_path / "m", tuned)


def test_cli_relevance_and_select(world, tmp_path):
    run_cli("relevance", world.base_dir, world.data_file("translation", "train"), "--out", tmp_path / "s.json",
            "--max-examples", 40, check=True)
    rel = Relevance.load(tmp_path / "s.json")
    assert rel.examples == 40 and rel.moe_layers == [1, 2, 3]
    run_cli("select", tmp_path / "s.json", "--out", tmp_path / "c.json", "-p", "0.5", check=True)
    config = json.loads((tmp_path / "c.json").read_text())
    assert set(config) == {"experts", "shared_experts", "non_expert_modules"}
    for layer, ids in config["experts"].items():
        scores = rel.scores["gate"][int(layer)]
        assert sum(scores[e] for e in ids) >= 0.5 > sum(scores[e] for e in ids[:-1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    proc = run_cli("relevance", world.base_dir, bad, "--out", tmp_path / "x.json")
    assert proc.returncode == 1 and "bad.jsonl: line 1 needs string fields" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_task_data_is_json_lines(tmp_path):
    """Task data as other tools write it (raw non-ASCII, U+2028 inside a string, CRLF) reads whole; a line nested
    too deeply or holding a 5,000-digit number is one line naming the file; a FIFO is refused, not waited on."""
    import os

    from esftctl.jsonl import read_jsonl

    examples = [{"prompt": "a\u2028b", "completion": "ü"}, {"prompt": "c\u0085d", "completion": "e"}]
    good = tmp_path / "good.jsonl"
    good.write_bytes("\r\n".join(json.dumps(e, ensure_ascii=False) for e in examples).encode())
    assert list(read_jsonl(good)) == examples
    for line in ("[" * 100_000, '{"prompt": 1' + "1" * 5000 + "}"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(examples[0]) + "\n" + line + "\n")
        with pytest.raises(EsftError, match=r"bad.jsonl: line 2 is not valid JSON$"):
            list(read_jsonl(bad))
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(EsftError, match="fifo.jsonl: not a regular file"):
        list(read_jsonl(tmp_path / "fifo.jsonl"))


def test_task_data_is_read_a_line_at_a_time(tmp_path, monkeypatch):
    """Lines are read as they are taken (the examples past `score --max-examples` are never read, so a bad line
    there is not refused), each decoded alone; a line that is not UTF-8 or longer than the bound is refused by
    number, the bound checked before the line is read whole."""
    from itertools import islice

    import esftctl.jsonl as jsonl

    good = json.dumps({"prompt": "ü", "completion": "x"})
    data = tmp_path / "data.jsonl"
    data.write_bytes(f"{good}\n{good}\n".encode() + b"\xff\xfe\n")
    assert len(list(islice(jsonl.read_jsonl(data), 2))) == 2
    with pytest.raises(EsftError, match=r"data.jsonl: line 3 is not UTF-8 text$"):
        list(jsonl.read_jsonl(data))
    monkeypatch.setattr(jsonl, "MAX_LINE", len(good) + 1)  # the line and its newline
    data.write_text(f"{good}\n{good} \n")
    with pytest.raises(EsftError, match=rf"data.jsonl: line 2 is longer than {len(good) + 1:,} bytes$"):
        list(jsonl.read_jsonl(data))


def test_pack_compares_stored_bits(tiny_models, tmp_path, monkeypatch):
    """A change is a change of stored bits: -0.0 for 0.0 is one (torch.equal misses it), the same NaN in both
    is none (torch.equal sees a change); a tensor compared in several chunks shows a change in its last one."""
    from esftctl.formats.checkpoint import write_checkpoint
    from esftctl.pack import StoredBytes, changed_experts, changed_non_expert

    base = MoECheckpoint(tiny_models["deepseek_v2"])
    gate, down, last = (base.expert_tensor_names(l, e)[w] for l, e, w in ((1, 3, "gate"), (2, 5, "down"),
                                                                          (3, 7, "down")))
    zero, nan = base.read_tensor(gate).clone(), base.read_tensor(down).clone()
    zero[0, 0], nan[-1, -1] = 0.0, float("nan")
    ref = MoECheckpoint(write_checkpoint(base, tmp_path / "ref", {gate: zero, down: nan}))
    negative, moved = zero.clone(), base.read_tensor(last).clone()
    negative[0, 0] = -0.0
    moved.view(-1)[-1] += 1
    tuned = MoECheckpoint(write_checkpoint(ref, tmp_path / "tuned", {gate: negative, last: moved}))
    assert torch.equal(negative, zero) and not torch.equal(nan, nan)  # what value comparison would say
    monkeypatch.setattr(StoredBytes, "CHUNK", 1000)  # several chunks per tensor
    changed = changed_experts(ref, tuned)
    assert {l: ids for l, ids in changed.items() if ids} == {1: [3], 3: [7]}
    assert changed_non_expert(ref, tuned) == []


def test_esft_finetune_trains_only_selected_experts(world, tmp_path):
    from esftctl.jsonl import read_jsonl
    from esftctl.world.esft import esft_finetune

    # The two experts arithmetic uses most in layers 1 and 3: they surely get tokens, hence gradients.
    usage = world.expert_usage()["usage"]["arithmetic"]
    busiest = {l: sorted(range(16), key=lambda e: -usage[str(l)][e])[:2] for l in (1, 3)}
    config = ExpertConfig({l: sorted(ids) for l, ids in busiest.items()})
    examples = list(read_jsonl(world.data_file("arithmetic", "train")))[:64]
    esft_finetune(world.base_dir, config, examples, tmp_path / "tuned", steps=3, batch_size=8, lr=1e-2)
    base, tuned = MoECheckpoint(world.base_dir), MoECheckpoint(tmp_path / "tuned")
    from esftctl.pack import changed_experts, changed_non_expert

    assert changed_non_expert(base, tuned) == []
    changed = changed_experts(base, tuned)
    assert {l: ids for l, ids in changed.items() if ids} == config.experts


# ---- atomic outputs ---------------------------------------------------------------------------------------------

def _write(folder, text):
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("a", "b", "c"):
        (folder / name).write_text(f"{text} {name}")


def _content(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_output_that_appears_during_the_run_is_kept(tmp_path, kind):
    """Without --overwrite, a target that appeared while the command ran is left as it is (it used to be deleted)
    and the new output stays beside it, under the name the error gives."""
    from esftctl.atomic import atomic_dir, atomic_file

    out = tmp_path / "out"
    with pytest.raises(EsftError, match="output appeared while this command ran and was left as it is; the new "
                                        "output is at (.*)") as e:
        with (atomic_dir(out) if kind == "dir" else atomic_file(out, overwrite=False)) as tmp:
            _write(tmp, "new") if kind == "dir" else tmp.write_text("new")
            _write(out, "theirs") if kind == "dir" else out.write_text("theirs")
    kept = Path(str(e.value).rsplit("the new output is at ", 1)[1])
    if kind == "dir":
        assert _content(out) == {n: f"theirs {n}" for n in "abc"} and _content(kept) == {n: f"new {n}" for n in "abc"}
    else:
        assert out.read_text() == "theirs" and kept.read_text() == "new"


@pytest.mark.parametrize("renameat2", [True, False], ids=["exchange", "aside"])
def test_overwrite_interrupted_leaves_an_output_whole(tmp_path, monkeypatch, renameat2):
    """--overwrite swaps by renames: interrupted while the old output is deleted, the target holds the new one
    whole (it used to hold what was left of the old one), with renameat2's exchange and without it."""
    import shutil as real_shutil

    from esftctl import atomic

    if not renameat2:
        monkeypatch.setattr(atomic, "_renameat2", None)
    out = tmp_path / "out"
    _write(out, "old")

    def interrupted_rmtree(path, *args, **kwargs):
        if kwargs.get("ignore_errors"):
            return real_shutil.rmtree(path, *args, **kwargs)
        (Path(path) / "a").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_dir(out, overwrite=True) as tmp:
            _write(tmp, "new")
    assert _content(out) == {n: f"new {n}" for n in "abc"}


def test_outputs_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Every file and folder of an output reaches the disk under its temporary name, then the folder that names
    it after the rename (a power loss could leave a merged checkpoint or a JSON file empty under its name)."""
    import os

    from esftctl.jsonfile import write_json

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, os.path.lexists(tmp_path / "out.json")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_json(tmp_path / "out.json", {"a": 1})
    assert [(".out.json.tmp-" in Path(p).name, after) for p, after in synced] == [(True, False),
                                                                                    (False, True)]
    assert synced[1][0] == str(tmp_path)


def test_overwrite_onto_a_symlink_is_refused_before_any_work(finetune, tmp_path):
    from esftctl.atomic import check_output

    base, tuned, _ = finetune
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(EsftError, match="link: output is a symbolic link"):
        check_output(tmp_path / "link", overwrite=True, folder=True)
    proc = run_cli("pack", base, tuned, "--out", tmp_path / "link", "--name", "x", "--overwrite")
    assert proc.returncode == 1 and "output is a symbolic link" in proc.stderr
    assert (tmp_path / "link").is_symlink() and not list((tmp_path / "real").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_pack_leaves_no_parent_folders(finetune, tmp_path):
    """Parent folders of an output are created only when it is written, and removed if writing fails."""
    from esftctl.atomic import atomic_dir

    base, _, _ = finetune
    proc = run_cli("pack", base, base, "--out", tmp_path / "new" / "deep" / "bundle", "--name", "x")
    assert proc.returncode == 1 and "identical to the base" in proc.stderr
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "new2" / "deep" / "out") as tmp:
            _write(tmp, "half")
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists() and not (tmp_path / "new2").exists()


def test_sizes_in_tera():
    from esftctl.units import parse_bytes

    assert parse_bytes("2TiB") == 2 * 2**40 and parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes("12gib") == 12 * 2**30 and parse_bytes("1048576") == 2**20
    assert parse_bytes("0.1GB") == 100_000_000  # exact, not float-rounded
    with pytest.raises(EsftError, match="cannot read '3 PB' as a size"):
        parse_bytes("3 PB")
