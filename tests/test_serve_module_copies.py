"""Adapters that also train non-expert modules (ESFT's `non_expert_modules: true`): attention projections, norms
and routers, served per request. An ESFT adapter folder that changes them beside its routed experts is packed
(`--include-non-expert`) and served with two plain adapters and the base; every name answers as its model merged
and served alone by plain vLLM does. Its routed experts are one plain adapter's, so the two differ by the modules
alone, and its router is one of them: its tokens are routed by its own router; its embeddings embed its tokens, and its
output head gives its requests' logits; on DeepSeek-V2 its MLA attention takes its own kv_b_proj, which vLLM folds into
the attention op's weights. Then it is unloaded and loaded again at run time into the copy it left, and a second one is
refused while the only copy is held."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from conftest import engine_settings, server_args
from rich.console import Console
from test_formats_esft_adapter import write_adapter
from test_serve_adapters import make_adapters, prompts_of, random_base, reference, serve_concurrently
from test_serve_shared_experts import differ

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.merge import merge
from esftctl.pack import pack
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import load, request, status, status_table, unload

pytestmark = pytest.mark.vllm

# What the adapter changes: every module vLLM keeps outside its MoE op (MLA's kv_b_proj, folded into the attention
# op, included).
CHANGED = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.", "q_a_proj.",
           "q_b_proj.", "kv_a_proj_with_mqa.", "kv_b_proj.", "layernorm.weight", "mlp.gate.weight",
           "model.norm.weight", "embed_tokens.weight", "lm_head.weight")


def moved_modules(base: MoECheckpoint, *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The base's tensors that CHANGED names, each moved by `scale` x its spread."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in base.tensors:
        if base.is_routed_expert_tensor(name) or not any(c in name for c in CHANGED):
            continue
        t = base.read_tensor(name)
        spread = t.float().std() if t.numel() > 1 and t.float().std() > 0 else t.float().abs().mean()
        out[name] = (t.float() + scale * spread * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


def module_adapter(base_dir: Path, like: Path, root: Path, name: str, seed: int) -> Path:
    """An ESFT adapter folder (non_expert_modules: true: every non-expert tensor, the moved ones changed) with the
    routed experts of bundle `like`, packed into a bundle."""
    base, plain = MoECheckpoint(base_dir), Bundle.open(like)
    routed = {base.arch.expert_tensor(l, e, w): t for l, per in plain.read_experts().items()
              for e, ws in per.items() for w, t in ws.items()}
    shared = {n for n in base.tensors if any(base.arch.is_shared_expert_tensor(n, l) for l in base.moe_layers)}
    others = {n: base.read_tensor(n) for n in base.tensors if not base.is_routed_expert_tensor(n) and n not in shared}
    listed = {l: sorted(per) for l, per in plain.experts.items()}
    folder = write_adapter(root / f"{name}-esft", base, routed | others | moved_modules(base, seed=seed, scale=0.5),
                           {l: listed.get(l, []) for l in base.moe_layers}, non_expert=True)
    pack(base.path, folder, root / "bundles" / name, name, include_non_expert=True)
    return root / "bundles" / name


def served_exactly(architecture: str, world, tmp_path: Path, settings: dict, **options) -> None:
    base = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    prompts = prompts_of(world)[:4]
    bundles, merged = make_adapters(base, tmp_path, seed=60, prompts=prompts)
    del bundles["task2"], merged["task2"]
    bundles["tuned"] = module_adapter(base, bundles["task0"], tmp_path, "tuned", seed=61)
    changed = Bundle.open(bundles["tuned"]).non_expert_tensors
    assert all(any(c in n for n in changed) for c in ("mlp.gate.weight", "o_proj", "embed_tokens", "lm_head"))
    assert (architecture == "deepseek_v2") == any("kv_b_proj" in n for n in changed)
    merged["tuned"] = merge(base, bundles["tuned"], tmp_path / "merged" / "tuned")
    ref = reference({"base": base, **merged}, prompts, tmp_path, settings)
    assert differ(ref, "tuned", "task0"), "the modules change no answer: the test would prove nothing"
    spare = module_adapter(base, bundles["task1"], tmp_path, "spare", seed=62)
    serve_plan = plan(base, [f"{n}={p}" for n, p in bundles.items()], name="base", port=free_port(),
                      state_dir=tmp_path / "state", vllm_args=server_args(settings), **options)
    assert serve_plan.module_copies == 1 and set(serve_plan.copied_tensors) == set(changed)
    with Server(serve_plan) as server:
        server.wait_ready()
        url = serve_plan.url
        serve_concurrently(url, list(ref), prompts, ref)
        s = status(url)
        modules = {a["name"]: a["modules"] for a in s["adapters"]}
        assert modules["task0"] == modules["task1"] == 0 and modules["tuned"] > 0
        assert s["module_copies"] == 1 and s["module_copy_bytes"] > 0
        table = io.StringIO()
        Console(file=table, width=200).print(status_table(s))
        assert f"tuned +{modules['tuned']} modules" in table.getvalue()
        assert "module copies (1 of 1 held)" in table.getvalue()
        with pytest.raises(EsftError, match="no free module copy"):
            load(url, "spare", str(spare))
        unload(url, "tuned")
        load(url, "tuned", str(bundles["tuned"]))  # into the copy it left
        serve_concurrently(url, ["tuned", "task0"], prompts, ref)
        unload(url, "tuned")
        load(url, "spare", str(spare))  # the copy is free again
        assert request(url, "/v1/completions", {"model": "spare", "prompt": prompts[0], "max_tokens": 2})["choices"]


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_module_adapter_served_exactly(architecture, world, tmp_path):
    served_exactly(architecture, world, tmp_path, engine_settings())


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_module_adapter_with_cuda_graphs_served_exactly(architecture, world, tmp_path):
    """vLLM's compilation and CUDA graphs on the server and the reference alike."""
    served_exactly(architecture, world, tmp_path, engine_settings(graphs=True))

