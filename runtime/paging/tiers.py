"""Where a paged layer's rows come from, and the fetch that brings a step's rows in.

Only base rows page (a layer's adapter rows stay on the device: esftctl.runtime.moe_layer), so a layer's fetch
covers rows [0, E): its routed ids past E name adapter rows, which are neither marked nor fetched. Two tiers: pinned
host copies of the base rows (the GPU reads them over the bus, esftctl.kernels.row_fetch), and for the base rows
below `store_rows` a Huffman store kept in GPU memory (esftctl.kernels.huffman_decode: about 68% of bf16, so a
compressed GPU tier holds every base expert of a paged layer in two thirds of their memory and moves nothing over
the bus). Both decide on the GPU which rows to bring,
from the step's routed ids or every row, and read their settings there (`active`, `store_rows`), so the launches
are the same every step and CUDA graphs captured once stay right when the planner changes either.

Where a compressed tier delivers every base row from the start (`--store-experts` = the expert count), the host
copies of the base rows would never be read: the layers keep none (`base_copies_needed`; for Qwen3-30B-A3B's shape
the base copies were 38.6 GB of pinned memory). Such a layer's `store_rows` stays at its
expert count, and a layer made resident gets its base rows from the tier too (`LayerTiers.fill`).

A second compressed GPU tier needs no store file (`FixedTier`, `serve --paging-codec fixed`): every paged layer's
base rows are encoded at start-up from the weights the engine loaded, on its device, in esftctl.kernels.fixed_rate's
fixed-rate code (75.1% of bf16 against Huffman's 67.7%, but a whole DeepSeek-V2-Lite layer decodes in 0.726 ms on
an H100, 89% of the bandwidth bound, against Huffman's 1.045 ms at 59%). Its decode is one masked launch per tensor,
reading the same `needed` marks and `first_host` boundary as the Huffman plan. It keeps the engine's own layout
(it encodes the rows as they are), so unlike the Huffman store it serves vLLM's CPU build too.

On the CPU (vLLM's CPU build, and the tests) the same decisions run in plain PyTorch on the host
(esftctl.kernels.row_fetch's references, the store's CPU decoder, the fixed-rate reference decoder).
"""

from __future__ import annotations

from typing import Sequence

import torch

from esftctl.errors import EsftError
from esftctl.kernels.fixed_rate import FixedRows, decode_rows, decode_rows_reference, encode_rows
from esftctl.kernels.row_fetch import RowFetch, fetch_rows_reference, mark_rows_reference


def base_copies_needed(tier: StoreTier | FixedTier | None, store_experts: int | None, num_experts: int) -> bool:
    """Whether paged layers keep host copies of their base rows: unless a compressed tier delivers all of them,
    fixed at start-up. A split measured at start-up (`store_experts` None) may give the host tier base rows, so it
    keeps them; nothing changes the split later (the residency planner changes only what stays resident), and
    LayerTiers.set_store_rows refuses a split that would need copies a layer does not keep."""
    return tier is None or store_experts is None or store_experts < num_experts


def tier_split(num_experts: int, host_bytes_per_s: float, store_bytes_per_s: float) -> int:
    """How many of a layer's experts to take from the store so that both tiers finish together: each tier's
    share in proportion to its measured bandwidth (bytes of experts delivered per second)."""
    share = store_bytes_per_s / (store_bytes_per_s + host_bytes_per_s)
    return min(num_experts, max(0, round(num_experts * share)))


class StoreTier:
    """A Huffman store of the base (esftctl compress): base expert e of a layer is names[layer][e]["gate"|"up"|
    "down"]; decoded straight into the layer's rows (w13 = gate over up, w2 = down: the checkpoint's layout)."""

    def __init__(self, store, names: dict[int, Sequence[dict[str, str]]]):
        self.store, self.names = store, names

    def targets(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[int, str, torch.Tensor]]:
        inter = w2.shape[-1]
        out = []
        for e, n in enumerate(self.names[layer]):
            out += [(e, n["gate"], w13[e, :inter]), (e, n["up"], w13[e, inter:]), (e, n["down"], w2[e])]
        return out

    @property
    def nbytes(self) -> int:
        return int(self.store.header["data_bytes"])


class FixedTier:
    """Fixed-rate codes of every paged layer's base rows, made from the layer's own rows on its device (before
    they are paged out): no store file, nothing untrusted read. Kept on the device, or with `on_host` (`serve
    --paging-codec fixed-host`) in pinned host memory, where the decoder reads them over the bus through zero-copy
    views (FixedRows.over_the_bus): 0.75 of the bytes a bf16 host copy moves, and no GPU memory for the base
    experts at all but the codes' small tables."""

    def __init__(self, on_host: bool = False):
        self.on_host = on_host
        self.codes: dict[int, tuple[FixedRows, FixedRows]] = {}

    def encode(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, num_experts: int) -> "FixedPlan":
        """Encode base rows [0, num_experts) of a layer's tensors as they hold now; the plan decoding them back."""
        codes = (encode_rows(w13[:num_experts]), encode_rows(w2[:num_experts]))
        if self.on_host:
            codes = tuple(c.over_the_bus() for c in codes)
        self.codes[layer] = codes
        return FixedPlan(codes, (w13[:num_experts], w2[:num_experts]))

    @property
    def nbytes(self) -> int:
        """Device memory of the codes (on the host: their small tables)."""
        return sum(c.nbytes for pair in self.codes.values() for c in pair) - self.host_nbytes

    @property
    def host_nbytes(self) -> int:
        """Host memory of the codes: their sign-mantissa bytes and exponent codes where `on_host`, else 0."""
        if not self.on_host:
            return 0
        return sum(t.numel() * t.element_size() for pair in self.codes.values() for c in pair for t in (c.sm, c.codes))


class FixedPlan:
    """A layer's fixed-rate decode into its rows: `run(needed, first_host)` as DecodePlan's (CUDA: two masked
    launches, capturable), `decode_row(row)` the CPU reference."""

    def __init__(self, codes: tuple[FixedRows, FixedRows], outs: tuple[torch.Tensor, torch.Tensor]):
        self.codes, self.outs = codes, outs

    def run(self, needed: torch.Tensor, first_host: torch.Tensor) -> None:
        for code, out in zip(self.codes, self.outs):
            decode_rows(code, out, needed, first_host)

    def decode_row(self, row: int) -> None:
        for code, out in zip(self.codes, self.outs):
            out[row].copy_(decode_rows_reference(code, [row])[0].view(out[row].shape))


class LayerTiers:
    """One paged layer's tiers and its fetch, over its base rows. `layer` gives its rows (w13, w2 virtual tensors
    at fixed addresses), `own_experts`, `host_row(row)` (pinned host copies; (None, None) without, where the
    compressed tier delivers every base row: `base_copies`) and `copy_in(skip)`."""

    def __init__(self, index: int, layer, *, store: StoreTier | FixedTier | None = None, decode_stream=None):
        """`decode_stream` (CUDA, with a store): where the decoder runs beside the host tier's copies. A FixedTier
        encodes the layer's base rows now, from what they hold: build it before the layer is paged out."""
        self.index, self.layer, self.decode_stream = index, layer, decode_stream
        self.num_experts = layer.num_experts
        w13, w2 = self.rows
        self.cuda = w13.device.type == "cuda"
        self.store_rows = 0  # base rows [0, store_rows) from the store, the rest from host copies
        self.active = True  # False: the layer is resident and fetches nothing
        self.has_store = store is not None
        if isinstance(store, FixedTier):
            self._init_fixed(store.encode(index, w13, w2, self.num_experts))
        else:
            self._init_store(store)
        if not layer.base_copies:  # no host copies of the base rows: the compressed tier delivers every one
            self.set_store_rows(self.num_experts)

    def _init_store(self, store: StoreTier | None) -> None:
        w13, w2 = self.rows
        targets = store.targets(self.index, w13, w2) if store is not None else []
        if self.cuda:
            self.fetcher = RowFetch(w13, w2)
            self.plan = store.store.plan([(n, t) for _, n, t in targets], rows=[e for e, _, _ in targets]) \
                if store is not None else None
        else:
            self.needed = torch.zeros(w13.shape[0], dtype=torch.int32)
            self.segments: dict[int, list] = {}
            self.store_targets: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for e, name, t in targets:
                self.store_targets.setdefault(e, []).append((name, t))
            decode = store.store.decode_tensor if store is not None else None
            self.decode_row = lambda row: [decode(name, out) for name, out in self.store_targets[row]]
            self.fetched_rows, self.marks = 0, 0
        self.refresh()

    def _init_fixed(self, plan: FixedPlan) -> None:
        if self.cuda:
            self.fetcher, self.plan = RowFetch(*self.rows), plan
        else:
            self.needed = torch.zeros(self.num_experts, dtype=torch.int32)
            self.segments, self.fetched_rows, self.marks = {}, 0, 0
            self.decode_row = plan.decode_row
        self.refresh()

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The base rows of w13 and w2: what this layer's fetch fills."""
        return self.layer.w13.tensor[:self.num_experts], self.layer.w2.tensor[:self.num_experts]

    def refresh(self) -> None:
        """Point every base row at its host copy."""
        w13, w2 = self.rows
        held = self.layer.own_experts
        if self.cuda:  # a whole-layer fetch lists every base row: the decoder's are counted as fetched too
            self.fetcher.set_sources([self.layer.host_row(r) for r in range(self.num_experts)], held=list(held))
        else:
            self.segments = {r: list(zip(self.layer.host_row(r), (w13[r], w2[r]))) for r in held}

    def set_active(self, active: bool) -> None:
        self.active = active
        if self.cuda:
            self.fetcher.active.fill_(int(active))

    def set_store_rows(self, rows: int) -> None:
        if rows and not self.has_store:
            raise ValueError("this layer has no store tier")
        if rows < self.num_experts and not self.layer.base_copies:
            raise EsftError(f"layer {self.index} keeps no host copies of its base rows: the compressed tier must "
                            f"deliver all {self.num_experts}, not {rows}")
        self.store_rows = min(rows, self.num_experts)
        if self.cuda:
            self.fetcher.first_host.fill_(self.store_rows)

    def fetch(self, ids: torch.Tensor | None, *, programs: int) -> None:
        """Bring in the base rows `ids` names (every one with None), from both tiers, on the current stream."""
        if self.cuda and ids is None and not torch.cuda.is_current_stream_capturing():
            self._copy_whole()  # outside graphs the host decides, and the copy engine leaves the SMs to kernels
            return
        if self.cuda:
            self.fetcher.mark(ids)
            if self.plan is None:
                self.fetcher.fetch(programs)
                return
            # Both tiers at once: the decoder on its own stream (launched whatever store_rows is now: a captured
            # graph follows its later values), joined before this call returns.
            here = torch.cuda.current_stream()
            self.decode_stream.wait_stream(here)
            with torch.cuda.stream(self.decode_stream):
                self.plan.run(self.fetcher.needed, self.fetcher.first_host)
            self.fetcher.fetch(programs)
            here.wait_stream(self.decode_stream)
            return
        rows = mark_rows_reference(ids, self.needed, self.active, held=list(self.segments))
        fetch_rows_reference(rows, self.store_rows, self.segments)
        for row in rows:
            if row < self.store_rows:
                self.decode_row(row)
        self.fetched_rows += len(rows)
        self.marks += int(self.active)

    def _copy_whole(self) -> None:
        """Every base row, through the copy engine (the rows from `store_rows` on in one copy per tensor) and the
        store's rows through the decoder beside it: what a whole-layer fetch is when no graph is captured (on
        an H100 a fetch kernel beside a large prefill's grouped products got few SMs: 0.83 of resident at 131K
        tokens, against 0.99 with copies)."""
        if not self.active:
            return
        layer, e, s = self.layer, self.num_experts, self.store_rows
        here = torch.cuda.current_stream()
        if self.plan is not None and s:
            self.fetcher.needed.fill_(1)
            self.decode_stream.wait_stream(here)
            with torch.cuda.stream(self.decode_stream):
                self.plan.run(self.fetcher.needed, self.fetcher.first_host)
        w13, w2 = self.rows
        if s < e:  # without base copies the tier delivers every base row (s == e)
            w13[s:].copy_(layer.host[0][s:], non_blocking=True)
            w2[s:].copy_(layer.host[1][s:], non_blocking=True)
        if self.plan is not None and s:
            here.wait_stream(self.decode_stream)
        self.fetcher.stats[0] += e  # counted on the device, like the kernels' fetches
        self.fetcher.stats[1] += 1

    def fill(self) -> None:
        """Every base row into the layer's rows, between steps (a layer made resident maps pages of its own
        again, or a parked one fills its block): from the host copies, or without copies from the compressed
        tier."""
        skip = 0 if self.layer.base_copies else self.store_rows
        if skip and self.cuda:
            self.fetcher.needed.fill_(1)  # the next fetch's mark sets it again
            self.plan.run(self.fetcher.needed, self.fetcher.first_host)
        elif skip:
            for row in range(skip):
                self.decode_row(row)
        self.layer.copy_in(skip=skip)

    @property
    def stats(self) -> torch.Tensor:
        """(rows fetched, fetches of this layer while active), summed since the start, int64 on the layer's device."""
        return self.fetcher.stats if self.cuda else torch.tensor([self.fetched_rows, self.marks])
