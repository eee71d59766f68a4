"""`esftctl serve`: many adapters in one vLLM server give exactly what their merged models give alone.

For each architecture: three synthetic adapters (2, 4 and 6 experts per layer) are packed, merged into full
models, and the merged models and the base are each served alone by plain vLLM (esftctl.vllm_generate) with
the server's engine settings: the reference. Then one `esftctl serve` holds the base and all three adapters,
and concurrent requests that mix every adapter and the base must get the reference's greedy tokens and
log-probabilities. The same tests run on vLLM's CPU build (CI) and its CUDA build (the GPU machine), where
vLLM's Triton MoE kernel runs and, in the `gpu` tests, CUDA graphs, the Huffman store tier and a GPU with no
memory left but the adapter budget.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import engine_settings, has_gpu, plain_vllm, run_cli, server_args
from rich.console import Console

from esftctl.bench.serve_paging import nudge, settled_status
from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle, file_identity
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl
from esftctl.merge import merge
from esftctl.runtime.serve_config import was_verified
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import load, models, request, status, status_table, unload
from esftctl.world.synthetic import experts_used_by, write_synthetic_adapter
from esftctl.world.tasks import TASKS

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
LOGPROBS = 3
# The same kernels run in both, but in batches of other shapes: log-probabilities may differ in bf16's last
# bits, and a greedy choice may differ only where the two best tokens are that close.
BF16_NOISE = 0.05
ENGINE_ARGS = server_args(engine_settings())


def prompts_of(world) -> list[str]:
    return [e["prompt"] for t in TASKS for e in list(read_jsonl(world.data_file(t.name, "test")))[:2]]


# How far a synthetic adapter moves its experts (x their std): the tiny world's one-word answers are confident,
# and at 8 most of its adapters left every answer of the test prompts as the base gives it.
ADAPTER_SCALE = 32.0


def make_adapters(base: Path, root: Path, seed: int, prompts: list[str]
                  ) -> tuple[dict[str, Path], dict[str, Path]]:
    """Three synthetic adapters of `base` and their merged models: ({name: bundle}, {name: merged dir}). Each
    perturbs the experts `prompts` use most, so that it surely changes their answers."""
    bundles, merged = {}, {}
    used = experts_used_by(base, prompts)
    for k, count in enumerate((2, 4, 6)):
        name = f"task{k}"
        bundles[name] = write_synthetic_adapter(base, root / "bundles" / name, name, seed=seed + k,
                                                experts_per_layer=count, scale=ADAPTER_SCALE, prefer=used)
        merged[name] = merge(base, bundles[name], root / "merged" / name)
    return bundles, merged


def reference(models_by_name: dict[str, Path], prompts: list[str], tmp: Path, engine: dict | None = None
              ) -> dict[str, list[dict]]:
    """Each model served alone by plain vLLM: {name: [per prompt: token_ids, logprobs]}."""
    return plain_vllm(models_by_name, prompts, tmp, MAX_TOKENS, LOGPROBS, engine)


def random_base(architecture: str, world, root: Path) -> Path:
    """A small random base of another architecture, with the tiny world's tokenizer."""
    from transformers import AutoTokenizer

    from esftctl.world.models import make_random_model

    return make_random_model(architecture, root / "base", seed=3,
                             tokenizer=AutoTokenizer.from_pretrained(world.tokenizer_dir))


def serve_exactly(base: Path, prompts: list[str], tmp: Path, engine: dict, seed: int, **options) -> dict:
    """Three adapters of `base` served together, with the base, answer as their merged models served alone by
    plain vLLM with the same engine settings; returns the server's status after the requests."""
    bundles, merged = make_adapters(base, tmp, seed=seed, prompts=prompts)
    ref = reference({"base": base, **merged}, prompts, tmp, engine)
    serve_plan = plan(base, [f"{n}={p}" for n, p in bundles.items()], name="base", port=free_port(),
                      state_dir=tmp / "state", vllm_args=server_args(engine), **options)
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(ref), prompts, ref)
        return status(serve_plan.url)


def complete(url: str, model: str, prompt: str) -> dict:
    reply = request(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                             "temperature": 0.0, "logprobs": LOGPROBS, "return_token_ids": True})
    choice = reply["choices"][0]
    return {"token_ids": choice["token_ids"], "token_logprobs": choice["logprobs"]["token_logprobs"]}


def assert_same_answer(served: dict, ref: dict, what: str) -> None:
    for step, (got, want) in enumerate(zip(served["token_ids"], ref["token_ids"])):
        ref_step = ref["logprobs"][step]
        if got != want:  # only a near-tie may part, and then the contexts differ
            gap = ref_step[str(want)] - ref_step.get(str(got), float("-inf"))
            assert gap < BF16_NOISE, f"{what}: step {step} gave {got}, the merged model {want} (gap {gap:.3f})"
            return
        assert abs(served["token_logprobs"][step] - ref_step[str(want)]) < BF16_NOISE, (what, step)
    assert len(served["token_ids"]) == len(ref["token_ids"]), what


def serve_concurrently(url: str, names: list[str], prompts: list[str], ref: dict) -> None:
    jobs = [(n, i) for n in names for i in range(len(prompts))]
    random.Random(0).shuffle(jobs)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: complete(url, job[0], prompts[job[1]]), jobs))
    for (name, i), answer in zip(jobs, answers):
        assert_same_answer(answer, ref[name][i], f"{name} / {prompts[i]!r}")


@pytest.fixture(scope="module")
def deepseek(world, tmp_path_factory):
    """The tiny world's DeepSeek-V2 base served with three adapters; the reference of every model."""
    tmp = tmp_path_factory.mktemp("serve_deepseek")
    prompts = prompts_of(world)
    bundles, merged = make_adapters(world.base_dir, tmp, seed=10, prompts=prompts)
    ref = reference({"base": world.base_dir, **merged}, prompts, tmp)
    serve_plan = plan(world.base_dir, [f"{n}={p}" for n, p in bundles.items()], name="base", port=free_port(),
                      state_dir=tmp / "state", vllm_args=ENGINE_ARGS)
    with Server(serve_plan) as server:
        server.wait_ready()
        yield {"url": serve_plan.url, "bundles": bundles, "prompts": prompts, "ref": ref, "tmp": tmp,
               "plan": serve_plan}


def test_adapters_served_together_equal_their_merged_models(deepseek):
    url = deepseek["url"]
    assert models(url) == ["base", "task0", "task1", "task2"]
    # The adapters really differ from the base and from each other, or the test would prove nothing.
    ref = deepseek["ref"]
    answers = {n: json.dumps([r["token_ids"] for r in ref[n]]) for n in ref}
    assert len(set(answers.values())) == 4, answers
    serve_concurrently(url, list(ref), deepseek["prompts"], ref)


def test_status_table_accounts_adapter_memory(deepseek):
    s = status(deepseek["url"])
    adapters = {a["name"]: a for a in s["adapters"]}
    assert set(adapters) == {"task0", "task1", "task2"}
    layers = len(s["moe_layers"])
    assert [adapters[f"task{k}"]["experts_per_layer"] for k in range(3)] == [[2] * layers, [4] * layers, [6] * layers]
    # Issue 31, item 4: every row of every adapter was checked to hold its weights where the kernel reads them.
    assert [adapters[f"task{k}"]["checked_rows"] for k in range(3)] == [2 * layers, 4 * layers, 6 * layers]
    assert s["adapter_expert_bytes"] == sum(a["bytes"] for a in adapters.values())
    # Physical memory within one page per layer and tensor of the experts' own bytes; padding costs more.
    page = s["page_bytes"]  # 64 KiB on the host, 2 MiB on CUDA
    assert s["adapter_expert_bytes"] <= s["adapter_physical_bytes"] <= s["adapter_expert_bytes"] + 2 * layers * page
    if s["adapter_expert_bytes"] > 4 * 2 * layers * page:  # pages small against experts (the host's, not CUDA's
        assert s["padded_bytes"] > s["adapter_physical_bytes"]  # 2 MiB under these ~100 KB experts)
    assert s["kv_cache_tokens"] > 0
    proc = run_cli("adapters", "list", "--url", deepseek["url"])
    assert proc.returncode == 0, proc.stderr
    assert "task2" in proc.stdout and "saved vs padding" in proc.stdout and "KV cache" in proc.stdout
    assert any(line.split()[:1] == ["task2"] and str(6 * layers) in line.split() for line in proc.stdout.splitlines())
    # every load timed by phase; the adapters given at start were hashed by the launcher, not again by the engine
    assert {a["loaded_from"] for a in adapters.values()} == {"file, verified before"}
    assert all(set(a["load_s"]) == {"verify", "stage", "copy"} for a in adapters.values())
    assert "s file*" in table_text(s)  # verified before, by the launcher


def test_bad_requests_are_refused_and_serving_goes_on(deepseek, tiny_models, tmp_path):
    url, bundles = deepseek["url"], deepseek["bundles"]
    with pytest.raises(EsftError, match=r"model `nope` does not exist. Servable models: base, task0, task1, "
                                        r"task2.*HTTP 404"):  # issue 18, item 3: every servable name
        complete(url, "nope", "1+1=")
    other = write_synthetic_adapter(tiny_models["deepseek_v2"], tmp_path / "other", "other", seed=1)
    # Issue 18, item 2: an expected refusal is a 4xx naming the bundle's real path, not `<path>` and HTTP 500.
    with pytest.raises(EsftError, match=f"{other}: bundle .*packed for another base model.*HTTP 400"):
        load(url, "other", other)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(bundles["task1"], corrupt)
    data = corrupt / "experts.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EsftError, match=f"{data}: checksum mismatch.*HTTP 400"):
        load(url, "corrupt", corrupt)
    copy = tmp_path / "copy"
    shutil.copytree(bundles["task1"], copy)  # new files, not staged: the middleware verifies them and says so
    load(url, "copy1", copy)
    assert_same_answer(complete(url, "copy1", deepseek["prompts"][0]), deepseek["ref"]["task1"][0], "copy1")
    status_file = deepseek["tmp"] / "state" / "status.json"
    assert was_verified(status_file, file_identity(copy)) and not was_verified(status_file, file_identity(corrupt))
    assert all(was_verified(status_file, file_identity(b)) for b in bundles.values())  # verified by the launcher
    loaded = {a["name"]: a for a in status(url)["adapters"]}  # hashed once, by the middleware; each phase timed
    assert loaded["copy1"]["loaded_from"] == "file, verified before"
    assert set(loaded["copy1"]["load_s"]) == {"verify", "stage", "copy"}
    unload(url, "copy1")
    free = deepseek["plan"].slots - 3
    for k in range(free):
        load(url, f"spare{k}", bundles["task0"])
    assert {a["name"]: a["loaded_from"] for a in status(url)["adapters"]}.get("spare0", "host cache") == "host cache"
    with pytest.raises(EsftError, match="no free adapter slot.*HTTP 507"):
        load(url, "one_too_many", bundles["task0"])
    for k in range(free):
        unload(url, f"spare{k}")
    assert models(url) == ["base", "task0", "task1", "task2"]
    serve_concurrently(url, ["base", "task1"], deepseek["prompts"][:3], deepseek["ref"])


def test_load_and_unload_under_load(deepseek):
    url, prompts, ref = deepseek["url"], deepseek["prompts"], deepseek["ref"]
    stop, failures, served = threading.Event(), [], []

    def client(name: str) -> None:
        i = 0
        while not stop.is_set():
            k = i % len(prompts)
            try:
                assert_same_answer(complete(url, name, prompts[k]), ref[name][k], f"{name} under load")
                served.append(name)
            except Exception as e:  # collected, so that the main thread reports it
                failures.append(f"{name}: {e}")
            i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in ("base", "task0", "task1")]
    for t in threads:
        t.start()
    try:
        for round_ in range(3):
            load(url, "extra", deepseek["bundles"]["task2"])
            for k in range(2):
                assert_same_answer(complete(url, "extra", prompts[k]), ref["task2"][k], f"extra, round {round_}")
            unload(url, "extra")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert {"base", "task0", "task1"} <= set(served)
    after = status(url)
    assert "extra" not in [a["name"] for a in after["adapters"]]
    staged = [list(part) for part in file_identity(deepseek["bundles"]["task2"])]  # staged once and loaded again
    assert staged in after["staged_bundles"]  # from the engine's host cache: the middleware reads it no more


def paged_status(deepseek, world, state: str, **options) -> dict:
    """The adapters served with the base under paging `options` answer as their merged models; the status once
    the engine has rewritten it after those requests."""
    serve_plan = plan(world.base_dir, [f"{n}={p}" for n, p in deepseek["bundles"].items()], name="base",
                      port=free_port(), state_dir=deepseek["tmp"] / state, vllm_args=ENGINE_ARGS, **options)
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(deepseek["ref"]), deepseek["prompts"][:4], deepseek["ref"])
        return settled_status(serve_plan.url, lambda: nudge(serve_plan.url))


def table_text(s: dict) -> str:
    """The status table as the server prints it."""
    console = Console(file=io.StringIO(), width=200)
    console.print(status_table(s))
    return console.file.getvalue()


def test_paged_experts_serve_the_same_answers(deepseek, world):
    """`--paging-window 1 --paging-adaptive`: one MoE layer's base experts at a time, the others loaded just before
    they run, the adapters' rows on the device throughout, and the residency planner deciding between passes."""
    s = paged_status(deepseek, world, "state_paged", paging_window=1, paging_adaptive=True)
    # Every step walks the layers: far more fetches than layers, so paging was really in the path.
    assert s["paging_window"] == 1 and s["paging_fetches"] > 3 * len(s["moe_layers"])
    assert 0 < s["paging_fetched_rows"] <= s["paging_fetches"] * s["paging_held_rows"]
    layers = len(s["moe_layers"])
    assert len(s["paging_resident_layers"]) <= layers - 1 and s["adapter_physical_bytes"] is None
    # Outside the window only adapter rows stay on the device: the window's and the resident layers' base experts,
    # and every adapter row (with at most the two pages per tensor and layer its rows start and end inside).
    window = (1 + len(s["paging_resident_layers"])) * s["base_expert_bytes"] / layers
    assert s["paging_adapter_bytes"] > 0
    assert s["expert_device_bytes"] <= window + s["adapter_expert_bytes"] + 4 * s["page_bytes"] * layers
    # The host tier holds pinned copies of the base rows only.
    assert s["paging_host_base_rows"] and s["paging_host_bytes"] == s["base_expert_bytes"]
    text = table_text(s)
    assert "experts on the device now" in text and "copies of the base experts" in text and "never fetched" in text


@pytest.mark.parametrize("codec", ["fixed", "fixed-host"])
def test_fixed_rate_tier_serves_the_same_answers(deepseek, world, codec):
    """`--paging-window 1 --paging-codec fixed`: every base expert of the paged layers encoded at start-up from
    the loaded weights and decoded from the GPU tier (on vLLM's CPU build too: it encodes the engine's own
    layout), the adapters' rows on the device; no store file, no host copies. `fixed-host`: the same codes in host
    memory (every base expert from them by default), only their small tables on the device."""
    experts = MoECheckpoint(world.base_dir).num_experts
    options = {"store_experts": experts} if codec == "fixed" else {}
    s = paged_status(deepseek, world, f"state_{codec}", paging_window=1, paging_codec=codec, **options)
    assert s["paging_store_codec"] == codec and s["paging_store_experts"] == experts
    assert s["paging_fetches"] > 3 * len(s["moe_layers"])
    assert not s["paging_host_base_rows"] and s["paging_adapter_bytes"] > 0  # every base row from the codes
    if codec == "fixed":  # the codes on the device, nothing on the host
        assert 0.7 * s["base_expert_bytes"] < s["paging_store_bytes"] < 0.8 * s["base_expert_bytes"]
        assert s["paging_host_bytes"] == 0 and "copies of none" in table_text(s)
    else:
        assert s["paging_store_bytes"] < 0.05 * s["base_expert_bytes"]
        assert 0.7 * s["base_expert_bytes"] < s["paging_host_bytes"] < 0.8 * s["base_expert_bytes"]
    assert "fixed-rate" in table_text(s)


@pytest.mark.gpu
def test_store_tier_served_exactly(deepseek, world):
    """`--paging-window 1 --paging-store`: half of every layer's base experts decoded from a Huffman store of
    the base by the GPU decoder, the rest and the adapters' from host copies, inside the real engine."""
    store = deepseek["tmp"] / "base_store"
    run_cli("compress", world.base_dir, "--out", store, check=True)
    serve_plan = plan(world.base_dir, [f"{n}={p}" for n, p in deepseek["bundles"].items()], name="base",
                      port=free_port(), state_dir=deepseek["tmp"] / "state_store", vllm_args=ENGINE_ARGS,
                      paging_window=1, paging_store=store, store_experts=MoECheckpoint(world.base_dir).num_experts // 2)
    with Server(serve_plan) as server:
        server.wait_ready()
        serve_concurrently(serve_plan.url, list(deepseek["ref"]), deepseek["prompts"][:4], deepseek["ref"])
        s = status(serve_plan.url)
    assert s["paging_store_experts"] == MoECheckpoint(world.base_dir).num_experts // 2
    assert s["paging_fetched_rows"] > 0 and s["paging_store_bytes"] > 0


def fill_gpu_memory() -> list:
    """Take every free byte of GPU memory in this process, 2 MiB at a time (what the driver maps), so that
    nothing but memory reserved beforehand is left for a server on the same GPU."""
    import torch

    held, chunk = [], 2 << 20
    while True:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            return held


def release_gpu_memory(held: list) -> None:
    """Give what `fill_gpu_memory` took back to the GPU, not only to this process's caching allocator (the
    tests after this one start engines of their own)."""
    import torch

    held.clear()
    if has_gpu():
        torch.cuda.empty_cache()


def test_adapter_memory_budget_is_reserved_and_enforced(deepseek, world):
    """`--adapter-memory` of exactly two adapters: their memory is set aside before vLLM sizes its KV cache, so
    on a GPU whose free memory another process then takes to the last page both still load and answer
    exactly; a third is refused with one line, and serving goes on; an unloaded one's memory is reusable."""
    bundles, ref, prompts = deepseek["bundles"], deepseek["ref"], deepseek["prompts"][:3]
    base = MoECheckpoint(world.base_dir)
    two = sum(Bundle.open(bundles[n]).num_experts for n in ("task1", "task2"))
    serve_plan = plan(world.base_dir, [], name="base", adapter_memory=two * base.expert_nbytes, port=free_port(),
                      state_dir=deepseek["tmp"] / "state_budget", vllm_args=ENGINE_ARGS)
    with Server(serve_plan) as server:
        server.wait_ready()
        url, held = serve_plan.url, fill_gpu_memory() if has_gpu() else []
        try:
            for name in ("task1", "task2"):
                load(url, name, bundles[name])
            with pytest.raises(EsftError, match="adapter memory budget exceeded"):
                load(url, "task0", bundles["task0"])
            serve_concurrently(url, ["base", "task1", "task2"], prompts, ref)
            s = status(url)
            # task1 ran in the last step, so unloading it only retires it; a load that needs its memory evicts it
            serve_concurrently(url, ["task1"], prompts[:1], ref)
            unload(url, "task1")
            load(url, "task1_again", bundles["task1"])
            serve_concurrently(url, ["task1_again"], prompts[:1], {"task1_again": ref["task1"]})
        finally:
            release_gpu_memory(held)
    assert s["adapter_expert_bytes"] == s["adapter_budget_bytes"]
    assert (s["reserved_bytes"] >= s["adapter_budget_bytes"]) if has_gpu() else s["reserved_bytes"] == 0


@pytest.mark.parametrize("architecture", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3",
                                          "qwen3_next", "gpt_oss"])
def test_other_architecture_served_exactly(architecture, world, tmp_path):
    serve_exactly(random_base(architecture, world, tmp_path), prompts_of(world)[:4], tmp_path, engine_settings(),
                  seed=20)


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_cuda_graphs_served_exactly(architecture, world, tmp_path):
    """vLLM's default compilation and CUDA graphs, on the server and on the plain-vLLM reference alike."""
    base = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    serve_exactly(base, prompts_of(world)[:4], tmp_path, engine_settings(graphs=True), seed=30)


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["deepseek_v2", "qwen2_moe"])
def test_paging_with_cuda_graphs_served_exactly(architecture, world, tmp_path):
    """Issue 28: every paged mode with CUDA graphs on the server and the reference alike. DeepSeek-V2 (3 MoE
    layers): two blocks, half of every layer's base experts decoded from a compressed tier on the GPU and the rest
    read from host memory (the adapters' rows stay on the GPU), the routed rows fetched in decode steps and whole
    layers ahead in prefills (--paging-fetch auto); the second layer, alone in its block, parked there. Qwen2-MoE
    (4): the same with the adaptive planner, which on these tiny models keeps every layer outside the window
    resident from the start and parks the window's two, one a block (its start: test_runtime_vllm_model.py;
    residency changes under captured graphs: test_runtime_paging.py's replays)."""
    base = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    store = tmp_path / "store"
    run_cli("compress", base, "--out", store, check=True)
    half = MoECheckpoint(base).num_experts // 2
    adaptive = architecture == "qwen2_moe"
    s = serve_exactly(base, prompts_of(world)[:4], tmp_path, engine_settings(graphs=True), seed=50, paging_window=2,
                      paging_store=store, store_experts=half, paging_adaptive=adaptive)
    assert s["paging_store_experts"] == half and s["paging_store_bytes"] > 0 and s["paging_window_bytes"] > 0
    layers = s["moe_layers"]
    if adaptive:
        paged = [l for l in layers if l not in s["paging_resident_layers"]]
        assert s["paging_parked_layers"] == paged and len(paged) == 2 and s["paging_decisions"]
    else:
        assert 0 < s["paging_fetched_rows"] < s["paging_fetches"] * s["paging_held_rows"]  # decode: routed rows
        assert s["paging_parked_layers"] == [layers[1]]


@pytest.mark.parametrize("architecture", [pytest.param("deepseek_v2", marks=pytest.mark.gpu), "qwen3_moe"])
def test_fixed_rate_tier_served_exactly(architecture, world, tmp_path):
    """Issue 28's other compressed GPU tier, with CUDA graphs on both sides where there is a GPU (eager on vLLM's
    CPU build, where paging implies it): every base expert of the paged layers decoded from the fixed-rate codes
    encoded at start-up, two shared blocks; Qwen3-MoE (the architecture of the paging bench's KV-heavy model)
    everywhere, with the planner between steps; DeepSeek-V2 on the GPU without it (the CPU has its fixed-tier test
    above)."""
    base = world.base_dir if architecture == "deepseek_v2" else random_base(architecture, world, tmp_path)
    experts = MoECheckpoint(base).num_experts
    adaptive = architecture == "qwen3_moe"  # on a GPU it parks every paged layer from the start: nothing fetched
    s = serve_exactly(base, prompts_of(world)[:4], tmp_path, engine_settings(graphs=has_gpu()), seed=60,
                      paging_window=2, paging_codec="fixed", store_experts=experts, paging_adaptive=adaptive)
    assert s["paging_store_codec"] == "fixed" and s["paging_store_experts"] == experts
    assert s["paging_store_bytes"] > 0 and s["paging_window_bytes"] > 0
    if not adaptive:  # layers 1 and 3 share a block: the tier's decoder runs every step
        assert s["paging_fetches"] > 0 and s["paging_parked_layers"] == [s["moe_layers"][1]]


def test_serve_refuses_bad_input_before_starting_vllm(world, tiny_models, tmp_path):
    other = write_synthetic_adapter(tiny_models["deepseek_v2"], tmp_path / "other", "other", seed=1)
    proc = run_cli("serve", world.base_dir, "--adapter", f"x={other}")
    assert proc.returncode == 1 and "packed for another base model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = run_cli("serve", world.base_dir, "--adapter", "no_equals_sign")
    assert proc.returncode == 1 and "expected NAME=BUNDLE" in proc.stderr
    proc = run_cli("serve", world.base_dir, "--adapter", f"x={tmp_path}")
    assert proc.returncode == 1 and "not an adapter bundle" in proc.stderr
    mine = write_synthetic_adapter(world.base_dir, tmp_path / "mine", "mine", seed=2)
    proc = run_cli("serve", world.base_dir, "--adapter", f"mine={mine}", "--adapter-memory", "1KB")
    assert proc.returncode == 1 and "--adapter-memory 1000 B is below adapter 'mine'" in proc.stderr
    proc = run_cli("serve", world.base_dir, "--adapter-memory", "lots")
    assert proc.returncode == 1 and "cannot read 'lots' as a size" in proc.stderr
    proc = run_cli("serve", world.base_dir, "--paging-window", "4")
    assert proc.returncode == 1 and "--paging-window 4: choose 1..2 layers" in proc.stderr
    proc = run_cli("serve", world.base_dir, "--paging-window", "3", "--paging-adaptive")  # 3: every layer resident
    assert proc.returncode == 1 and "every layer is resident already" in proc.stderr
    proc = run_cli("serve", world.base_dir, "--paging-adaptive")
    assert proc.returncode == 1 and "need --paging-window" in proc.stderr
    run_cli("compress", other, "--out", tmp_path / "bundle_store", check=True)
    proc = run_cli("serve", world.base_dir, "--paging-window", "1", "--paging-store", tmp_path / "bundle_store")
    assert proc.returncode == 1 and "holds an adapter bundle" in proc.stderr
    run_cli("compress", tiny_models["qwen2_moe"], "--out", tmp_path / "other_store", check=True)
    proc = run_cli("serve", world.base_dir, "--paging-window", "1", "--paging-store", tmp_path / "other_store")
    assert proc.returncode == 1 and "made from another model" in proc.stderr  # same names and shapes, other weights
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("serve", world.base_dir, "--paging-window", "1", "--store-experts", "2")
    assert proc.returncode == 1 and "--store-experts needs --paging-store" in proc.stderr
    if has_gpu():
        return  # vLLM's CUDA build keeps experts in the checkpoint's layout: test_store_tier_served_exactly
    # A store of this base passes the checks, but vLLM's CPU build prepacks experts, which the store tier cannot
    # write: the engine refuses at start-up, and the CLI reports that one line.
    run_cli("compress", world.base_dir, "--out", tmp_path / "base_store", check=True)
    proc = run_cli("serve", world.base_dir, "--paging-window", "1", "--paging-store", tmp_path / "base_store",
                   "--port", str(free_port()), "--state-dir", tmp_path / "state", "--", *ENGINE_ARGS)  # its log
    assert proc.returncode == 1 and "keeps its own" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("serve", world.base_dir, "--adapter", f"x={other}", "--slots", "0")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr


def test_serve_refuses_a_busy_port_before_starting_vllm(world, tmp_path):
    """Issue 18, item 1: with another server on the port, one line at once, and no state folder left behind."""
    import socket
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("esftctl-serve-*"))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = run_cli("serve", world.base_dir, "--port", port)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port} (Address already in use): another "
                                   "server? choose another --port"), proc.stderr
    assert set(Path(tempfile.gettempdir()).glob("esftctl-serve-*")) == before


def test_a_server_that_is_not_ours_is_never_taken_for_ours(tmp_path, monkeypatch):
    """Issue 18, item 1: should another server answer on the port while ours starts, the launcher stops and says
    so instead of reporting that server's models and status as its own."""
    import http.server
    import threading

    from esftctl.runtime.serve_config import ServeSettings
    from esftctl.serve import AnotherServer, ServePlan

    monkeypatch.setattr(ServePlan, "command", lambda self: ["sleep", "60"])  # "our vLLM", still starting

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"server_pid": 1, "adapters": []} if self.path == "/esftctl/status" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor) as impostor:
        threading.Thread(target=impostor.serve_forever, daemon=True).start()
        settings = ServeSettings(base=tmp_path, port=impostor.server_address[1], state_dir=tmp_path / "s")
        serve_plan = ServePlan(settings, tmp_path, "base")
        server = Server(serve_plan)
        server.start()
        with pytest.raises(AnotherServer, match=r"another server \(process 1\) answers at http://127.0.0.1:"):
            server.wait_ready(timeout=20)
        assert server.process.poll() is not None  # ours was stopped
        impostor.shutdown()


def test_serve_removes_its_temporary_state_folder_on_stop(world, tmp_path):
    """Issue 18, item 6: `esftctl serve` without --state-dir leaves no /tmp/esftctl-serve-* behind (SIGTERM)."""
    import os
    import signal
    import subprocess
    import sys

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "esftctl.cli", "serve", world.base_dir, "--port", str(port),
                             "--", *ENGINE_ARGS], env={**os.environ, "TMPDIR": str(scratch)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if models(f"http://127.0.0.1:{port}") == [world.base_dir.name]:
                    break
            except EsftError:
                time.sleep(1)
        state = list(scratch.glob("esftctl-serve-*"))
        assert len(state) == 1 and (state[0] / "vllm.log").exists(), proc.poll()
        time.sleep(2)  # past the launcher's own status requests
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert not list(scratch.glob("esftctl-serve-*"))  # (vLLM leaves files of its own in TMPDIR)
