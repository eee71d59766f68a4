"""What `esftctl serve` tells the engine's processes, through one environment variable.

vLLM starts its engine in processes of its own; they inherit the environment, and the plugin
(esftctl.runtime.vllm.plugin) turns the ESFT runtime on only where `ESFTCTL_SERVE` is set, so a plain
`vllm serve --enable-lora` with esftctl installed keeps vLLM's own LoRA. What it tells them is the serve settings
themselves (ServeSettings, the one type from the CLI to the engine) with what the launcher's plan derived
(ServeConfig).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from itertools import takewhile
from pathlib import Path

from esftctl.errors import EsftError

ENV = "ESFTCTL_SERVE"
# `serve --admit-by-adapter`'s default, seconds a queued request may be passed over. Measured with 256 requests at
# once against plain vLLM (benchmarks/RESULTS.md, Adapters against the base): over 5 adapters on an H200, both
# servers on one card, throughput 0.958x against 0.912x in vLLM's order, TPOT 1.045x against 1.120x, TTFT p99 1.034x
# against 1.077x; over 20 adapters on an H100 (three starts, medians), TPOT 1.218x against 1.308x, throughput 0.823x
# against 0.787x, TTFT by the mean 1.124x against 1.187x.
# Without a queue for batch slots it changes nothing (esftctl.runtime.vllm.adapter_groups).
ADMIT_BY_ADAPTER_S = 10.0
MAX_SHARED_COPIES = 64  # each copy is one more product of its modules per step
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for its API key: `esftctl serve --api-key` hands it on there
API_KEY_ENV = "ESFTCTL_API_KEY"  # esftctl's: `serve --api-key` and the client read it (it keeps the key out of `ps`)


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """Everything `esftctl serve` is given, from the command line to the engine: one type, checked once, here, for
    what needs no file (the plan checks the files: esftctl.serve.plan). Adding an option is a field here, its
    flag in the CLI and the code that uses it."""

    base: Path | None = None  # the base model folder; None with `variants`
    adapters: tuple[str, ...] = ()  # NAME=BUNDLE, served from the start
    name: str | None = None  # the base's served name (default: its folder's name)
    slots: int | None = None  # adapters resident at once (None: the plan sizes them)
    experts_per_slot: int | None = None  # address space reserved per slot and layer (rows pooled across slots)
    adapter_memory: int | None = None  # bytes of adapter experts loaded at once, reserved before the KV cache
    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: Path | None = None  # None: a temporary folder, made when the server starts, removed when it stops
    vllm_args: tuple[str, ...] = ()  # given to vLLM as they are
    cpu_kv_cache_gib: float | None = None  # None: $VLLM_CPU_KVCACHE_SPACE if set, else 1 GiB
    esft: bool = True  # False: plain vLLM serving the base alone (the baseline of `esftctl bench serve`)
    paging_window: int = 0  # > 0: base experts paged through this many layers' worth of memory (adapters stay)
    paging_store: Path | None = None  # a Huffman store of the base: the GPU tier of paging
    paging_codec: str | None = None  # the compressed tier: huffman (the store's; default with paging_store), fixed
    # (esftctl.kernels.fixed_rate: encoded from the loaded base at start-up, no store file), fixed-host (those codes
    # in pinned host memory, decoded over the bus), None: none
    store_experts: int | None = None  # base experts per layer taken from it (None: split by measured speeds)
    paging_adaptive: bool = False  # the residency planner keeps layers resident while loads show
    paging_fetch: str = "auto"  # auto, routed (the rows a step routes to), layer (the next layer whole, ahead)
    host_cache: int = 8 << 30  # bytes of adapters kept staged in (pinned) host memory for fast reloads
    variants: Path | None = None  # `serve --variants`: a consolidated map's folder (esftctl.variants)
    variant_names: tuple[str, ...] | None = None  # their served names, the home one first (None: folder names)
    quantum: int = 4  # engine steps per variant turn (esftctl.runtime.vllm.variant_turns)
    one_step: bool = False  # variants' requests in the same steps, per-token copies of what differs (module_copies)
    api_key: str | None = field(default=None, repr=False)  # handed to vLLM in its environment, never in ENV
    adapter_root: Path | None = None  # adapters load at run time only from under this folder
    shared_expert_copies: int | None = None  # copies of every MoE layer's shared experts kept for adapters that
    # replace them (esftctl.runtime.vllm.shared_experts); None: as many as the adapters given at start need
    module_copies: int | None = None  # copies of the other non-expert modules that the adapters given at start change
    # (esftctl.runtime.vllm.module_copies); None: one per such adapter
    group_adapters: int = 0  # > 0: at most this many adapters per engine step (esftctl.runtime.adapter_groups)
    group_wait: int = 8  # with group_adapters: engine steps a request may be held back before it must run
    admit_by_adapter: float | None = None  # > 0: queued requests of running adapters admitted first, none passed
    # over longer than this many seconds (esftctl.runtime.adapter_groups.admission_order); 0: vLLM's order; None:
    # ADMIT_BY_ADAPTER_S where adapters are served, 0 for plain vLLM and --variants (resolved in __post_init__)

    def __post_init__(self) -> None:
        if self.admit_by_adapter is None:
            default = ADMIT_BY_ADAPTER_S if self.esft and self.variants is None else 0.0
            object.__setattr__(self, "admit_by_adapter", default)
        if self.base is None and self.variants is None:
            raise EsftError("give the base model folder to serve (esftctl serve BASE ...), or --variants MAP_DIR")
        if self.base is not None and self.variants is not None:
            raise EsftError("give a base model or --variants MAP_DIR, not both")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise EsftError(f"--port {self.port}: choose a port in 1..65535")
        if self.api_key and vllm_api_keys(self.vllm_args):
            raise EsftError(f"an API key is given twice: with --api-key (or ${API_KEY_ENV}) and after `--`; give one")
        if self.variant_names is not None and self.variants is None:
            raise EsftError("--variant-names needs --variants")
        if self.variants is not None and self.name is not None:
            raise EsftError("with --variants, name the variants with --variant-names (the first is the home one)")
        if self.one_step and self.variants is None:
            raise EsftError("--one-step needs --variants")
        if self.quantum < 1:
            raise EsftError(f"--quantum {self.quantum}: give at least one engine step per turn")
        if self.shared_expert_copies is not None and not 0 <= self.shared_expert_copies <= MAX_SHARED_COPIES:
            raise EsftError(f"--shared-expert-copies {self.shared_expert_copies}: give 0 to {MAX_SHARED_COPIES}")
        if self.module_copies is not None and not 0 <= self.module_copies <= MAX_SHARED_COPIES:
            raise EsftError(f"--module-copies {self.module_copies}: give 0 to {MAX_SHARED_COPIES}")
        if (self.shared_expert_copies or self.module_copies) and self.variants is not None:
            raise EsftError("--shared-expert-copies and --module-copies cannot be combined with --variants (a "
                            "variant's non-expert weights come with it)")
        self._check_groups()
        if self.variants is not None and self.compressed_tier is not None:
            what = "--paging-store decodes" if self.paging_store is not None else "--paging-codec fixed keeps"
            raise EsftError(f"{what} the base's own experts, but with --variants the base rows hold the map's "
                            "consolidated ones: page variants from host memory (--paging-window alone)")
        self._check_paging()

    def _check_groups(self) -> None:
        if self.group_adapters < 0 or self.group_wait < 1:
            raise EsftError(f"--group-adapters {self.group_adapters} / --group-wait {self.group_wait}: give 0 (off) or "
                            "more adapters per step, and at least one step of waiting")
        if self.group_adapters and self.variants is not None:
            raise EsftError("--group-adapters cannot be combined with --variants, whose steps already run one variant "
                            "each (--quantum)")
        if not self.admit_by_adapter >= 0 or self.admit_by_adapter == float("inf"):
            raise EsftError(f"--admit-by-adapter {self.admit_by_adapter}: give the seconds a waiting request may be "
                            "passed over (0: off)")
        if self.admit_by_adapter and self.variants is not None:
            raise EsftError("--admit-by-adapter cannot be combined with --variants, whose steps run one variant each")
        if self.scheduler and "--scheduler-cls" in map(vllm_option, self.vllm_args):
            raise EsftError("--scheduler-cls after `--`: esftctl gives vLLM its own scheduler (variants' turns, "
                            "adapter groups, or the admission order, which `--admit-by-adapter 0` turns off), and "
                            "vLLM would take the last one given")

    @property
    def scheduler(self) -> str | None:
        """The scheduler esftctl has vLLM build (`--scheduler-cls`), or None for vLLM's own."""
        if not self.esft:
            return None
        if self.variants is not None and not self.one_step:
            return "esftctl.runtime.vllm.variant_turns.variant_scheduler"
        if self.group_adapters or self.admit_by_adapter:
            return "esftctl.runtime.vllm.adapter_groups.grouping_scheduler"
        return None

    @property
    def compressed_tier(self) -> str | None:
        """The compressed tier of paging: "huffman" (the store's), "fixed" (encoded at start-up), "fixed-host" (the
        same codes in host memory, decoded over the bus), or None."""
        return self.paging_codec or ("huffman" if self.paging_store is not None else None)

    def _check_paging(self) -> None:  # the window's range needs the base: the plan checks it
        if not self.paging_window and (self.paging_store is not None or self.store_experts is not None
                                       or self.paging_adaptive or self.paging_codec is not None):
            raise EsftError("--paging-store, --paging-codec, --store-experts and --paging-adaptive need "
                            "--paging-window")
        self._check_codec()
        if self.store_experts is not None and self.compressed_tier is None:
            raise EsftError("--store-experts needs --paging-store STORE or --paging-codec fixed or fixed-host (a "
                            "compressed tier)")
        if self.paging_fetch not in ("auto", "routed", "layer"):
            raise EsftError(f"--paging-fetch {self.paging_fetch}: choose auto, routed or layer")
        if self.paging_fetch != "auto" and not self.paging_window:
            raise EsftError("--paging-fetch needs --paging-window")

    def _check_codec(self) -> None:
        if self.paging_codec not in (None, "huffman", "fixed", "fixed-host"):
            raise EsftError(f"--paging-codec {self.paging_codec}: choose huffman (with --paging-store), fixed or "
                            "fixed-host")
        if self.paging_codec in ("fixed", "fixed-host") and self.paging_store is not None:
            raise EsftError(f"--paging-codec {self.paging_codec} encodes the base from the loaded weights and reads "
                            "no store: drop --paging-store, or use --paging-codec huffman with it")
        if self.paging_codec == "huffman" and self.paging_store is None:
            raise EsftError("--paging-codec huffman decodes a store of the base: give --paging-store STORE "
                            "(`esftctl compress BASE`), or use --paging-codec fixed, which needs none")

    def to_json(self) -> dict:
        """As the engine gets it: paths as text, and no API key (vLLM gets that in its own variable)."""
        data = asdict(self) | {"api_key": None}
        return data | {k: str(data[k]) for k in PATH_FIELDS if data[k] is not None}

    @classmethod
    def from_json(cls, data: dict) -> "ServeSettings":
        data = data | {k: Path(data[k]) for k in PATH_FIELDS if data.get(k) is not None}
        names = data.get("variant_names")
        return cls(**data | {"adapters": tuple(data.get("adapters", ())), "vllm_args": tuple(data.get("vllm_args", ())),
                             "variant_names": tuple(names) if names is not None else None})


# The settings that are paths (text on the wire), read from the fields' types, so a new path setting needs no list.
PATH_FIELDS = tuple(f.name for f in fields(ServeSettings) if "Path" in str(f.type))


def vllm_option(arg: str) -> str:
    """The option an argument of vLLM's names, as its parser reads it: `--api_key=K` is `--api-key`."""
    return arg.partition("=")[0].replace("_", "-")


def vllm_api_keys(args) -> list[str]:
    """The API keys in vLLM's arguments, as its parser reads them: `--api-key K [K ...]` or `--api-key=K` (also
    spelt `--api_key`), the last such option winning."""
    keys: list[str] = []
    for i, arg in enumerate(args):
        _, eq, value = arg.partition("=")
        if vllm_option(arg) == "--api-key":
            keys = [value] if eq else list(takewhile(lambda a: not a.startswith("-"), args[i + 1:]))
    return [k for k in keys if k]


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What the engine's processes get: the settings as the plan checked them (paths resolved), and what the plan
    derived from the base and the bundles."""

    settings: ServeSettings
    slots: int  # adapters resident at once
    experts_per_slot: int  # address space reserved per slot and layer (rows are pooled across slots)
    status_file: str  # where the engine writes its adapter and memory table
    adapter_budget: int | None = None  # adapter experts (all layers) loaded at once, reserved before the KV cache
    variant_names: tuple[str, ...] = ()  # served names of the variants, the home one (vLLM's --model) first
    shared_copies: int = 0  # copies of every MoE layer's shared experts for adapters that replace them
    module_copies: int = 0  # copies of the modules reading `copied_tensors`, for adapters that replace them
    copied_tensors: tuple[str, ...] = ()  # the non-expert tensors (not shared experts) the start-up adapters change

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self) | {"settings": self.settings.to_json()})}

    @classmethod
    def from_env(cls) -> "ServeConfig | None":
        raw = os.environ.get(ENV)
        if not raw:
            return None
        fields = json.loads(raw)
        return cls(**fields | {"settings": ServeSettings.from_json(fields["settings"]),
                               "variant_names": tuple(fields.get("variant_names", ())),
                               "copied_tensors": tuple(fields.get("copied_tensors", ()))})


def opened_for_load(settings: ServeSettings, path: str):
    """How a run-time load opens a bundle: None (by its path) where the server has no adapter root or the path is
    one the server was started with (`--adapter`, a variant); else the folder pinned beneath the root
    (esftctl.beneath.PinnedFolder, a context manager), so that every byte read comes from under the root whatever
    a link under it points at by then. Raises EsftError for a path outside the root."""
    from esftctl.beneath import PinnedFolder

    if settings.adapter_root is None or path in startup_bundles(settings):
        return None
    return PinnedFolder.beneath(settings.adapter_root, path)


def startup_bundles(settings: ServeSettings) -> set[str]:
    """The bundle paths the server was started with, as the launcher hands them to vLLM (resolved)."""
    return {str(Path(spec.partition("=")[2]).resolve()) for spec in settings.adapters}


def rank_status_file(status_file: str | Path, rank: int) -> Path:
    """Where tensor-parallel rank `rank` writes its status: rank 0 the status file itself (every field of the
    table), rank r > 0 a file beside it (the API server adds its memory to rank 0's: esftctl.runtime.vllm.status)."""
    path = Path(status_file)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


VERIFIED_KEEP = 64  # file identities a server's record of verified bundles keeps, newest last
VERIFIED_FOR_S = 1800  # how long an entry spares the engine its hash: past a start-up's adapter loads, not longer


def verified_record(status_file: str | Path) -> Path:
    """The server's record of the bundles its launcher (those given at start) and its middleware (those loaded
    later) verified, by file identity and when, beside the status file in its own state folder: the engine, reading
    such a bundle within VERIFIED_FOR_S, does not hash it again (a cold load of a 2.47 GiB adapter hashed it
    twice, taking five times its disk floor on an H100); a reload later on, from the files, hashes them."""
    return Path(status_file).with_name("verified.json")


def record_verified(status_file: str | Path, identities) -> None:
    """Add bundles' file identities (each taken before the bundle was read), verified now, to the record
    (atomically; a lost race only makes the engine hash again)."""
    from esftctl.formats.bundle import identity_json
    from esftctl.jsonfile import write_json

    entries = [identity_json(identity) for identity in identities]
    kept = [e for e in _verified(status_file) if e[0] not in entries]
    now = time.time()
    write_json(verified_record(status_file), (kept + [[e, now] for e in entries])[-VERIFIED_KEEP:])


def bundle_identity(path: str | Path, pinned=None) -> tuple | None:
    """A bundle's file identity (esftctl.formats.bundle.file_identity); None where its files cannot say (opening
    it then says what is wrong)."""
    from esftctl.formats.bundle import file_identity

    try:
        return file_identity(path, pinned)
    except (OSError, EsftError):
        return None


def was_verified(status_file: str | Path, identity) -> bool:
    """Whether the record holds this file identity (a changed file has another), verified within VERIFIED_FOR_S."""
    from esftctl.formats.bundle import identity_json

    if identity is None:
        return False
    wanted, now = identity_json(identity), time.time()
    return any(e[0] == wanted and 0 <= now - e[1] <= VERIFIED_FOR_S for e in _verified(status_file))


def _verified(status_file: str | Path) -> list:
    """The record's [identity, time] entries; none where it is missing or not a record."""
    try:
        found = json.loads(verified_record(status_file).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(found, list):
        return []
    return [e for e in found if isinstance(e, list) and len(e) == 2 and isinstance(e[1], (int, float))]


def open_servable_bundle(path: str | Path, base, *, hash_data: bool = True, pinned=None):
    """A verified bundle of `base` (a MoECheckpoint) that changes routed experts, and maybe shared experts, only
    (what the runtime serves); `hash_data` False for bytes verified already, `pinned` the folder opened beneath the
    adapter root (Bundle.open)."""
    from esftctl.formats.bundle import Bundle  # here: the CLI reads this module's names and stays quick to start

    bundle = Bundle.open(path, hash_data=hash_data, pinned=pinned)
    bundle.check_base(base)
    non_expert_kinds(bundle, base)
    return bundle


def non_expert_kinds(bundle, base) -> tuple[list[str], list[str]]:
    """The bundle's non-expert tensors: (shared experts', other modules')."""
    names = bundle.non_expert_tensors
    shared = [n for n in names if any(base.arch.is_shared_expert_tensor(n, layer) for layer in base.moe_layers)]
    return shared, [n for n in names if n not in set(shared)]
