"""`esftctl train`: task data to a bundle of the selected experts, trained alone; the rest of the model untouched.

On a tiny model of every architecture in the table (per-expert checkpoints, which transformers stacks in memory, and
GPT-OSS's fused ones with biases): the bundle holds exactly the configured experts, each changed; a merged model
differs from the base in those experts only. A run killed after a checkpoint and run again resumes and writes the same
bytes as an uninterrupted one. An FP8 base trains in bf16 and stores its experts quantized; packed examples give the
unpacked loss. Data lines of neither shape are refused naming the line;
chat lines are rendered with the base's chat template. Shared experts and non-expert modules train into bundles that
serve plans copies for, and a trained bundle is served exactly as its merged model (CPU build)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl, write_jsonl
from esftctl.merge import merge
from esftctl.train import TrainSettings, read_examples, train_adapter
from esftctl.world.models import ARCHITECTURES

QUICK = TrainSettings(steps=3, batch_size=4, lr=1e-2, save_every=0, eval_share=0.2)


@pytest.fixture
def data(world, tmp_path) -> Path:
    examples = list(read_jsonl(world.data_file(world.task_names[0], "train")))[:24]
    path = tmp_path / "train.jsonl"
    write_jsonl(path, examples)
    return path


def config(tmp_path: Path, experts: dict[int, list[int]]) -> Path:
    path = tmp_path / "experts.json"
    path.write_text(json.dumps({"experts": {str(l): e for l, e in experts.items()}, "shared_experts": False,
                                "non_expert_modules": False}))
    return path


def chosen(base: MoECheckpoint, data: Path) -> dict[int, list[int]]:
    """The two experts the data uses most in the first MoE layer, the one in the last, none elsewhere (used ones: an
    expert no token reaches gets no gradient and stays the base's)."""
    from esftctl.world.synthetic import experts_used_by

    used = experts_used_by(base.path, [e["prompt"] + e["completion"] for e in read_jsonl(data)])
    layers = base.moe_layers
    out = {l: [] for l in layers}
    out[layers[0]], out[layers[-1]] = sorted(used[layers[0]][:2]), used[layers[-1]][:1]
    return out


def random_base(architecture: str, world, root: Path) -> Path:
    from transformers import AutoTokenizer

    from esftctl.world.models import make_random_model

    return make_random_model(architecture, root / architecture, seed=3,
                             tokenizer=AutoTokenizer.from_pretrained(world.tokenizer_dir))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_only_the_selected_experts_are_trained(architecture, world, data, tmp_path):
    base_dir = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    base = MoECheckpoint(base_dir)
    experts = chosen(base, data)
    report = train_adapter(base_dir, data, tmp_path / "bundle", "task", QUICK, config_file=config(tmp_path, experts))
    bundle = Bundle.open(tmp_path / "bundle")
    assert bundle.experts == {l: e for l, e in experts.items() if e}
    assert report.trained_parameters == expert_parameters(base, experts)
    assert len(report.losses) == 3 and report.eval_examples == 5 and report.eval_loss is not None
    for layer, ids in bundle.experts.items():
        for e in ids:  # each trained expert moved from the base's
            got, was = bundle.read_expert(layer, e), base.read_expert(layer, e)
            assert any(not torch.equal(g, w) for (_, g), (_, w) in zip(got.items(), was.items())), (layer, e)
    merged = MoECheckpoint(merge(base_dir, tmp_path / "bundle", tmp_path / "merged"))
    for layer in base.moe_layers:  # the merged model is the base everywhere else
        for e in set(range(base.num_experts)) - set(experts[layer]):
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(merged.read_expert(layer, e).items(),
                                                                  base.read_expert(layer, e).items()))


def test_a_resumed_run_equals_an_uninterrupted_one(world, data, tmp_path):
    settings = TrainSettings(steps=4, batch_size=4, lr=1e-2, save_every=2, eval_share=0.2)
    cfg = config(tmp_path, chosen(MoECheckpoint(world.base_dir), data))
    train_adapter(world.base_dir, data, tmp_path / "whole", "task", settings, config_file=cfg)

    def killed(step, loss, tps):
        if step == 2:  # after the checkpoint at step 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_adapter(world.base_dir, data, tmp_path / "resumed", "task", settings, config_file=cfg, on_step=killed)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "resumed.ckpt" / "state.json").is_file()
    report = train_adapter(world.base_dir, data, tmp_path / "resumed", "task", settings, config_file=cfg)
    assert report.resumed_from == 2 and len(report.losses) == 2
    assert not (tmp_path / "resumed.ckpt").exists()  # removed once the bundle is written
    assert (tmp_path / "resumed" / "experts.safetensors").read_bytes() == \
        (tmp_path / "whole" / "experts.safetensors").read_bytes()
    # a checkpoint of another run is refused, not resumed
    (tmp_path / "other.ckpt").mkdir()
    (tmp_path / "other.ckpt" / "state.json").write_text(json.dumps({"identity": {}, "step": 1}))
    (tmp_path / "other.ckpt" / "state.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}" + b" " * 6)
    with pytest.raises(EsftError, match="the checkpoint is of another run"):
        train_adapter(world.base_dir, data, tmp_path / "other", "task", settings, config_file=cfg)


def test_the_command_selects_by_relevance_and_reports(world, data, tmp_path):
    out = run_cli("train", world.base_dir, data, "--out", tmp_path / "b", "--name", "task", "--steps", "2",
                  "--batch-size", "4", "-p", "0.3", "--save-every", "0", "--json", check=True)
    report = json.loads(out.stdout)
    assert report["steps"] == 2 and report["experts_per_layer"] and report["trained_parameters"] > 0
    assert Bundle.open(tmp_path / "b").experts == {int(l): Bundle.open(tmp_path / "b").experts[int(l)]
                                                   for l in report["experts_per_layer"]}


def test_two_processes_train_what_one_does(world, data, tmp_path):
    """torchrun with two processes (gloo on the CPU, NCCL on GPUs): FSDP2 shards the model, each process trains on half
    of every batch with its loss weighted by its share of the loss tokens, and the bundle holds the rows one process
    trains on the whole batches (the same gradients but for the order of float sums), the shared experts' tensors
    included; a checkpoint is gathered and written on the way."""
    import subprocess
    import sys

    examples = list(read_jsonl(data))  # completions of 1 to 5 repeats: the processes' shares differ in loss tokens
    write_jsonl(data, [e | {"completion": e["completion"] * (1 + i % 5)} for i, e in enumerate(examples)])
    experts = chosen(MoECheckpoint(world.base_dir), data)
    path = config(tmp_path, experts)
    path.write_text(path.read_text().replace('"shared_experts": false', '"shared_experts": true'))
    settings = TrainSettings(steps=4, batch_size=4, lr=1e-2, save_every=2, eval_share=0.2)
    train_adapter(world.base_dir, data, tmp_path / "one", "task", settings, config_file=path)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "esftctl",
                           "train", world.base_dir, data, "--out", tmp_path / "two", "--name", "task", "--config",
                           path, "--steps", "4", "--batch-size", "4", "--lr", "1e-2", "--save-every", "2",
                           "--eval-share", "0.2", "--json"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["steps"] == 4  # one report: the first process's
    assert not (tmp_path / "two.ckpt").exists()
    one, two = Bundle.open(tmp_path / "one"), Bundle.open(tmp_path / "two")
    assert one.experts == two.experts and one.non_expert_tensors == two.non_expert_tensors
    base = MoECheckpoint(world.base_dir)
    for layer, ids in one.experts.items():
        for e in ids:
            for (_, a), (_, b), (_, w) in zip(one.read_expert(layer, e).items(), two.read_expert(layer, e).items(),
                                              base.read_expert(layer, e).items()):
                close(a, b, w, (layer, e))
    for name in one.non_expert_tensors:
        tensors = [b.read_tensor("non_expert." + name) for b in (one, two)]
        close(*tensors, base.read_tensor(name), name)


def test_two_processes_resume_from_their_checkpoint(world, data, tmp_path):
    """A two-process run stopped after a checkpoint (its masters and AdamW's moments gathered from the shards) and run
    again resumes from it, sharded again, and writes the bytes of an uninterrupted two-process run; the experts come
    from relevance and selection on the first process."""
    import subprocess
    import sys
    import time

    def command(out: str) -> list:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "esftctl", "train",
                world.base_dir, data, "--out", tmp_path / out, "--name", "task", "-p", "0.3", "--steps", "40",
                "--batch-size", "4", "--lr", "1e-2", "--save-every", "2", "--eval-share", "0.2"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command("whole"), check=True, capture_output=True, env=env)
    run = subprocess.Popen(command("resumed"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                           start_new_session=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "resumed.ckpt" / "state.json").is_file() and run.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.05)
    kill_every_process_of(str(tmp_path / "resumed"))  # torchrun and its workers, which run in sessions of their own
    run.wait()
    assert not (tmp_path / "resumed").exists(), "the run ended before it was stopped: the test proves nothing"
    step = json.loads((tmp_path / "resumed.ckpt" / "state.json").read_text())["step"]
    proc = subprocess.run(command("resumed") + ["--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["resumed_from"] >= step > 0
    assert (tmp_path / "resumed" / "experts.safetensors").read_bytes() == \
        (tmp_path / "whole" / "experts.safetensors").read_bytes()


def kill_every_process_of(marker: str) -> None:
    """SIGKILL every process whose command line holds `marker`."""
    import signal

    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def close(one: torch.Tensor, two: torch.Tensor, base: torch.Tensor, what) -> None:
    """Two runs' tensors (bf16, as bundles store them) moved alike from the base's: they differ in a few roundings
    (under 1% of their values, a last bit each), by far less than either moved."""
    moved, apart = (one.float() - base.float()).abs().mean(), (one.float() - two.float()).abs().mean()
    assert moved > 0 and apart <= 1e-3 * moved and (one != two).float().mean() < 0.01, (what, float(moved),
                                                                                        float(apart))


class ChatTokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                            else "")


def test_data_lines_read_or_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    assert read_examples(path, ChatTokenizer()) == [{"prompt": "a", "completion": "b"},
                                                     {"prompt": "<user>hi<assistant>", "completion": "yo"}]
    no_template = type("T", (), {"chat_template": None})()
    with pytest.raises(EsftError, match="line 2 holds chat messages, but the base's tokenizer has no chat template"):
        read_examples(path, no_template)
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(EsftError, match="line 2 needs string fields 'prompt' and 'completion', or 'messages'"):
        read_examples(path, ChatTokenizer())
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}, {"role": "user",
                                                                                     "content": "y"}]}) + "\n")
    with pytest.raises(EsftError, match="line 1: 'messages' must be .* ending with the assistant's turn"):
        read_examples(path, ChatTokenizer())


def train_with_switch(switch: str, architecture: str, world, data: Path, tmp_path: Path):
    """(base, experts, report, bundle) of a quick run whose expert config sets ESFT's `switch` to true."""
    base_dir = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    base = MoECheckpoint(base_dir)
    experts = chosen(base, data)
    path = config(tmp_path, experts)
    path.write_text(path.read_text().replace(f'"{switch}": false', f'"{switch}": true'))
    report = train_adapter(base_dir, data, tmp_path / "bundle", "task", QUICK, config_file=path)
    return base, experts, report, Bundle.open(tmp_path / "bundle")


def expert_parameters(base: MoECheckpoint, experts: dict[int, list[int]]) -> int:
    return sum(map(len, experts.values())) * sum(t.numel() for _, t in base.read_expert(base.moe_layers[0], 0).items())


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_shared_experts_trained_into_a_servable_bundle(architecture, world, data, tmp_path):
    """ESFT's shared_experts: true: every MoE layer's shared experts (Qwen2-MoE's gate too) train beside the selected
    experts and travel as the bundle's non-expert tensors, which `esftctl serve` plans a shared-expert copy for."""
    from esftctl.serve import free_port, plan

    base, experts, report, bundle = train_with_switch("shared_experts", architecture, world, data, tmp_path)
    shared = sorted(n for n in base.tensors if any(base.arch.is_shared_expert_tensor(n, l) for l in base.moe_layers))
    assert bundle.non_expert_tensors == shared and bundle.experts == {l: e for l, e in experts.items() if e}
    assert report.trained_parameters == sum(math.prod(base.tensors[n].shape) for n in shared) + expert_parameters(
        base, experts)
    moved = [n for n in shared if not torch.equal(bundle.read_tensor("non_expert." + n), base.read_tensor(n))]
    assert moved, "no shared-expert tensor moved"
    serve_plan = plan(base.path, [f"task={tmp_path / 'bundle'}"], port=free_port(), state_dir=tmp_path / "state")
    assert serve_plan.shared_copies == 1 and serve_plan.module_copies == 0


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_non_expert_modules_trained_into_a_servable_bundle(architecture, world, data, tmp_path):
    """ESFT's non_expert_modules: true: every tensor outside the experts (attention, norms, routers, the dense MLP,
    embeddings and head) trains beside the selected experts, under the checkpoint's names, and the bundle carries
    them; `esftctl serve` plans module copies for it. The shared experts stay the base's (their own switch)."""
    from esftctl.serve import free_port, plan

    base, experts, report, bundle = train_with_switch("non_expert_modules", architecture, world, data, tmp_path)
    shared = {n for n in base.tensors if any(base.arch.is_shared_expert_tensor(n, l) for l in base.moe_layers)}
    modules = sorted(n for n in base.tensors if not base.is_routed_expert_tensor(n) and n not in shared)
    assert bundle.non_expert_tensors == modules and shared
    assert any(n.endswith("embed_tokens.weight") for n in modules) and any("self_attn" in n for n in modules)
    assert report.trained_parameters == sum(math.prod(base.tensors[n].shape) for n in modules) + expert_parameters(
        base, experts)
    moved = {n for n in modules if not torch.equal(bundle.read_tensor("non_expert." + n), base.read_tensor(n))}
    assert any("self_attn" in n for n in moved) and any(n.endswith("lm_head.weight") for n in moved)
    if architecture == "qwen2_moe":  # (MLA's kv_b_proj, which DeepSeek-V2's bundle changes, is refused at start)
        serve_plan = plan(base.path, [f"task={tmp_path / 'bundle'}"], port=free_port(), state_dir=tmp_path / "state")
        assert serve_plan.module_copies == 1 and serve_plan.shared_copies == 0


def test_non_expert_modules_of_a_tied_base_are_refused(world, data, tmp_path):
    """A base whose head is its embedding matrix: training either as a tensor of its own would part them."""
    from transformers import AutoTokenizer

    from esftctl.world.models import make_random_model

    base_dir = make_random_model("qwen2_moe", tmp_path / "tied", seed=3, tie_word_embeddings=True,
                                 tokenizer=AutoTokenizer.from_pretrained(world.tokenizer_dir))
    with pytest.raises(EsftError, match="ties its output head to its embeddings"):
        train_adapter(base_dir, data, tmp_path / "bundle", "task", QUICK, non_expert_modules=True,
                      config_file=config(tmp_path, chosen(MoECheckpoint(base_dir), data)))
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen3_moe"])
def test_packed_examples_give_the_unpacked_loss(architecture, world, data):
    """Packing short examples into rows (own positions, a block-diagonal mask, no label across a boundary) changes
    the padding, not the objective: the loss and the gradient of a batch are the unpacked batch's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esftctl.train import _encode_counted, _encode_packed

    base_dir = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, Path(
        data).parent)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    batch = read_examples(data, tokenizer)[:8]
    plain, tokens = _encode_counted(tokenizer, batch)
    longest = int(plain["attention_mask"].sum(dim=1).max())
    packed, packed_tokens = _encode_packed(tokenizer, batch, 3 * longest, torch.float32)
    assert packed_tokens == tokens and packed["input_ids"].shape[0] < len(batch)  # fewer rows, same tokens
    assert int((packed["labels"] != -100).sum()) == int((plain["labels"][:, 1:] != -100).sum())

    def loss_and_grad(enc):
        model.zero_grad()
        loss = model(**enc).loss
        loss.backward()
        return loss.detach(), model.get_input_embeddings().weight.grad.clone()

    (a, ga), (b, gb) = loss_and_grad(plain), loss_and_grad(packed)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float((ga - gb).norm() / ga.norm()) < 1e-4  # float32's rounding in other sums, not another gradient


def test_packing_is_refused_where_a_mask_cannot_separate_examples(world, data, tmp_path):
    base_dir = random_base("qwen3_next", world, tmp_path)
    settings = TrainSettings(**{**QUICK.__dict__, "pack_length": 256})
    with pytest.raises(EsftError, match="linear_attention layers"):
        train_adapter(base_dir, data, tmp_path / "bundle", "task", settings,
                      config_file=config(tmp_path, chosen(MoECheckpoint(base_dir), data)))


def test_an_fp8_base_trains_its_experts_in_bf16_and_stores_them_quantized(world, data, tmp_path):
    """An FP8 base (block-quantized projections) loads dequantized; relevance selects on it, the selected experts train
    in bf16 and the bundle holds them quantized with the base's block scheme, as `pack` stores a bf16 fine-tune of it:
    a bundle of that base, which serve plans for. Training its FP8 attention instead is refused."""
    from test_formats_fp8 import quantize_model

    from esftctl.serve import free_port, plan

    base_dir = quantize_model(random_base("qwen3_moe", world, tmp_path), tmp_path / "fp8")
    base = MoECheckpoint(base_dir, fp8=True)
    assert base.fp8 is not None
    report = train_adapter(base_dir, data, tmp_path / "bundle", "task", QUICK, threshold=0.3)
    bundle = Bundle.open(tmp_path / "bundle")
    bundle.check_base(base)
    assert bundle.fp8 == base.fp8 and bundle.manifest["dtype"] == "F8_E4M3"
    assert {l: len(e) for l, e in bundle.experts.items()} == report.experts_per_layer
    moved = 0
    for layer, ids in bundle.experts.items():
        for e in ids:
            mine, theirs = bundle.read_expert(layer, e), base.read_expert(layer, e)
            for w in ("gate", "up", "down"):
                q, s = getattr(mine, w), getattr(mine, w + "_scale")
                assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
                requantized = base.fp8.quantize(base.fp8.dequantize(q, s, torch.bfloat16))
                assert torch.equal(requantized[1], s)  # the bytes a quantization of bf16 weights gives
                moved += not torch.equal(q.view(torch.uint8), getattr(theirs, w).view(torch.uint8))
    assert moved
    serve_plan = plan(base_dir, [f"task={tmp_path / 'bundle'}"], port=free_port(), state_dir=tmp_path / "state")
    assert list(serve_plan.adapters) == ["task"] and serve_plan.module_copies == 0
    with pytest.raises(EsftError, match="is an FP8 weight of this base"):
        train_adapter(base_dir, data, tmp_path / "b2", "task", QUICK, threshold=0.3, non_expert_modules=True)


def test_gradient_checkpointing_trains_the_same_rows(world, data, tmp_path):
    """Recomputing activations in the backward pass changes the memory, not the arithmetic: the same bytes."""
    cfg = config(tmp_path, chosen(MoECheckpoint(world.base_dir), data))
    train_adapter(world.base_dir, data, tmp_path / "plain", "task", QUICK, config_file=cfg)
    again = TrainSettings(**{**QUICK.__dict__, "gradient_checkpointing": True})
    train_adapter(world.base_dir, data, tmp_path / "ckpt", "task", again, config_file=cfg)
    assert (tmp_path / "ckpt" / "experts.safetensors").read_bytes() == \
        (tmp_path / "plain" / "experts.safetensors").read_bytes()



@pytest.mark.vllm
def test_a_trained_bundle_serves_as_its_merged_model(world, tmp_path):
    """What `esftctl train` writes (here with the shared experts) is served beside the base exactly as its merged
    model is served alone by plain vLLM, CPU build."""
    from conftest import engine_settings, server_args
    from test_serve_adapters import prompts_of, reference, serve_concurrently

    from esftctl.serve import Server, free_port, plan

    task = world.task_names[0]
    data = tmp_path / "train.jsonl"
    write_jsonl(data, list(read_jsonl(world.data_file(task, "train")))[:200])
    settings = TrainSettings(steps=20, batch_size=16, lr=1e-2, save_every=0, eval_share=0.0)
    train_adapter(world.base_dir, data, tmp_path / "bundle", task, settings, threshold=0.5, shared_experts=True)
    merged = merge(world.base_dir, tmp_path / "bundle", tmp_path / "merged")
    prompts = prompts_of(world)[:4]
    ref = reference({"base": world.base_dir, task: merged}, prompts, tmp_path, engine_settings())
    assert [r["token_ids"] for r in ref[task]] != [r["token_ids"] for r in ref["base"]], "training changed nothing"
    serve_plan = plan(world.base_dir, [f"{task}={tmp_path / 'bundle'}"], name="base", port=free_port(),
                      state_dir=tmp_path / "state", vllm_args=server_args(engine_settings()))
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), prompts, ref)
