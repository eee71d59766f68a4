"""Consolidation: distances, ranking, round-robin assignment, materialized and averaged checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_cli

from esftctl.consolidate import (
    ExpertMap,
    assign_round_robin,
    average,
    consolidate,
    expert_distances,
    materialize,
    pair_distances,
    pair_distances_reference,
    rank_positions,
)
from esftctl.errors import EsftError
from esftctl.formats import native
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint


def test_ranking_and_round_robin_on_hand_made_distances():
    d = np.array([[3.0, 1.0, 2.0], [1.0, 0.5, 9.0]])
    ranking = rank_positions(d)
    assert ranking == [(1, 1), (0, 1), (1, 0), (0, 2), (0, 0), (1, 2)]  # tie 1.0: (0,1) before (1,0)
    assert assign_round_robin(ranking, 2, 4) == {(1, 1): 0, (0, 1): 1, (1, 0): 0, (0, 2): 1}
    assert assign_round_robin(ranking, 3, 2) == {(1, 1): 0, (0, 1): 1}
    everything = assign_round_robin(ranking, 3, 100)  # capacity above the positions: all loaded
    assert len(everything) == 6 and [everything[p] for p in ranking] == [0, 1, 2, 0, 1, 2]
    assert assign_round_robin(ranking, 2, 0) == {}


FINGERPRINTS = ["sha256:" + "a" * 64, "sha256:" + "b" * 64]
GOOD_MAP = {"format": "esftctl-expert-map", "version": 2, "models": ["/m/a", "/m/b"], "fingerprints": FINGERPRINTS,
            "moe_layers": [1, 2], "num_experts": 3, "capacity": 4, "map": {"1": [0, -1, 1], "2": [1, 0, -1]}}


@pytest.mark.parametrize("change, match", [
    ({"version": 3}, "version must be 2"),
    ({"models": []}, "models must be a non-empty list of at most 64 paths"),
    ({"models": ["/m/a", 3]}, "models must be a non-empty list of at most 64 paths"),
    ({"models": [f"/m/{i}" for i in range(65)], "fingerprints": FINGERPRINTS[:1] * 65},
     "models must be a .* at most 64 paths"),
    ({"fingerprints": FINGERPRINTS[:1]}, r"fingerprints must hold one fingerprint \(sha256:...\) per model"),
    ({"fingerprints": [FINGERPRINTS[0], "sha256:xyz"]}, "fingerprints must hold one fingerprint"),
    ({"fingerprints": None}, "fingerprints must hold one fingerprint"),
    ({"moe_layers": [2, 1], "map": {"1": [0, 0, 0], "2": [0, 0, 0]}}, "moe_layers must be increasing"),
    ({"moe_layers": [1, True]}, "moe_layers must be increasing"),
    ({"num_experts": "3"}, "num_experts must be an integer in 1-65536"),
    ({"capacity": -1}, "capacity must be a non-negative integer"),
    ({"map": {"1": [0, -1, 1]}}, "map must hold one list per MoE layer"),
    ({"map": {"1": [0, -1], "2": [1, 0, -1]}}, "each layer's list must hold 3 owners, each a variant 0-1 or -1"),
    ({"map": {"1": [0, -1, 2], "2": [1, 0, -1]}}, "each layer's list must hold 3 owners"),  # no variant 2: an index
    ({"map": {"1": [0, -2, 1], "2": [1, 0, -1]}}, "each layer's list must hold 3 owners"),
    ({"map": {"1": [0, 0, 1], "2": [1, 0, -1]}}, "the map loads more experts than its capacity of 4"),
])
def test_a_malformed_expert_map_is_refused_in_one_line(tmp_path, change, match):
    """`serve --variants` and `materialize` index variants by the map's owners: every field is checked first."""
    path = tmp_path / "expert_map.json"
    path.write_text(json.dumps(GOOD_MAP))
    assert ExpertMap.load(path).owner.tolist() == [[0, -1, 1], [1, 0, -1]]
    path.write_text(json.dumps(GOOD_MAP | change))
    with pytest.raises(EsftError, match=rf"^\S*expert_map.json: malformed expert map: {match}"):
        ExpertMap.load(path)


def _variant(base: MoECheckpoint, out, seed: int, changed):
    g = torch.Generator().manual_seed(seed)
    new = {key: ExpertWeights(*(t + (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)
                                for _, t in base.read_expert(*key).items())) for key in changed}
    router = base.arch.router_tensor(base.moe_layers[0])
    reps = expert_replacements(base, new)
    reps[router] = base.read_tensor(router) + 1  # variants differ in non-expert weights too
    return write_checkpoint(base, out, reps)


@pytest.fixture
def variants(tiny_models, tmp_path):
    base = MoECheckpoint(tiny_models["deepseek_v2"])
    a = _variant(base, tmp_path / "a", 1, [(1, 0), (2, 3), (3, 7)])
    b = _variant(base, tmp_path / "b", 2, [(1, 0), (3, 7), (3, 8)])
    c = _variant(base, tmp_path / "c", 3, [(2, 3)])
    return [a, b, c]


def test_distances_match_direct_computation(variants):
    models = [MoECheckpoint(p) for p in variants]
    d = expert_distances(models)
    for li, layer in enumerate(models[0].moe_layers):
        for e in (0, 3, 7, 8, 15):
            flat = [torch.cat([t.reshape(-1).double() for _, t in m.read_expert(layer, e).items()]) for m in models]
            want = sum(float((flat[i] - flat[j]).norm()) for i, j in ((0, 1), (0, 2), (1, 2)))
            assert abs(d[li, e] - want) < 1e-9 * max(1.0, want)
    untouched = d.copy()
    for li, e in ((0, 0), (1, 3), (2, 7), (2, 8)):
        untouched[li, e] = np.nan
    assert np.nanmax(untouched) == 0  # experts nobody changed are identical everywhere


def test_consolidate_materialize_average(variants, tmp_path):
    emap, d = consolidate(variants, tmp_path / "map", capacity=44)
    assert (emap.owner >= 0).sum() == 44 and (tmp_path / "map" / "distances.png").exists()
    # the four changed positions are the least similar: ranked last, so not loaded under capacity 44 of 48
    for li, e in ((0, 0), (1, 3), (2, 7), (2, 8)):
        assert emap.owner[li, e] == -1
    assert ExpertMap.load(tmp_path / "map" / "expert_map.json").owner.tolist() == emap.owner.tolist()
    ranking = json.loads((tmp_path / "map" / "ranking.json").read_text())
    assert [r["rank"] for r in ranking] == list(range(1, 49))
    assert all(ranking[i]["distance"] <= ranking[i + 1]["distance"] for i in range(47))

    out = materialize(tmp_path / "map", 1, tmp_path / "m1")
    m1, models = MoECheckpoint(out), [MoECheckpoint(p) for p in variants]
    for li, layer in enumerate(m1.moe_layers):
        for e in range(16):
            source = emap.owner[li, e]
            want = models[source if source >= 0 else 1].read_expert(layer, e)
            assert m1.read_expert(layer, e).equal(want)
    router = m1.arch.router_tensor(1)
    assert torch.equal(m1.read_tensor(router), models[1].read_tensor(router))  # its own non-expert weights

    avg = MoECheckpoint(average(variants[:2], tmp_path / "avg"))
    name = m1.arch.expert_tensor(1, 0, "gate")
    want = ((models[0].read_tensor(name).float() + models[1].read_tensor(name).float()) / 2).to(torch.bfloat16)
    assert torch.equal(avg.read_tensor(name), want)


def test_capacity_from_budget_and_refusals(variants, tiny_models, tmp_path):
    expert = MoECheckpoint(variants[0]).expert_nbytes
    emap, _ = consolidate(variants[:2], tmp_path / "map", budget_bytes=10 * expert + expert // 2)
    assert emap.capacity == 10
    with pytest.raises(EsftError, match="differs from .* in architecture"):
        consolidate([variants[0], tiny_models["qwen3_moe"]], tmp_path / "x", capacity=4)
    with pytest.raises(EsftError, match="exactly one of"):
        consolidate(variants, tmp_path / "y")
    with pytest.raises(EsftError, match="at least two"):
        consolidate(variants[:1], tmp_path / "z", capacity=1)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_cli(variants, tmp_path):
    proc = run_cli("consolidate", *variants, "--out", tmp_path / "map", "--budget", "1MiB", check=True)
    assert "Consolidated expert map" in proc.stdout
    assert ExpertMap.load(tmp_path / "map" / "expert_map.json").capacity == (1 << 20) // (3 * 256 * 64 * 2)
    proc = run_cli("consolidate", *variants, "--out", tmp_path / "m2", "--budget", "lots")
    assert proc.returncode == 1 and "cannot read 'lots' as a size" in proc.stderr
    run_cli("materialize", tmp_path / "map", "--variant", "0", "--out", tmp_path / "v0", check=True)
    proc = run_cli("materialize", tmp_path / "map", "--variant", "5", "--out", tmp_path / "v5")
    assert proc.returncode == 1 and "variant 5 out of range" in proc.stderr


def test_whole_model_swapping_serves_batches_in_arrival_order():
    """bench.turnaround.Swapping: one model at a time, a swap only when nothing runs, every request served, and
    far fewer swaps than model changes in the arrival order (each swap serves the waiting batch of a model)."""
    import asyncio
    import time

    from esftctl.bench.turnaround import Swapping, Traffic

    loads = []

    def swap(model: str) -> str:
        assert router.running == 0  # nothing runs on the server being replaced
        time.sleep(0.05)
        loads.append(model)
        return f"url-{model}"

    router = Swapping(swap, loaded="a", url="url-a")
    traffic = Traffic(["a", "b", "c"], rate=200, requests=30, prompts=["p"], output_len=1)
    arrivals = traffic.arrivals()

    async def one(ticket, at, model):
        await asyncio.sleep(at)
        url, name = await router.acquire(model, ticket)
        assert url == f"url-{model}" and name == model and router.loaded == model
        await asyncio.sleep(0.001)
        router.release(model)
        return model

    async def main():
        return await asyncio.gather(*[one(i, t, m) for i, (t, m, _) in enumerate(arrivals)])

    served = asyncio.run(main())
    changes = sum(1 for x, y in zip(arrivals, arrivals[1:]) if x[1] != y[1])
    assert sorted(served) == sorted(m for _, m, _ in arrivals)
    assert router.swaps == len(loads) and 1 <= router.swaps < changes


def test_bench_consolidate_tables_and_plot(tmp_path):
    from esftctl.bench import consolidate as bench

    q = {"loss": 0.1, "exact": 0.9}
    summary = {"mean_ttft_ms": 10.0, "mean_tpot_ms": 2.0, "mean_e2el_ms": 40.0, "p99_e2el_ms": 80.0,
               "request_throughput": 1.5}
    result = {"capacity": 96, "eval_examples": 4, "rows": [{"variants": 2, "task": t, "own": q, "consolidated": q,
                                                            "averaged": q} for t in ("a", "b")],
              "sweep": {"variants": ["a", "b"], "positions": 96, "own": {"a": q, "b": q}, "averaged": {"a": q, "b": q},
                        "points": [{"capacity": c, "fraction": c / 96, "resident_experts": 96 + 96 - c,
                                    "tasks": {"a": q, "b": q}} for c in (96, 48, 0)]},
              "serving": {"capacity": 48,
                          "traffic": {"models": ["a", "b"], "rate": 2.0, "requests": 8, "output_len": 4},
                          "setups": {"consolidated": {"summary": summary, "ready_s": 30},
                                     "one server per variant": {"summary": summary, "ready_s": 60},
                                     "whole-model swapping": {"summary": summary, "ready_s": 30, "swaps": 3,
                                                              "swap_s": 27.0}}}}
    assert len(bench.tables(result)) == 3
    bench.plot(result, tmp_path / "all.png")
    serve_only = {**result, "rows": [], "sweep": {**result["sweep"], "points": []}}
    assert len(bench.tables(serve_only)) == 1
    bench.plot(serve_only, tmp_path / "serve.png")
    assert (tmp_path / "all.png").stat().st_size > 0 and (tmp_path / "serve.png").stat().st_size > 0


@pytest.mark.skipif(native.module() is None, reason="the native extension was not built (no C compiler)")
@pytest.mark.parametrize("variants", [2, 4, 7])
def test_native_pair_distances_match_the_reference(variants):
    """native/distances.c against the torch reference, on fresh random bf16 experts of odd sizes: nearly equal
    variants (a fine-tune's small changes), identical ones (distance 0 exactly) and thread counts."""
    g = torch.Generator().manual_seed(variants)
    base = [torch.randn(37, 301, generator=g).bfloat16() for _ in range(3)]  # 3 blocks of 4096 values
    experts = [ExpertWeights(*(w + (0.01 * torch.randn(w.shape, generator=g)).bfloat16() * (k % 3 != 0) for w in base))
               for k in range(variants)]
    experts[-1] = experts[0]  # an identical pair
    want = pair_distances_reference(experts)
    assert abs(pair_distances(experts) - want) <= 1e-12 * want
    bits = [x.gate.view(torch.int16).numpy() for x in experts]
    one, three = (np.frombuffer(native.module().pair_squared_distances(bits, t), dtype=np.float64) for t in (1, 3))
    assert np.array_equal(one, three)  # blocks summed in order, whatever the thread count
    assert one[variants - 2] == 0.0  # pair (0, last): identical experts
