"""The ESFT runtime installed into a loaded vLLM model: virtual expert tensors and per-token rerouting.

For every MoE layer of the model (vLLM's `MoERunner`: a `router` and `routed_experts` holding `w13_weight`
[E, 2I, H] and `w2_weight` [E, H, I] in the kernel's own layout) this
- builds a `VirtualMoELayer` whose first E rows receive the base experts exactly as vLLM loaded them, and
  whose further rows take adapter experts, converted by vLLM's own weight processing for that kernel
  (`process_weights_after_loading` of the layer's experts, on a stand-in layer), so the fused kernel reads
  one ordinary tensor and is not changed;
- gives experts with biases (GPT-OSS: `w13_bias`, `w2_bias`, gate and up interleaved as the checkpoint keeps them)
  bias rows beside the weight rows, handed to the layer and the kernel's quant config (which the kernel reads
  biases from) as FP8 block scales are;
- checks that conversion once against the loaded base (the rank's first expert of the checkpoint, converted,
  must equal its row bit for bit) and refuses a backend whose layout it cannot reproduce;
- under expert parallelism keeps only the rank's experts and the adapter rows that replace them, and hands
  the kernel vLLM's expert map extended to those rows (esftctl.runtime.moe_layer);
- optionally pages the experts (esftctl.runtime.paging): the layers share `paging_window` blocks of device
  memory under their own addresses, and each layer's rows, base and adapter alike, come in from host copies (or
  the base's Huffman store on the GPU) just before its kernel, the rows its tokens route to or the next layer
  whole (the experts layer calls the pager around its kernel: esftctl.runtime.vllm.layers); an adapter loaded
  meanwhile is written to the host copies (which leave out the base rows where a compressed tier delivers all
  of them: esftctl.runtime.paging.tiers.base_copies_needed);
- makes the kernel compute every row (its expert count becomes the row count) and refuses set-ups in which
  some adapter row would be dropped or mis-mapped (esftctl.runtime.vllm.moe);
- sets device memory aside for the adapter budget (or the paging window) before vLLM sizes its KV cache
  from the memory left free: adapters load after that sizing;
- reroutes each token's top-k ids to its adapter's rows, ids[t, j] = table[adapter(t), ids[t, j]]
  (esftctl.kernels.reroute): inside vLLM's compiled grouped top-k where the router computes one (DeepSeek's:
  esftctl.runtime.vllm.topk, no kernel of its own; ESFTCTL_FOLD_REROUTE=0 turns that off), else through the
  router's capture callback, which vLLM calls with the logical ids before it uses them, rewriting them in place.
  The per-token adapter slots live in one persistent buffer shared by all layers; `set_token_adapters` fills it
  each step. Static shapes, no host synchronization: CUDA graphs replay it as they replay the router.
"""

from __future__ import annotations

import mmap
from typing import Callable

import numpy as np
import torch

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint
from esftctl.formats.store import ExpertStore, missing_base_experts
from esftctl.kernels.fixed_rate import ENCODE_BYTES_PER_VALUE, ENCODE_ROWS_AT_ONCE
from esftctl.kernels.reroute import reroute
from esftctl.runtime.adapters import AdapterSlots
from esftctl.runtime.address_space import CudaAddressSpace, HostAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import ExpertLayout, VirtualMoELayer, stack_experts
from esftctl.runtime.paging.pager import PagedExperts
from esftctl.runtime.paging.planner import AdaptiveResidency, KvNeed
from esftctl.runtime.paging.tiers import FixedTier, StoreTier, base_copies_needed, tier_split
from esftctl.runtime.vllm.module_copies import ModuleCopies
from esftctl.runtime.vllm.moe import (
    BIASES,
    EngineMoELayer,
    check_rows,
    check_supported,
    expert_biases,
    expert_map,
    expert_scales,
    find_moe_layers,
    interleaves_gate_up,
    kernel_config,
    max_rows,
    set_biases,
    set_expert_map,
    set_scales,
    widen_to_rows,
)
from esftctl.runtime.vllm.shared_experts import SharedExperts
from esftctl.runtime.vllm.topk import enabled as fold_enabled
from esftctl.runtime.vllm.topk import fold_reroute
from esftctl.units import format_bytes

HOST_PAGE = 16 * mmap.PAGESIZE  # 64 KiB: small experts (the tiny models' are ~100 KB) still share pages


def tensor_parallel_shard(w13: torch.Tensor, w2: torch.Tensor, *, rank: int, size: int,
                          per_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked checkpoint experts (w13 [n, 2I, H], gate over up; w2 [n, H, I]) -> rank `rank` of `size`'s
    part, as vLLM's FusedMoE weight loader shards them: the intermediate dim I cut into `size` equal parts, the
    rank's part of gate over its part of up, and the same part of w2's columns. `per_rank` is the rank's
    (possibly padded) width of I in the engine's tensors; padding stays zero, as vLLM leaves it."""
    inter = w2.shape[-1]
    if size == 1 and per_rank in (None, inter):
        return w13, w2
    loaded = inter // size
    per_rank = per_rank or loaded
    start = loaded * rank
    n = max(0, min(loaded, inter - start))
    n_experts, hidden = w13.shape[0], w13.shape[-1]
    part13 = w13.new_zeros(n_experts, 2 * per_rank, hidden)
    part13[:, :n] = w13[:, start:start + n]
    part13[:, per_rank:per_rank + n] = w13[:, inter + start:inter + start + n]
    part2 = w2.new_zeros(n_experts, w2.shape[1], per_rank)
    part2[..., :n] = w2[..., start:start + n]
    return part13, part2


def fp8_layout(engine: EngineMoELayer) -> ExpertLayout:
    """FP8 experts on vLLM's Triton kernel: weights and block scales as the checkpoint stores them (its FP8
    conversion leaves them as loaded: esftctl.runtime.vllm.moe), moved to the layer's device; one rank only."""
    experts = engine.experts
    targets = (experts.w13_weight, experts.w2_weight, *expert_scales(engine))

    def convert(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if [p.dtype for p in parts] != [t.dtype for t in targets]:
            raise EsftError(f"layer {engine.index}: experts of {[str(p.dtype) for p in parts]} given for FP8 rows of "
                            f"{[str(t.dtype) for t in targets]}")
        return tuple(p.to(t.device) for p, t in zip(parts, targets))

    return ExpertLayout(tuple(targets[0].shape[1:]), tuple(targets[1].shape[1:]), convert,
                        scale_rows=(tuple(targets[2].shape[1:]), tuple(targets[3].shape[1:])))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, on any dtype (torch.equal has no FP8 kernels on every device)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """w13 rows or biases [n, 2I, ...] with gate over up -> gate and up interleaved along 2I (gate_0, up_0, gate_1,
    ...): the order GPT-OSS's checkpoint keeps and vLLM's loader leaves, which its swigluoai activation reads."""
    inter = w13.shape[1] // 2
    return torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(w13.shape)


def engine_layout(engine: EngineMoELayer) -> ExpertLayout:
    """The layer's kernel layout, as a conversion that takes this rank's tensor-parallel part of the experts
    (`tensor_parallel_shard`) and runs vLLM's own processing on a stand-in layer (FP8 experts: `fp8_layout`).
    Experts with biases (GPT-OSS, one rank) hand their biases to that processing too, gate and up interleaved
    where the activation reads them so (`interleave_gate_up`)."""
    if expert_scales(engine):
        return fp8_layout(engine)
    experts, kernel = engine.experts, engine.kernel
    parallel = experts.moe_config.moe_parallel_config
    per_rank = getattr(experts.moe_config, "intermediate_size_per_partition", None)
    biases = expert_biases(engine)
    interleaved = interleaves_gate_up(engine)

    def convert(w13: torch.Tensor, w2: torch.Tensor, *bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w13, w2 = tensor_parallel_shard(w13, w2, rank=parallel.tp_rank, size=parallel.tp_size, per_rank=per_rank)
        if interleaved:
            w13, bias = interleave_gate_up(w13), (interleave_gate_up(bias[0]), *bias[1:])
        stand_in = torch.nn.Module()
        for name, value, like in zip(("w13_weight", "w2_weight", *BIASES), (w13, w2, *bias),
                                     (experts.w13_weight, experts.w2_weight, *biases)):
            setattr(stand_in, name, torch.nn.Parameter(value.to(like.device, like.dtype), requires_grad=False))
        stand_in.moe_config = experts.moe_config  # kernels decide by these, as for the real layer
        stand_in.activation = experts.activation
        kernel.process_weights_after_loading(stand_in)
        return tuple(getattr(stand_in, n).data for n in ("w13_weight", "w2_weight", *BIASES[:len(bias)]))

    bias_rows = (tuple(biases[0].shape[1:]), tuple(biases[1].shape[1:])) if biases else None
    return ExpertLayout(tuple(experts.w13_weight.shape[1:]), tuple(experts.w2_weight.shape[1:]), convert,
                        bias_rows=bias_rows)


def _replace_weight(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    delattr(module, name)
    module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


class EsftModel:
    """A vLLM model serving ESFT adapters: `slots` loads and evicts them, `set_token_adapters` routes."""

    def __init__(self, model: torch.nn.Module, base: MoECheckpoint, *, num_slots: int, experts_per_slot: int,
                 max_tokens: int, adapter_budget: int | None = None, paging_window: int = 0,
                 paging_store: ExpertStore | None = None, fixed_tier: bool = False, fixed_on_host: bool = False,
                 store_experts: int | None = None,
                 adaptive: bool = False, kv_need: KvNeed | None = None, paging_fetch: str = "auto",
                 base_rows: dict[int, dict[int, ExpertWeights]] | None = None, shared_copies: int = 0,
                 module_copies: int = 0, copied_tensors: tuple[str, ...] = ()):
        """`adapter_budget`: the most adapter experts (summed over layers) loaded at once, their device memory
        reserved now (None: no limit, nothing reserved); `paging_window` > 0 pages the experts through that many
        layers' blocks; `paging_store` (a store of the base, `esftctl compress BASE`) delivers the first
        `store_experts` base experts of each layer (None: split by the two tiers' measured speeds); `fixed_tier`
        instead encodes every layer's base experts at start-up, from the loaded weights, in a fixed-rate code kept
        on the device (esftctl.runtime.paging.tiers.FixedTier: no store), or with `fixed_on_host` in pinned host
        memory, decoded over the bus (every base expert from it unless `store_experts` says otherwise); `adaptive`
        lets the residency planner keep layers resident while loads show, from the start those that fit beside
        `kv_need` (the KV cache vLLM can use at most; None: none); `paging_fetch` how paged layers fetch
        (esftctl.runtime.paging.pager: auto, routed, layer); `base_rows` ({layer: {expert:
        weights}}) replaces base experts (consolidated variants: esftctl.variants) before anything is paged;
        `shared_copies` copies of every MoE layer's shared experts are kept for adapters that replace them
        (esftctl.runtime.vllm.shared_experts), and `module_copies` of every module that reads one of
        `copied_tensors` (checkpoint names) for adapters that replace those (esftctl.runtime.vllm.module_copies)."""
        engine_layers = find_moe_layers(model)
        if sorted(engine_layers) != base.moe_layers:
            raise EsftError(f"{base.path}: the model's MoE layers {sorted(engine_layers)} are not the checkpoint's "
                            f"{base.moe_layers}")
        first = next(iter(engine_layers.values())).experts
        self.device = first.w13_weight.device
        self.token_adapters = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)
        self._written_slots: np.ndarray | None = None  # what set_token_adapters last wrote there
        self.pool = None if self.device.type == "cpu" else PhysicalPagePool(self.device)
        self.layers: dict[int, VirtualMoELayer] = {}
        for index, engine in engine_layers.items():
            self.layers[index] = self._install(engine, base, num_slots, experts_per_slot)
            self.layers[index].replace_base((base_rows or {}).get(index, {}))
            # vLLM's tensors of this layer's experts are replaced: their memory goes back to the driver, which maps
            # the next layer's rows. Kept in torch's cache, they made the start-up hold the base's experts twice
            # (27 GiB more for DeepSeek-V2-Lite: beside plain vLLM on an 80 GB H100 it ran out)
            if self.pool is not None:
                torch.cuda.empty_cache()
        self.shared = self._shared_experts(engine_layers, base, shared_copies, num_slots) if shared_copies else None
        if module_copies and first.moe_config.moe_parallel_config.tp_size > 1:
            raise EsftError("adapters that change non-expert modules are served on one GPU only for now (their copies "
                            "are converted and checked whole); serve without --tensor-parallel-size")
        self.sample_adapters = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)  # logits rows'
        self.module_copies = ModuleCopies(model, base, list(copied_tensors), copies=module_copies, slots=num_slots,
                                          token_adapters=self.token_adapters, sample_adapters=self.sample_adapters,
                                          device=self.device) if module_copies else None
        pools = {"shared": self.shared, "modules": self.module_copies}
        self.slots = AdapterSlots(self.layers, budget=adapter_budget,
                                  pools={k: v for k, v in pools.items() if v is not None})
        self.pager, self.residency = None, None
        if paging_window:
            tier = self._store_tier(base, paging_store, paging_window) if paging_store is not None else \
                self._fixed_tier(paging_window, fixed_on_host) if fixed_tier else None
            if fixed_on_host and store_experts is None:  # both tiers would cross the one bus: no split to measure
                store_experts = base.num_experts
            self.pager = self._page_experts(engine_layers, paging_window, tier, store_experts, paging_fetch)
            if adaptive:
                self.residency = AdaptiveResidency(self.pager,
                                                   lambda: max(l.base_bytes() for l in self.layers.values()))
                if kv_need is not None and self.pool is not None:
                    torch.cuda.empty_cache()
                    free, total = torch.cuda.mem_get_info(self.device)  # less what the adapters' rows will take
                    self.residency.start(kv_need, free=free - self._adapter_reserve(adapter_budget), total=total)
        self.reserved_bytes = self._reserve_device_memory(adapter_budget, paging_window)

    def _shared_experts(self, engine_layers: dict[int, EngineMoELayer], base: MoECheckpoint, copies: int,
                        slots: int) -> SharedExperts:
        lacking = [i for i, e in engine_layers.items() if e.shared is None]
        if lacking:
            raise EsftError(f"layer {lacking[0]}: this model computes no shared experts beside its MoE layer (or not "
                            "through vLLM's shared-expert runner); serve without --shared-expert-copies")
        first = next(iter(engine_layers.values()))
        parallel = first.experts.moe_config.moe_parallel_config
        dtype = next(first.shared.parameters()).dtype
        return SharedExperts(base, {i: e.shared for i, e in engine_layers.items()}, copies=copies, slots=slots,
                             token_adapters=self.token_adapters, rank=(parallel.tp_rank, parallel.tp_size),
                             dtype=dtype)

    @property
    def page_bytes(self) -> int:
        """The page by which expert memory is mapped (2 MiB on CUDA, HOST_PAGE on the host)."""
        return HOST_PAGE if self.pool is None else self.pool.page_size

    def _make_space(self, nbytes: int):
        if self.pool is None:
            return HostAddressSpace(nbytes, page_size=HOST_PAGE)
        return CudaAddressSpace(nbytes, self.pool)

    def _reserve_device_memory(self, budget: int | None, window: int) -> int:
        """Set device memory aside now for what serving maps later, since vLLM sizes its KV cache from the
        memory left free once the model is loaded (adapters, `--lora-modules` ones too, load after that): the
        adapter budget's experts, paged or not (a paged layer keeps its adapter rows in pages of its own; the
        layers paged out gave their base rows back, so the KV cache gets those). Returns the bytes set aside."""
        if self.pool is None:
            return 0
        torch.cuda.empty_cache()  # what start-up left in torch's cache (paging: the fixed-rate encoder's temporaries)
        if window and window < len(self.layers):
            self.pool.trim()
        nbytes, page = self._adapter_reserve(budget), self.pool.page_size
        free = torch.cuda.mem_get_info(self.device)[0]
        if nbytes > free:
            raise EsftError(f"the adapter memory budget needs {format_bytes(nbytes)} of GPU memory, but "
                            f"{format_bytes(free)} are free after loading the model; serve with a smaller "
                            "--adapter-memory or --paging-window, or fewer --slots or --experts-per-slot")
        pages = -(-nbytes // page)
        self.pool.reserve(pages)
        return pages * page

    def _adapter_reserve(self, budget: int | None) -> int:
        """Device bytes of `budget` adapter experts (all layers): their rows, and in each layer the two pages per
        tensor their rows start and end inside."""
        if not budget:
            return 0
        layer = next(iter(self.layers.values()))
        return budget * layer.expert_bytes + 2 * len(layer.parts) * len(self.layers) * self.page_bytes

    def _page_experts(self, engine_layers: dict[int, EngineMoELayer], window: int,
                      tier: StoreTier | FixedTier | None, store_experts: int | None, fetch: str) -> PagedExperts:
        """Keep the layers' rows in host memory (base rows only where the host tier may deliver some:
        base_copies_needed) and let the layers share `window` blocks of device memory."""
        if any(layer.expert_map is not None for layer in self.layers.values()):
            raise EsftError("paging is not supported under expert parallelism yet (a rank's rows are its own "
                            "experts, the pager's blocks assume every expert); serve without --paging-window")
        custom = [i for i, e in engine_layers.items() if not hasattr(type(e.experts), "esft_paging")]
        if custom:
            raise EsftError(f"layer {custom[0]}: this model builds its experts with its own class "
                            f"({type(engine_layers[custom[0]].experts).__name__}), which esftctl's pager cannot "
                            "bracket; serve it without --paging-window")
        base_copies = base_copies_needed(tier, store_experts, next(iter(self.layers.values())).num_experts)
        for layer in self.layers.values():
            layer.keep_host_copy(base_rows=base_copies)  # copied before it returns, so the rows can be given back
        first = next(iter(engine_layers.values())).experts
        # A window of every layer keeps every layer's own memory, with the pager in the path finding nothing to
        # fetch: its machinery alone against resident serving (`esftctl bench paging --serve`'s machinery regime).
        every = list(self.layers) if window >= len(self.layers) else ()
        pager = PagedExperts(self.layers, window=window, make_space=self._make_space, top_k=first.top_k,
                             store=tier, fetch=fetch, resident=every,
                             make_room=self.pool.trim if self.pool is not None else lambda: None)
        if tier is not None:
            pager.set_store_rows(store_experts if store_experts is not None else self._measured_split(pager))
        for index, engine in engine_layers.items():
            engine.experts.esft_paging = (pager, index)
        return pager

    def _free_once_paged(self, window: int) -> int:
        """GPU memory free once the paged layers gave their experts back (the window's blocks keep as many
        layers' rows): the compressed tier's room, since the pager builds it as the layers page out."""
        held = sorted((layer.base_bytes() for layer in self.layers.values()), reverse=True)
        return torch.cuda.mem_get_info(self.device)[0] + sum(held[window:])

    def _store_tier(self, base: MoECheckpoint, store: ExpertStore, window: int) -> StoreTier:
        """The store's decoder for base experts, if the engine keeps experts in the checkpoint's layout (the
        decoder writes that layout straight into the rows; an engine that repacks experts cannot use it)."""
        index, layer = next(iter(self.layers.items()))
        raw = stack_experts([base.read_expert(index, 0)])
        converted = layer.layout.convert(*raw)
        if not all(c.shape == r.shape and torch.equal(c.cpu(), r.to(c.dtype)) for c, r in zip(converted, raw)):
            raise EsftError(f"{store.path}: the store tier writes experts in the checkpoint's layout, but this "
                            "engine's MoE kernel keeps its own (e.g. vLLM's CPU build prepacks them); page from host "
                            "memory only")
        missing = missing_base_experts(base, set(store.tensors))
        if missing:
            raise EsftError(f"the store lacks {len(missing)} expert tensors of this base (e.g. {missing[0]!r}); make "
                            "it with `esftctl compress BASE`", store.path)
        if self.device.type == "cuda":  # the compressed tier lives on the GPU, taken before vLLM sizes its KV cache
            need, free = int(store.header["data_bytes"]), self._free_once_paged(window)
            if need > free:
                raise EsftError(f"the compressed tier needs {format_bytes(need)} of GPU memory and "
                                f"{format_bytes(free)} are free once the model's experts are paged; page from host "
                                "memory only (no --paging-store)", store.path)
        return StoreTier(store, {i: [base.expert_tensor_names(i, e) for e in range(l.num_experts)]
                                 for i, l in self.layers.items()})

    def _fixed_tier(self, window: int, on_host: bool = False) -> FixedTier:
        """The fixed-rate tier, once its codes fit: about 0.752 of the base experts' bf16 bytes, plus the encoder's
        temporaries (ENCODE_ROWS_AT_ONCE w13 rows at ENCODE_BYTES_PER_VALUE, freed after); on the host, in pinned
        memory (each layer's codes move there as they are made)."""
        if on_host:
            return FixedTier(on_host=True)
        if self.device.type == "cuda":
            layer = next(iter(self.layers.values()))
            need = int(0.76 * layer.num_experts * layer.expert_bytes * len(self.layers))
            need += ENCODE_BYTES_PER_VALUE * ENCODE_ROWS_AT_ONCE * layer.expert_bytes // 3  # a w13 row: 2/3 of 2 B
            free = self._free_once_paged(window)
            if need > free:
                raise EsftError(f"the fixed-rate tier needs about {format_bytes(need)} of GPU memory and "
                                f"{format_bytes(free)} are free once the model's experts are paged; page from host "
                                "memory only (no --paging-codec)")
        return FixedTier()

    def _measured_split(self, pager: PagedExperts) -> int:
        """How many base experts a layer takes from the store: both tiers timed once on the first layer."""
        index, layer = next(iter(self.layers.items()))
        e = layer.num_experts
        pager.timed_fetch(index, store_rows=e)  # warm-up: the kernels' compilation
        nbytes = e * layer.expert_bytes
        return tier_split(e, nbytes / pager.timed_fetch(index, 0), nbytes / pager.timed_fetch(index, e))

    def _install(self, engine: EngineMoELayer, base: MoECheckpoint, num_slots: int,
                 experts_per_slot: int) -> VirtualMoELayer:
        check_supported(engine)
        w13, w2 = engine.experts.w13_weight.data, engine.experts.w2_weight.data
        scales = expert_scales(engine)  # FP8 experts: their block scales, rows beside the weights' rows
        owned = expert_map(engine)  # expert parallelism: this rank's experts
        experts = base.num_experts if owned is not None else w13.shape[0]
        check_rows(experts + num_slots * experts_per_slot, max_rows(engine), experts, f"layer {engine.index}")
        layout = engine_layout(engine)
        layer = VirtualMoELayer(experts, base.hidden_size, base.moe_intermediate_size, num_slots=num_slots,
                                experts_per_slot=experts_per_slot, dtype=w13.dtype, make_space=self._make_space,
                                layout=layout, expert_map=owned)
        if layer.base_rows != w13.shape[0]:
            raise EsftError(f"layer {engine.index}: vLLM's expert map gives this rank {layer.base_rows} experts, its "
                            f"weights hold {w13.shape[0]}")
        layer.load_base_rows(w13, w2, *scales, *expert_biases(engine))
        probe = layer.own_experts[0]  # one of this rank's experts, converted
        converted = layout.convert(*stack_experts([base.read_expert(engine.index, probe)]))
        row = layer.local_row(probe)
        if not all(same_bits(c[0], part.tensor[row]) for c, part in zip(converted, layer.parts)):
            method = type(engine.experts.quant_method).__name__
            raise EsftError(f"layer {engine.index}: vLLM's expert layout for {method}"
                            " could not be reproduced from the checkpoint; this MoE backend is not supported")
        _replace_weight(engine.experts, "w13_weight", layer.w13.tensor)
        _replace_weight(engine.experts, "w2_weight", layer.w2.tensor)
        if scales:
            set_scales(engine, *(part.tensor for part in layer.scales))
        if layer.biases:
            set_biases(engine, *(part.tensor for part in layer.biases))
        widen_to_rows(engine, layer.num_rows)
        if layer.expert_map is not None:
            set_expert_map(engine, layer.expert_map)
        engine.experts.esft_kernel_config = kernel_config(engine, layer.base_rows)
        engine.experts.esft_base_experts = layer.base_rows
        if not (fold_enabled() and fold_reroute(engine.router, self.token_adapters, layer.table)):
            engine.router.set_capture_fn(self._rerouter(layer.table, engine.router.capture_fn))
        return layer

    def _rerouter(self, table: torch.Tensor, previous: Callable | None) -> Callable[[torch.Tensor], None]:
        adapters = self.token_adapters

        def reroute_in_place(topk_ids: torch.Tensor) -> None:
            if previous is not None:  # e.g. vLLM's routed-experts capture: it wants logical ids
                previous(topk_ids)
            reroute(topk_ids, adapters, table, out=topk_ids)  # the kernel reads the first tokens' entries

        return reroute_in_place

    def set_token_adapters(self, slots: np.ndarray) -> None:
        """This step's adapter slot per token (-1 = base), in the order of the tokens in the forward pass;
        tokens past the end (padding) use the base. Slots equal to the last step's (a decode batch that kept
        its requests and their adapters' slots) are not written again: the buffer holds them, and nothing else
        writes it. That saves a copy and a fill (two launches, one pageable host-to-device copy) per step."""
        slots = np.ascontiguousarray(slots, dtype=np.int32)
        if self._written_slots is not None and np.array_equal(slots, self._written_slots):
            return
        n = len(slots)
        if n > len(self.token_adapters):
            raise EsftError(f"{n} tokens in one step, more than the {len(self.token_adapters)} planned for")
        self.token_adapters[:n].copy_(torch.from_numpy(slots), non_blocking=True)
        self.token_adapters[n:].fill_(-1)
        self._written_slots = slots.copy()

    def set_sample_adapters(self, slots: np.ndarray) -> None:
        """This step's adapter slot per sampled row (the logits' rows: a request's last token, or its speculative
        ones), for an output head that adapters replace (esftctl.runtime.vllm.module_copies)."""
        n = len(slots)
        if n > len(self.sample_adapters):
            raise EsftError(f"{n} sampled rows in one step, more than the {len(self.sample_adapters)} planned for")
        self.sample_adapters[:n].copy_(torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int32)))
        self.sample_adapters[n:].fill_(-1)

    def expert_bytes(self) -> int:
        return sum(l.expert_bytes for l in self.layers.values())
