"""EsftModel on CPU and CUDA, without vLLM: the runtime installed into a model shaped like vLLM's.

vLLM is not installed on the GPU machine, so its CUDA path (virtual tensors from the CUDA driver behind the
weights, the Triton reroute inside the router's capture callback, CUDA-graph replay while the per-token
adapters change) is exercised here on a module tree with the attributes EsftModel uses: `layers.{L}.mlp.
experts` holding a `router` (set_capture_fn) and `routed_experts` (w13_weight, w2_weight, and a kernel whose
weight processing keeps the checkpoint layout). A plain PyTorch MoE reads the weights through the ids the
capture callback left, as vLLM's fused kernel does. Served with adapters, each token must get what the
merged model of its adapter gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.runtime.moe_layer import stack_experts
from esftctl.runtime.vllm.model import EsftModel
from esftctl.world.synthetic import synthetic_experts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Router:
    def __init__(self, gate: torch.Tensor, top_k: int):
        self.gate, self.top_k, self.capture_fn = gate, top_k, None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(x.float() @ self.gate.float().T, -1), self.top_k)
        ids = ids.to(torch.int32)
        if self.capture_fn is not None:
            self.capture_fn(ids)
        return weights, ids


class CPUUnquantizedExperts:
    """Named as vLLM's CPU kernel, which indexes weights by expert id, as MoE.forward below does."""

    def process_weights_after_loading(self, layer) -> None:
        pass


class TritonExperts(CPUUnquantizedExperts):
    """Named as vLLM's Triton kernel, which applies the expert map (pairs mapped to -1 are another rank's), as
    MoE.forward below does."""


class UnquantizedFusedMoEMethod:
    """Named as vLLM's method for bf16 experts: EsftModel refuses other methods and kernels by name."""

    is_monolithic = False

    def __init__(self, kernel=CPUUnquantizedExperts):
        self.moe_kernel = SimpleNamespace(fused_experts=kernel())


class Experts(torch.nn.Module):
    """Shaped as esftctl's RoutedExperts in vLLM: `run_layers` calls the pager around it as that class does.
    `expert_map`: expert parallelism, as vLLM sets it up (this rank's rows of its experts, -1 elsewhere)."""

    esft_paging = None

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, expert_map: torch.Tensor | None = None, top_k: int = 2):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        self.quant_method = UnquantizedFusedMoEMethod(CPUUnquantizedExperts if expert_map is None else TritonExperts)
        ep = expert_map is not None
        parallel = SimpleNamespace(use_ep=ep, enable_eplb=False, tp_rank=0, tp_size=1)
        experts = w13.shape[0] if expert_map is None else len(expert_map)
        self.moe_config = SimpleNamespace(moe_parallel_config=parallel, num_experts=experts,
                                          intermediate_size_per_partition=w2.shape[-1])
        self.expert_map_manager = SimpleNamespace(num_fused_shared_experts=0)
        self.activation, self.global_num_experts, self.top_k = "silu", experts, top_k
        self.register_buffer("_expert_map", expert_map, persistent=False)

    @property
    def expert_map(self) -> torch.Tensor | None:
        return self._expert_map


class MoE(torch.nn.Module):
    def __init__(self, router: Router, experts: Experts):
        super().__init__()
        self.router, self.routed_experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router.select(x)
        paging = self.routed_experts.esft_paging  # as esftctl's RoutedExperts calls the pager (runtime/vllm/layers.py)
        if paging is not None:
            paging[0].before_kernel(paging[1], ids, x.shape[0])
        expert_map = self.routed_experts.expert_map
        if expert_map is not None:  # another rank's pairs count nothing here
            ids = expert_map[ids.long()]
            weights, ids = weights * (ids >= 0), ids.clamp(min=0)
        w13, w2 = self.routed_experts.w13_weight[ids.long()], self.routed_experts.w2_weight[ids.long()]
        gate, up = (w13.float() @ x.float()[:, None, :, None]).squeeze(-1).chunk(2, -1)
        out = (w2.float() @ (torch.nn.functional.silu(gate) * up)[..., None]).squeeze(-1)
        if paging is not None:
            paging[0].after_kernel(paging[1])
        return (weights[..., None] * out).sum(1)


def engine_model(ckpt: MoECheckpoint, experts: dict | None, device: str,
                 rank: tuple[int, int] | None = None) -> torch.nn.Module:
    """`ckpt`'s MoE layers (with `experts` replacing some, as in a merged model) as vLLM-shaped modules;
    `rank` (r, n): rank r's part under expert parallelism over n ranks, experts placed round-robin (vLLM's
    other placement, "linear", gives contiguous blocks: the runtime reads whichever from the map)."""
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleDict()
    for l in ckpt.moe_layers:
        weights = [ckpt.read_expert(l, e) for e in range(ckpt.num_experts)]
        for e, w in (experts or {}).get(l, {}).items():
            weights[e] = w
        expert_map = None
        if rank is not None:
            r, n = rank
            weights = weights[r::n]
            expert_map = torch.tensor([e // n if e % n == r else -1 for e in range(ckpt.num_experts)],
                                      dtype=torch.int32, device=device)
        w13, w2 = stack_experts(weights)
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = MoE(Router(ckpt.read_router(l).to(device), ckpt.top_k),
                                Experts(w13.to(device), w2.to(device), expert_map, ckpt.top_k))
        root.layers[str(l)] = layer
    return root


def run_layers(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every MoE layer on x, one after another (residual), as the model's forward would."""
    for layer in model.layers.values():
        x = x + layer.mlp.experts(x).to(x.dtype)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paging_window", [0, 1, 2])
def test_tokens_of_each_adapter_get_their_merged_model(tiny_models, device, paging_window):
    """With base experts paged (window 1 or 2 of 3 MoE layers) or not. With 2 blocks, the second layer is alone in
    its block: parked there, its adapters' rows copied in as they load."""
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=k, experts_per_layer=2 + 2 * k, scale=4.0) for k in range(3)}
    served = engine_model(ckpt, None, device)
    runtime = EsftModel(served, ckpt, num_slots=4, experts_per_slot=6, max_tokens=64, paging_window=paging_window)
    slots = {name: runtime.slots.load(name, experts) for name, experts in adapters.items()}
    assert isinstance(served.layers["1"].mlp.experts.routed_experts.w13_weight.data, torch.Tensor)
    x = torch.randn(48, ckpt.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    owner = np.array([-1, 0, 1, 2] * 12, dtype=np.int32)  # base, a0, a1, a2 interleaved
    runtime.set_token_adapters(owner)
    got = run_layers(served, x)
    for name, slot in [("base", -1), *slots.items()]:
        merged = engine_model(ckpt, adapters.get(name), device)
        want = run_layers(merged, x)
        rows = owner == slot
        torch.testing.assert_close(got[torch.from_numpy(rows).to(device)], want[torch.from_numpy(rows).to(device)],
                                   rtol=0, atol=0, msg=f"tokens of {name}")
    if paging_window:
        counters = runtime.pager.counters()
        assert runtime.pager.parked == ({2} if paging_window == 2 else set())
        assert counters["fetches"] == len(runtime.layers) - len(runtime.pager.parked) and counters["fetched_rows"] > 0
        assert runtime.pager.window.size == paging_window
    # The adapters change the outputs, so the comparison above means something.
    assert not torch.equal(run_layers(engine_model(ckpt, adapters["a2"], device), x), run_layers(
        engine_model(ckpt, None, device), x))


def _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed):
    x = torch.randn(40, ckpt.hidden_size, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    owner = np.array(([-1] + sorted(slots.values())) * 40, dtype=np.int32)[:40]
    runtime.set_token_adapters(owner)
    got = run_layers(served, x)
    for name, slot in [("base", -1), *slots.items()]:
        rows = torch.from_numpy(owner == slot).to(device)
        want = run_layers(engine_model(ckpt, adapters.get(name), device), x)
        torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=0, msg=f"tokens of {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_adapter_experts_stay_on_the_device_while_their_layer_pages(tiny_models, device):
    """Window 1 of 3 layers: a paged-out layer gives its base rows back and keeps its adapters' rows (they are
    never fetched), the window's one block holds the base rows of one layer; adapters loaded and unloaded while
    their layers are out still give their merged models."""
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=20 + k, experts_per_layer=3 + k, scale=4.0) for k in range(4)}
    served = engine_model(ckpt, None, device)
    runtime = EsftModel(served, ckpt, num_slots=3, experts_per_slot=6, max_tokens=64, paging_window=1)
    slots = {name: runtime.slots.load(name, adapters[name]) for name in ("a0", "a1")}
    _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=1)
    # The layers keep their adapter rows (a0's 3 experts, a1's 4, and at most the page they share with the last
    # base row per tensor) and compute their base rows from the window's one block.
    page = runtime.page_bytes
    for layer in runtime.layers.values():
        assert 7 * layer.expert_bytes <= layer.physical_bytes() <= 7 * layer.expert_bytes + 2 * 2 * page
        assert layer.physical_bytes() == layer.adapter_device_bytes()
    assert runtime.pager.device_bytes()["adapters"] == sum(l.physical_bytes() for l in runtime.layers.values())
    base = next(iter(runtime.layers.values())).base_bytes()
    assert base - 2 * page <= runtime.pager.device_bytes()["window"] <= base

    runtime.slots.evict("a0")
    runtime.slots.collect()
    slots.pop("a0")
    slots["a2"] = runtime.slots.load("a2", adapters["a2"])  # into their own pages, the layers paged out
    slots["a3"] = runtime.slots.load("a3", adapters["a3"])
    _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=2)
    for name in ("a1", "a2", "a3"):
        runtime.slots.evict(name)
    runtime.slots.collect()  # no adapter left: a paged layer holds at most its shared page of each tensor
    assert all(layer.physical_bytes() <= 2 * page for layer in runtime.layers.values())
    runtime.pager.close()


@pytest.mark.gpu
def test_start_up_holds_at_most_one_layer_of_experts_twice(tmp_path):
    """EsftModel maps each layer's base rows into memory of its own and drops vLLM's tensors of them: while it
    installs layer after layer, the card's memory in use grows by at most one layer's experts, not by one a layer
    (kept in torch's cache, vLLM's tensors made the start-up hold the base's experts twice, 27 GiB more for
    DeepSeek-V2-Lite: out of memory beside plain vLLM on an 80 GB H100, 2026-12-05)."""
    from unittest import mock

    from esftctl.world.models import make_random_model

    ckpt = MoECheckpoint(make_random_model("deepseek_v2", tmp_path / "wide", seed=3, hidden_size=1024,
                                           moe_intermediate_size=512, num_hidden_layers=6))  # 5 of 48 MiB experts
    served = engine_model(ckpt, None, "cuda")
    experts = served.layers[str(ckpt.moe_layers[0])].mlp.experts.routed_experts
    layer_bytes = sum(t.numel() * t.element_size() for t in (experts.w13_weight, experts.w2_weight))
    used, install = [], EsftModel._install

    def measured(self, *args):
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used.append(total - free)
        return install(self, *args)

    torch.cuda.empty_cache()
    with mock.patch.object(EsftModel, "_install", measured):
        EsftModel(served, ckpt, num_slots=1, experts_per_slot=4, max_tokens=64)
    assert len(used) == len(ckpt.moe_layers) == 5  # without the hand-back the last grew by 4 layers
    growth = [u - used[0] for u in used]
    assert max(growth) <= 1.5 * layer_bytes, (growth, layer_bytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store_experts", [3, None])  # None: split by the tiers' measured speeds
def test_store_tier_and_planner_page_the_same_answers(tiny_models, tmp_path, device, store_experts):
    """Base experts decoded from a Huffman store of the base (the first `store_experts` of each layer), the
    rest and the adapters' from host copies, with the residency planner running every pass."""
    from esftctl.formats.store import ExpertStore, compress

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    compress(ckpt.path, tmp_path / "store")
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=30 + k, experts_per_layer=2 + k, scale=4.0) for k in range(2)}
    served = engine_model(ckpt, None, device)
    runtime = EsftModel(served, ckpt, num_slots=2, experts_per_slot=4, max_tokens=64, paging_window=1,
                        paging_store=ExpertStore(tmp_path / "store"), store_experts=store_experts, adaptive=True)
    runtime.residency.every = 1
    split = runtime.pager.store_rows
    assert split == 3 if store_experts else 0 <= split <= ckpt.num_experts
    slots = {name: runtime.slots.load(name, experts) for name, experts in adapters.items()}
    for seed in range(3):  # the planner may change what stays resident between these passes
        runtime.pager.step()
        _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=seed)
    assert runtime.residency.decisions and runtime.pager.counters()["fetched_rows"] > 0
    runtime.pager.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["huffman", "fixed"])
@pytest.mark.parametrize("split", ["all", "half"])
def test_base_rows_get_host_copies_only_where_the_host_tier_may_serve_them(tiny_models, tmp_path, device, tier,
                                                                           split):
    """`--store-experts` = the expert count: a compressed tier delivers every base row, so the layers keep no host
    copies (Qwen3-30B-A3B's shape: 38.6 GB of pinned base copies saved; adapter rows stay on the device); half from
    the tier keeps the base rows' copies. Tokens get their merged models either way, with adapters loaded and
    unloaded and a layer made resident and paged out again."""
    from esftctl.formats.store import ExpertStore, compress

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    options = {"fixed_tier": True}
    if tier == "huffman":
        compress(ckpt.path, tmp_path / "store")
        options = {"paging_store": ExpertStore(tmp_path / "store")}
    experts = ckpt.num_experts if split == "all" else ckpt.num_experts // 2
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=50 + k, experts_per_layer=2 + k, scale=4.0) for k in range(3)}
    served = engine_model(ckpt, None, device)
    runtime = EsftModel(served, ckpt, num_slots=2, experts_per_slot=5, max_tokens=64, paging_window=1,
                        store_experts=experts, **options)
    layers = list(runtime.layers.values())
    base_bytes = sum(l.num_experts * l.expert_bytes for l in layers)

    def host_bytes() -> int:
        return sum(l.host_bytes() for l in layers) - (0 if split == "all" else base_bytes)

    assert runtime.pager.store_rows == experts and [l.base_copies for l in layers] == [split == "half"] * len(layers)
    assert host_bytes() == 0
    slots = {name: runtime.slots.load(name, adapters[name]) for name in ("a0", "a1")}
    assert host_bytes() == 0  # adapter rows stay on the device
    _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=1)
    runtime.slots.evict("a0")
    runtime.slots.collect()
    slots.pop("a0")
    slots["a2"] = runtime.slots.load("a2", adapters["a2"])
    assert host_bytes() == 0
    first = next(iter(runtime.layers))
    for resident in ([first], []):  # made resident (its own pages filled), then paged out again
        runtime.pager.set_resident(resident)
        _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=2)
    runtime.pager.close()


def test_store_tier_refuses_an_engine_layout_it_cannot_write(tiny_models, tmp_path):
    from esftctl.errors import EsftError
    from esftctl.formats.store import ExpertStore, compress

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    compress(ckpt.path, tmp_path / "store")
    served = engine_model(ckpt, None, "cpu")
    for layer in served.layers.values():  # an engine that keeps w13 with up before gate
        experts = layer.mlp.experts.routed_experts
        def swap(module):
            module.w13_weight.data = torch.cat(module.w13_weight.data.chunk(2, 1)[::-1], 1).contiguous()
        experts.quant_method.moe_kernel.fused_experts.process_weights_after_loading = swap
        swap(experts)
    with pytest.raises(EsftError, match="checkpoint's layout"):
        EsftModel(served, ckpt, num_slots=2, experts_per_slot=4, max_tokens=16, paging_window=1,
                  paging_store=ExpertStore(tmp_path / "store"))


def test_the_kv_need_is_what_the_scheduler_can_hold():
    """max_num_seqs sequences of max_model_len tokens at vLLM's memory share; none where vLLM's KV cache has a
    size of its own (--kv-cache-memory-bytes) or its bytes per token are unknown."""
    from esftctl.runtime.paging.planner import KvNeed
    from esftctl.runtime.vllm.worker import kv_need

    def config(kv_cache_memory_bytes=None, mla=True):
        text = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64)
        model = SimpleNamespace(get_num_layers=lambda parallel: 27, hf_text_config=text, use_mla=mla,
                                dtype=torch.bfloat16, max_model_len=4096)
        cache = SimpleNamespace(cache_dtype="auto", gpu_memory_utilization=0.9,
                                kv_cache_memory_bytes=kv_cache_memory_bytes)
        return SimpleNamespace(model_config=model, parallel_config=None, cache_config=cache,
                               scheduler_config=SimpleNamespace(max_num_seqs=64))

    assert kv_need(config()) == KvNeed(tokens=64 * 4096, bytes_per_token=27 * 576 * 2, utilization=0.9)
    assert kv_need(config(kv_cache_memory_bytes=8 << 30)) is None
    assert kv_need(config(mla=False)) is None  # a model config without KV heads: unknown bytes per token


@pytest.mark.gpu
def test_adaptive_paging_starts_with_the_layers_the_kv_cache_leaves_room_for(tiny_models):
    """A KV need that leaves the card's share free keeps every layer outside the window resident from the start
    (the window's layer parked in it, the adapter's rows in pages of their own); one beyond the share keeps none;
    the tokens stay the merged model's either way."""
    from esftctl.runtime.paging.planner import KvNeed

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {"a0": synthetic_experts(ckpt, seed=40, experts_per_layer=3, scale=4.0)}
    total = torch.cuda.mem_get_info()[1]
    for tokens, resident in ((1, len(ckpt.moe_layers) - 1), (total, 0)):
        served = engine_model(ckpt, None, "cuda")
        runtime = EsftModel(served, ckpt, num_slots=1, experts_per_slot=4, max_tokens=64, paging_window=1,
                            adaptive=True, kv_need=KvNeed(tokens=tokens, bytes_per_token=1, utilization=0.9))
        assert len(runtime.pager.resident) == resident
        assert len(runtime.pager.parked) == (1 if resident else 0)  # the one paged layer, alone in the window
        slots = {"a0": runtime.slots.load("a0", adapters["a0"])}
        _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, "cuda", seed=5)
        runtime.pager.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec,store_experts", [("fixed", 3), ("fixed", None), ("fixed-host", None)])
def test_fixed_rate_tier_pages_the_same_answers(tiny_models, device, codec, store_experts):
    """`--paging-codec fixed`: base experts encoded at start-up from the rows the engine loaded (in its own layout:
    on vLLM's CPU build too, where the Huffman store is refused), no store file; adapters and planner as above.
    None: split by the tiers' measured speeds. `fixed-host`: the same codes in host memory (on a GPU pinned, decoded
    over the bus), every base expert from them by default, no host copies of the base rows."""
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=40 + k, experts_per_layer=2 + k, scale=4.0) for k in range(2)}
    served = engine_model(ckpt, None, device)
    runtime = EsftModel(served, ckpt, num_slots=2, experts_per_slot=4, max_tokens=64, paging_window=1,
                        fixed_tier=True, fixed_on_host=codec == "fixed-host", store_experts=store_experts,
                        adaptive=True)
    runtime.residency.every = 1
    assert runtime.pager.codec == codec and runtime.pager.store.nbytes > 0
    split = runtime.pager.store_rows
    if codec == "fixed-host":
        assert split == ckpt.num_experts and not any(layer.base_copies for layer in runtime.layers.values())
        assert runtime.pager.store.host_nbytes > 10 * runtime.pager.store.nbytes
    else:
        assert split == 3 if store_experts else 0 <= split <= ckpt.num_experts
    if store_experts is None:
        runtime.pager.set_store_rows(ckpt.num_experts)  # every base expert from the codes
    slots = {name: runtime.slots.load(name, experts) for name, experts in adapters.items()}
    for seed in range(2):
        runtime.pager.step()
        _assert_tokens_match_merged(ckpt, served, runtime, adapters, slots, device, seed=seed)
    runtime.pager.close()


@pytest.mark.gpu
def test_reroute_replays_in_a_cuda_graph_as_adapters_change(tiny_models):
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=10 + k, experts_per_layer=3, scale=4.0) for k in range(2)}
    served = engine_model(ckpt, None, "cuda")
    runtime = EsftModel(served, ckpt, num_slots=2, experts_per_slot=3, max_tokens=32)
    for name, experts in adapters.items():
        runtime.slots.load(name, experts)
    x = torch.randn(32, ckpt.hidden_size, device="cuda", dtype=torch.bfloat16)
    runtime.set_token_adapters(np.zeros(32, dtype=np.int32))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run_layers(served, x)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = run_layers(served, x)
    # [1] * 20: 12 padding tokens take the base; a repeated step writes nothing, a shorter one resets the tail
    for pattern in ([-1] * 32, [0] * 32, [1, -1] * 16, [1] * 20, [1] * 20, [0] * 8, [0] * 8, [0] * 32):
        runtime.set_token_adapters(np.array(pattern, dtype=np.int32))
        graph.replay()
        torch.cuda.synchronize()
        owner = np.array(pattern + [-1] * (32 - len(pattern)))
        for slot, name in [(-1, None), (0, "a0"), (1, "a1")]:
            rows = torch.from_numpy(owner == slot).cuda()
            if rows.any():
                want = run_layers(engine_model(ckpt, adapters.get(name), "cuda"), x)
                torch.testing.assert_close(out[rows], want[rows], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_token_adapters_hold_every_step_also_when_a_step_repeats(tiny_models, device):
    """Unchanged steps are not written again (set_token_adapters): the buffer must still hold each step's slots."""
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    runtime = EsftModel(engine_model(ckpt, None, device), ckpt, num_slots=2, experts_per_slot=3, max_tokens=8)
    for step in ([0, 1, -1], [0, 1, -1], [0, 1], [0, 1], [1, 1], [], [1, 0, 0, 1, 1, 0, 0, 1], [1]):
        runtime.set_token_adapters(np.array(step, dtype=np.int32))
        assert runtime.token_adapters.tolist() == step + [-1] * (8 - len(step))


def test_kernel_computes_every_row_and_unsupported_layers_are_refused(tiny_models):
    """The experts layer's expert count (what vLLM's Triton kernel aligns over) becomes the row count, while
    the router keeps routing over the base's E; layer set-ups in which adapter rows would be dropped or
    mis-mapped are refused with one line."""
    from esftctl.errors import EsftError
    from esftctl.runtime.vllm import moe as vllm_moe

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    served = engine_model(ckpt, None, "cpu")
    runtime = EsftModel(served, ckpt, num_slots=3, experts_per_slot=5, max_tokens=16)
    for index, layer in runtime.layers.items():
        experts = served.layers[str(index)].mlp.experts.routed_experts
        assert experts.global_num_experts == layer.num_rows == ckpt.num_experts + 3 * 5
        assert experts.esft_kernel_config is None  # the by-id kernel has no tile configs

    def refused(change, match):
        model = engine_model(ckpt, None, "cpu")
        moe = model.layers[str(ckpt.moe_layers[0])].mlp.experts
        change(moe.routed_experts)
        with pytest.raises(EsftError, match=match):
            EsftModel(model, ckpt, num_slots=2, experts_per_slot=2, max_tokens=16)

    refused(lambda e: setattr(e.quant_method, "is_monolithic", True), "monolithic")
    refused(lambda e: setattr(e, "quant_method", SimpleNamespace(is_monolithic=False)), "quantized experts")
    refused(lambda e: setattr(e.quant_method.moe_kernel, "fused_experts", object()), "has not been checked on")
    refused(lambda e: setattr(e.moe_config.moe_parallel_config, "use_ep", True), "expert parallelism needs a kernel")
    refused(lambda e: e.register_buffer("_expert_map", torch.arange(ckpt.num_experts)), "CPUUnquantizedExperts")
    refused(lambda e: setattr(e.moe_config.moe_parallel_config, "enable_eplb", True), "EPLB")
    refused(lambda e: setattr(e.expert_map_manager, "num_fused_shared_experts", 1), "shared experts fused")
    refused(lambda e: setattr(e.moe_config, "num_logical_experts", ckpt.num_experts - 1), "redundant experts")
    # Experts with biases (GPT-OSS): both biases, in the weights' dtype, on one rank.
    def biases(e, dtype=torch.bfloat16, both=True, tp=1):
        e.moe_config.moe_parallel_config.tp_size = tp
        e.register_parameter("w13_bias", torch.nn.Parameter(torch.zeros(e.w13_weight.shape[:2], dtype=dtype)))
        if both:
            e.register_parameter("w2_bias", torch.nn.Parameter(torch.zeros(e.w2_weight.shape[:2], dtype=dtype)))

    refused(lambda e: biases(e, both=False), "with both w13_bias and w2_bias only")
    refused(lambda e: biases(e, dtype=torch.float32), "keeps expert biases in torch.float32")
    refused(lambda e: biases(e, tp=2), "biases .* under tensor or expert parallelism")
    model = engine_model(ckpt, None, "cpu")
    model.layers[str(ckpt.moe_layers[0])].mlp.experts.router.zero_expert_type = "identity"
    with pytest.raises(EsftError, match="zero-expert routing"):
        EsftModel(model, ckpt, num_slots=2, experts_per_slot=2, max_tokens=16)
    engine = SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=False),
                             aux_output_config=SimpleNamespace(enable_return_routed_experts=True),
                             parallel_config=SimpleNamespace(enable_dbo=False, data_parallel_size=1))
    with pytest.raises(EsftError, match="returning routed experts"):
        vllm_moe.check_engine(engine)
    engine.aux_output_config.enable_return_routed_experts = False
    vllm_moe.check_engine(engine)
    engine.parallel_config.data_parallel_size = 2
    with pytest.raises(EsftError, match="data parallelism"):
        vllm_moe.check_engine(engine)
    # The Triton kernel's alignment limit: checked per layer, with what to lower.
    with pytest.raises(EsftError, match=r"1000 expert rows per layer .* exceed the 992"):
        vllm_moe.check_rows(1000, vllm_moe.KERNEL_MAX_ROWS, 64, "layer 1")
    vllm_moe.check_rows(992, vllm_moe.KERNEL_MAX_ROWS, 64, "layer 1")
    vllm_moe.check_rows(5000, None, 64, "layer 1")  # a by-id kernel has no limit


@pytest.mark.parametrize("device", DEVICES)
def test_expert_parallel_ranks_compute_each_rerouted_pair_once(tiny_models, monkeypatch, device):
    """Two ranks of expert parallelism (each holds every other expert, vLLM's round-robin placement), the same
    adapters loaded on both: every rank reroutes alike, but only the rank holding the base expert an adapter
    replaces maps and computes its row, so the ranks' outputs summed (vLLM's all-reduce) are each adapter's
    merged model; a pair computed on both ranks, or on neither, would show."""
    from esftctl.runtime.vllm import model as vllm_model

    monkeypatch.setattr(vllm_model, "kernel_config", lambda layer, experts: None)  # vLLM's Triton tile lookup
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    adapters = {f"a{k}": synthetic_experts(ckpt, seed=40 + k, experts_per_layer=3 + k, scale=4.0) for k in range(3)}
    ranks = [engine_model(ckpt, None, device, rank=(r, 2)) for r in range(2)]
    runtimes = [EsftModel(model, ckpt, num_slots=3, experts_per_slot=6, max_tokens=64) for model in ranks]
    slots = [{name: rt.slots.load(name, experts) for name, experts in adapters.items()} for rt in runtimes]
    for rt, loaded in zip(runtimes, slots):  # rows freed and taken again: the ranks' allocations stay alike
        rt.slots.evict("a1")
        rt.slots.collect()
        loaded["a1"] = rt.slots.load("a1", adapters["a1"])
    assert slots[0] == slots[1]
    for index in ckpt.moe_layers:
        layers = [rt.layers[index] for rt in runtimes]
        assert torch.equal(layers[0].table, layers[1].table)
        for r, layer in enumerate(layers):
            experts = ranks[r].layers[str(index)].mlp.experts.routed_experts
            assert experts.global_num_experts == layer.num_rows and len(experts.expert_map) == layer.num_rows
            mine = [e for a in adapters.values() for e in a.get(index, {}) if e % 2 == r]
            assert layer.base_rows == ckpt.num_experts // 2
            assert sum(map(layer.w13.is_mapped, range(layer.base_rows, layer.w13.num_rows))) == len(mine)
            here = experts.expert_map[ckpt.num_experts:]  # adapter rows: this rank's, or -1
            assert int((here >= 0).sum()) == len(mine)
        assert torch.equal((layers[0].expert_map >= 0) ^ (layers[1].expert_map >= 0),  # every row: one rank
                           torch.tensor([True] * ckpt.num_experts + [
                               row in {r for rows in layers[0].slot_rows.values() for r in rows.values()}
                               for row in range(ckpt.num_experts, layers[0].num_rows)], device=device))
    x = torch.randn(48, ckpt.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    owner = np.array([-1, 0, 1, 2] * 12, dtype=np.int32)
    for rt in runtimes:
        rt.set_token_adapters(owner)
    got = x
    for index in map(str, ckpt.moe_layers):  # each layer: the ranks' outputs all-reduced
        got = got + sum(model.layers[index].mlp.experts(got) for model in ranks)
    names = {slot: name for name, slot in slots[0].items()}
    for slot in (-1, 0, 1, 2):
        rows = torch.from_numpy(owner == slot).to(device)
        want = run_layers(engine_model(ckpt, adapters.get(names.get(slot)), device), x)
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5, msg=f"tokens of slot {slot}")
