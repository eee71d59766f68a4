"""Expert paging on the CPU (memfd-backed host ranges, the fetch's PyTorch references) and CUDA (aliased driver
mappings, the row-fetch and decode kernels, the load stream, CUDA graphs).

A stack of small MoE layers (esftctl's VirtualMoELayer, as serving builds them) whose experts come from host
memory and, for some base experts, from a Huffman store; the outputs with paging must equal, bit for bit, the
outputs with every layer resident, in every fetch mode, for any window, residency and tier split, with adapters
loaded while layers are paged out, and (on CUDA) when the whole paged forward is replayed from a CUDA graph whose
residency and split changed after capture.
"""

from __future__ import annotations

import mmap
import random

import pytest
import torch
from test_formats_store import _store_of

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights
from esftctl.kernels.reroute import reroute
from esftctl.runtime.address_space import HostAddressSpace
from esftctl.runtime.moe_layer import VirtualMoELayer
from esftctl.runtime.paging.pager import PagedExperts
from esftctl.runtime.paging.planner import (
    AdaptiveResidency,
    KvNeed,
    ResidencyPlanner,
    resident_choice,
    spread,
    start_resident,
)
from esftctl.runtime.paging.tiers import FixedTier, StoreTier, base_copies_needed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
E, H, I, TOP_K, LAYERS = 8, 64, 32, 2, 6


def make_weights(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"router": torch.randn(E, H, generator=g) * 0.5,
             "w13": (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16),
             "w2": (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)} for _ in range(LAYERS)]


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.softmax(x.float() @ router.T, -1), TOP_K)
    return weights, ids.to(torch.int32)


def experts(x, weights, ids, w13, w2) -> torch.Tensor:
    """The MoE product reading only the rows `ids` names (as the fused kernels do)."""
    gate, up = (w13[ids.long()].float() @ x.float()[:, None, :, None]).squeeze(-1).chunk(2, -1)
    out = (w2[ids.long()].float() @ (torch.nn.functional.silu(gate) * up)[..., None]).squeeze(-1)
    return x + (weights[..., None] * out).sum(1).to(x.dtype)


def resident_forward(weights, x, device, adapter=None, adapter_tokens=None):
    """Every layer's experts in ordinary tensors; `adapter` {layer: {expert: (w13, w2)}} for `adapter_tokens`."""
    x = x.to(device)
    for l, w in enumerate(weights):
        gw, ids = route(x, w["router"].to(device))
        w13, w2 = w["w13"].to(device), w["w2"].to(device)
        out = experts(x, gw, ids, w13, w2)
        if adapter and l in adapter and adapter_tokens is not None:
            a13, a2 = w13.clone(), w2.clone()
            for e, (e13, e2) in adapter[l].items():
                a13[e], a2[e] = e13.to(device), e2.to(device)
            out = torch.where(adapter_tokens[:, None].to(device), experts(x, gw, ids, a13, a2), out)
        x = out
    return x.cpu()


class Stack:
    """The layers as serving holds them, paged: each layer's forward routes, reroutes, lets the pager fetch, and
    computes from the layer's own rows."""

    def __init__(self, weights, device, *, window, slots=0, per_slot=0, store=None, base_copies=True,
                 host_page=4 * mmap.PAGESIZE, **options):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool

            self.pool = PhysicalPagePool(self.device)
            self.make_space = lambda n: CudaAddressSpace(n, self.pool)
        else:
            self.pool = None
            self.make_space = lambda n: HostAddressSpace(n, page_size=host_page)
        self.routers = [w["router"].to(device) for w in weights]
        self.layers = {}
        for l, w in enumerate(weights):
            layer = VirtualMoELayer(E, H, I, num_slots=slots, experts_per_slot=per_slot, dtype=torch.bfloat16,
                                    make_space=self.make_space)
            layer.load_base_rows(w["w13"].to(device), w["w2"].to(device))
            layer.keep_host_copy(base_rows=base_copies)
            self.layers[l] = layer
        # encoded from the rows as loaded, before paging; fixed-host: the codes in host memory, read over the bus
        tier = FixedTier(on_host=store == "fixed-host") if store in ("fixed", "fixed-host") else None
        if store is not None and store not in ("fixed", "fixed-host"):
            tier = StoreTier(store, {l: [{k: f"{l}.{e}.{k}" for k in ("gate", "up", "down")} for e in range(E)]
                                     for l in self.layers})
        self.pager = PagedExperts(self.layers, window=window, make_space=self.make_space, top_k=TOP_K, store=tier,
                                  **options)
        self.token_slots = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One forward pass; x on the stack's device."""
        for l, layer in self.layers.items():
            gw, ids = route(x, self.routers[l])
            if self.token_slots is not None:
                ids = reroute(ids, self.token_slots, layer.table)
            self.pager.before_kernel(l, ids, x.shape[0])
            x = experts(x, gw, ids, layer.w13.tensor, layer.w2.tensor)
            self.pager.after_kernel(l)
        return x

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.pager.step()
        return self.forward(x.to(self.device)).cpu()

    def close(self):
        self.pager.close()
        for layer in self.layers.values():
            layer.close()
        if self.pool is not None:
            self.pool.trim()


def expert_store(weights, path):
    tensors = {}
    for l, w in enumerate(weights):
        for e in range(E):
            tensors[f"{l}.{e}.gate"] = w["w13"][e, :I]
            tensors[f"{l}.{e}.up"] = w["w13"][e, I:]
            tensors[f"{l}.{e}.down"] = w["w2"][e]
    return _store_of(tensors, path, chunk=256, table_scope="layer")


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fetch", ["routed", "layer", "auto"])
@pytest.mark.parametrize("window,resident,store_rows", [(2, (), 0), (3, (0, 4), 3), (1, (), 0), (2, (5,), E)])
def test_paging_equals_resident(device, fetch, window, resident, store_rows, tmp_path):
    weights = make_weights(window * 10 + store_rows)
    store = expert_store(weights, tmp_path / "store") if store_rows else None
    stack = Stack(weights, device, window=window, store=store, fetch=fetch, resident=resident)
    stack.pager.set_store_rows(store_rows)
    for n, seed in ((1, 1), (24, 2), (1, 3)):  # decode-sized and prefill-sized steps: auto takes both ways
        x = tokens(n, seed)
        assert torch.equal(stack.run(x), resident_forward(weights, x, device)), (n, seed)
    counters = stack.pager.counters()
    # A block shared by several paged layers makes them fetch every step (layer mode: ahead); a paged layer alone in
    # its block is parked there (window 3 with layers 0 and 4 resident: layers 1 and 3 each have a block).
    assert stack.pager.parked == ({1, 3} if window == 3 else set())
    paged = LAYERS - len(resident) - len(stack.pager.parked)
    assert counters["fetches"] >= 3 * paged
    assert counters["fetched_rows"] <= counters["fetches"] * E
    if fetch == "routed":  # the rows tokens route to, never more
        assert counters["fetched_rows"] < counters["fetches"] * E
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_routed_fetch_brings_exactly_the_routed_rows(device):
    weights = make_weights(3)
    stack = Stack(weights, device, window=1, fetch="routed")
    x = tokens(1, 4).to(stack.device)
    gw, ids = route(x, stack.routers[0])
    w13 = stack.layers[0].w13.tensor
    w13.fill_(7)  # poison the shared block: only what the fetch brings may change
    before = stack.pager.counters()["fetched_rows"]
    stack.pager.before_kernel(0, ids, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    routed = set(ids.flatten().tolist())
    assert stack.pager.counters()["fetched_rows"] - before == len(routed) == TOP_K
    for e in range(E):
        row = w13[e].cpu()
        assert torch.equal(row, weights[0]["w13"][e]) if e in routed else bool((row == 7).all()), e
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_window_aliases_one_block_per_position(device):
    """Paged layers p and p + window read one memory at their own addresses; a resident layer has its own."""
    stack = Stack(make_weights(5), device, window=2, resident=(3,))
    l0, l2, l3 = (stack.layers[i].w13.tensor for i in (0, 2, 3))
    assert l0.data_ptr() != l2.data_ptr()
    l0[1].fill_(5)
    assert bool((l2[1] == 5).all()) and not bool((stack.layers[1].w13.tensor[1] == 5).all())
    l3[1].fill_(6)  # resident: nobody else sees it
    assert not bool((stack.layers[1].w13.tensor[1] == 6).all()) and bool((l0[1] == 5).all())
    per_layer, page = stack.layers[0].held_bytes(), stack.layers[0].w13.space.page_size
    assert per_layer * 2 <= stack.pager.device_bytes()["window"] <= per_layer * 2 + 4 * page
    assert stack.pager.device_bytes()["resident"] == stack.layers[3].physical_bytes() >= per_layer
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fetch", ["routed", "layer"])
def test_adapters_loaded_while_paged_out_are_served_and_unloaded(device, fetch):
    """An adapter's rows stay on the device in the layer's own pages, paged or not: never copied to the host, never
    fetched (only base rows are: a whole-layer fetch brings E rows, adapters or not), in the memory the pager
    counts, and given back when the adapter goes."""
    weights = make_weights(8)
    stack = Stack(weights, device, window=2, slots=2, per_slot=3, fetch=fetch)
    assert stack.pager.device_bytes()["adapters"] == 0
    g = torch.Generator().manual_seed(9)
    adapter = {l: {e: ((torch.randn(2 * I, H, generator=g) * 0.1).to(torch.bfloat16),
                       (torch.randn(H, I, generator=g) * 0.1).to(torch.bfloat16)) for e in (1, 4, 6)}
               for l in (0, 3, 4)}
    host = host_bytes(stack)
    for l, chosen in adapter.items():
        stack.layers[l].load(1, {e: ExpertWeights(w13[:I], w13[I:], w2) for e, (w13, w2) in chosen.items()})
    assert host_bytes(stack) == host  # no host copies of adapter rows
    expert_bytes = stack.layers[0].expert_bytes
    assert stack.pager.device_bytes()["adapters"] >= 3 * 3 * expert_bytes
    x = tokens(12, 10)
    use = torch.tensor([k % 2 == 0 for k in range(12)])
    stack.token_slots = torch.where(use, 1, -1).to(torch.int32).to(stack.device)
    want = resident_forward(weights, x, device, adapter, use)
    assert torch.equal(stack.run(x), want)
    assert not torch.equal(want, resident_forward(weights, x, device))  # the adapter changes answers
    rows, fetches = stack.pager.counters().values()
    assert rows <= fetches * E and (fetch == "routed" or rows == fetches * E)
    for l in adapter:
        rows = stack.layers[l].detach(1)
        stack.layers[l].release_rows(rows)
    assert stack.pager.device_bytes()["adapters"] == 0
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    stack.close()


@pytest.mark.parametrize("fetch", ["routed", "layer"])
def test_a_page_that_base_and_adapter_rows_share_stays_the_layers_own(fetch):
    """Pages of 12 KiB against rows of 8 KiB (w13) and 4 KiB (w2): the last base row and the first adapter row
    share a page. A paged-out layer keeps that page (the window's block maps only the pages wholly below it), so
    its adapter rows load into it and the fetch writes the base row's tail there: outputs as resident, with an
    adapter loaded before paging out, one loaded while paged out, and layers made resident and paged out again."""
    weights = make_weights(31)
    page = 3 * mmap.PAGESIZE
    stack = Stack(weights, "cpu", window=2, slots=2, per_slot=3, fetch=fetch, host_page=page)
    layer = stack.layers[5]
    for t in (layer.w13, layer.w2):
        assert t.boundary_page(E) and (E * t.row_bytes) % page  # the case this test is for
    assert layer.physical_bytes() == 2 * page  # paged out, no adapters: the shared page of each tensor alone
    adapters = random_adapter((0, 3, 4), (1, 4, 6), seed=32), random_adapter((1, 4, 5), (0, 2, 7), seed=33)
    stack.pager.set_resident((0, 3))
    load_adapter(stack, 0, adapters[0])  # layers 0 and 3 resident, 4 paged
    stack.pager.set_resident(())
    load_adapter(stack, 1, adapters[1])  # every layer paged
    x = tokens(12, 34)
    slots = torch.tensor([k % 3 - 1 for k in range(12)], dtype=torch.int32)  # base, adapter 0, adapter 1
    stack.token_slots = slots
    want = resident_forward(weights, x, "cpu")
    for slot, adapter in enumerate(adapters):
        want = torch.where((slots == slot)[:, None], resident_forward(weights, x, "cpu", adapter, slots == slot), want)
    for resident in ((), (2, 4), ()):
        stack.pager.set_resident(resident)
        assert torch.equal(stack.run(x), want), resident
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_alone_in_its_block_is_parked_there_until_another_shares_it(device):
    """The adaptive planner with memory to spare pages only the window's layers: each alone in its block keeps its
    rows there from step to step (no fetches), adapters loaded meanwhile included, and fetches again once the
    planner pages out a layer of the same block."""
    weights = make_weights(12)
    stack = Stack(weights, device, window=2, slots=2, per_slot=3, resident=(0, 1, 2, 3))
    assert stack.pager.parked == {4, 5}  # positions 4 and 5: blocks 0 and 1, each its only paged layer
    x, use = tokens(6, 13), torch.tensor([k % 2 == 0 for k in range(6)])
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    assert stack.pager.counters()["fetches"] == 0
    g = torch.Generator().manual_seed(14)
    adapter = {4: {e: ((torch.randn(2 * I, H, generator=g) * 0.1).to(torch.bfloat16),
                       (torch.randn(H, I, generator=g) * 0.1).to(torch.bfloat16)) for e in (1, 4, 6)}}
    stack.layers[4].load(1, {e: ExpertWeights(w13[:I], w13[I:], w2) for e, (w13, w2) in adapter[4].items()})
    stack.token_slots = torch.where(use, 1, -1).to(torch.int32).to(stack.device)
    want = resident_forward(weights, x, device, adapter, use)
    assert not torch.equal(want, resident_forward(weights, x, device))  # the adapter changes answers
    assert torch.equal(stack.run(x), want)  # the parked layer's new rows were copied into its block
    stack.pager.set_resident((0, 1))  # layers 2 and 4 share block 0, 3 and 5 block 1: all four fetch
    assert stack.pager.parked == set()
    assert torch.equal(stack.run(x), want) and stack.pager.counters()["fetches"] >= 4
    stack.pager.set_resident((0, 1, 2, 3))
    assert stack.pager.parked == {4, 5}
    before = stack.pager.counters()["fetches"]
    assert torch.equal(stack.run(x), want) and stack.pager.counters()["fetches"] == before
    stack.layers[4].release_rows(stack.layers[4].detach(1))
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_residency_and_tier_changes_between_steps_keep_outputs(device, tmp_path):
    weights = make_weights(11)
    stack = Stack(weights, device, window=2, store=expert_store(weights, tmp_path / "store"))
    rng = random.Random(0)
    for step in range(8):
        stack.pager.set_resident(rng.sample(range(LAYERS), rng.randint(0, LAYERS - 2)))
        stack.pager.set_store_rows(rng.choice([0, 3, E]))
        x = tokens(rng.choice([1, 2, 16]), 20 + step)
        assert torch.equal(stack.run(x), resident_forward(weights, x, device)), step
    stack.close()


def test_bad_settings_are_refused():
    weights = make_weights(1)
    with pytest.raises(EsftError, match="at least one block"):
        Stack(weights, "cpu", window=0)
    with pytest.raises(EsftError, match="fetch 'ahead'"):
        Stack(weights, "cpu", window=1, fetch="ahead")
    stack = Stack(weights, "cpu", window=1)
    with pytest.raises(EsftError, match="no store tier"):
        stack.pager.set_store_rows(2)
    stack.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fetch", ["routed", "layer"])
def test_paged_forward_replays_from_a_cuda_graph(fetch, tmp_path):
    """A whole paged forward captured once; replays with new inputs, residency and tier split changed after
    capture, give the resident outputs."""
    weights = make_weights(13)
    stack = Stack(weights, "cuda", window=2, store=expert_store(weights, tmp_path / "store"), fetch=fetch,
                  resident=(2,))
    replays_follow_changes(stack, weights)
    assert stack.pager.counters()["fetches"] > 0
    stack.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["store", "fixed"])
@pytest.mark.parametrize("fetch", ["routed", "layer"])
def test_paged_forward_without_base_copies_replays_from_a_cuda_graph(tier, fetch, tmp_path):
    """As above with layers that keep no host copies of their base rows: every base row from the compressed tier,
    in the captured graph too, and a whole-layer fetch (the mark kernel's listing) still counts every held row."""
    weights = make_weights(14)
    store = expert_store(weights, tmp_path / "store") if tier == "store" else "fixed"
    stack = Stack(weights, "cuda", window=2, store=store, fetch=fetch, resident=(2,), base_copies=False)
    assert host_bytes(stack) == 0
    replays_follow_changes(stack, weights)
    counters = stack.pager.counters()
    assert counters["fetches"] > 0
    if fetch == "layer":
        assert counters["fetched_rows"] == counters["fetches"] * E
    stack.close()


def replays_follow_changes(stack, weights) -> None:
    """Capture the stack's forward once (CUDA), then replay it with new inputs after residency and the tier split
    changed: every replay gives the resident outputs."""
    static = tokens(4, 30).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            stack.forward(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stack.forward(static)
    splits = (0, E, 3, 0, 3) if all(l.base_copies for l in stack.layers.values()) else (E,) * 5
    # The last residency leaves layers 4 and 5 paged, one a block: parked, their captured fetches idle.
    for step, (resident, store_rows) in enumerate(zip([(2,), (), (0, 1, 4), (5,), (0, 1, 2, 3)], splits)):
        stack.pager.set_resident(resident)
        stack.pager.set_store_rows(store_rows)
        x = tokens(4, 40 + step)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), resident_forward(weights, x, "cuda")), step


def random_adapter(layers, experts, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {l: {e: ((torch.randn(2 * I, H, generator=g) * 0.1).to(torch.bfloat16),
                    (torch.randn(H, I, generator=g) * 0.1).to(torch.bfloat16)) for e in experts} for l in layers}


def load_adapter(stack, slot: int, adapter: dict) -> None:
    for l, chosen in adapter.items():
        stack.layers[l].load(slot, {e: ExpertWeights(w13[:I], w13[I:], w2) for e, (w13, w2) in chosen.items()})


def host_bytes(stack) -> int:
    return sum(layer.host_bytes() for layer in stack.layers.values())


def test_base_copies_are_left_out_only_where_a_tier_delivers_every_base_row_from_the_start():
    tier = FixedTier()
    assert not base_copies_needed(tier, E, E) and not base_copies_needed(tier, E + 1, E)
    assert base_copies_needed(tier, E - 1, E) and base_copies_needed(tier, 0, E)
    assert base_copies_needed(tier, None, E)  # a split measured at start-up may give the host tier base rows
    assert base_copies_needed(None, None, E)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["store", "fixed", "fixed-host"])
@pytest.mark.parametrize("fetch", ["routed", "layer"])
def test_a_tier_of_every_base_row_pages_without_base_copies(device, tier, fetch, tmp_path):
    """Layers that keep no host copies of their base rows (a compressed tier delivers every one: for Qwen3-30B-
    A3B's shape the copies were 38.6 GB of pinned memory) take no host memory for them, deliver them all from the
    tier from the start, and page as resident: with an adapter loaded while paged out and unloaded, and with layers
    made resident (filled from the tier) and paged out again. A split that would need the copies is refused."""
    weights = make_weights(17)
    store = expert_store(weights, tmp_path / "store") if tier == "store" else tier
    stack = Stack(weights, device, window=2, slots=2, per_slot=3, store=store, fetch=fetch, base_copies=False)
    assert stack.pager.store_rows == E and host_bytes(stack) == 0
    if tier == "fixed-host":  # the codes' bulk on the host, 0.75 of the base rows' bf16 bytes; their tables here
        expert_bytes = stack.layers[0].expert_bytes
        assert stack.pager.codec == "fixed-host"
        assert 0.74 * LAYERS * E * expert_bytes < stack.pager.store.host_nbytes < 0.76 * LAYERS * E * expert_bytes
        assert 0 < stack.pager.store.nbytes < 0.05 * LAYERS * E * expert_bytes
        if device == "cuda":  # the decoder's views are of pinned host memory
            from cuda.bindings import runtime

            for pair in stack.pager.store.codes.values():
                for code in pair:
                    err, attrs = runtime.cudaPointerGetAttributes(code.sm.data_ptr())
                    assert err == runtime.cudaError_t.cudaSuccess
                    assert attrs.type == runtime.cudaMemoryType.cudaMemoryTypeHost
    adapter = random_adapter((0, 3, 4), (1, 4, 6), seed=18)
    load_adapter(stack, 1, adapter)
    assert host_bytes(stack) == 0  # the adapter's rows stay on the device
    x, use = tokens(12, 19), torch.tensor([k % 2 == 0 for k in range(12)])
    stack.token_slots = torch.where(use, 1, -1).to(torch.int32).to(stack.device)
    want = resident_forward(weights, x, device, adapter, use)
    for resident in ((), (0, 3), (1,), ()):  # made resident: base rows decoded from the tier into own pages
        stack.pager.set_resident(resident)
        assert torch.equal(stack.run(x), want), resident
    if fetch == "layer":  # a whole-layer fetch counts every base row (decoded ones too), never an adapter row
        for l, tiers in stack.pager.tiers.items():
            rows, fetches = tiers.stats.tolist()
            assert fetches > 0 and rows == fetches * E, l
    for l in adapter:
        stack.layers[l].release_rows(stack.layers[l].detach(1))
    assert host_bytes(stack) == 0
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    with pytest.raises(EsftError, match="keeps no host copies of its base rows"):
        stack.pager.set_store_rows(3)
    with pytest.raises(EsftError, match="cannot change while paged"):
        stack.layers[0].replace_base({2: ExpertWeights(weights[0]["w13"][1, :I], weights[0]["w13"][1, I:],
                                                       weights[0]["w2"][1])})
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["store", "fixed"])
def test_the_tier_takes_its_memory_as_the_layers_give_theirs_back(device, tier, tmp_path, monkeypatch):
    """Built all at once, the Qwen3-30B-A3B shape's fixed-rate codes (28 GiB) did not fit beside its resident
    experts (38 GiB) on an 80 GB H100: each layer's codes are made just before it pages out, and what it gave back
    goes to the driver (make_room) before the next layer's are made; a Huffman store goes to the device (CUDA)
    once every layer has paged out. A resident layer gives nothing back."""
    from esftctl.formats.store import ExpertStore

    weights, events = make_weights(29), []

    def spy(cls, name, event):
        original = getattr(cls, name)

        def logged(self, *args, **kwargs):
            events.append(event(args))
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, logged)
    spy(FixedTier, "encode", lambda a: ("encode", a[0]))
    spy(VirtualMoELayer, "page_out", lambda a: "out")
    spy(ExpertStore, "_data_on", lambda a: "upload")  # store.bin to the device (to_device keeps it after)
    store = expert_store(weights, tmp_path / "store") if tier == "store" else "fixed"
    stack = Stack(weights, device, window=2, store=store, resident=(1,), make_room=lambda: events.append("room"))
    gives_back = [[] if l == 1 else ["out", "room"] for l in range(LAYERS)]
    if tier == "fixed":
        assert events == [e for l in range(LAYERS) for e in [("encode", l), *gives_back[l]]]
    else:
        assert events == [e for g in gives_back for e in g] + (["upload"] if device == "cuda" else [])
    x = tokens(6, 30)
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    stack.close()


def test_planner_shrinks_grows_and_holds_in_the_dead_zone():
    planner = ResidencyPlanner(num_layers=26, max_resident=4, resident=2)
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 1  # rho 2.5: compute hides loads, give memory back
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 0
    assert planner.update(compute_ms=5.0, load_ms=2.0) == 0  # nothing left to give
    assert planner.update(compute_ms=1.9, load_ms=2.0) == 0  # rho 0.95: dead zone
    for expected in (1, 2, 3, 4, 4):  # rho 0.5: loads show, keep more resident, up to the memory cap
        assert planner.update(compute_ms=1.0, load_ms=2.0) == expected
    assert [round(d["rho"], 2) for d in planner.decisions[:2]] == [2.5, 2.5]


def test_layers_stay_resident_from_the_start_past_the_kv_caches_need():
    """vLLM sizes its KV cache once, from its share of the card left after loading: the layers that fit beyond
    the most KV the engine can use stay resident from the start, none where memory binds."""
    gib = 1 << 30
    need = KvNeed(tokens=10, bytes_per_token=2, utilization=0.5)  # share 50, need 20, margin 5
    assert start_resident(need, free=90, total=100, layer_bytes=4, cap=10) == 3  # (50 - 10 - 20 - 5) // 4
    assert start_resident(need, free=90, total=100, layer_bytes=4, cap=2) == 2  # the layers outside the window
    assert start_resident(need, free=70, total=100, layer_bytes=4, cap=10) == 0  # 30 used: nothing left
    # DeepSeek-V2-Lite on an 80 GB H100 with the Huffman tier (H100, 2026-11-26): 25 GiB used once paged,
    # --max-num-seqs 64 x --max-model-len 4096 tokens of 31,104 bytes, 1.07 GiB a layer, 24 layers outside the
    # window: with memory to spare all of them stay resident; on a 48 GB card's share with 256 requests, none.
    spare = KvNeed(tokens=64 * 4096, bytes_per_token=31_104, utilization=0.9)
    assert start_resident(spare, free=55 * gib, total=80 * gib, layer_bytes=int(1.07 * gib), cap=24) == 24
    bound = KvNeed(tokens=256 * 4096, bytes_per_token=31_104, utilization=0.3198)
    assert start_resident(bound, free=55 * gib, total=80 * gib, layer_bytes=int(1.07 * gib), cap=24) == 0


def test_adaptive_residency_starts_with_the_layers_past_the_kv_caches_need():
    """The serving planner's start: the layers start_resident allows become resident at once (spread over the
    stack), the planner counts them, and the outputs stay the resident model's."""
    weights = make_weights(13)
    stack = Stack(weights, "cpu", window=1)
    residency = AdaptiveResidency(stack.pager, layer_bytes=lambda: 4, spare=lambda: 0)
    residency.start(KvNeed(tokens=10, bytes_per_token=2, utilization=0.5), free=90, total=100)  # room 15: 3 layers
    assert sorted(stack.pager.resident) == spread(list(range(LAYERS)), 3) and residency.planner.resident == 3
    x = tokens(4, 5)
    assert torch.equal(stack.run(x), resident_forward(weights, x, "cpu"))
    stack.close()


def test_with_memory_to_spare_the_window_keeps_its_layers_parked():
    """Every layer outside the window resident (memory to spare): the paged ones are the last, one a block, parked
    there; spread evenly they would share blocks and fetch every step (layers 1 and 3 of 0-3 in 2 blocks)."""
    assert resident_choice(list(range(4)), 2, window=2) == [0, 1] != spread(list(range(4)), 2)
    assert resident_choice(list(range(6)), 3, window=2) == spread(list(range(6)), 3)  # 3 paged > 2 blocks: spread
    assert resident_choice(list(range(6)), 0, window=2) == []
    weights = make_weights(15)
    stack = Stack(weights, "cpu", window=2)
    residency = AdaptiveResidency(stack.pager, layer_bytes=lambda: 1, spare=lambda: 0)
    residency.start(KvNeed(tokens=1, bytes_per_token=1, utilization=1.0), free=100, total=100)
    assert sorted(stack.pager.resident) == [0, 1, 2, 3] and stack.pager.parked == {4, 5}
    x = tokens(4, 6)
    assert torch.equal(stack.run(x), resident_forward(weights, x, "cpu"))
    assert stack.pager.counters()["fetches"] == 0
    stack.close()


def test_planner_uses_the_store_only_while_host_copies_would_show():
    assert ResidencyPlanner.store_experts(compute_ms=30.0, host_load_ms=20.0, split=55) == 0
    assert ResidencyPlanner.store_experts(compute_ms=10.0, host_load_ms=20.0, split=55) == 55


@pytest.mark.parametrize("device", DEVICES)
def test_pager_times_fetches_and_kernels_in_eager_steps(device):
    """What the serving planner reads: one load and one compute span per paged layer and eager step."""
    stack = Stack(make_weights(9), device, window=2, resident=(2,), fetch="routed")
    stack.pager.times.enabled = True  # a planner turns it on
    stack.run(tokens(8, 4))
    if device == "cuda":
        torch.cuda.synchronize()
    compute, load = stack.pager.times.take()
    assert len(compute) == len(load) == LAYERS - 1  # the resident layer's (no-op) fetch is not the planner's input
    assert all(ms >= 0 for ms in compute + load)
    assert stack.pager.times.take() == ([], [])  # each span is handed out once
    stack.close()


def test_adaptive_residency_follows_rho_within_spare_memory():
    """Fed timings: loads that show make layers resident (spread over the stack, never more than the spare
    memory or the layers outside the window allow); compute that hides the loads gives them back; steps with no
    timings (replayed graphs) count as loads that show."""
    weights = make_weights(11)
    stack = Stack(weights, "cpu", window=1)
    timings, spare = [], {"layers": 3}
    residency = AdaptiveResidency(stack.pager, layer_bytes=lambda: 1, every=2, measure=lambda: timings.pop(0),
                                  spare=lambda: spare["layers"])
    x = tokens(4, 5)
    want = resident_forward(weights, x, "cpu")

    def steps(compute_ms, load_ms, count=2):
        for _ in range(count):
            timings.append(([compute_ms], [load_ms]) if compute_ms is not None else ([], []))
        for _ in range(count):  # the planner runs on every second step, between steps
            assert torch.equal(stack.run(x), want)
        timings.clear()
        return sorted(stack.pager.resident)

    assert steps(1.0, 4.0) == [0]  # rho 0.25: one layer more
    assert steps(1.0, 4.0) == [0, 3]
    spare["layers"] = 0  # memory taken meanwhile: no further growth
    assert steps(1.0, 4.0) == [0, 3]
    spare["layers"] = 10
    assert steps(1.0, 4.0, count=4) == [0, 1, 3, 4]
    assert steps(None, None, count=4) == [0, 1, 2, 3, 4]  # untimed (graph) steps: grow within memory
    assert steps(0.95, 1.0) == [0, 1, 2, 3, 4]  # rho 0.95: the dead zone, nothing changes
    assert steps(8.0, 1.0) == [0, 1, 3, 4]  # rho 8: compute hides loads, one layer fewer
    assert [d["resident"] for d in residency.decisions] == [1, 2, 2, 3, 4, 5, 5, 5, 4]
    stack.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_window_of_every_layer_is_the_machinery_alone(device):
    """Every layer resident from the start (serve --paging-window = the MoE layers): outputs as resident, no block
    memory mapped and nothing fetched, the pager's launches in the path; a layer paged out later still works, from
    its own block, where it is parked: filled once, fetching nothing."""
    weights = make_weights(11)
    stack = Stack(weights, device, window=LAYERS, resident=range(LAYERS))
    assert stack.pager.window.nbytes() == 0 and not stack.pager.window.paged
    for n, seed in ((1, 1), (24, 2)):
        x = tokens(n, seed)
        assert torch.equal(stack.run(x), resident_forward(weights, x, device)), n
    assert stack.pager.counters() == {"fetched_rows": 0, "fetches": 0}
    stack.pager.set_resident(range(1, LAYERS))
    x = tokens(3, 3)
    assert torch.equal(stack.run(x), resident_forward(weights, x, device))
    assert stack.pager.parked == {0} and stack.pager.window.paged == {0}
    assert stack.pager.counters() == {"fetched_rows": 0, "fetches": 0}
    stack.close()
