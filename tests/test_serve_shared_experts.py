"""Adapters that also train the shared experts (ESFT's `shared_experts: true`), served per request: an ESFT adapter
folder that changes a layer's shared experts beside its routed ones is packed (`--include-non-expert`) and served
with two plain adapters and the base, and every name answers as its model merged and served alone by plain vLLM
does. Its routed experts are those of one of the plain adapters, so the two differ by the shared experts alone: a
server that gave its tokens the base's shared experts would answer as that plain adapter does, not as its merged
model. Then the shared adapter is unloaded and loaded again at run time into the copy it left, and a second one is
refused while the only copy is held."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from conftest import engine_settings, server_args
from rich.console import Console
from test_formats_esft_adapter import write_adapter
from test_serve_adapters import (
    make_adapters,
    prompts_of,
    random_base,
    reference,
    serve_concurrently,
)

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.merge import merge
from esftctl.pack import pack
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import load, request, status, status_table, unload

pytestmark = pytest.mark.vllm


def shared_tensors(base: MoECheckpoint, *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """Every MoE layer's shared-expert tensors (Qwen2-MoE's gate too), each moved by `scale` x its std."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in base.tensors:
        if any(base.arch.is_shared_expert_tensor(name, layer) for layer in base.moe_layers):
            t = base.read_tensor(name)
            spread = t.float().std() if t.numel() > 1 else t.float().abs().mean()
            out[name] = (t.float() + scale * spread * torch.randn(t.shape, generator=g)).to(t.dtype)
    assert out, "the base has no shared experts"
    return out


def shared_adapter(base_dir: Path, like: Path, root: Path, name: str, seed: int) -> Path:
    """An ESFT adapter folder (shared_experts: true) with the routed experts of bundle `like` and its own shared
    experts, packed into a bundle."""
    base, plain = MoECheckpoint(base_dir), Bundle.open(like)
    routed = {base.arch.expert_tensor(l, e, w): t for l, per in plain.read_experts().items()
              for e, ws in per.items() for w, t in ws.items()}
    listed = {l: sorted(per) for l, per in plain.experts.items()}
    folder = write_adapter(root / f"{name}-esft", base, routed | shared_tensors(base, seed=seed, scale=4.0),
                           {l: listed.get(l, []) for l in base.moe_layers}, shared=True)
    pack(base.path, folder, root / "bundles" / name, name, include_non_expert=True)
    return root / "bundles" / name


def differ(ref: dict, a: str, b: str) -> bool:
    return [r["token_ids"] for r in ref[a]] != [r["token_ids"] for r in ref[b]]


def served_exactly(architecture: str, world, tmp_path: Path, settings: dict, **options) -> None:
    base = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    prompts = prompts_of(world)[:4]
    bundles, merged = make_adapters(base, tmp_path, seed=40, prompts=prompts)
    del bundles["task2"], merged["task2"]
    bundles["shared"] = shared_adapter(base, bundles["task0"], tmp_path, "shared", seed=41)
    assert Bundle.open(bundles["shared"]).non_expert_tensors
    merged["shared"] = merge(base, bundles["shared"], tmp_path / "merged" / "shared")
    ref = reference({"base": base, **merged}, prompts, tmp_path, settings)
    assert differ(ref, "shared", "task0"), "the shared experts change no answer: the test would prove nothing"
    assert differ(ref, "task0", "base")
    # a second shared adapter, to be refused while the one copy is held
    spare = shared_adapter(base, bundles["task1"], tmp_path, "spare", seed=42)
    serve_plan = plan(base, [f"{n}={p}" for n, p in bundles.items()], name="base", port=free_port(),
                      state_dir=tmp_path / "state", vllm_args=server_args(settings), **options)
    assert serve_plan.shared_copies == 1
    with Server(serve_plan) as server:
        server.wait_ready()
        url = serve_plan.url
        serve_concurrently(url, list(ref), prompts, ref)
        s = status(url)
        layers = {a["name"]: a["shared_layers"] for a in s["adapters"]}
        assert layers == {"task0": 0, "task1": 0, "shared": len(s["moe_layers"])}
        assert s["shared_copies"] == 1 and s["shared_copy_bytes"] > 0
        table = io.StringIO()
        Console(file=table, width=200).print(status_table(s))
        assert f"shared +shared ({len(s['moe_layers'])} layers)" in table.getvalue()
        assert "shared-expert copies (1 of 1 held)" in table.getvalue()
        with pytest.raises(EsftError, match="no free shared-expert copy"):
            load(url, "spare", str(spare))
        unload(url, "shared")
        load(url, "shared", str(bundles["shared"]))  # into the copy it left
        serve_concurrently(url, ["shared", "task0"], prompts, ref)
        unload(url, "shared")
        load(url, "spare", str(spare))  # the copy is free again
        assert {a["name"]: a["shared_layers"] for a in status(url)["adapters"]}["spare"] == len(s["moe_layers"])
        assert request(url, "/v1/completions", {"model": "spare", "prompt": prompts[0], "max_tokens": 2})["choices"]


@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_shared_expert_adapter_served_exactly(architecture, world, tmp_path):
    served_exactly(architecture, world, tmp_path, engine_settings())


def test_shared_expert_adapter_paged_served_exactly(world, tmp_path):
    """Paged: the routed experts come through one layer's block; the shared experts' copies stay resident."""
    served_exactly("deepseek_v2", world, tmp_path, engine_settings(), paging_window=1)


@pytest.mark.gpu
@pytest.mark.parametrize("paging_window", [0, 1], ids=["resident", "paged"])
@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_shared_expert_adapter_with_cuda_graphs_served_exactly(architecture, paging_window, world, tmp_path):
    """vLLM's compilation and CUDA graphs on the server and the reference alike: the graphs capture every copy, and
    a load at run time writes into the captured tensors."""
    served_exactly(architecture, world, tmp_path, engine_settings(graphs=True), paging_window=paging_window)
