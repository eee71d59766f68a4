"""Checkpoints whose experts are stacked as transformers 5 holds them in memory: one tensor per MoE layer and
projection (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), as tools that save a state
dict as it is write them. For every architecture in the table but GPT-OSS (whose checkpoints are fused already): the
stacked copy is transformers' own state dict of the hub checkpoint, and inspect, relevance, pack (a stacked fine-tune
against a per-expert base, and the reverse), merge, compress and decompress treat it as the same model. Except where
transformers holds a tensor in another dtype than the hub file: DeepSeek-V3's and GLM-4.5's router correction bias,
bf16 on the hub, float32 in memory. Such a state dict is another base to the hub checkpoint's bundles, and pack across
the two refuses in one line naming the tensor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from esftctl.consolidate import MAP_FILE, ExpertMap, consolidate, materialize
from esftctl.describe import describe_path
from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint, write_checkpoint
from esftctl.formats.store import compress, decompress
from esftctl.merge import merge
from esftctl.pack import pack
from esftctl.world.models import ARCHITECTURES
from esftctl.world.synthetic import synthetic_experts

STACKED = [a for a in ARCHITECTURES if a != "gpt_oss"]
WIDER_IN_MEMORY = {"deepseek_v3", "glm4_moe"}  # their routers' e_score_correction_bias: float32 in transformers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_expert(a, b) -> bool:
    return [w for w, _ in a.items()] == [w for w, _ in b.items()] and all(
        torch.equal(bits(x), bits(y)) for (_, x), (_, y) in zip(a.items(), b.items()))


def state_dict_copy(src: Path, out: Path) -> Path:
    """`src` saved as transformers 5 holds it in memory: its model's state dict, written as it is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    out.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json" and extra.is_file():
            shutil.copy(extra, out / extra.name)
    return out


@pytest.fixture(scope="module")
def layouts(tiny_models, tmp_path_factory):
    """{architecture: (hub base, stacked base, hub fine-tune, stacked fine-tune)}; the fine-tunes change 1-2 experts
    per MoE layer."""
    root = tmp_path_factory.mktemp("stacked")
    found = {}
    for arch in STACKED:
        base = MoECheckpoint(tiny_models[arch])
        counts = [1 + layer % 2 for layer in range(len(base.moe_layers))]
        experts = synthetic_experts(base, seed=5, experts_per_layer=counts, scale=2.0)
        tuned = write_checkpoint(base, root / f"{arch}-tuned", experts={(l, e): w for l, per in experts.items()
                                                                        for e, w in per.items()})
        found[arch] = (base.path, state_dict_copy(base.path, root / f"{arch}-base-stacked"), tuned,
                       state_dict_copy(tuned, root / f"{arch}-tuned-stacked"))
    return found


@pytest.mark.parametrize("arch", STACKED)
def test_a_stacked_checkpoint_holds_the_same_experts(layouts, arch):
    hub, stacked = (MoECheckpoint(p) for p in layouts[arch][:2])
    assert hub.arch.fused is None and stacked.arch.fused.kind == "stacked"
    assert stacked.expert_nbytes == hub.expert_nbytes and stacked.moe_layers == hub.moe_layers
    for layer in hub.moe_layers:
        assert all(same_expert(hub.read_expert(layer, e), stacked.read_expert(layer, e))
                   for e in range(hub.num_experts))
    differ = ("path", "num_tensors", "total_bytes")  # 2 tensors a MoE layer where the hub layout has 3 per expert
    described = {k: v for k, v in describe_path(stacked.path).items() if k not in differ}
    assert described == {k: v for k, v in describe_path(hub.path).items() if k not in differ}


@pytest.mark.parametrize("arch", STACKED)
def test_pack_across_layouts_gives_the_same_bundle(layouts, arch, tmp_path):
    """A stacked fine-tune packed against a per-expert base, the reverse, and both stacked: the bundle of the
    per-expert pair, expert for expert (the unchanged ones found byte-identical across the layouts)."""
    hub_base, stacked_base, hub_tuned, stacked_tuned = layouts[arch]
    want = pack(hub_base, hub_tuned, tmp_path / "hub", "t")
    reference = Bundle.open(tmp_path / "hub")
    pairs = [(hub_base, stacked_tuned), (stacked_base, hub_tuned), (stacked_base, stacked_tuned)]
    if arch in WIDER_IN_MEMORY:
        for k, (base, tuned) in enumerate(pairs[:2]):
            with pytest.raises(EsftError, match=r"e_score_correction_bias' is (F32|BF16) \[\d+\] here, (BF16|F32)"):
                pack(base, tuned, tmp_path / f"refused{k}", "t")
        pairs = pairs[2:]
    for k, (base, tuned) in enumerate(pairs):
        report = pack(base, tuned, tmp_path / f"b{k}", "t")
        assert report.experts == want.experts and not report.non_expert_changed
        assert Bundle.open(tmp_path / f"b{k}").manifest["tensors_sha256"] == reference.manifest["tensors_sha256"]


@pytest.mark.parametrize("arch", ["deepseek_v2", "mixtral"])
def test_merge_and_stores_keep_the_stacked_layout(layouts, arch, tmp_path):
    """merge writes the base's layout with the bundle's experts in their stacked rows and every other byte the
    base's; stacked variants consolidate and materialize; a store of a stacked model decodes back to its stacked
    tensors."""
    hub_base, stacked_base, hub_tuned, stacked_tuned = layouts[arch]
    pack(hub_base, hub_tuned, tmp_path / "hub-bundle", "t")
    with pytest.raises(EsftError, match="packed against a base without a tensor .* another layout"):
        merge(stacked_base, tmp_path / "hub-bundle", tmp_path / "refused")  # its record names the hub's tensors
    pack(stacked_base, hub_tuned, tmp_path / "bundle", "t")
    merged = merge(stacked_base, tmp_path / "bundle", tmp_path / "merged")
    assert load_file(merged / "model.safetensors").keys() == load_file(stacked_tuned / "model.safetensors").keys()
    a, b = load_file(merged / "model.safetensors"), load_file(stacked_tuned / "model.safetensors")
    assert all(torch.equal(bits(a[n]), bits(b[n])) for n in a)
    consolidate([stacked_base, stacked_tuned], tmp_path / "map", capacity=4)  # two stacked variants, one map
    owner = ExpertMap.load(tmp_path / "map" / MAP_FILE).owner
    variant = MoECheckpoint(materialize(tmp_path / "map", 1, tmp_path / "variant"))
    models = [MoECheckpoint(stacked_base), MoECheckpoint(stacked_tuned)]
    assert variant.arch.fused.kind == "stacked" and (owner >= 0).sum() == 4
    for li, layer in enumerate(variant.moe_layers):  # each position from its owner where loaded, else its own
        for e in range(variant.num_experts):
            source = models[owner[li, e] if owner[li, e] >= 0 else 1]
            assert same_expert(variant.read_expert(layer, e), source.read_expert(layer, e))
    compress(stacked_base, tmp_path / "store")
    decompress(tmp_path / "store", tmp_path / "back")
    back, base = load_file(tmp_path / "back" / "experts.safetensors"), load_file(stacked_base / "model.safetensors")
    assert back and all(n.endswith(("gate_up_proj", "down_proj")) and torch.equal(bits(t), bits(base[n]))
                        for n, t in back.items())


def test_serving_a_stacked_base_is_refused_before_vllm(layouts):
    """vLLM loads the hub layout: a stacked base is one line saying how to get one, before any engine starts."""
    from esftctl.serve import plan

    with pytest.raises(EsftError, match="stacked as transformers holds them in memory.*save_pretrained"):
        plan(layouts["qwen2_moe"][1])


@pytest.mark.parametrize("arch", STACKED)
def test_relevance_of_a_stacked_base_is_the_hub_checkpoints(layouts, arch):
    """`esftctl relevance` (and so `esftctl train`'s selection) scores the same experts on either layout: both load
    into the same transformers model."""
    from test_pipeline_routing import _relevance_of_ids

    hub, stacked, _, _ = layouts[arch]
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    a, b = (_relevance_of_ids(MoECheckpoint(p), ids) for p in (hub, stacked))
    assert a.keys() == b.keys() == {"token", "gate"}
    for metric in a:
        assert a[metric] == b[metric] and len(a[metric]) == len(MoECheckpoint(hub).moe_layers)
