"""ESFT adapters behind vLLM's LoRA plumbing, on the worker side.

vLLM already does everything around an adapter that is not about its weights: the OpenAI server maps a
request's `model` name to a LoRARequest (`--lora-modules`, /v1/load_lora_adapter, /v1/models), the
scheduler keeps at most `max_loras` adapters in a batch, and every step the model runner hands its
worker LoRA manager the batch's requests and the adapter id of every token. `EsftWorkerManager` takes that
manager's place (the plugin swaps the class the model runner builds) and, instead of wrapping layers
with LoRA layers:
- `create_lora_manager` installs the ESFT runtime into the model (esftctl.runtime.vllm.model);
- `add_adapter` opens the LoRARequest's path as an ESFT bundle, checks it against the served base, and
  loads its experts into a free slot (from the host cache, esftctl.runtime.host_cache, when it holds the
  unchanged file); no free slot, a bundle of another base, a corrupted bundle: it raises, vLLM answers the
  load request with the message, and serving goes on;
- `set_active_adapters` turns the per-token LoRA ids into per-token slots for the rerouting.
Under `serve --variants` (esftctl.variants) it also loads the consolidated experts into the base rows, each
variant's own experts into a slot of its own, and every variant's non-expert weights beside the model
(esftctl.runtime.vllm.variant_weights); a variant's LoRA name binds to its slot, and each step puts the step's
variant's non-expert weights in place (vLLM's scheduler runs one variant per step: esftctl.runtime.vllm.variant_turns).
After every change, and every second while serving (off the steps: esftctl.runtime.engine_status.StatusFile), it
writes the adapter and memory table to the status file `esftctl serve` shows; under tensor parallelism every rank
writes its own (`rank_status_file`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from esftctl.errors import EsftError
from esftctl.formats.bundle import NON_EXPERT_PREFIX
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.formats.store import ExpertStore
from esftctl.names import check_name
from esftctl.runtime.engine_status import (
    LOADED_FROM,
    AdapterStatus,
    EngineStatus,
    PagingStatus,
    StatusFile,
    VariantStatus,
    check_free_slot,
)
from esftctl.runtime.host_cache import HostAdapterCache, stage
from esftctl.runtime.paging.planner import KvNeed
from esftctl.runtime.serve_config import (
    ServeConfig,
    open_servable_bundle,
    opened_for_load,
    rank_status_file,
    was_verified,
)
from esftctl.runtime.vllm.model import EsftModel
from esftctl.runtime.vllm.module_copies import ModuleCopies
from esftctl.runtime.vllm.moe import check_engine
from esftctl.runtime.vllm.variant_weights import VariantWeights, collect
from esftctl.variants import HOME, VariantSet

FROM_CACHE, FROM_HASHED_FILE, FROM_VERIFIED_FILE = LOADED_FROM


class EsftWorkerManager:
    """The interface of vLLM's WorkerLoRAManager, over ESFT adapter slots."""

    def __init__(self, vllm_config, device, embedding_modules=None, **_unused):
        config = ServeConfig.from_env()
        if config is None:
            raise EsftError("the ESFT worker manager runs only under `esftctl serve`")
        self.config = config
        self.vllm_config = vllm_config
        self.base = MoECheckpoint(vllm_config.model_config.model, fp8=True)
        self.runtime: EsftModel | None = None
        self.names: dict[int, str] = {}  # LoRA id -> adapter name; slots are keyed by the id (see _key)
        self.last_used: dict[int, float] = {}
        self.load_times: dict[int, tuple[dict[str, float], str]] = {}  # LoRA id -> its load's phases, whence
        self.active: set[int] = set()  # LoRA ids of the last step's batch
        self.retiring: set[int] = set()  # unloaded, kept until their running requests finish
        self.host_cache = HostAdapterCache(config.settings.host_cache)
        self.status_file = StatusFile(None)  # its path once the rank is known (create_lora_manager)
        self.variants: VariantSet | None = None
        self.variant_weights: VariantWeights | None = None
        self.variant_loras: dict[int, int] = {}  # LoRA id -> variant (never evicted: a variant's slot is fixed)
        self.dummy_loras: set[int] = set()  # vLLM's warm-up adapters: no slot
        self.one_step = False  # variants in the same steps (serve --one-step)

    # ---- set-up ----------------------------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return True

    def create_lora_manager(self, model, vllm_config=None):
        check_engine(self.vllm_config)
        config, settings, scheduler = self.config, self.config.settings, self.vllm_config.scheduler_config
        if self.rank[1] > 1 and (settings.compressed_tier or settings.variants):
            what = f"--paging-codec {settings.compressed_tier}" if settings.compressed_tier else "--variants"
            raise EsftError(f"{what} is not supported under tensor or expert parallelism yet (the store decodes whole "
                            "experts, the fixed-rate tier is untested on a rank's shards; variants' non-expert "
                            "weights are not split per rank); serve on one GPU, or page from host memory only")
        if config.status_file:
            self.status_file = StatusFile(rank_status_file(config.status_file, self.rank[0]))
        max_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs) + 1024  # + graph padding
        store = ExpertStore(settings.paging_store) if settings.paging_store else None
        if settings.variants:
            self.variants = VariantSet.open(settings.variants, config.variant_names)
            self.variant_weights = collect(model, self.vllm_config, dict(enumerate(self.variants.paths)))
            closures = self.variant_weights.swapped_closures
            if closures and not self.vllm_config.model_config.enforce_eager:
                raise EsftError(f"this engine keeps weights in closures ({', '.join(closures[:3])}), which compiled "
                                "code captures: serve variants with --enforce-eager")
        copies = config.shared_copies or config.module_copies
        if copies and not torch.cuda.is_available() and not self.vllm_config.model_config.enforce_eager:
            raise EsftError("copies of shared experts or other modules on vLLM's CPU build swap the closures its "
                            "linear layers compute with, which compiled code captures: serve with --enforce-eager")
        self.runtime = EsftModel(model, self.base, num_slots=config.slots, experts_per_slot=config.experts_per_slot,
                                 max_tokens=max_tokens, adapter_budget=config.adapter_budget,
                                 paging_window=settings.paging_window, paging_store=store,
                                 fixed_tier=settings.compressed_tier in ("fixed", "fixed-host"),
                                 fixed_on_host=settings.compressed_tier == "fixed-host",
                                 store_experts=settings.store_experts, adaptive=settings.paging_adaptive,
                                 kv_need=kv_need(self.vllm_config), paging_fetch=settings.paging_fetch,
                                 base_rows=self.variants.base_rows() if self.variants else None,
                                 shared_copies=config.shared_copies, module_copies=config.module_copies,
                                 copied_tensors=config.copied_tensors)
        if self.variants:
            for v in range(1, len(self.variants.names)):
                staged = stage(self.runtime.layers, self.variants.own_experts(v))
                self.runtime.slots.load(_variant_key(v), staged.experts(), staged.rows(), staged.checksums())
            if settings.one_step:  # the variants' differing modules as per-token copies; no weights swapped per step
                slots_of = {v: self.runtime.slots.slot_of(_variant_key(v)) for v in range(1, len(self.variants.names))}
                self.runtime.module_copies = ModuleCopies.for_variants(
                    model, self.variant_weights, slots_of, slots=self.runtime.slots.num_slots,
                    token_adapters=self.runtime.token_adapters, sample_adapters=self.runtime.sample_adapters,
                    device=self.runtime.device)
                self.one_step = True
                self.variant_weights = VariantWeights([])  # the copies hold the other variants' weights: nothing swaps
        self.write_status()
        return model

    @property
    def rank(self) -> tuple[int, int]:
        """(this worker's tensor-parallel rank, the group's size): each rank holds its part of every expert, or
        under expert parallelism (over the same group) its own experts."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    # ---- adapters --------------------------------------------------------------------------------
    def _bind_variant(self, lora_request) -> bool:
        """Bind a LoRA request naming a variant's checkpoint to that variant (its slot is loaded at start)."""
        if not self.variants or lora_request.lora_int_id in self.variant_loras:
            return False
        path = str(Path(lora_request.lora_path).resolve())
        paths = [str(p) for p in self.variants.paths]
        if path not in paths[HOME + 1:]:
            return False
        self.variant_loras[lora_request.lora_int_id] = paths.index(path)
        self.write_status()
        return True

    def add_adapter(self, lora_request) -> bool:
        lora_id, name = lora_request.lora_int_id, lora_request.lora_name
        if self._bind_variant(lora_request):
            return True
        if lora_id in self.variant_loras:
            return False
        if lora_id in self.names and getattr(lora_request, "load_inplace", False):  # vLLM would answer success
            raise EsftError(f"adapter {name!r} is loaded already and esftctl does not swap an adapter's experts in "
                            f"place: unload it first (esftctl adapters unload {name}), then load it again")
        if lora_id in self.names:
            self.retiring.discard(lora_id)  # loaded again under the same id: keep it
            return False
        slots = self.runtime.slots
        try:  # vLLM hides paths in the messages it returns, so the message names the adapter
            check_name(name)
            if not slots.free_slots() and not self.retiring:  # refused at once, before reading anything
                check_free_slot(slots.num_slots, self.status().taken_by())
            pinned = opened_for_load(self.config.settings, lora_request.lora_path)
            with pinned if pinned is not None else contextlib.nullcontext():
                clock = _Phases()
                key, staged = self.host_cache.lookup(lora_request.lora_path, pinned)
                bundle, source = None, FROM_CACHE
                if staged is None:  # its data hashed unless the middleware has just verified these very files
                    verified = was_verified(self.config.status_file, key)
                    bundle = open_servable_bundle(lora_request.lora_path, self.base, hash_data=not verified,
                                                  pinned=pinned)
                    source = FROM_VERIFIED_FILE if verified else FROM_HASHED_FILE
                clock.end("verify")
                count = staged.num_experts if staged is not None else bundle.num_experts
                non_expert = list(staged.non_expert if staged is not None else bundle.non_expert_tensors)
                # unloaded ones make room first; a running one reloads on demand
                while self.retiring and not self._fits(count, non_expert):
                    self._evict(min(self.retiring, key=lambda i: self.last_used.get(i, 0.0)))
                if not slots.free_slots():
                    check_free_slot(slots.num_slots, self.status().taken_by())
                clock.skip()  # evictions are the unloads' time, not this load's
                if staged is None:
                    experts = bundle.read_experts() if bundle.fp8 is not None else bundle.stored_experts()
                    others = {n: bundle.read_tensor(NON_EXPERT_PREFIX + n) for n in bundle.non_expert_tensors}
                    staged = stage(self.runtime.layers, experts, others)  # read in place, through `pinned` if given
                    self.host_cache.put(key, staged)
                clock.end("stage")
            slots.load(_key(lora_id), staged.experts(), staged.rows(), staged.checksums(), non_expert=staged.non_expert)
            if slots.device.type == "cuda":  # loaded means on the device: the pinned rows' copies have run
                torch.cuda.current_stream(slots.device).synchronize()
            clock.end("copy")
        except EsftError as e:
            raise EsftError(f"adapter {name!r}: {e}") from None
        self.load_times[lora_id] = (clock.seconds, source)
        self.names[lora_id] = lora_request.lora_name
        self.last_used[lora_id] = time.monotonic()
        self.write_status()
        return True

    def _fits(self, experts: int, non_expert: list[str]) -> bool:
        """Whether a load of `experts` experts and the copies its `non_expert` tensors need fits now."""
        slots = self.runtime.slots
        return (bool(slots.free_slots()) and slots.copies_free(non_expert)
                and (slots.budget is None or slots.loaded_experts() + experts <= slots.budget))

    def add_dummy_lora(self, lora_request, rank: int) -> bool:
        """Warm-up adapters (vLLM adds --max-loras of them for profiling and CUDA graph capture): no slot, their
        tokens take the base experts; slots taken at start-up (variants) stay free of them."""
        if lora_request.lora_int_id in self.names or lora_request.lora_int_id in self.dummy_loras:
            return False
        self.dummy_loras.add(lora_request.lora_int_id)
        return True

    @contextlib.contextmanager
    def dummy_lora_cache(self):
        yield

    def get_dummy_lora_warmup_rank(self, default_rank: int) -> int:
        return default_rank

    def remove_adapter(self, lora_id: int) -> bool:
        """Evict now, or, if the last step ran tokens of it, once its running requests have finished. A variant's
        name is unbound only (its slot stays: the next request under that name binds it again)."""
        if self.variant_loras.pop(lora_id, None) is not None or lora_id in self.dummy_loras:
            self.dummy_loras.discard(lora_id)
            return True
        if lora_id not in self.names:
            return False
        if lora_id in self.active:
            self.retiring.add(lora_id)
            self.write_status()  # the table shows it retiring the moment the unload answers
            return True
        self._evict(lora_id)
        return True

    def _evict(self, lora_id: int) -> None:
        self.names.pop(lora_id)
        self.last_used.pop(lora_id, None)
        self.load_times.pop(lora_id, None)
        self.retiring.discard(lora_id)
        self.runtime.slots.evict(_key(lora_id))
        self.write_status()

    def remove_all_adapters(self) -> None:
        self.dummy_loras.clear()
        for lora_id in list(self.names):
            self._evict(lora_id)

    def pin_adapter(self, lora_id: int) -> bool:
        return lora_id in self.names  # adapters stay resident until unloaded

    def list_adapters(self) -> set[int]:
        return set(self.names) | set(self.variant_loras) | self.dummy_loras

    def supports_tower_connector_lora(self) -> bool:
        return False

    # ---- every step ------------------------------------------------------------------------------
    def set_active_adapters(self, requests, mapping) -> None:
        now = time.monotonic()
        wanted = {r.lora_int_id: r for r in requests if r}
        for lora_id in self.retiring - set(wanted):
            self._evict(lora_id)
        for request in wanted.values():  # a variant's name unloaded and loaded again while its requests waited
            self._bind_variant(request)
        self._activate_variant(wanted.values())
        for lora_id, request in wanted.items():
            if lora_id in self.variant_loras or lora_id in self.dummy_loras:
                continue
            if lora_id not in self.names:  # a request that was queued before its adapter was unloaded
                self._make_room(keep=set(wanted))
                self.add_adapter(request)
                self.retiring.add(lora_id)
            self.last_used[lora_id] = now
        self.active = set(wanted)
        if self.runtime.pager is not None:
            self.runtime.pager.step()  # between steps: where the residency planner acts
        prefill = mapping is not None and len(mapping.index_mapping) > len(mapping.prompt_mapping)  # a prompt's tokens
        self.status_file.tick(self.status, prefill=prefill)  # counters (paging fetches, KV cache) stay current
        if mapping is None:
            return
        self.runtime.set_token_adapters(self._slots(mapping.index_mapping))
        if self.runtime.module_copies is not None and self.runtime.module_copies.head is not None:
            self.runtime.set_sample_adapters(self._slots(mapping.prompt_mapping))

    def _slots(self, lora_mapping) -> np.ndarray:
        """vLLM's LoRA id per token (or per sampled row) as the adapter slot of each (-1: the base)."""
        lora_ids = np.asarray(lora_mapping, dtype=np.int64)
        slots = np.full(len(lora_ids), -1, dtype=np.int32)
        for lora_id in np.unique(lora_ids):
            if lora_id > 0 and lora_id not in self.dummy_loras:
                slots[lora_ids == lora_id] = self.runtime.slots.slot_of(self._slot_key(int(lora_id)))
        return slots

    def _slot_key(self, lora_id: int) -> str:
        variant = self.variant_loras.get(lora_id)
        return _key(lora_id) if variant is None else _variant_key(variant)

    def _activate_variant(self, requests) -> None:
        """Put the step's variant's non-expert weights in place (the home one's for the base and adapters); nothing
        with --one-step, where each token takes its variant's copies."""
        if self.variant_weights is None or self.one_step:
            return
        variants = {self.variant_loras[r.lora_int_id] for r in requests if r.lora_int_id in self.variant_loras}
        if len(variants) > 1:
            names = ", ".join(self.variants.names[v] for v in sorted(variants))
            raise EsftError(f"one engine step mixes variants ({names}); serve variants with esftctl's scheduler")
        self.variant_weights.activate(variants.pop() if variants else HOME)

    def _make_room(self, keep: set[int]) -> None:
        """Evict the least recently used adapter outside this batch when every slot is taken, unloaded ones
        first (vLLM's scheduler keeps at most `slots` adapters in a batch, so one is always idle; an evicted
        one that is still registered is loaded again by its next request)."""
        if self.runtime.slots.free_slots():
            return
        idle = [i for i in self.names if i not in keep]
        if idle:
            self._evict(min(idle, key=lambda i: (i not in self.retiring, self.last_used.get(i, 0.0))))

    # ---- the status table ------------------------------------------------------------------------
    def status(self) -> EngineStatus:
        runtime = self.runtime
        slots = runtime.slots
        expert_bytes = runtime.expert_bytes()  # one expert in every MoE layer
        base_experts = sum(l.base_rows * l.expert_bytes for l in runtime.layers.values())
        adapters = [self._adapter_status(lora_id, name) for lora_id, name in sorted(self.names.items())]
        widest = max((max(a.experts_per_layer, default=0) for a in adapters), default=0)
        # Boundary pages shared with the base count here. Paged, only the layers in the window hold any memory.
        physical_adapter = None if runtime.pager else slots.physical_bytes() - base_experts
        paging = self._paging_status() if runtime.pager else None
        cache = self.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        rank, ranks = self.rank
        settings = self.config.settings
        return EngineStatus(
            updated=time.time(), base=str(self.base.path), device=str(runtime.device), rank=rank, ranks=ranks,
            slots=slots.num_slots, experts_per_slot=self.config.experts_per_slot, moe_layers=list(runtime.layers),
            adapters=adapters, variants=self._variant_statuses(),
            variant_map=str(settings.variants) if settings.variants else None,
            variant_paths=[str(p) for p in self.variants.paths] if self.variants else [],
            variant_switch_bytes=self.variant_weights.nbytes() if self.variant_weights else 0,
            base_expert_bytes=base_experts, model_bytes=self.base.total_nbytes,
            adapter_expert_bytes=slots.adapter_bytes(),
            adapter_budget_bytes=slots.budget * slots.expert_bytes if slots.budget is not None else None,
            adapter_budget_experts=slots.budget,
            reserved_bytes=runtime.reserved_bytes, page_bytes=runtime.page_bytes,
            adapter_physical_bytes=physical_adapter,
            expert_device_bytes=(paging.window_bytes + paging.resident_bytes + paging.adapter_bytes
                                 + paging.store_bytes) if paging else slots.physical_bytes(),
            padded_bytes=len(adapters) * widest * expert_bytes, merged_bytes=len(adapters) * self.base.total_nbytes,
            kv_cache_tokens=blocks * cache.block_size if blocks else None,
            host_cache_used_bytes=self.host_cache.nbytes, host_cache_hits=self.host_cache.hits,
            host_cache_misses=self.host_cache.misses, staged_bundles=self.host_cache.identities(),
            paging_window=settings.paging_window,
            shared_copies=runtime.shared.num_copies if runtime.shared else 0,
            shared_copy_bytes=runtime.shared.nbytes() if runtime.shared else 0,
            module_copies=runtime.module_copies.num_copies if runtime.module_copies else 0,
            module_copy_bytes=runtime.module_copies.nbytes() if runtime.module_copies else 0,
            paging=paging)

    def _adapter_status(self, lora_id: int, name: str) -> AdapterStatus:
        info = self.runtime.slots.adapters[_key(lora_id)]
        load_s, source = self.load_times.get(lora_id, ({}, ""))
        return AdapterStatus(name=name, lora_id=lora_id, slot=info.slot, bytes=info.nbytes,
                             retiring=lora_id in self.retiring, checked_rows=info.checked_rows,
                             experts_per_layer=[info.experts_per_layer.get(l, 0) for l in self.runtime.layers],
                             load_s=load_s, loaded_from=source, shared_layers=info.replaced.get("shared", 0),
                             modules=info.replaced.get("modules", 0))

    def _variant_statuses(self) -> list[VariantStatus]:
        if self.variants is None:
            return []
        out = []
        for v, name in enumerate(self.variants.names):
            info = self.runtime.slots.adapters[_variant_key(v)] if v != HOME else None
            out.append(VariantStatus(name=name, slot=info.slot if info else None, bytes=info.nbytes if info else 0,
                                     home=v == HOME, experts_per_layer=[info.experts_per_layer.get(l, 0) if info else 0
                                                                        for l in self.runtime.layers]))
        return out

    def _paging_status(self) -> PagingStatus:
        pager, residency = self.runtime.pager, self.runtime.residency
        device, counters = pager.device_bytes(), pager.counters(wait=False)
        layers = list(self.runtime.layers.values())
        held = sum(l.held_bytes() for l in layers)
        freed = max(0, held - sum(device.values()))
        per_token = kv_bytes_per_token(self.vllm_config)
        return PagingStatus(fetch=pager.fetch_mode, store_experts=pager.store_rows, store_codec=pager.codec or "",
                            window_bytes=device["window"],
                            resident_bytes=device["resident"], adapter_bytes=device["adapters"],
                            store_bytes=device["store"],
                            host_bytes=sum(l.host_bytes() for l in layers) + getattr(pager.store, "host_nbytes", 0),
                            host_base_rows=all(l.base_copies for l in layers),
                            freed_bytes=freed, freed_kv_tokens=freed // per_token if per_token else None,
                            held_rows=max(l.base_rows for l in layers),
                            fetched_rows=counters["fetched_rows"], fetches=counters["fetches"],
                            resident_layers=sorted(pager.resident), parked_layers=sorted(pager.parked),
                            decisions=residency.decisions[-5:] if residency else [])

    def write_status(self) -> None:
        self.status_file.write(self.status())


def kv_need(vllm_config) -> KvNeed | None:
    """The most KV cache this engine can use: max_num_seqs sequences of max_model_len tokens, at vLLM's memory
    share; None where vLLM's KV cache is sized by --kv-cache-memory-bytes (then it does not take the rest) or
    its bytes per token are unknown."""
    per_token, cache = kv_bytes_per_token(vllm_config), vllm_config.cache_config
    if per_token is None or getattr(cache, "kv_cache_memory_bytes", None):
        return None
    tokens = vllm_config.scheduler_config.max_num_seqs * vllm_config.model_config.max_model_len
    return KvNeed(tokens=tokens, bytes_per_token=per_token, utilization=cache.gpu_memory_utilization)


def kv_bytes_per_token(vllm_config) -> int | None:
    """The KV cache's bytes per token on this rank (MLA: one latent vector per layer; else keys and values of
    the rank's KV heads), from vLLM's model config; None where it cannot tell."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        layers = model.get_num_layers(parallel)
        text = model.hf_text_config
        if getattr(model, "use_mla", False):
            per_layer = text.kv_lora_rank + text.qk_rope_head_dim
        else:
            per_layer = 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
        dtype = vllm_config.cache_config.cache_dtype
        size = 1 if "fp8" in str(dtype) else model.dtype.itemsize
    except (AttributeError, TypeError):
        return None
    return layers * per_layer * size


def _variant_key(variant: int) -> str:
    return f"variant-{variant}"


class _Phases:
    """Seconds between marks, by phase name (engine_status.LOAD_PHASES): `end(phase)` closes a phase, `skip()`
    drops the time since the last mark."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def end(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._mark, 4)
        self._mark = now

    def skip(self) -> None:
        self._mark = time.perf_counter()


def _key(lora_id: int) -> str:
    """The slot key of a LoRA id: ids, not names, since a name may be reused while its old adapter retires."""
    return f"lora-{lora_id}"
