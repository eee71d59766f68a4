"""Runtime core on the host backend: page sharing, virtual MoE layers, adapter slots, rerouted layers (the reroute
and router kernels themselves: tests/test_kernel_reroute.py, tests/test_kernel_router.py)."""

from __future__ import annotations

import mmap
import random

import pytest
import torch
from conftest import load_staged, refused_when_written_wrong

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights
from esftctl.kernels.reroute import reroute
from esftctl.runtime.adapters import AdapterSlots
from esftctl.runtime.address_space import HostAddressSpace
from esftctl.runtime.moe_layer import VirtualMoELayer
from esftctl.runtime.pages import PageRefCounts

OS_PAGE = mmap.PAGESIZE


# ---- page reference counts ------------------------------------------------------------------------

def test_neighbours_share_the_straddling_page():
    pages = PageRefCounts(page_size=100, num_pages=10)
    assert pages.acquire(0, 150) == [0, 1]
    assert pages.acquire(150, 300) == [2]  # page 1 is shared, already mapped
    assert pages.acquire(300, 420) == [3, 4]
    assert pages.release(150, 300) == [2]  # the middle one leaves: pages 1 and 3 stay for its neighbours
    assert pages.is_mapped(1) and pages.is_mapped(3)
    assert pages.release(0, 150) == [0, 1]
    assert pages.acquire(150, 300) == [1, 2]  # reload into the hole
    s = pages.stats()
    assert (s.mapped_pages, s.needed_bytes) == (4, 270)
    with pytest.raises(ValueError):
        pages.release(0, 150)
    with pytest.raises(ValueError):
        pages.acquire(900, 1001)


def test_random_ranges_map_exactly_the_touched_pages():
    rng = random.Random(0)
    pages = PageRefCounts(page_size=64, num_pages=200)
    live: list[tuple[int, int]] = []
    mapped: set[int] = set()
    for _ in range(500):
        if live and rng.random() < 0.4:
            r = live.pop(rng.randrange(len(live)))
            mapped -= set(pages.release(*r))
        else:
            start = rng.randrange(0, 12000)
            r = (start, start + rng.randrange(1, 700))
            live.append(r)
            mapped |= set(pages.acquire(*r))
        touched = {p for s, e in live for p in range(s // 64, (e - 1) // 64 + 1)}
        assert mapped == touched
        assert pages.stats().mapped_pages == len(touched)


# ---- host address space ------------------------------------------------------------------------------

def test_host_pages_commit_and_return_memory():
    space = HostAddressSpace(8 * OS_PAGE * 4, page_size=OS_PAGE * 4)
    try:
        assert space.resident_pages() == 0
        view = space.view(torch.float32, (space.nbytes // 4,))
        space.map_pages([2])
        per_page = space.page_size // 4
        chunk = view[2 * per_page: 3 * per_page]
        chunk.copy_(torch.arange(per_page, dtype=torch.float32))
        assert space.resident_pages() == 4  # the whole 4-OS-page page was written
        assert torch.equal(chunk, torch.arange(per_page, dtype=torch.float32))
        space.unmap_pages([2])
        assert space.resident_pages() == 0
        space.map_pages([2])
        assert torch.count_nonzero(view[2 * per_page: 3 * per_page]) == 0  # fresh memory, old data gone
    finally:
        space.close()


# ---- virtual MoE layers and adapter slots ------------------------------------------------------------

H, I, E = 24, 10, 6  # one expert: w13 row 2*10*24*2 = 960 B, w2 row 480 B: never a whole number of pages


def _expert(seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(*(torch.randn(shape, generator=g).to(torch.bfloat16) for shape in ((I, H), (I, H), (H, I))))


def _layer(slots=4, per_slot=3, page=OS_PAGE) -> VirtualMoELayer:
    layer = VirtualMoELayer(E, H, I, num_slots=slots, experts_per_slot=per_slot, dtype=torch.bfloat16,
                            make_space=lambda n: HostAddressSpace(n, page_size=page))
    layer.load_base({e: _expert(e) for e in range(E)})
    return layer


def _touched_pages(tensor, rows) -> int:
    return len({p for r in rows for p in range(r * tensor.row_bytes // tensor.pages.page_size,
                                               ((r + 1) * tensor.row_bytes - 1) // tensor.pages.page_size + 1)})


def _check_layer(layer: VirtualMoELayer, expected: dict[int, ExpertWeights]) -> None:
    """Every mapped row holds its expert, the page tables match the rows, memory is resident only there."""
    for row, w in expected.items():
        assert torch.equal(layer.w13.tensor[row, :I], w.gate)
        assert torch.equal(layer.w13.tensor[row, I:], w.up)
        assert torch.equal(layer.w2.tensor[row], w.down)
    for t in (layer.w13, layer.w2):
        rows = [r for r in range(t.num_rows) if t.is_mapped(r)]
        assert sorted(rows) == sorted(expected)
        assert t.stats().mapped_pages == _touched_pages(t, rows)
        assert t.space.resident_pages() <= t.stats().mapped_pages * (t.pages.page_size // OS_PAGE)


def test_layer_load_evict_middle_reload():
    layer = _layer()
    slots = AdapterSlots({1: layer})
    expected = {e: _expert(e) for e in range(E)}
    adapters = {name: {e: _expert(100 * k + e) for e in ids}
                for k, (name, ids) in enumerate([("a", [0, 3]), ("b", [1, 2, 5]), ("c", [4])])}
    for name, experts in adapters.items():
        slot = slots.load(name, {1: experts})
        for e, row in layer.slot_rows[slot].items():
            expected[row] = experts[e]
    assert [slots.slot_of(n) for n in "abc"] == [0, 1, 2]
    assert sorted(r for rows in layer.slot_rows.values() for r in rows.values()) == list(range(E, E + 6))
    _check_layer(layer, expected)
    # the table: row 1 (adapter b) sends 1, 2, 5 to b's rows and the rest to the base
    b_rows = layer.slot_rows[1]
    assert layer.table[1].tolist() == [0, b_rows[1], b_rows[2], 3, 4, b_rows[5]]
    assert layer.table[layer.base_row].tolist() == list(range(E))

    slots.evict("b")
    for row in b_rows.values():
        expected.pop(row)
    assert layer.table[1].tolist() == list(range(E))
    _check_layer(layer, expected)

    d = {2: _expert(999), 3: _expert(998)}
    slot = slots.load("d", {1: d})
    assert slot == 1  # the freed slot
    assert sorted(layer.slot_rows[1].values()) == sorted(b_rows.values())[:2]  # the lowest freed rows
    for e, row in layer.slot_rows[1].items():
        expected[row] = d[e]
    _check_layer(layer, expected)
    layer.close()


def test_staged_load_equals_plain_load_and_the_host_cache_keys_by_file(tmp_path):
    """Rows staged once (runtime.host_cache) load the same contents as the experts themselves; the cache
    serves a bundle again only while its files are unchanged, and drops the least recently used past its size."""
    import os

    from esftctl.formats.bundle import DATA_FILE, MANIFEST
    from esftctl.runtime.host_cache import HostAdapterCache, stage

    plain, staged_layer = _layer(), _layer()
    experts = {1: {4: _expert(7), 0: _expert(8)}}
    AdapterSlots({1: plain}).load("a", experts)
    staged = stage({1: staged_layer}, experts)
    assert staged.num_experts == 2 and staged.layers[1][0] == [0, 4]
    AdapterSlots({1: staged_layer}).load("a", staged.experts(), staged.rows())
    assert plain.slot_rows == staged_layer.slot_rows and torch.equal(plain.table, staged_layer.table)
    for row in plain.slot_rows[0].values():
        assert torch.equal(plain.w13.tensor[row], staged_layer.w13.tensor[row])
        assert torch.equal(plain.w2.tensor[row], staged_layer.w2.tensor[row])
    for name in ("x", "y"):
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST).write_text(f'{{"file": "{DATA_FILE}"}}')  # the key follows the file it names
        (tmp_path / name / DATA_FILE).write_text(name)
    cache = HostAdapterCache(capacity=staged.nbytes)
    key, hit = cache.lookup(tmp_path / "x")
    assert hit is None
    cache.put(key, staged)
    assert cache.lookup(tmp_path / "x")[1] is staged
    os.utime(tmp_path / "x" / DATA_FILE, ns=(1, 1))  # a changed file is read again
    assert cache.lookup(tmp_path / "x")[1] is None
    key, _ = cache.lookup(tmp_path / "y")
    cache.put(key, staged)  # full: x's entry goes
    assert cache.nbytes == staged.nbytes and cache.lookup(tmp_path / "y")[1] is staged
    small = HostAdapterCache(capacity=staged.nbytes - 1)
    small.put(key, staged)  # too big for this cache: not kept, no error
    assert small.nbytes == 0
    assert cache.lookup(tmp_path / "missing") == (None, None)
    with pytest.raises(EsftError, match=r"layers \[5\], which are not MoE layers"):
        stage({1: staged_layer}, {5: experts[1]})
    plain.close()
    staged_layer.close()


def test_physical_bytes_within_a_page_of_needed():
    page = OS_PAGE
    layer = _layer(slots=8, per_slot=6, page=page)
    slots = AdapterSlots({3: layer})
    rng = random.Random(1)
    for k in range(8):
        slots.load(f"a{k}", {3: {e: _expert(k * 10 + e) for e in rng.sample(range(E), rng.randint(1, E))}})
    for t in (layer.w13, layer.w2):
        s = t.stats()
        assert s.needed_bytes == t.row_bytes * sum(map(t.is_mapped, range(t.num_rows)))
        assert s.wasted_bytes < page  # one dense run of rows: at most the last partial page
    layer.close()


def test_slot_errors():
    layer = _layer(slots=2, per_slot=2)
    slots = AdapterSlots({1: layer})
    slots.load("a", {1: {0: _expert(1)}})
    with pytest.raises(EsftError, match="already loaded"):
        slots.load("a", {1: {0: _expert(1)}})
    with pytest.raises(EsftError, match="not MoE layers"):
        slots.load("x", {7: {0: _expert(1)}})
    with pytest.raises(EsftError, match="out of range"):
        slots.load("x", {1: {E: _expert(1)}})
    slots.load("b", {1: {0: _expert(2), 1: _expert(3)}})
    with pytest.raises(EsftError, match="no free adapter slot"):
        slots.load("c", {1: {0: _expert(1)}})
    slots.evict("a")
    with pytest.raises(EsftError, match="no room: 3 experts"):
        slots.load("c", {1: {0: _expert(1), 1: _expert(1), 2: _expert(1)}})
    # the failed load left nothing behind: a's freed row and the spare row stay unmapped
    assert layer.free_rows == 2 and not layer.w13.is_mapped(E) and not layer.w13.is_mapped(E + 3)
    with pytest.raises(EsftError, match="no adapter named 'zz'"):
        slots.evict("zz")
    layer.close()


def _moe_forward(x, w13, w2, ids, weights):
    """Plain top-k MoE: sum_j w_j * down(silu(gate x) * up x) over each token's chosen rows."""
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w = w13[ids[t, j]].float()
            h = torch.nn.functional.silu(w[:inter] @ x[t].float()) * (w[inter:] @ x[t].float())
            out[t] += weights[t, j] * (w2[ids[t, j]].float() @ h)
    return out


def test_rerouted_virtual_layer_equals_merged_models():
    """Tokens of three adapters and the base in one batch get exactly what each merged model gives them."""
    layer = _layer()
    slots = AdapterSlots({1: layer})
    base = {e: _expert(e) for e in range(E)}
    adapters = {"a": {0: _expert(50), 3: _expert(51)}, "b": {1: _expert(60), 3: _expert(61), 5: _expert(62)},
                "c": {4: _expert(70)}}
    for name, experts in adapters.items():
        slots.load(name, {1: experts})
    slots.evict("c")  # an evicted adapter must not leak into anything
    slots.load("c", {1: {2: _expert(80)}})
    adapters["c"] = {2: _expert(80)}

    tokens = 24
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    names = [None, "a", "b", "c"] * (tokens // 4)
    adapter_ids = torch.tensor([slots.slot_of(n) for n in names], dtype=torch.int32)

    routed = reroute(ids, adapter_ids, layer.table)
    served = _moe_forward(x, layer.w13.tensor, layer.w2.tensor, routed, weights)
    for name in (None, "a", "b", "c"):
        merged = {**base, **adapters.get(name, {})}
        w13 = torch.stack([torch.cat([merged[e].gate, merged[e].up]) for e in range(E)])
        w2 = torch.stack([merged[e].down for e in range(E)])
        want = _moe_forward(x, w13, w2, ids, weights)
        mine = [t for t, n in enumerate(names) if n == name]
        assert torch.equal(served[mine], want[mine]), name
    layer.close()


def test_failed_load_rolls_back_every_layer():
    first, second = _layer(), _layer()
    slots = AdapterSlots({1: first, 2: second})
    with pytest.raises(EsftError, match="out of range"):
        slots.load("bad", {1: {0: _expert(1), 1: _expert(2)}, 2: {E + 4: _expert(3)}})
    assert not slots.adapters and slots.free_slots() == [0, 1, 2, 3]
    for layer in (first, second):
        assert layer.free_rows == 12 and not layer.slot_rows
        assert layer.table[0].tolist() == list(range(E))
        assert layer.w13.stats().needed_bytes == E * layer.w13.row_bytes
    first.close()
    second.close()


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
def test_an_adapter_that_does_not_reach_the_kernel_is_refused_and_undone(paged, monkeypatch):
    """Issue 31, item 4: every row a load writes is checked, where the kernel reads it (the device rows, or the
    host copies a paged layer is fetched from), against the staged rows' checksums; rows corrupted on their way
    in, or a map that sends an expert to another row, refuse the load with one line and leave no trace."""
    from esftctl.runtime.host_cache import stage
    from esftctl.runtime.moe_layer import row_checksums

    first, second = _layer(), _layer()
    for layer in (first, second):
        if paged:
            layer.keep_host_copy()
            layer.page_out()
    slots = AdapterSlots({1: first, 2: second})
    experts = {1: {4: _expert(7), 0: _expert(8)}, 2: {5: _expert(9)}}
    staged = stage({1: first, 2: second}, experts)
    assert torch.equal(staged.checksums()[1], row_checksums(*staged.rows()[1]))
    slots.load("good", staged.experts(), staged.rows(), staged.checksums())
    assert slots.adapters["good"].checked_rows == 3

    write = VirtualMoELayer.write_rows

    def corrupting(self, rows, w13, w2):  # one value of the last row, after staging: a copy gone wrong
        w13 = w13.clone()
        w13[-1].view(-1)[w13[-1].numel() // 2] += 1
        write(self, rows, w13, w2)

    monkeypatch.setattr(VirtualMoELayer, "write_rows", corrupting)
    with pytest.raises(EsftError, match=r"adapter 'bad' did not reach the kernel in layer 1: the rows of experts "
                                        r"\[4\] do not hold"):
        slots.load("bad", staged.experts(), staged.rows(), staged.checksums())
    monkeypatch.undo()
    assert set(slots.adapters) == {"good"} and first.free_rows == 12 - 2 and len(first.slot_rows) == 1

    load = VirtualMoELayer.load

    def misrouting(self, slot, experts, staged=None):  # the map sends expert 0 to another row
        rows = load(self, slot, experts, staged)
        self.table[slot][min(rows)] = max(rows.values()) + 1
        return rows

    monkeypatch.setattr(VirtualMoELayer, "load", misrouting)
    with pytest.raises(EsftError, match=r"the expert map sends experts \[0\] elsewhere"):
        slots.load("lost", staged.experts(), staged.rows(), staged.checksums())
    monkeypatch.undo()
    assert set(slots.adapters) == {"good"} and first.table[1].tolist() == list(range(E))
    first.close()
    second.close()


def test_page_runs():
    from esftctl.runtime.address_space import page_runs

    assert page_runs([5, 1, 2, 3, 9, 10]) == [(1, 3), (5, 1), (9, 2)]
    assert page_runs([]) == []


def test_tensor_parallel_shards_put_back_together_are_the_experts():
    """Issue 20: rank r's part of stacked experts is vLLM's cut (gate's and up's r-th slice of I, stacked; w2's
    r-th slice of columns), so the ranks' parts side by side are the experts again; a padded width stays zero."""
    from esftctl.runtime.vllm.model import tensor_parallel_shard

    g = torch.Generator().manual_seed(5)
    n, inter, hidden = 3, 12, 8
    w13, w2 = torch.randn(n, 2 * inter, hidden, generator=g), torch.randn(n, hidden, inter, generator=g)
    assert tensor_parallel_shard(w13, w2, rank=0, size=1) == (w13, w2)
    for size in (2, 3, 4):
        parts = [tensor_parallel_shard(w13, w2, rank=r, size=size) for r in range(size)]
        gate = torch.cat([p13[:, : inter // size] for p13, _ in parts], dim=1)
        up = torch.cat([p13[:, inter // size:] for p13, _ in parts], dim=1)
        assert torch.equal(torch.cat([gate, up], dim=1), w13)
        assert torch.equal(torch.cat([p2 for _, p2 in parts], dim=2), w2)
    p13, p2 = tensor_parallel_shard(w13, w2, rank=1, size=2, per_rank=8)  # padded from 6 to 8
    assert p13.shape == (n, 16, hidden) and p2.shape == (n, hidden, 8)
    assert torch.equal(p13[:, :6], w13[:, 6:12]) and torch.equal(p13[:, 8:14], w13[:, 18:24])
    assert not p13[:, 6:8].any() and not p13[:, 14:].any() and not p2[..., 6:].any()


def test_virtual_rows_hold_expert_biases_and_the_checksums_cover_them(monkeypatch):
    """Experts with biases (GPT-OSS): the layer's bias tensors get the same virtual rows as its weights, written
    gate's over up's then down's; a staged load's checksums cover them, so a bias corrupted on its way in refuses
    the load; an evicted adapter's bias rows are unmapped with its weights; paging refuses them in one line."""
    from esftctl.runtime.moe_layer import ExpertLayout

    e, h, i = 4, 64, 48

    def expert(seed: int) -> ExpertWeights:
        g = torch.Generator().manual_seed(seed)
        shapes = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_bias": (i,), "up_bias": (i,), "down_bias": (h,)}
        return ExpertWeights(**{w: torch.randn(s, generator=g).to(torch.bfloat16) for w, s in shapes.items()})

    layout = ExpertLayout.plain(h, i, biases=True)
    layer = VirtualMoELayer(e, h, i, num_slots=2, experts_per_slot=2, dtype=torch.bfloat16,
                            make_space=lambda n: HostAddressSpace(n, page_size=4096), layout=layout)
    assert [tuple(p.tensor.shape) for p in layer.parts] == [(8, 96, 64), (8, 64, 48), (8, 96), (8, 64)]
    base = {x: expert(x) for x in range(e)}
    layer.load_base(base)
    assert torch.equal(layer.biases[0].tensor[2], torch.cat([base[2].gate_bias, base[2].up_bias]))
    adapter = {1: expert(11), 3: expert(13)}
    slots, staged, rows = load_staged(layer, adapter)
    for x, w in adapter.items():
        assert torch.equal(layer.biases[0].tensor[rows[x]], torch.cat([w.gate_bias, w.up_bias]))
        assert torch.equal(layer.biases[1].tensor[rows[x]], w.down_bias)
        assert torch.equal(layer.w2.tensor[rows[x]], w.down)
    assert layer.table[0].tolist() == [0, rows[1], 2, rows[3]]

    def corrupt(b13, b2):  # one bias of the last row changed on its way in
        b2 = b2.clone()
        b2[-1, 0] += 1
        return b13, b2
    refused_when_written_wrong(slots, staged, layer, monkeypatch, corrupt)
    slots.evict("a")
    assert not any(p.is_mapped(r) for p in layer.parts for r in rows.values())
    with pytest.raises(EsftError, match="paging experts with biases is not supported"):
        layer.keep_host_copy()
    layer.close()
