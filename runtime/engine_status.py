"""What the engine reports about its adapters and memory: one typed record, filled by the worker
(esftctl.runtime.vllm.worker), served by the API server's middleware (esftctl.runtime.vllm.status) and read by the
client's table (esftctl.serve_client) and the benchmarks.

On the wire (the status file, GET /esftctl/status) it is the flat JSON object clients and scripts have read all
along: `to_json` writes exactly those keys (the paging keys only while paging, `per_rank` only under tensor
parallelism, `server_pid` as the API server adds it) and `from_json` reads them back. The rule for a load when the
slots are full is here too, once (`check_free_slot`), for the engine and the middleware alike.

The engine writes the file through `StatusFile`, off its serving steps. The worker used to rebuild and write it
(JSON, fsync, rename) in the first step a second after the last write, which after any pause was the step that
prefilled the prompt arriving at an idle server: milliseconds more TTFT for such prompts (benchmarks/lab/
ttft_alone.py measures them), mostly the record summing the base's 5,291 tensor sizes twice (now cached), and
most of the low-load TTFT excess of prompts prefilled alone. An fsync adds 1-4 ms on a disk.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from esftctl.errors import EsftError, one_line
from esftctl.jsonfile import write_json

STATUS_EVERY_S = 1.0  # the worker rewrites the status file at most this often while serving, between steps
STATUS_SETTLE_S = 0.1  # ... in a stretch of steps this old: never where a prompt that woke the server waits

# The fields of each rank's own memory, collected by the API server under tensor parallelism (`per_rank`).
RANK_FIELDS = ("rank", "device", "base_expert_bytes", "adapter_expert_bytes", "adapter_physical_bytes",
               "expert_device_bytes", "reserved_bytes", "updated")


# An adapter load's phases in the engine (runtime.vllm.worker.add_adapter): verify (open the bundle, check it
# against the base, hash its data unless the launcher or middleware just did), stage (read the experts, stack them
# in pinned rows, take their checksums; nothing on a host-cache hit), copy (map rows, copy, check them on the
# device, wait for the device). Why: a cold load of 2.47 GiB once took five times its disk floor on an H100 and
# nobody could say where; every load now says.
LOAD_PHASES = ("verify", "stage", "copy")
LOADED_FROM = ("host cache", "file, hashed", "file, verified before")


@dataclass(kw_only=True)
class AdapterStatus:
    name: str
    lora_id: int
    slot: int
    bytes: int
    retiring: bool  # unloaded, kept until its running requests finish
    experts_per_layer: list[int]
    checked_rows: int = 0  # rows checked after loading to hold its weights where the kernel reads them
    load_s: dict[str, float] = field(default_factory=dict)  # its last load's engine seconds by LOAD_PHASES
    loaded_from: str = ""  # LOADED_FROM: whence that load took its rows
    shared_layers: int = 0  # MoE layers whose shared experts it replaces (in a copy of its own)
    modules: int = 0  # other non-expert modules it replaces (attention projections, norms, routers)


@dataclass(kw_only=True)
class VariantStatus:
    name: str
    slot: int | None  # None: the home variant, in the base rows
    bytes: int
    home: bool
    experts_per_layer: list[int]


@dataclass(kw_only=True)
class PagingStatus:
    fetch: str  # how paged layers fetch: auto, routed (the rows a step routes to), layer (the next layer whole)
    store_experts: int  # base experts per paged layer from the Huffman store on the GPU (the compressed tier)
    store_codec: str = ""  # the compressed tier's code: huffman (a store), fixed (encoded at start-up), "" (none)
    window_bytes: int  # device memory of the window's blocks
    resident_bytes: int  # device memory of the layers kept resident
    store_bytes: int  # device memory of the compressed tier (0 while no base expert comes from it)
    adapter_bytes: int = 0  # device memory of the paged layers' adapter rows: they stay there, never fetched
    host_bytes: int  # pinned host memory of the host tier: its copies of the base rows, as allocated
    host_base_rows: bool = True  # whether the host tier holds them (else none: a compressed tier delivers every
    # base row, esftctl.runtime.paging.tiers.base_copies_needed)
    freed_bytes: int  # expert memory that paging leaves to the KV cache: all held rows less the four above
    freed_kv_tokens: int | None  # those bytes in KV-cache tokens of this model (None: unknown)
    held_rows: int  # the base rows of a paged layer: what a whole-layer fetch brings
    fetched_rows: int  # rows fetched, summed over every fetch since the start
    fetches: int  # fetches of paged layers since the start (one per layer and step)
    resident_layers: list[int]
    parked_layers: list[int] = field(default_factory=list)  # paged layers alone in their block: filled once, no fetches
    decisions: list[dict]  # the residency planner's last decisions


@dataclass(kw_only=True)
class EngineStatus:
    updated: float  # time.time() of the report
    base: str
    device: str
    rank: int
    ranks: int
    slots: int
    experts_per_slot: int
    moe_layers: list[int]
    adapters: list[AdapterStatus]
    variants: list[VariantStatus]
    variant_map: str | None
    variant_paths: list[str]
    variant_switch_bytes: int
    base_expert_bytes: int
    model_bytes: int
    adapter_expert_bytes: int
    adapter_budget_bytes: int | None
    adapter_budget_experts: int | None = None  # the same budget in experts (all layers), as the engine counts it
    reserved_bytes: int
    page_bytes: int
    adapter_physical_bytes: int | None  # None while paging: only the window's layers hold memory
    expert_device_bytes: int
    padded_bytes: int
    merged_bytes: int
    kv_cache_tokens: int | None
    host_cache_used_bytes: int
    host_cache_hits: int
    host_cache_misses: int
    staged_bundles: list[list[list[int]]] = field(default_factory=list)  # file identities (bundle.file_identity)
    # of the bundles the host cache holds, verified when staged: the middleware does not read them again
    paging_window: int
    shared_copies: int = 0  # copies of every MoE layer's shared experts kept for adapters that replace them
    shared_copy_bytes: int = 0  # their device memory (all copies and layers; this rank's part)
    module_copies: int = 0  # copies of the other non-expert modules the adapters given at start change
    module_copy_bytes: int = 0
    paging: PagingStatus | None = None
    per_rank: list[dict | None] | None = None  # the API server's, under tensor parallelism (RANK_FIELDS)
    server_pid: int | None = None  # the API server's process, so the launcher knows the server is its own
    extra: dict = field(default_factory=dict)  # keys of a newer engine, passed through unread

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("paging", "extra")}
        data["adapters"] = [asdict(a) for a in self.adapters]
        data["variants"] = [asdict(v) for v in self.variants]
        if self.paging is not None:
            data.update({f"paging_{k}": v for k, v in asdict(self.paging).items()})
        for optional in ("per_rank", "server_pid"):
            if data[optional] is None:
                del data[optional]
        return data | self.extra

    @classmethod
    def from_json(cls, data: dict) -> "EngineStatus":
        data = dict(data)
        paging_keys = [f"paging_{f.name}" for f in fields(PagingStatus)]
        paging = PagingStatus(**{k[len("paging_"):]: data.pop(k) for k in paging_keys if k in data}) \
            if paging_keys[0] in data else None
        known = {f.name for f in fields(cls)} - {"paging", "extra"}
        return cls(**{k: v for k, v in data.items() if k in known and k not in ("adapters", "variants")},
                   adapters=[AdapterStatus(**a) for a in data.get("adapters", [])],
                   variants=[VariantStatus(**v) for v in data.get("variants", [])], paging=paging,
                   extra={k: v for k, v in data.items() if k not in known})

    def rank_memory(self) -> dict:
        """This rank's own memory, as the API server collects it into `per_rank`."""
        data = self.to_json()
        return {k: data.get(k) for k in RANK_FIELDS}

    def taken_by(self) -> list[str]:
        """Who holds a slot a load cannot take: every adapter that is not retiring (retiring ones make room) and
        every variant but the home one."""
        return [a.name for a in self.adapters if not a.retiring] + [v.name for v in self.variants if not v.home]


class StatusFile:
    """A file that describes a running engine (its status; the grouping scheduler's statistics): written in order
    on a thread of its own, whole for every reader (written beside, renamed), not fsynced (a crash ends what it
    describes).

    `write(record, wait=True)` returns once the file holds `record` (an EngineStatus, serialized on the writer's
    thread, or JSON-ready data): after a load, an unload or the start, whoever asked reads the file next.
    `tick(status_of, prefill=...)` is the refresh between serving steps: at most every `every_s`, without waiting,
    its record built on the engine's thread (`status_of`), and only in a stretch of steps older than `settle_s`. A
    stretch starts at a step that prefills after a pause longer than `settle_s` (the prompt that woke an idle
    server: its first token would wait for the refresh, and with async scheduling so would the next step's); decode
    steps never start one, however slow (vLLM's CPU build). So a server whose requests all end within `settle_s`
    keeps the status of its last change; a client wanting fresh counters sends one that decodes longer
    (esftctl.bench.serve_paging.settled_status). A write that is not waited on and fails is logged, and serving
    goes on."""

    def __init__(self, path: str | Path | None, *, every_s: float = STATUS_EVERY_S, settle_s: float = STATUS_SETTLE_S):
        self.path = Path(path) if path else None
        self.every_s, self.settle_s = every_s, settle_s
        self.written = self.last_step = self.busy_since = float("-inf")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="esftctl-status") if self.path else None

    def write(self, record: EngineStatus | dict, *, wait: bool = True) -> None:
        self.written = time.monotonic()
        if self._writer is None:
            return
        done = self._writer.submit(self._write, record)
        if wait:
            done.result()
        else:
            done.add_done_callback(self._log_failure)

    def tick(self, status_of, *, prefill: bool) -> None:
        now = time.monotonic()
        if prefill and now - self.last_step > self.settle_s:
            self.busy_since = now
        self.last_step = now
        if now - self.written > self.every_s and now - self.busy_since >= self.settle_s:
            self.write(status_of(), wait=False)

    def _write(self, record: EngineStatus | dict) -> None:
        write_json(self.path, record.to_json() if isinstance(record, EngineStatus) else record, durable=False)

    def _log_failure(self, done) -> None:
        if done.exception() is not None:
            logging.getLogger(__name__).warning("esftctl: %s was not rewritten: %s", self.path,
                                                one_line(done.exception(), 200))


class NoFreeSlot(EsftError):
    """A load found every adapter slot taken, or the adapter memory budget spent (HTTP 507 from the middleware)."""


def check_free_slot(slots: int, taken_by: list[str]) -> None:
    """The one rule for a load when slots run out: refuse it when `taken_by` (adapters not retiring, variants
    besides the home one) fills every slot. The caller names the adapter."""
    if len(taken_by) >= slots:
        raise NoFreeSlot(f"no free adapter slot: all {slots} are taken ({', '.join(sorted(taken_by))}); unload one, "
                         "or serve with more --slots")


def check_shared_copy(status: EngineStatus) -> None:
    """A load of an adapter that replaces shared experts when every copy of them is held (retiring adapters make
    room), by the engine's last status."""
    held = sum(1 for a in status.adapters if a.shared_layers and not a.retiring)
    if held >= status.shared_copies:
        raise NoFreeSlot(f"no free shared-expert copy: {held} of the {status.shared_copies} are held; unload an "
                         "adapter that replaces shared experts, or serve with more --shared-expert-copies")


def check_module_copy(status: EngineStatus) -> None:
    """A load of an adapter that replaces other non-expert modules when every copy of them is held."""
    held = sum(1 for a in status.adapters if a.modules and not a.retiring)
    if held >= status.module_copies:
        raise NoFreeSlot(f"no free module copy: {held} of the {status.module_copies} are held; unload an adapter "
                         "that replaces non-expert modules, or serve with more --module-copies")


def check_budget(status: EngineStatus, experts: int) -> None:
    """A load of `experts` experts (all layers) past the adapter memory budget, by the engine's last status:
    refused as the engine would refuse it (runtime.adapters.AdapterSlots.load), retiring adapters making room."""
    budget = status.adapter_budget_experts
    loaded = (sum(sum(a.experts_per_layer) for a in status.adapters if not a.retiring)
              + sum(sum(v.experts_per_layer) for v in status.variants if not v.home))
    if budget is not None and loaded + experts > budget:
        raise NoFreeSlot(f"adapter memory budget exceeded: it needs {experts} experts, {loaded} of the {budget} the "
                         "budget holds are in use; unload an adapter, or serve with a larger --adapter-memory")
