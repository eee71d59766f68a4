"""`esftctl serve --variants`: consolidated fine-tuned variants in one server answer as their materialized models.

Three stand-ins for full fine-tunes of the tiny world's base (every non-expert tensor and six experts per layer
changed, the six the test prompts use most) are consolidated twice: with a capacity of every position (all
hits: each perturbed position serves every variant one variant's expert) and with half of the perturbed
positions left out (misses: each variant keeps its own there). Each variant's `esftctl materialize` checkpoint,
served alone by plain vLLM, is the reference; one server per map takes concurrent mixed requests for all three
variants, and the half one also pages its experts (misses included) through one layer's memory (the map of every
position runs where a GPU is).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import engine_settings, plain_vllm, run_cli, server_args
from test_serve_adapters import ENGINE_ARGS, LOGPROBS, MAX_TOKENS, prompts_of, serve_concurrently

from esftctl.consolidate import consolidate, materialize
from esftctl.errors import EsftError
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import status
from esftctl.world.synthetic import experts_used_by, write_synthetic_variant

pytestmark = pytest.mark.vllm

PERTURBED = 6  # experts per layer each variant changes


@pytest.fixture(scope="module")
def variants(world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("variants")
    prompts = prompts_of(world)
    used = experts_used_by(world.base_dir, prompts)
    dirs = [write_synthetic_variant(world.base_dir, tmp / f"task{k}", seed=30 + k, experts_per_layer=PERTURBED,
                                    scale=8.0, non_expert_scale=0.4, prefer=used) for k in range(3)]
    base = MoECheckpoint(world.base_dir)
    positions = len(base.moe_layers) * base.num_experts
    maps = {"all": consolidate(dirs, tmp / "map_all", capacity=positions)[0],
            "half": consolidate(dirs, tmp / "map_half", capacity=positions - PERTURBED * len(base.moe_layers) // 2)[0]}
    materialized = {m: {f"task{v}": materialize(tmp / f"map_{m}", v, tmp / f"mat_{m}_{v}") for v in range(3)}
                    for m in maps}
    references = {}

    def reference(m: str, engine: dict | None = None) -> dict:
        """Each variant's materialized checkpoint under map `m`, served alone by plain vLLM (once per engine)."""
        key = (m, str(engine))
        if key not in references:
            (tmp / f"ref_{len(references)}").mkdir()
            references[key] = plain_vllm(materialized[m], prompts, tmp / f"ref_{len(references)}", MAX_TOKENS,
                                         LOGPROBS, engine)
        return references[key]

    return {"tmp": tmp, "dirs": dirs, "maps": maps, "prompts": prompts, "reference": reference}


def test_every_map_has_hits_and_the_half_one_misses(variants):
    full, half = variants["maps"]["all"], variants["maps"]["half"]
    assert (full.owner >= 0).all() and len(set(full.owner.ravel().tolist())) == 3  # every variant owns some
    misses = (half.owner < 0).sum(axis=1)
    assert misses.sum() > 0 and np.all(misses <= PERTURBED)
    # The variants answer differently: serving one for another fails.
    ref = variants["reference"]("half")
    answers = [[r["token_ids"] for r in ref[f"task{v}"]] for v in range(3)]
    assert answers[0] != answers[1] != answers[2] != answers[0]


# Every position loaded (hits only) runs on the GPU machine; CI serves the half map, whose hits and paged misses
# cover it, to keep the suite short.
@pytest.mark.parametrize("capacity", [pytest.param("all", marks=pytest.mark.gpu), "half"])
def test_variants_served_together_equal_their_materialized_models(variants, capacity):
    tmp, ref = variants["tmp"], variants["reference"](capacity)
    options = {"paging_window": 1} if capacity == "half" else {}
    serve_plan = plan(None, [], variants=tmp / f"map_{capacity}", port=free_port(), state_dir=tmp / f"state_{capacity}",
                      vllm_args=ENGINE_ARGS, quantum=2, **options)
    assert serve_plan.variant_names == ["task0", "task1", "task2"]
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), variants["prompts"], ref)
        s = status(serve_plan.url)
    by_name = {v["name"]: v for v in s["variants"]}
    assert by_name["task0"]["home"] and s["variant_switch_bytes"] > 0
    own = sum(sum(v["experts_per_layer"]) for v in s["variants"])
    assert (own > 0) == (capacity == "half")  # misses take slot rows; with every position loaded, none


@pytest.mark.gpu
def test_variants_with_cuda_graphs(variants):
    """vLLM's compilation and CUDA graphs: a switch copies weights into the tensors the graphs captured."""
    tmp, engine = variants["tmp"], engine_settings(graphs=True)
    serve_plan = plan(None, [], variants=tmp / "map_half", port=free_port(), state_dir=tmp / "state_graphs",
                      vllm_args=server_args(engine), quantum=1)
    assert "--enforce-eager" not in serve_plan.command()
    with Server(serve_plan) as server:
        server.wait_ready()
        ref = variants["reference"]("half", engine)  # a server that fails to start fails the test sooner
        serve_concurrently(serve_plan.url, list(ref), variants["prompts"], ref)


def test_bad_variant_maps_are_refused_before_vllm_starts(variants, tmp_path, tiny_models):
    tmp, dirs = variants["tmp"], variants["dirs"]
    with pytest.raises(EsftError, match="not both"):
        plan(dirs[0], [], variants=tmp / "map_all")
    with pytest.raises(EsftError, match="not a folder written by `esftctl consolidate`"):
        plan(None, [], variants=dirs[0])
    with pytest.raises(EsftError, match="also a variant's name"):
        plan(None, [f"task1={dirs[1]}"], variants=tmp / "map_all", port=free_port())
    with pytest.raises(EsftError, match="cannot hold the 0 adapters given and 2 variants"):
        plan(None, [], variants=tmp / "map_half", slots=1, port=free_port())
    with pytest.raises(EsftError, match="--paging-store decodes the base's own experts"):
        plan(None, [], variants=tmp / "map_all", paging_window=1, paging_store=tmp, port=free_port())
    with pytest.raises(EsftError, match="share the name"):
        plan(None, [], variants=tmp / "map_all", variant_names=["a", "a", "b"], port=free_port())
    moved = tmp_path / "map"
    moved.mkdir()
    text = (tmp / "map_all" / "expert_map.json").read_text().replace(str(dirs[2]), str(tmp_path / "gone"))
    (moved / "expert_map.json").write_text(text)
    with pytest.raises(EsftError, match="variant 2 of the map, .*gone, is missing"):
        plan(None, [], variants=moved)
    proc = run_cli("serve", "--variants", moved)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "is missing" in proc.stderr
    (moved / "expert_map.json").write_text(text.replace(str(tmp_path / "gone"), str(tiny_models["qwen2_moe"])))
    with pytest.raises(EsftError, match="differs from .* in architecture"):
        plan(None, [], variants=moved)


def test_turns_are_round_robin_by_quantum_and_nothing_starves():
    from esftctl.runtime.vllm.variant_turns import Turns

    turns = Turns(3, quantum=2)
    assert [turns.next({0, 1, 2}) for _ in range(7)] == [0, 0, 1, 1, 2, 2, 0]
    turns = Turns(3, quantum=2)
    assert [turns.next({2}) for _ in range(4)] == [2, 2, 2, 2]  # alone: no switch, however long
    assert turns.next({1, 2}) == 1  # its quantum is over and another variant waits
    assert turns.next({0}) == 0  # the current one has nothing left: the next with work at once
    assert turns.next(set()) == 0  # no work: stays


def test_one_step_variants_served_exactly(world, tmp_path):
    """`--one-step`: three Qwen2-MoE variants (every non-expert tensor of theirs changed: attention, norms, routers,
    shared experts, embeddings, the output head) in the same engine steps, each token with its variant's copies of
    the modules that differ, answer as their materialized models served alone."""
    from test_serve_adapters import random_base

    base = random_base("qwen2_moe", world, tmp_path)
    prompts = prompts_of(world)[:4]
    used = experts_used_by(base, prompts)
    dirs = [write_synthetic_variant(base, tmp_path / f"task{k}", seed=50 + k, experts_per_layer=PERTURBED, scale=8.0,
                                    non_expert_scale=0.4, prefer=used) for k in range(3)]
    ckpt = MoECheckpoint(base)
    consolidate(dirs, tmp_path / "map", capacity=len(ckpt.moe_layers) * ckpt.num_experts)
    materialized = {f"task{v}": materialize(tmp_path / "map", v, tmp_path / f"mat{v}") for v in range(3)}
    ref = plain_vllm(materialized, prompts, tmp_path, MAX_TOKENS, LOGPROBS)
    answers = [[r["token_ids"] for r in ref[f"task{v}"]] for v in range(3)]
    assert answers[0] != answers[1] != answers[2] != answers[0]
    serve_plan = plan(None, [], variants=tmp_path / "map", port=free_port(), state_dir=tmp_path / "state",
                      vllm_args=ENGINE_ARGS, one_step=True)
    assert "--scheduler-cls" not in serve_plan.command()  # vLLM's own scheduler: no turns
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), prompts, ref)
        s = status(serve_plan.url)
    assert s["module_copies"] == 2 and s["module_copy_bytes"] > 0 and s["variant_switch_bytes"] == 0


def test_one_step_mla_variants_served_exactly(variants, tmp_path):
    """The tiny world's DeepSeek-V2 variants differ in kv_b_proj too, which vLLM's MLA folds into its attention op's
    weights: in one step, each token attends with its variant's copy of that op (and its own experts where the map
    misses)."""
    ref = variants["reference"]("half")
    serve_plan = plan(None, [], variants=variants["tmp"] / "map_half", port=free_port(), state_dir=tmp_path / "state",
                      vllm_args=ENGINE_ARGS, one_step=True)
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), variants["prompts"], ref)
        s = status(serve_plan.url)
    assert s["module_copies"] == 2 and s["variant_switch_bytes"] == 0
