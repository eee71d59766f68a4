"""`esftctl serve` under vLLM's tensor and expert parallelism (issue 20): adapters answer as their merged models do.

Each rank's virtual tensors hold its part of every expert, base and adapter alike, cut as vLLM's FusedMoE
loader cuts the base's (esftctl.runtime.vllm.model.tensor_parallel_shard): an adapter served by two ranks
must give the greedy tokens of its merged model served by plain vLLM with the same parallelism. vLLM's CPU
build runs TP=2 on two cores when each rank's OpenMP threads are bound by hand (its automatic binding wants a
NUMA node per rank), so this runs in CI; on the GPU machine it needs two GPUs. Under expert parallelism each
rank holds its own experts and the adapter rows that replace them (esftctl.runtime.moe_layer): GPUs only.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from conftest import engine_settings, has_gpu
from rich.console import Console
from test_serve_adapters import prompts_of, serve_exactly

from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.serve_client import status_table

pytestmark = pytest.mark.vllm


@pytest.fixture
def two_ranks(monkeypatch):
    """Skip without two GPUs (on a GPU machine) or two cores (on the CPU); on the CPU bind one core per rank."""
    if has_gpu():
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
def test_adapters_under_tensor_parallelism_equal_their_merged_models(world, tmp_path, two_ranks, paged):
    """Resident, and paged through one layer's memory on every rank (each rank pages its own parts)."""
    engine = engine_settings() | {"tensor_parallel_size": 2}
    status = serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine, seed=40,
                           **({"paging_window": 1} if paged else {}))
    assert status["paging_window"] == (1 if paged else 0) and (status.get("paging_fetches", 0) > 0) == paged
    # Issue 20, item 4: each rank reports its own memory, half of every expert.
    ranks = status["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and status["ranks"] == 2
    whole = MoECheckpoint(world.base_dir)
    experts = len(whole.moe_layers) * whole.num_experts * whole.expert_nbytes
    for r in ranks:  # (a kernel's layout may pad its rows: vLLM's CPU build prepacks them)
        assert experts // 2 <= r["base_expert_bytes"] == ranks[0]["base_expert_bytes"] < experts
        assert 0 < r["adapter_expert_bytes"] == ranks[0]["adapter_expert_bytes"]
        assert 0 < r["expert_device_bytes"] <= (r["base_expert_bytes"] if paged else experts)
    table = io.StringIO()
    Console(file=table, width=200).print(status_table(status))
    assert "memory per rank (2 ranks" in table.getvalue()


def test_adapters_under_expert_parallelism_equal_their_merged_models(world, tmp_path, two_ranks):
    """Each rank holds half of the experts and the adapter rows that replace them, and vLLM's Triton kernel
    applies the expert map extended to those rows. vLLM's CPU kernel ignores expert maps (plain vLLM crashes
    there, vllm-project/vllm#57837; esftctl refuses it), so this needs two GPUs."""
    if not has_gpu():
        pytest.skip("vLLM's CPU MoE kernel ignores the expert map (vllm-project/vllm#57837): needs two GPUs")
    engine = engine_settings() | {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    status = serve_exactly(world.base_dir, prompts_of(world), tmp_path, engine, seed=41)
    whole = MoECheckpoint(world.base_dir)
    experts = len(whole.moe_layers) * whole.num_experts * whole.expert_nbytes
    # A rank maps whole pages: its half of the base, then, in each layer's two tensors (w13, w2), the pages its
    # adapter rows reach. Here a rank's half of w13 fills its 2 MiB page exactly, so the rank maps as many bytes
    # as one copy of every expert (18 MiB on two H200s); a rank holding every expert would map 30 MiB.
    rounding = 2 * len(whole.moe_layers) * status["page_bytes"]
    for r in status["per_rank"]:
        assert r["base_expert_bytes"] == experts // 2
        assert r["expert_device_bytes"] <= r["base_expert_bytes"] + r["adapter_expert_bytes"] + rounding
