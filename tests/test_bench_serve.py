"""`esftctl bench serve`'s parts: the generated DeepSeek-V2-Lite-shaped model (at a small size), the peer's LoRA
adapters, its scenarios and tables, and the whole bench in CI size on the CPU build (the traffic, the load
generator's arguments and the per-request numbers: tests/test_bench_traffic.py)."""

from __future__ import annotations

import io
import json
import math
import random

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from esftctl.bench import serve_runs
from esftctl.bench.lora_peer import lora_modules, write_lora
from esftctl.bench.synthetic_model import (
    INDEX_FILE,
    adapter_expert_ids,
    deepseek_v2_lite_config,
    write_adapter,
    write_model,
)
from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=3,
             n_routed_experts=8, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=32, v_head_dim=64,
             bos_token_id=1000, eos_token_id=1001, pad_token_id=1002)


@pytest.fixture(scope="module")
def small_lite(tmp_path_factory):
    """DeepSeek-V2-Lite's structure at a small size, written by the generator in 1 MiB shards."""
    return write_model(tmp_path_factory.mktemp("lite") / "base", deepseek_v2_lite_config(**SMALL), seed=0,
                       shard_bytes=1 << 20)


def _tensors(folder):
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            out.update({k: (f.name, tuple(h.get_slice(k).get_shape())) for k in h.keys()})
    return out


def test_generated_model_is_what_save_pretrained_writes(small_lite, tmp_path):
    from transformers import AutoModelForCausalLM

    config = deepseek_v2_lite_config(**SMALL)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "ref")
    ours, ref = _tensors(small_lite), _tensors(tmp_path / "ref")
    assert {k: s for k, (_, s) in ours.items()} == {k: s for k, (_, s) in ref.items()}
    config_of = {p: json.loads((p / "config.json").read_text()) for p in (small_lite, tmp_path / "ref")}
    assert config_of[small_lite]["architectures"] == config_of[tmp_path / "ref"]["architectures"]  # vLLM reads it
    index = json.loads((small_lite / INDEX_FILE).read_text())["weight_map"]
    assert index == {k: f for k, (f, _) in ours.items()}  # every tensor in the shard the index names
    assert all(f.stat().st_size < (1 << 20) + (1 << 16) for f in small_lite.glob("*.safetensors"))  # 1 MiB shards
    ckpt = MoECheckpoint(small_lite)
    assert ckpt.moe_layers == [1, 2] and ckpt.num_experts == 8 and ckpt.top_k == 6
    norm = ckpt.read_tensor("model.norm.weight")
    gate = ckpt.read_expert(1, 3).gate.float()
    assert torch.equal(norm, torch.ones_like(norm)) and 0.005 < gate.std() < 0.08  # trained-like, not zeros
    model = AutoModelForCausalLM.from_pretrained(small_lite)  # transformers loads it and it computes
    assert torch.isfinite(model(torch.tensor([[1000, 5, 6]])).logits).all()


def test_full_size_config_has_deepseek_v2_lite_parameters():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(deepseek_v2_lite_config())
    assert abs(sum(p.numel() for p in model.parameters()) - 15.706e9) < 0.01e9


def test_tokenizer_round_trips_every_token(small_lite):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_lite)
    ids = [random.Random(0).randrange(1000) for _ in range(200)]
    assert len(tok) == 1024
    assert tok(tok.decode(ids))["input_ids"] == [1000] + ids  # BOS first, then exactly the same ids


def test_adapters_have_the_counts_asked_for(small_lite, tmp_path):
    base = MoECheckpoint(small_lite)
    ids = adapter_expert_ids(base, most=5, mean=3.5, seed=1)
    assert sorted(ids) == [1, 2] and max(map(len, ids.values())) == 5 and sum(map(len, ids.values())) == 7
    bundle = Bundle.open(write_adapter(base, tmp_path / "a", "a", most=5, mean=3.5, seed=1))
    assert bundle.experts == ids
    bundle.check_base(base)


def test_lora_peer_adapts_every_expert_and_attention(small_lite, tmp_path):
    base = MoECheckpoint(small_lite)
    out = write_lora(base, tmp_path / "lora", seed=0, rank=16)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["bias"] == "none"
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for layer in base.moe_layers:  # vLLM's MoE LoRA asserts all three projections of every expert
        for e in range(base.num_experts):
            for w in ("gate", "up", "down"):
                module = base.arch.expert_tensor(layer, e, w).removesuffix(".weight")
                rows, cols = base.tensors[f"{module}.weight"].shape
                assert keys[f"base_model.model.{module}.lora_A.weight"] == (16, cols)
                assert keys[f"base_model.model.{module}.lora_B.weight"] == (rows, 16)
    assert "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight" in keys
    # vLLM ignores LoRA on kv_b_proj (absorbed by MLA) and on the router: none is written
    assert not [k for k in keys if "kv_b_proj" in k or ".mlp.gate.lora" in k]
    assert len(lora_modules(base)) * 2 == len(keys)


def test_scenarios_follow_expertweaves_grid():
    """Every count at the first alpha, the largest count at every alpha, per rate; DeepSeek-sized adapters beside
    at the highest rate; the base's runs have every scenario's rates."""
    from dataclasses import replace

    from esftctl.bench import serve as bench
    from esftctl.bench.serve_runs import base_runs, scenarios

    profile = replace(bench.PROFILES["deepseek-v2-lite"], rates=(1.0, math.inf))
    runs = scenarios(profile, 20, 5)
    names = [s.name for s in runs]
    assert names[:8] == ["base @ 1 rps", "1 adapter @ 1 rps", "5 adapters, alpha 1 @ 1 rps",
                         "10 adapters, alpha 1 @ 1 rps", "20 adapters, alpha 1 @ 1 rps",
                         "20 adapters, alpha 0.6 @ 1 rps", "20 adapters, alpha 0.3 @ 1 rps",
                         "20 adapters, alpha 0.1 @ 1 rps"]
    assert names[-1] == "5 DeepSeek-sized adapters, alpha 1 @ inf rps" and runs[-1].pool == "esft_sized"
    assert len(runs) == 17 and len(scenarios(profile, 10, 0)) == 2 * 7  # 20 not there: 10 takes every alpha
    assert [s.name for s in base_runs(profile)] == ["base @ 1 rps", "base @ inf rps"]
    assert profile.requests(2.0) == 120 and profile.requests(math.inf) == 256  # 60 s at 2 rps; inf: --prompts
    five = next(s for s in runs if s.adapters == 5)
    assert five.draw(0, 120) == five.draw(0, 120) != five.draw(1, 120) and max(five.draw(0, 120)) == 4


def test_merged_copies_share_the_device_and_run_the_largest_count(tmp_path, monkeypatch):
    from dataclasses import replace

    from esftctl.bench import serve as bench

    args = ("--max-model-len", "4096", "--gpu-memory-utilization", "0.92")
    assert bench.share_memory(args, 2) == ["--max-model-len", "4096", "--gpu-memory-utilization", "0.460"]
    assert bench.share_memory(("--max-model-len", "256"), 2) == ["--max-model-len", "256"]  # CPU: its own KV space
    # beside plain vLLM, esftctl's share carries its adapter experts on top of the same room: 0.92 of 140 GiB less
    # 38 for the adapters leaves 45.4 GiB each (halving gave esftctl 64.4 GiB for a 29 GiB base and the 38)
    plain, esft = bench.split_memory(args, [0, 38 * 2**30], card=140 * 2**30)
    assert (plain[-1], esft[-1]) == ("0.324", "0.596")  # 45.4 / 140 and (45.4 + 38) / 140
    assert float(plain[-1]) + float(esft[-1]) == pytest.approx(0.92, abs=1e-3)
    with pytest.raises(EsftError, match="no memory"):
        bench.split_memory(args, [0, 130 * 2**30], card=140 * 2**30)
    assert bench.split_memory(("--max-model-len", "256"), [0, 1], card=0) == [["--max-model-len", "256"]] * 2
    profile = replace(bench.PROFILES["deepseek-v2-lite"], rates=(2.0,))
    b = bench.Bench(profile, bench.Options(servers=("base",)), served=None, work=tmp_path, scratch=tmp_path,
                    out=tmp_path, gpu=False, on_step=print)
    assert [s.name for s in b.merged_runs(1)] == ["merged @ 2 rps"]
    assert [s.name for s in b.merged_runs(2)] == [f"20 adapters, alpha {a} @ 2 rps" for a in ("1", "0.6", "0.3", "0.1")]
    unloaded = []
    monkeypatch.setattr(bench.serve_client, "unload", lambda url, name: unloaded.append(name))
    unload = b.unloader(["a", "b", "c"], ["x"])
    unload("url", 3)
    unload("url", 1)
    unload("url", 1)
    assert unloaded == ["x", "b", "c"]  # each once, the grid's first k kept


def test_warm_up_paces_the_busiest_rate_and_kernel_compiles_are_counted(tmp_path):
    """After the burst of every model name, the warm-up sends the runs' busiest finite rate for up to WARM_UP_S
    (the burst alone left a Triton MoE compile to the first measured run on the H200); the compiles vLLM's JIT
    monitor logs are counted in the servers' logs."""
    from dataclasses import replace
    from types import SimpleNamespace

    from esftctl.bench import serve as bench
    from esftctl.bench.serve_runs import JIT_WARNING, WARM_UP_S, Scenario, jit_compiles, warm_up

    profile = replace(bench.PROFILES["deepseek-v2-lite"], cv=2.0)
    runs = [Scenario("base @ 1 rps", 1.0), Scenario("5 adapters @ 5 rps", 5.0, 5), Scenario("at once", math.inf, 2)]
    sent = []
    warm_up(lambda name, load, models, folder: sent.append((load, models)), "esftctl", runs,
             names={"grid": [f"a{i}" for i in range(9)]}, profile=profile, on_step=lambda msg: None)
    (burst, burst_models), (paced, paced_models) = sent
    assert math.isinf(burst.rate) and burst.prompts == 16 and set(burst_models) == {f"a{i}" for i in range(5)}
    assert paced.rate == 5.0 and paced.cv == 2.0 and paced.prompts == 5 * WARM_UP_S == len(paced_models)
    assert paced.seed != burst.seed and (paced.input_len, paced.output_len) == (profile.input_len, profile.output_len)
    sent.clear()
    warm_up(lambda name, load, models, folder: sent.append(load), "base", [Scenario("at once", math.inf)],
             names={}, profile=replace(profile, duration=1.5), on_step=lambda msg: None)
    assert [math.isinf(load.rate) for load in sent] == [True]  # no finite rate: the burst alone
    logs = [tmp_path / "a.log", tmp_path / "b.log", tmp_path / "gone.log"]
    logs[0].write_text(f"WARNING [jit_monitor.py:129] Triton kernel {JIT_WARNING}: fused_moe_kernel.\n" * 2)
    logs[1].write_text(f"INFO ready\nWARNING Triton kernel {JIT_WARNING}: other_kernel.\n")
    assert jit_compiles([SimpleNamespace(log_file=f) for f in logs]) == 3
    assert jit_compiles([SimpleNamespace(log_file=logs[2])]) == 0


def test_a_failed_run_says_what_the_servers_logs_give(tmp_path, monkeypatch):
    """A load run that fails brings the servers' causes with it: each log's lines from its first ERROR on (bounded
    in count and width, since vLLM's fatal-error dump is long) go to the progress lines, then the memory each
    process holds on the GPUs, named by its server where it is one's; each server's root cause joins the error; a
    server whose log says nothing adds its last line, one never started nothing. Without nvidia-smi, no memory
    line."""
    import os
    import stat
    import sys
    from types import SimpleNamespace

    from esftctl.bench.serve_runs import failures_explained
    from esftctl.serve import Server

    dead, calm, never = (tmp_path / f"{name}.log" for name in ("dead", "calm", "never"))
    dumped = "(EngineCore pid=7) ERROR 12-06 02:00:12 [dump_input.py:79] Dumping scheduler output for model " \
        "execution: SchedulerOutput(scheduled_new_reqs=[" + ", ".join(["NewRequestData(req_id=1)"] * 200) + "])"
    dead.write_text("(EngineCore pid=7) INFO 12-06 02:00:11 [core.py:1] ready\n"
                    "(EngineCore pid=7) ERROR 12-06 02:00:12 [core.py:2] EngineCore encountered a fatal error.\n"
                    + f"{dumped}\n" * 60 +
                    "(EngineCore pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    calm.write_text("(APIServer pid=8) INFO 12-06 02:00:13 [loggers.py:1] Running: 0 reqs\n")
    servers = [Server(SimpleNamespace(log_file=log)) for log in (dead, calm, never)]
    servers[1].process = SimpleNamespace(pid=os.getpgid(0))  # this test's process stands in for calm's engine
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # a stand-in: this process on two cards, and one of no server's (a pid unused)
    smi.write_text(f"#!{sys.executable}\nprint('{os.getpid()}, 30000\\n{os.getpid()}, 12\\n4194303, 5')\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def fail(said: list[str], error: Exception) -> str:
        with pytest.raises(type(error)) as failed:
            with failures_explained(servers, said.append):
                raise error
        return str(failed.value)

    said = []
    message = fail(said, RuntimeError("plain_r0: 255 of 256 requests failed (first error: Never received a chunk)"))
    assert message.startswith("plain_r0: 255 of 256 requests failed")
    assert f"{dead}: (EngineCore pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in message
    assert f"{calm}: (APIServer pid=8) INFO" in message and str(never) not in message
    assert said[0] == f"{dead}: (EngineCore pid=7) ERROR 12-06 02:00:12 [core.py:2] EngineCore encountered a fatal " \
        "error."
    assert len(said) == 41 and all(len(line) <= len(str(dead)) + 2 + 300 for line in said[:40])
    assert said[40] == f"GPU memory held now: process {os.getpid()} ({calm}) 30012 MiB, process 4194303 5 MiB"
    assert fail(said, KeyError("x")) == "'x'" and len(said) == 41  # anything but a failed run passes as it came
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: the CPU build
    said.clear()
    fail(said, RuntimeError("failed"))
    assert len(said) == 40 and not any(line.startswith("GPU memory") for line in said)


@pytest.mark.vllm
def test_bench_serve_runs_on_the_cpu_build(tmp_path):
    """CI size: plain vLLM's base, esftctl serve with two adapters over 0 and 2 of them (and grouped, and under
    vLLM's --max-loras 1), at 8 requests/s and all at once; the microbenchmarks; vLLM's own results. Sliced by
    adapter count as the GPU grid is: one slice per server and count (1 + 3 x 2), the counts of esftctl and of
    --max-loras each on one server start, and the microbenchmarks' (2: base and esftctl)."""
    proc = run_cli("bench", "serve", "--out", tmp_path / "out", "--work", tmp_path / "work", "--servers",
                   "base,esftctl", "--adapters", "0,2", "--rates", "8,inf", "--duration", "0.5", "--prompts", "4",
                   "--repeats", "1", "--micro-runs", "2", "--group-adapters", "1", "--max-loras", "1",
                   "--slice-by", "adapters", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = (tmp_path / "out").glob("serve-*.json")  # the grid's report on this device
    result = json.loads(report.read_text())
    sliced = {p.relative_to(p.parents[1]).as_posix(): json.loads(p.read_text())
              for p in (tmp_path / "out" / "slices").rglob("*.json")}
    assert result["missing"] == [] and len(sliced) == 1 + 3 * 2 + 2
    assert not result["errors"]
    for server in ("esftctl", "max-loras-1"):  # one start served both counts, 2 adapters first
        first, second = sliced[f"{server}/n2.r0.json"], sliced[f"{server}/n0.r0.json"]
        assert (first["parts_before"], second["parts_before"]) == (0, 1) and first["ready_s"] == second["ready_s"]
    assert sliced["grouped-1-8/n0.r0.json"]["parts_before"] == 0  # the grouping scheduler's: a start per count
    rows = {(s["server"], r["scenario"]): r for s in result["servers"] for r in s["rows"]}
    esftctl = {f"{n} @ {rate} rps" for rate in ("8", "inf")
               for n in ("base", "2 adapters, alpha 1", "2 adapters, alpha 0.3")}
    assert set(rows) == {("vLLM base", "base @ 8 rps"), ("vLLM base", "base @ inf rps")} | {
        (server, name) for server in ("esftctl", "esftctl, groups of 1", "esftctl, --max-loras 1") for name in esftctl}
    for r in rows.values():
        assert r["completed"] == 4 and r["median_tpot_ms"] > 0 and r["p99_ttft_ms"] >= r["median_ttft_ms"]
        assert r["median_prefill_tps"] > 0 and r["median_decode_tps"] > 0 and r["ttft_spread"] == 0  # one repeat
    skewed = rows[("esftctl", "2 adapters, alpha 0.3 @ 8 rps")]
    assert skewed["shares"]["expected"] == pytest.approx([0.5 ** 0.3, 1 - 0.5 ** 0.3]) and sum(
        skewed["shares"]["counts"]) == 4
    assert rows[("esftctl", "base @ 8 rps")]["arrival_cv"] is not None
    for r in rows.values():  # vLLM's own per-request means: TTFT's parts inside the server, within the client's
        assert 0 < r["server_prefill_ms"] and 0 <= r["server_queue_ms"] and r["server_decode_ms"] > 0
        assert r["server_queue_ms"] + r["server_prefill_ms"] <= r["server_ttft_ms"] * 1.01 + 0.1
        assert r["server_ttft_ms"] <= r["mean_ttft_ms"] * 1.01 + 0.1
    for r in rows.values():  # TTFT by what each prompt met (load.prefill_modes), each request kept in its slice
        assert 0 <= r["alone_share"] <= 1 and (r["median_ttft_alone_ms"] or r["median_ttft_beside_ms"])
    assert rows[("esftctl", "base @ inf rps")]["alone_share"] == 0  # all at once: none alone
    assert all(r["median_stall_ms"] is None or r["median_stall_ms"] > 0 for r in rows.values())  # load.prefill_stalls
    for r in rows.values():  # the machine over each run (bench.conditions): the host's CPU, no nvidia-smi here
        assert 0 < r["host_busy"] <= 1 and 0 <= r["host_steal"] < 1 and r["gpu_sm_mhz"] is None
    kept = sliced["esftctl/n2.r0.json"]["runs"][0]
    assert len(kept["requests"]["ttft_ms"]) == len(kept["drawn"]) == kept["result"]["completed"]
    from rich.console import Console

    from esftctl.bench.serve_report import tables
    text = io.StringIO()
    for table in tables(result):
        Console(file=text, width=250).print(table)
    assert "TTFT by what the prompt met" in text.getvalue() and "stall ms" in text.getvalue()
    assert "the machine over each run" in text.getvalue()
    esft_base = rows[("esftctl", "base @ inf rps")]
    assert esft_base["tpot_ratio"] == esft_base["mean_tpot_ms"] / rows[("vLLM base", "base @ inf rps")]["mean_tpot_ms"]
    assert result["kv_cache"]["reported"]["esftctl"] > 0
    servers = {s["server"]: s for s in result["servers"]}
    load = servers["esftctl"]["adapter_load"]
    assert len(load["seconds"]["cold"]) == len(load["seconds"]["warm"]) == 3
    assert load["host_cache_hits"] == 3  # every warm load came from the server's host cache, no cold one did
    assert [e["from"] for e in load["engine"]["warm"]] == ["host cache"] * 3  # as the engine says, with its phases
    assert [e["from"] for e in load["engine"]["cold"]] == ["file, verified before"] * 3  # hashed by the middleware
    assert all(set(e) == {"from", "verify", "stage", "copy"} for e in load["engine"]["cold"])
    assert all(s["jit_compiles_in_runs"] is not None for s in result["servers"])  # counted in every slice
    groups = servers["esftctl, groups of 1"]["groups"]
    assert groups["most"] == groups["most_groups_scheduled"] == 1 and groups["grouped_steps"] > 0
    assert set(servers["esftctl"]["micro"]) == {"2", "1"} and set(servers["vLLM base"]["micro"]) == {"all"}
    micro = servers["esftctl"]["micro"]["1"]
    assert set(micro["ttft_ms"]) == {"16", "64"} and set(micro["tpot_ms"]) == {"1", "4"}
    base_micro = servers["vLLM base"]["micro"]["all"]
    assert micro["ttft_ms_ratio"]["16"] == micro["ttft_ms"]["16"] / base_micro["ttft_ms"]["16"]
    assert 0 < micro["machine"]["host_busy"] <= 1 and base_micro["machine"]["gpu_sm_mhz"] is None  # no nvidia-smi
    assert len(list((tmp_path / "out" / "vllm-results").glob("*.json"))) == 2 + 3 * 6  # vLLM's own result files
    assert report.with_suffix(".png").stat().st_size > 0
    logs = list((tmp_path / "work" / "state").rglob("vllm.log"))  # every server without the prefix cache
    assert len(logs) >= 4 and all("enable_prefix_caching=False" in log.read_text(errors="replace") for log in logs)


def test_cpu_ranks_are_bound_only_while_a_parallel_server_starts(monkeypatch):
    import os

    from esftctl.bench.serve import cpu_ranks_bound

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    cores = sorted(os.sched_getaffinity(0))
    for ranks, gpu in ((1, False), (2, True)):
        with cpu_ranks_bound(ranks, gpu):
            assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # one rank: vLLM's own binding, every core
    if len(cores) >= 2:
        with cpu_ranks_bound(2, False):
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == f"{cores[0]}|{cores[1]}"
            assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")  # the user's own binding is kept
    with cpu_ranks_bound(2, False):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"


def test_parallel_sizes_have_their_own_anchors_and_a_ratio_to_the_first(world):
    """`--parallel 1,2`: each size's ratios are against plain vLLM's base at that size, and every server's
    throughput is also set against its own run at the first size (what the second GPU buys)."""
    from rich.console import Console

    from esftctl.bench import serve as bench
    from esftctl.bench.serve_models import Served

    def measured(kind: str, ranks: int, throughput: float, tpot: float) -> dict:
        row = {"scenario": "base @ inf rps", "rate": "inf rps", "mean_ttft_ms": 10.0, "median_ttft_ms": 10.0,
               "p99_ttft_ms": 12.0, "mean_tpot_ms": tpot, "median_tpot_ms": tpot, "p99_tpot_ms": tpot,
               "p99_itl_ms": 9.0, "mean_e2el_ms": 50.0, "output_throughput": throughput, "adapters": 0,
               "alpha": None, "ttft_spread": 0.0, "shares": None}
        return {"server": kind + bench.parallel_label(ranks, False), "kind": kind, "ranks": ranks,
                "kv_cache_tokens": 1000, "rows": [row]}

    results = [measured("vLLM base", 1, 100.0, 5.0), measured("vLLM base", 2, 150.0, 4.0),
               measured("esftctl", 1, 90.0, 5.5), measured("esftctl", 2, 120.0, 4.4)]
    out = bench.finish(bench.PROFILES["tiny"], bench.ModelFacts.of(Served(world.base_dir)), results, {}, device="CPU",
                       options=bench.Options(servers=("base", "esftctl")))
    rows = {res["server"]: res["rows"][0] for res in out["servers"]}
    assert out["config"]["parallel"] == [1, 2] and set(rows) == {"vLLM base", "vLLM base TP=2", "esftctl",
                                                                   "esftctl TP=2"}
    assert rows["esftctl TP=2"]["throughput_ratio"] == 120 / 150 and rows["esftctl TP=2"]["tpot_ratio"] == 4.4 / 4
    assert rows["esftctl TP=2"]["throughput_vs_first"] == 120 / 90
    assert rows["vLLM base TP=2"]["throughput_vs_first"] == 1.5
    assert rows["esftctl"]["throughput_ratio"] == 0.9 and rows["esftctl"]["throughput_vs_first"] == 1
    text = io.StringIO()
    for table in bench.tables(out):
        Console(file=text, width=250).print(table)
    assert "tok/s vs first" in text.getvalue() and "1.33" in text.getvalue()
    assert bench.parallel_args(1, True) == () and bench.parallel_args(2, True) == (
        "--tensor-parallel-size", "2", "--enable-expert-parallel")


def test_bad_bench_serve_options_are_one_line_errors(world):
    cases = [(("bench", "serve", "--rates", "4,nan"), "--rates '4,nan': every rate must be above 0"),
             (("bench", "serve", "--parallel", "1,0"), "--parallel '1,0': every number must be at least 1"),
             (("bench", "serve", "--parallel", "1,4096"), "--parallel '1,4096': 4096 ranks, but this machine has"),
             (("bench", "serve", "--servers", "base,,esftctl"), "--servers: unknown ''"),
             (("bench", "serve", "--model", "huge"), "unknown --model 'huge'"),
             (("bench", "serve", "--alphas", "1,0"), "--alphas '1,0': every alpha must be above 0"),
             (("bench", "serve", "--cv", "0"), "--cv 0.0: choose a coefficient of variation above 0"),
             (("bench", "serve", "--adapters", "0,2", "--max-loras", "2"), "--max-loras 2: choose fewer than"),
             (("bench", "serve", "--adapter-shape", "wide"), "unknown --adapter-shape 'wide'"),
             (("serve", world.base_dir, "--host-cache", "1.2.3"), "--host-cache: cannot read '1.2.3' as a size")]
    if not torch.cuda.is_available():
        cases.append((("bench", "serve", "--servers", "base,lora"), "need a GPU"))
        cases.append((("bench", "serve", "--parallel", "2", "--expert-parallel"), "need a GPU"))
    for args, message in cases:
        proc = run_cli(*args)
        assert proc.returncode == 1 and message in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_streamed_finetunes_of_a_generated_base(small_lite, tmp_path):
    """Issue 19, item 1: cheap fine-tunes of a generated base, written shard by shard with the base's index: an
    ESFT-style one changes exactly the chosen experts (and `pack` finds them), a full one every non-expert tensor
    too (and `consolidate` ranks the variants)."""
    from esftctl.bench.synthetic_model import write_finetune
    from esftctl.consolidate import consolidate
    from esftctl.pack import changed_experts, changed_non_expert, pack

    base = MoECheckpoint(small_lite)
    esft = write_finetune(small_lite, tmp_path / "esft", kind="esft", seed=1, experts_per_layer=2)
    full = write_finetune(small_lite, tmp_path / "full", kind="full", seed=2, experts_per_layer=2)
    assert (esft / INDEX_FILE).read_text() == (small_lite / INDEX_FILE).read_text()
    changed = changed_experts(base, MoECheckpoint(esft))
    assert all(len(ids) == 2 for ids in changed.values()) and not changed_non_expert(base, MoECheckpoint(esft))
    non_expert = {n for n in base.tensors if not base.is_routed_expert_tensor(n)}
    assert set(changed_non_expert(base, MoECheckpoint(full))) == non_expert
    report = pack(small_lite, esft, tmp_path / "bundle", "esft")
    assert report.experts == changed
    emap, _ = consolidate([small_lite, esft, full], tmp_path / "map", capacity=4)
    assert (emap.owner >= 0).sum() == 4
    again = write_finetune(small_lite, tmp_path / "again", kind="esft", seed=1, experts_per_layer=2)
    assert changed_experts(MoECheckpoint(esft), MoECheckpoint(again)) == {l: [] for l in base.moe_layers}


def test_grid_adapters_of_either_shape(small_lite, tmp_path, monkeypatch):
    """`--adapter-shape deepseek`: the grid's 20 names over 10 files of DeepSeek's published sizes (83-153 experts,
    one file per size, shared with the Table 1 grid's DeepSeek-sized extras), none beside; table1: Table 1's, and
    the DeepSeek-sized extras beside."""
    from esftctl.bench import serve_models
    from esftctl.bench.serve_models import Served

    written = []
    monkeypatch.setattr(serve_models, "_lite", lambda base, path, **kw: written.append((path.name, kw)) or path)
    served = Served(small_lite)
    serve_models.write_adapters(served, "deepseek-v2-lite", tmp_path, 20, distinct=10, shape="deepseek")
    assert served.grid == [f"ds-{i:02d}" for i in range(20)] and served.esft_sized == []
    assert served.bundles["ds-13"] == served.bundles["ds-03"] == tmp_path / "adapters" / "ds-106e"
    assert [name for name, _ in written] == [f"ds-{t}e" for t in (83, 90, 98, 106, 114, 121, 129, 137, 145, 153)]
    assert all(kw["most"] == 9 for _, kw in written)
    written.clear()
    serve_models.write_adapters(served, "deepseek-v2-lite", tmp_path, 20, distinct=10, esft_sized=5)
    assert served.grid == [f"t1-{i:02d}" for i in range(20)] and served.esft_sized == [f"ds-{i}" for i in range(5)]
    assert [name for name, _ in written][10:] == [f"ds-{t}e" for t in (83, 100, 118, 135, 153)]


METRICS = """# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="base"} 1.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="base"} 3.0
vllm:request_queue_time_seconds_count{engine="0",model_name="base"} 3.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="base"} 0.5
vllm:request_queue_time_seconds_count{engine="1",model_name="base"} 1.0
vllm:request_queue_time_seconds_created{engine="0",model_name="base"} 1.7e+09
vllm:request_prefill_time_seconds_sum NaN
vllm:request_prefill_time_seconds_count 0.0
vllm:time_to_first_token_seconds_sum{model_name="base"} 2e-1
vllm:time_to_first_token_seconds_count{model_name="base"} 4
"""


def test_server_times_add_label_sets_and_servers(monkeypatch):
    """vLLM's histograms from /metrics (Prometheus' text format): _sum and _count added over label sets and
    servers, buckets and _created left out, NaN skipped; the means between two readings in ms."""
    class Reply:
        def read(self):
            return METRICS.encode()
    monkeypatch.setattr(serve_runs.urllib.request, "urlopen", lambda url, timeout: Reply())
    before = serve_runs.server_times(["http://a"])
    assert before == {"queue": [2.0, 4.0], "prefill": [0.0, 0.0], "ttft": [0.2, 4.0], "decode": [0.0, 0.0]}
    after = serve_runs.server_times(["http://a", "http://b"])  # two servers side by side: the sums add
    assert after["queue"] == [4.0, 8.0]
    means = serve_runs.server_means(before, after)
    assert means == {"server_queue_ms": 500.0, "server_prefill_ms": None, "server_ttft_ms": 50.0,
                     "server_decode_ms": None}
