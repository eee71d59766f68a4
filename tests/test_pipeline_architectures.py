"""The offline pipeline on the architectures of issue 31 (OLMoE, GLM-4.5 MoE, DeepSeek-V3, GPT-OSS, Qwen3-Next), as
a user runs it: inspect, relevance, select, pack from a full fine-tune and from an ESFT adapter folder, merge, compress
and decompress, consolidate and materialize; each output checked against what it must equal. GPT-OSS stores a
layer's experts fused (gate and up interleaved, with biases): read against transformers' own parameters, its
adapter folders hold whole fused tensors, and layouts esftctl does not know are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_formats_esft_adapter import assert_nothing_written, cli, manifest, write_adapter

from esftctl.consolidate import ExpertMap
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
from esftctl.jsonl import read_jsonl
from esftctl.world.synthetic import write_synthetic_variant
from esftctl.world.tasks import TASKS

NEW = ["olmoe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next"]


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
    tuned = write_checkpoint(base, tmp_path / "tuned", experts={(l, e): w for l, per in experts.items()
                                                                 for e, w in per.items()})
    assert cli(capsys, "pack", base_dir, tuned, "--out", tmp_path / "bundle", "--name", "task", "--config",
               tmp_path / "experts.json")[0] == 0
    replaced = {(l, e): w for l, per in experts.items() for e, w in per.items()}
    adapter = write_adapter(tmp_path / "adapter", base, expert_replacements(base, replaced), chosen)
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


def test_gpt_oss_experts_and_routing_are_read_as_transformers_has_them(tiny_models):
    """Expert e of a layer: gate and up the even and odd columns of gate_up_proj[e] (x @ W), transposed, their
    biases alike, down transposed; a token's experts the top-k of router logits W h + b; written back in place."""
    from test_pipeline_routing import _relevance_of_ids
    from transformers import AutoModelForCausalLM

    from esftctl.relevance import scoring_device

    ckpt = MoECheckpoint(tiny_models["gpt_oss"])
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    for layer in ckpt.moe_layers:
        mlp = model.model.layers[layer].mlp
        for e in range(ckpt.num_experts):
            w, experts = ckpt.read_expert(layer, e), mlp.experts
            assert torch.equal(w.gate.float(), experts.gate_up_proj[e][:, 0::2].T)  # x @ gate_up: x @ gate.T
            assert torch.equal(w.up.float(), experts.gate_up_proj[e][:, 1::2].T)
            assert torch.equal(w.down.float(), experts.down_proj[e].T)
            assert torch.equal(w.gate_bias.float(), experts.gate_up_proj_bias[e][0::2])
            assert torch.equal(w.up_bias.float(), experts.gate_up_proj_bias[e][1::2])
            assert torch.equal(w.down_bias.float(), experts.down_proj_bias[e])
    picks, device = {}, scoring_device()  # where compute_relevance routes: near-ties fall by device
    for layer in ckpt.moe_layers:
        def hook(module, args, out, layer=layer):
            picks[layer] = torch.bincount(out[2].reshape(-1), minlength=ckpt.num_experts).cpu()

        model.model.layers[layer].mlp.router.register_forward_hook(hook)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.to(device)(input_ids=ids.to(device))
    rel = _relevance_of_ids(ckpt, ids)
    for layer in ckpt.moe_layers:
        assert rel["token"][layer] == (picks[layer].double() / (40 * ckpt.top_k)).tolist(), layer
    # written back: the one expert changes, every other byte of the fused tensors stays
    w = ckpt.read_expert(2, 5)
    new = ExpertWeights(*(t + 1 for _, t in w.items()))
    tensors = expert_replacements(ckpt, {(2, 5): new})
    assert sorted(tensors) == sorted(ckpt.routed_tensor_names(2))
    for name, t in tensors.items():
        old = ckpt.read_tensor(name)
        assert torch.equal(t[:5], old[:5]) and torch.equal(t[6:], old[6:]) and not torch.equal(t[5], old[5])


def test_unknown_expert_layouts_and_mxfp4_are_refused(tiny_models, tmp_path, capsys):
    """Qwen3-MoE experts half stacked (down as transformers holds it in memory, gate and up per expert) and GPT-OSS
    experts saved one tensor per expert: one line naming a tensor of the layout, exit 1, nothing written (wholly
    stacked experts are read: tests/test_formats_stacked.py). GPT-OSS in MXFP4 (its published
    checkpoints): inspect names the method, pack refuses it. Serving GPT-OSS adapters is refused before vLLM."""
    from safetensors.torch import save_file

    def variant(arch: str, out, change) -> object:
        ckpt = MoECheckpoint(tiny_models[arch])
        tensors = change({n: ckpt.read_tensor(n) for n in ckpt.tensors})
        out.mkdir()
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text((ckpt.path / "config.json").read_text())
        return out

    def half_fused_qwen3(t):  # down stacked as transformers holds it, gate and up still one tensor per expert
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts."
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(16)])
        return t

    def split_gpt_oss(t):
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts."
            down = t.pop(p + "down_proj")
            for e in range(8):
                t[f"{p}{e}.down_proj.weight"] = down[e].T.contiguous()
        return t

    def mxfp4(t):
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts."
            for name in ("gate_up_proj", "down_proj"):
                w = t.pop(p + name)
                t[p + name + "_blocks"] = torch.zeros(w.shape[0], w.shape[2], w.shape[1] // 32, 16, dtype=torch.uint8)
                t[p + name + "_scales"] = torch.zeros(w.shape[0], w.shape[2], w.shape[1] // 32, dtype=torch.uint8)
        return t

    cases = [("qwen3_moe", variant("qwen3_moe", tmp_path / "q", half_fused_qwen3), "experts of layer 0 are stored as "
              "'model.layers.0.mlp.experts.down_proj' [16, 256, 128], a layout esftctl does not read for qwen3_moe"),
             ("gpt_oss", variant("gpt_oss", tmp_path / "g", split_gpt_oss), "experts of layer 0 are stored as "
              "'model.layers.0.mlp.experts.0.down_proj.weight' [256, 192], a layout esftctl does not read for gpt_oss")]
    for arch, model, message in cases:
        code, err = cli(capsys, "pack", model, tiny_models[arch], "--out", tmp_path / "b", "--name", "x")
        assert code == 1 and err.count("\n") == 1 and message in err, err
        assert_nothing_written(tmp_path, tmp_path / "b")

    quantized = variant("gpt_oss", tmp_path / "mx", mxfp4)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    described = json.loads(run_cli("inspect", quantized, "--json", check=True).stdout)
    assert described["quantization"] == {"method": "mxfp4", "source": "config", "expert_dtypes": ["BF16", "U8"],
                                         "scale_tensors": 16}
    code, err = cli(capsys, "pack", quantized, tiny_models["gpt_oss"], "--out", tmp_path / "b", "--name", "x")
    assert code == 1 and err.count("\n") == 1 and "experts quantized with mxfp4 (expert tensors BF16, U8)" in err

    # served with adapters (tests/test_serve_adapters.py), but not paged: the pager moves weight rows, not bias rows
    code, err = cli(capsys, "serve", tiny_models["gpt_oss"], "--paging-window", "1")
    assert code == 1 and err.count("\n") == 1 and "--paging-window with gpt_oss is not supported yet" in err


def test_gpt_oss_export_needs_the_base_and_round_trips(tiny_models, tmp_path, capsys):
    from esftctl.world.synthetic import write_synthetic_adapter

    base = tiny_models["gpt_oss"]
    write_synthetic_adapter(base, tmp_path / "bundle", "task", seed=2, experts_per_layer=3)
    code, err = cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--out", tmp_path / "esft")
    assert code == 1 and "gpt_oss keeps a layer's experts in one tensor per projection" in err
    assert_nothing_written(tmp_path, tmp_path / "esft")
    assert cli(capsys, "export", tmp_path / "bundle", "--format", "esft", "--base", base, "--out",
               tmp_path / "esft")[0] == 0
    assert cli(capsys, "pack", base, tmp_path / "esft", "--out", tmp_path / "again", "--name", "task")[0] == 0
    assert manifest(tmp_path / "again") == manifest(tmp_path / "bundle")
    assert Bundle.open(tmp_path / "bundle").weights == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]


def test_gpt_oss_experts_converted_to_vllms_rows(tiny_models):
    """The rows esftctl writes for a GPT-OSS expert are what vLLM 0.32's loader makes of the checkpoint (gpt_oss.py,
    bf16: w13_weight = gate_up_proj permuted to [E, 2I, H], gate and up left interleaved; w13_bias = gate_up_proj_bias;
    w2_weight = down_proj permuted to [E, H, I]; w2_bias = down_proj_bias), before the kernel's own processing."""
    from esftctl.runtime.moe_layer import stack_experts
    from esftctl.runtime.vllm.model import interleave_gate_up

    base = MoECheckpoint(tiny_models["gpt_oss"])
    tensors = load_file(str(tiny_models["gpt_oss"] / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    for e in (0, 5):
        w13, w2, b13, b2 = stack_experts([base.read_expert(1, e)])
        assert torch.equal(interleave_gate_up(w13)[0], tensors[p + "gate_up_proj"][e].T)
        assert torch.equal(interleave_gate_up(b13)[0], tensors[p + "gate_up_proj_bias"][e])
        assert torch.equal(w2[0], tensors[p + "down_proj"][e].T)
        assert torch.equal(b2[0], tensors[p + "down_proj_bias"][e])
