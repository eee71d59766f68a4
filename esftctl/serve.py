"""`esftctl serve`: vLLM's OpenAI-compatible server over one base model and many ESFT adapters.

Everything is checked before vLLM starts (the base, every bundle against it), so a bad input costs a
one-line error, not a minute of engine start-up. Then vLLM's own server runs in a child process with
- LoRA support enabled for its plumbing: each adapter is a LoRA module name (`--lora-modules`), picked by
  the request's `model` field, listed by /v1/models, loadable and unloadable at run time;
- ESFTCTL_SERVE in the environment, which makes esftctl's vLLM plugin (esftctl.runtime.vllm.plugin) put
  the ESFT runtime in place of vLLM's LoRA layers;
- esftctl's status middleware (GET /esftctl/status).
With `--variants MAP_DIR` (consolidated fine-tuned variants, esftctl.variants) the first variant is the model
vLLM loads, every other one is a LoRA module name bound to its slot, and vLLM's scheduler runs with turns
(esftctl.runtime.vllm.variant_turns), one variant per engine step.
The launcher waits until the server answers, prints the adapter table, and forwards Ctrl-C / SIGTERM.
With an API key (`serve --api-key` or ESFTCTL_API_KEY), vLLM gets it in its environment (VLLM_API_KEY), not on a
command line every user can read; a key given to vLLM after `--` works too. The launcher's own requests send it.
`--adapter-root DIR` limits adapters loaded at run time to bundles under DIR (checked by the middleware, and read
by the engine through their folder opened beneath DIR: esftctl.beneath).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from esftctl.errors import EsftError
from esftctl.formats.architectures import EXPERT_BIASES
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.names import check_name
from esftctl.runtime.launcher import LAUNCHER_ENV
from esftctl.runtime.serve_config import (
    ENV,
    PATH_FIELDS,
    VLLM_API_KEY_ENV,
    ServeConfig,
    ServeSettings,
    bundle_identity,
    non_expert_kinds,
    open_servable_bundle,
    record_verified,
    vllm_api_keys,
)
from esftctl.runtime.vllm.moe import KERNEL_MAX_ROWS, check_rows
from esftctl.serve_client import request
from esftctl.units import format_bytes
from esftctl.variants import VariantSet

STATUS_MIDDLEWARE = "esftctl.runtime.vllm.status.StatusMiddleware"


@dataclass
class ServePlan:
    """A checked `esftctl serve`: its settings (paths resolved) and what the plan derived from the base and the
    bundles; it makes vLLM's command line and environment."""

    settings: ServeSettings
    base: Path
    name: str
    adapters: dict[str, Path] = field(default_factory=dict)
    slots: int = 1
    experts_per_slot: int = 1
    adapter_budget: int | None = None  # adapter experts (all layers) loaded at once; memory reserved at start
    variant_names: list[str] = field(default_factory=list)  # every variant's served name, the home one first
    variant_paths: list[Path] = field(default_factory=list)
    verified: list = field(default_factory=list)  # file identities of the bundles the plan verified (hashed)
    shared_copies: int = 0  # copies of every MoE layer's shared experts for adapters that replace them
    module_copies: int = 0  # copies of the modules reading `copied_tensors`
    copied_tensors: tuple[str, ...] = ()  # other non-expert tensors the adapters given change

    state_dir: Path | None = field(default=None, init=False)  # made on first use when the settings give none
    temporary_state: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.state_dir = self.settings.state_dir
        self.temporary_state = self.state_dir is None

    @property
    def esft(self) -> bool:
        return self.settings.esft

    @property
    def host(self) -> str:
        return self.settings.host

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def state(self) -> Path:
        """The state folder; a temporary one is made on first use, so a plan never started leaves none behind."""
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="esftctl-serve-"))
        return self.state_dir

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.state / "vllm.log"

    @property
    def request_key(self) -> str | None:
        """The key this server's clients send: one given to vLLM after `--` (vLLM prefers it), else esftctl's own,
        else a VLLM_API_KEY inherited from the environment, which vLLM reads too."""
        given = vllm_api_keys(self.settings.vllm_args)
        return given[0] if given else (self.settings.api_key or os.environ.get(VLLM_API_KEY_ENV) or None)

    def config(self) -> ServeConfig:
        return ServeConfig(settings=self.settings, slots=self.slots, experts_per_slot=self.experts_per_slot,
                           status_file=str(self.state / "status.json"), adapter_budget=self.adapter_budget,
                           variant_names=tuple(self.variant_names), shared_copies=self.shared_copies,
                           module_copies=self.module_copies, copied_tensors=self.copied_tensors)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.base), "--served-model-name", self.name, "--host", self.host,
               "--port", str(self.port), "--dtype", "bfloat16"]
        vllm_args = list(self.settings.vllm_args)
        if not self.esft:
            return cmd + vllm_args
        cmd += ["--enable-lora", "--max-loras", str(self.slots), "--max-cpu-loras", str(self.slots),
                "--middleware", STATUS_MIDDLEWARE]
        modules = {**dict(zip(self.variant_names[1:], self.variant_paths[1:])), **self.adapters}
        if modules:
            cmd += ["--lora-modules", *(f"{n}={p}" for n, p in modules.items())]
        if self.settings.scheduler:
            cmd += ["--scheduler-cls", self.settings.scheduler]
        if self.eager and "--enforce-eager" not in vllm_args:
            cmd.append("--enforce-eager")
        return cmd + vllm_args

    @property
    def eager(self) -> bool:
        """vLLM's CPU build compiles the model with the MoE layer inside (no custom op walls it off there), so
        paging's host-side fetch would be traced, and variants and shared-expert copies swap the closures its
        linear layers compute with, which compiled code would have captured: no compilation on the CPU build for
        any of them. On CUDA the MoE layer is an opaque op of the compiled graph and paging captures as CUDA graphs."""
        import torch

        settings = self.settings
        return not torch.cuda.is_available() and (bool(settings.paging_window) or settings.variants is not None
                                                  or bool(self.shared_copies or self.module_copies))

    def env(self) -> dict[str, str]:
        # vLLM's CPU build sizes its KV cache from this (GPU builds ignore it and use --gpu-memory-utilization);
        # an explicit --cpu-kv-cache-gib wins over the variable.
        gib = self.settings.cpu_kv_cache_gib
        space = f"{gib:g}" if gib is not None else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        kv = {"VLLM_CPU_KVCACHE_SPACE": space}
        env = {**os.environ, **kv, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        env.pop(ENV, None)
        env[LAUNCHER_ENV] = str(os.getpid())  # the server stops when this process dies (runtime.launcher)
        if self.settings.api_key:
            env[VLLM_API_KEY_ENV] = self.settings.api_key
        if self.esft:
            env.update({**self.config().to_env(), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_adapters(specs: list[str]) -> dict[str, Path]:
    adapters: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise EsftError(f"--adapter {spec!r}: expected NAME=BUNDLE")
        check_name(name)
        if name in adapters:
            raise EsftError(f"--adapter {name!r} is given twice")
        adapters[name] = Path(path).resolve()
    return adapters


def plan(base_dir: Path | None, adapter_specs: list[str] = (), **options) -> ServePlan:
    """`plan_serving` of the settings these make (the options are ServeSettings' fields): for scripts and tests."""
    given = {"base": base_dir, "adapters": tuple(adapter_specs), **options}
    for key in ("vllm_args", "variant_names"):
        if given.get(key) is not None:
            given[key] = tuple(given[key])
    return plan_serving(ServeSettings(**given | {k: Path(given[k]) for k in PATH_FIELDS if given.get(k) is not None}))


def plan_serving(settings: ServeSettings) -> ServePlan:
    """Check the base and every bundle, and size the slots: by default room for the given adapters plus
    two loaded later (fewer where vLLM's Triton kernel limits the rows), each layer reserving the most
    experts any given adapter has in one layer. `adapter_memory` (bytes of adapter experts loaded at once,
    reserved before vLLM sizes its KV cache) defaults to `slots` times the largest given adapter, or with
    none given to two adapters of an eighth of the base's experts each (unseen_adapters_budget).

    `variants` (a folder of `esftctl consolidate`) serves its variants instead of one base: the first is what
    vLLM loads (adapters are of it), every other one takes a slot for its experts where the map loaded none
    (at most that many per layer: the plan counts positions, the engine loads only those that differ)."""
    if settings.adapter_root is not None:
        settings = replace(settings, adapter_root=settings.adapter_root.resolve())
        if not settings.adapter_root.is_dir():
            raise EsftError("--adapter-root: not a folder", settings.adapter_root)
    vset = VariantSet.open(settings.variants, settings.variant_names) if settings.variants is not None else None
    base = vset.home if vset is not None else MoECheckpoint(settings.base, fp8=True)
    if base.arch.fused is not None and base.arch.fused.kind == "stacked":
        raise EsftError("this model's experts are stacked as transformers holds them in memory (mlp.experts."
                        "gate_up_proj), and vLLM loads the hub layout, one tensor per expert: save the model with "
                        "transformers' save_pretrained and serve that folder", base.path)
    adapters = parse_adapters(settings.adapters)
    name = vset.names[0] if vset is not None else check_name(settings.name or base.path.resolve().name,
                                                             "served model")
    if name in adapters:
        raise EsftError(f"adapter name {name!r} is the base model's served name; pick another")
    clash = sorted(set(adapters) & set(vset.names if vset is not None else []))
    if clash:
        raise EsftError(f"adapter name {clash[0]!r} is also a variant's name; pick another")
    identities = {n: bundle_identity(p) for n, p in adapters.items()}  # before reading them
    verified = list({i: None for i in identities.values() if i is not None})
    bundles = open_bundles(adapters, identities, base)
    # A variant other than the home one holds at most its map's unloaded positions (per layer, in all).
    misses = [] if vset is None else [(vset.emap.owner < 0).sum(axis=1).tolist()] * (len(vset.names) - 1)
    slots, experts_per_slot = _size_slots(settings, base, bundles, misses)
    budget = _adapter_budget(settings.adapter_memory, base, bundles, misses, slots=slots,
                             experts_per_slot=experts_per_slot)
    settings = _check_paging(settings, base)
    shared, modules, copied = _copies(settings, base, bundles)
    check_port_free(settings.host, settings.port)
    if vset is not None:
        settings = replace(settings, variants=vset.map_dir.resolve(), variant_names=tuple(vset.names))
    return ServePlan(settings, base.path.resolve(), name, adapters, slots, experts_per_slot, budget,
                     variant_names=list(vset.names) if vset else [], variant_paths=list(vset.paths) if vset else [],
                     verified=verified, shared_copies=shared, module_copies=modules, copied_tensors=copied)


def _copies(settings: ServeSettings, base: MoECheckpoint, bundles: dict) -> tuple[int, int, tuple[str, ...]]:
    """(copies of the shared experts, copies of the other modules the adapters given change, those modules' tensors):
    each count given, or one per adapter given that needs it (each name takes a copy, as it takes a slot)."""
    kinds = {n: non_expert_kinds(b, base) for n, b in bundles.items()}
    need_shared = sum(1 for shared, _ in kinds.values() if shared)
    need_modules = sum(1 for _, other in kinds.values() if other)
    copied = tuple(sorted({t for _, other in kinds.values() for t in other}))
    shared = settings.shared_expert_copies if settings.shared_expert_copies is not None else need_shared
    modules = settings.module_copies if settings.module_copies is not None else need_modules
    if shared < need_shared:
        raise EsftError(f"--shared-expert-copies {shared} cannot hold the {need_shared} adapters given that replace "
                        "shared experts")
    if modules < need_modules:
        raise EsftError(f"--module-copies {modules} cannot hold the {need_modules} adapters given that replace "
                        "non-expert modules")
    if shared and not base.num_shared_experts:
        raise EsftError("--shared-expert-copies: this base has no shared experts", base.path)
    if modules and not copied:
        raise EsftError("--module-copies: the modules copied are those the adapters given at start change, and none "
                        "changes one; give such an adapter with --adapter")
    return shared, modules, copied


def open_bundles(adapters: dict[str, Path], identities: dict, base: MoECheckpoint) -> dict:
    """Each adapter's bundle, verified against the base: each distinct file once (names that share a file share
    its Bundle), several files at a time (reading and SHA-256 let go of the GIL). Why: `bench serve` gives esftctl
    20 names over 10 files of 2.47 GiB, which hashed one name after another took about 30 s at SHA-256's 1.5 GB/s,
    most of the start-up esftctl took beyond plain vLLM's. The first failing bundle in the
    adapters' order is the error, as one after the other."""
    keys = {n: identities.get(n) or ("path", str(p)) for n, p in adapters.items()}  # unreadable: opening says why
    first: dict = {}  # each file's path under its first name, in the adapters' order
    for n, k in keys.items():
        first.setdefault(k, adapters[n])
    pool = ThreadPoolExecutor(min(VERIFY_THREADS, os.cpu_count() or 1, max(len(first), 1)),
                              thread_name_prefix="esftctl-verify")
    try:
        opened = dict(zip(first, pool.map(lambda path: open_servable_bundle(path, base), first.values())))
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure, the files not started yet are not read
    return {n: opened[k] for n, k in keys.items()}


def _size_slots(settings: ServeSettings, base: MoECheckpoint, bundles: dict, misses: list) -> tuple[int, int]:
    """(slots, experts per slot): given, or room for the given adapters and variants and two more."""
    served = len(bundles) + len(misses)
    widest = max([max(b.experts_per_layer(), default=0) for b in bundles.values()] +
                 [max(m, default=0) for m in misses], default=0)
    experts_per_slot = settings.experts_per_slot if settings.experts_per_slot is not None else (
        widest or base.num_experts)
    row_limit = launch_row_limit()
    slots = settings.slots
    if slots is None:
        slots = max(served + 2, 4)
        if row_limit is not None:  # as many as the kernel computes, but never fewer than the adapters given
            slots = max(min(slots, (row_limit - base.num_experts) // experts_per_slot), served, 1)
    if slots < max(served, 1):
        what = f"the {len(bundles)} adapters given" + (f" and {len(misses)} variants besides the home one"
                                                         if misses else "")
        raise EsftError(f"--slots {slots} cannot hold {what}")
    check_rows(base.num_experts + slots * experts_per_slot, row_limit, base.num_experts, str(base.path))
    # The slots' rows are pooled per layer (an adapter takes the free rows it needs, as `adapters load` does
    # while serving): what the given adapters and variants take together in a layer must fit in them.
    taken = [sum(c) for c in zip(*[b.experts_per_layer() for b in bundles.values()], *misses)] or [0]
    if max(taken) > slots * experts_per_slot:
        layer = base.moe_layers[taken.index(max(taken))]
        raise EsftError(f"--slots {slots} x --experts-per-slot {experts_per_slot} = {slots * experts_per_slot} expert "
                        f"rows per layer cannot hold the {max(taken)} the given adapters take in layer {layer}")
    return slots, experts_per_slot


def _adapter_budget(adapter_memory: int | None, base: MoECheckpoint, bundles: dict, misses: list, *, slots: int,
                    experts_per_slot: int) -> int:
    """Adapter experts loaded at once (all layers): `adapter_memory` in experts, or slots x the largest."""
    sizes = [b.num_experts for b in bundles.values()] + [sum(m) for m in misses]
    if adapter_memory is None:
        budget = slots * max(sizes) if sizes else unseen_adapters_budget(base)
    else:
        budget = adapter_memory // base.expert_nbytes
        largest = max(bundles.values(), key=lambda b: b.num_experts, default=None)
        if largest is not None and budget < largest.num_experts:
            raise EsftError(f"--adapter-memory {format_bytes(adapter_memory)} is below adapter {largest.name!r}'s "
                            f"{format_bytes(largest.num_experts * base.expert_nbytes)} of experts")
    if budget < sum(sizes):
        raise EsftError(f"--adapter-memory {format_bytes(budget * base.expert_nbytes)} cannot hold the given "
                        f"adapters' and variants' {format_bytes(sum(sizes) * base.expert_nbytes)}")
    return budget


VERIFY_THREADS = 8  # bundle files the launcher reads and hashes at once (at most the CPUs)
LATER_ADAPTERS = 2  # adapters a server started with none given has memory for (`adapters load` later)
UNSEEN_SHARE = 8  # such an adapter is taken to replace at most 1/8 of the base's experts: DeepSeek's published
# ESFT adapters replace 83-153 of DeepSeek-V2-Lite's 1,664 (5-9%). A whole slot (every expert of every layer) would
# set aside 4 copies of the experts by default, 115 GB on DeepSeek-V2-Lite: more than an H100 has.


def unseen_adapters_budget(base: MoECheckpoint) -> int:
    """Adapter experts reserved when no adapter is given: LATER_ADAPTERS of 1/UNSEEN_SHARE of the base's experts."""
    return LATER_ADAPTERS * -(-base.num_experts * len(base.moe_layers) // UNSEEN_SHARE)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, before vLLM starts (it would fail 15 s later, and until then
    the port's other server would answer this command's requests)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: only a listener blocks it
        try:
            probe.bind((host, port))
        except OSError as e:
            raise EsftError(f"cannot listen on {host}:{port} ({e.strerror or e}): another server? choose another "
                            "--port") from None


def launch_row_limit() -> int | None:
    """The expert rows per layer vLLM's kernel computes here: the Triton kernel's limit on a CUDA machine
    (checked again in the engine, on the kernel vLLM picked), none on the CPU build."""
    import torch

    return KERNEL_MAX_ROWS if torch.cuda.is_available() else None


def _check_paging(settings: ServeSettings, base: MoECheckpoint) -> ServeSettings:
    """The window against the base's layers, the store against the base; the settings with the store's path
    resolved."""
    window, store, count = settings.paging_window, settings.paging_store, settings.store_experts
    layers = len(base.moe_layers)
    if window < 0 or window > layers:
        raise EsftError(f"--paging-window {window}: choose 1..{layers - 1} layers (the base has {layers} MoE layers), "
                        f"{layers} (every layer keeps its own memory: the pager's machinery alone), or 0 for no paging")
    if window == layers and settings.paging_adaptive:
        raise EsftError(f"--paging-adaptive: with --paging-window {layers} every layer is resident already")
    if window and base.fp8 is not None:
        raise EsftError("--paging-window with an FP8 base is not supported yet (the pager moves weight rows, not their "
                        "block scales); serve it resident", base.path)
    if window and EXPERT_BIASES[0] in base.arch.expert_weights:
        raise EsftError(f"--paging-window with {base.arch.name} is not supported yet (the pager moves weight rows, not "
                        "the experts' biases); serve it resident", base.path)
    if count is not None and not 0 <= count <= base.num_experts:
        raise EsftError(f"--store-experts {count}: choose 0..{base.num_experts} (the base's experts per layer)")
    if store is None:
        return settings
    import torch

    from esftctl.formats.store import ExpertStore, missing_base_experts

    opened = ExpertStore(store, verify=False)  # header checked; the probe's tensor against its own hash (store v3)
    header = opened.header
    if header["source"]["kind"] != "model":
        raise EsftError("--paging-store: this store holds an adapter bundle; make one of the base with "
                        "`esftctl compress BASE`", store)
    missing = missing_base_experts(base, {e["name"] for e in header["tensors"]})
    if missing:
        raise EsftError(f"--paging-store: the store lacks {len(missing)} expert tensors of this base (e.g. "
                        f"{missing[0]!r}); it was made from another model", store)
    probe = base.expert_tensor_names(base.moe_layers[0], 0)["gate"]  # same names, same weights?
    if not torch.equal(opened.decode_tensor(probe).view(torch.int16), base.read_tensor(probe).view(torch.int16)):
        raise EsftError(f"--paging-store: its {probe} differs from the base's; it was made from another model",
                        store)
    return replace(settings, paging_store=Path(store).resolve())


def private_state_folder(path: Path) -> None:
    """Make `path` a server's state folder, which only its owner may enter (0700): the vLLM log, the status and the
    record of verified bundles in it are what the API key protects over HTTP. A missing one is created so (its
    parents as the umask says). An existing one must be this user's and writable by no one else, else it is refused
    in one line: another user's folder, or one others may write (a shared /tmp folder), may already hold what they
    planted, such as a `vllm.log` link that would receive the server's log, and tightening its mode would not remove
    it. One of this user's that others may only read or enter is tightened to 0700."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        found = os.stat(path)
    except OSError as e:
        raise EsftError(f"cannot create the state folder ({e.strerror or e})", path) from None
    if not stat.S_ISDIR(found.st_mode):
        raise EsftError("--state-dir: not a folder", path)
    if found.st_uid != os.geteuid():
        raise EsftError(f"the state folder belongs to another user (uid {found.st_uid}): give a folder of your own "
                        "(--state-dir)", path)
    if found.st_mode & 0o022:
        raise EsftError(f"the state folder is writable by others (mode {stat.S_IMODE(found.st_mode):o}): what they put "
                        "there (a vllm.log link) would receive the server's files; give a folder only you may write "
                        "(--state-dir), or chmod 700 this one after checking what it holds", path)
    if stat.S_IMODE(found.st_mode) != 0o700:
        os.chmod(path, 0o700)


def open_log(path: Path) -> int:
    """A descriptor to append vLLM's output to `path`, a regular file of mode 0600 (created so, an older one
    tightened), opened without following a symbolic link (O_NOFOLLOW: a link there is refused in one line, not
    written through) or waiting on a FIFO."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EsftError("the server's log is a symbolic link here: not written through; remove it", path) from None
        raise EsftError(f"cannot open the server's log ({e.strerror or e})", path) from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise EsftError("the server's log is not a regular file; remove it", path)
        if stat.S_IMODE(found.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except OSError as e:
        os.close(fd)
        raise EsftError(f"cannot make the server's log private ({e.strerror or e})", path) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class AnotherServer(EsftError):
    """Something other than the vLLM this command started answers on the plan's port."""


@contextmanager
def _child_hears_sigint():
    """Start vLLM able to hear the SIGINT that Server.stop sends. A command that a shell script puts in the
    background (`esftctl serve ... &`, nohup) ignores SIGINT, and a child inherits an ignored signal across exec:
    vLLM's API server then ignores stop's SIGINT until uvicorn sets its handlers (before that vLLM catches only
    SIGTERM), and the suite's stand-in servers (`sleep`) ignored it outright, each stop waiting its 30 s grace
    before SIGKILL (as in a test suite run from `nohup ... &`). A caught signal is reset to its default by exec,
    so catching SIGINT for the moment of the start gives the child the default while esftctl keeps ignoring it;
    the child is in a session of its own, which no terminal's Ctrl-C reaches. Python sets handlers only on the
    main thread; elsewhere nothing changes."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class Server:
    """The vLLM server process of a plan: start, wait until it answers, stop."""

    def __init__(self, plan: ServePlan):
        self.plan = plan
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start vLLM, its output appended to the log in the plan's state folder (private_state_folder, open_log)."""
        private_state_folder(self.plan.state)
        with os.fdopen(open_log(self.plan.log_file), "ab") as log:  # the child keeps its own handle
            if self.plan.esft and self.plan.verified:  # the engine loads these next: hashed once, here
                record_verified(self.plan.config().status_file, self.plan.verified)
            with _child_hears_sigint():
                self.process = subprocess.Popen(self.plan.command(), env=self.plan.env(), stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900, on_wait=lambda seconds: None) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise EsftError(f"vLLM exited with status {self.process.returncode} before it was ready: "
                                f"{self.last_error()}{self.memory_hint()}", self.plan.log_file)
            try:
                request(self.plan.url, "/health", timeout=5, api_key=self.plan.request_key)
                if self.plan.esft:  # the server that answers must be ours, not one that held the port first
                    status = request(self.plan.url, "/esftctl/status", timeout=5, api_key=self.plan.request_key)
                    pid = status.get("server_pid") if isinstance(status, dict) else None
                    if pid != self.process.pid:
                        self.stop()
                        raise AnotherServer(f"another server (process {pid}) answers at {self.plan.url}; "
                                            "choose another --port")
                return
            except AnotherServer:
                raise
            except EsftError:
                on_wait(time.monotonic() - start)
                time.sleep(1)
        self.stop()
        raise EsftError(f"vLLM was not ready after {timeout:.0f} s", self.plan.log_file)

    def last_error(self) -> str:
        """The root cause in vLLM's log: its first exception line (later ones are re-raises; warnings that
        mention errors are skipped; a validation error brings its detail line), else the last line."""
        lines = [l for l in self.plan.log_file.read_text(errors="replace").splitlines() if l.strip()]
        for i, line in enumerate(lines):
            if " WARNING " not in line and re.search(r"\b\w*(Error|Exception): ", line):
                cause = line.split("] ", 1)[-1]
                if "validation error" in cause and i + 1 < len(lines):
                    cause += ": " + lines[i + 1]
                return " ".join(cause.split())[:400]
        return " ".join((lines[-1:] or ["no output"])[0].split())[:400]

    def error_lines(self, count: int = 40, width: int = 300) -> list[str]:
        """Up to `count` lines of vLLM's log from its first ERROR on (a fatal engine error's dump of its config and
        scheduler output, then the traceback), each cut to `width` characters: the whole log can be too large to
        read back (plain vLLM's passed 16 MiB after its engine failed under 256 requests on an H100)."""
        if not self.plan.log_file.exists():
            return []
        lines = self.plan.log_file.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines) if " ERROR " in line), len(lines))
        return [line[:width] for line in lines[first:] if line.strip()][:count]

    def memory_hint(self) -> str:
        """What esftctl set aside before vLLM sized its KV cache, where vLLM found no room left for it."""
        if not self.plan.esft or not self.plan.adapter_budget or "No available memory for the cache" not in \
                self.plan.log_file.read_text(errors="replace"):
            return ""
        reserved = self.plan.adapter_budget * MoECheckpoint(self.plan.base).expert_nbytes
        return f" (esftctl set aside {format_bytes(reserved)} for adapter experts: lower --adapter-memory)"

    def stop(self, grace: float = 30) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()

    def serve_until_interrupted(self, console) -> None:
        """Leave the server up until Ctrl-C (the recipes' --keep-serving)."""
        console.print(f"serving at {self.plan.url}/v1; Ctrl-C stops")
        try:
            self.process.wait()
        except KeyboardInterrupt:
            pass

    def __enter__(self) -> "Server":
        self.start()
        return self

    def remove_state(self) -> None:
        """Remove the plan's state folder if it is a temporary one (kept after a failure: the log is in it)."""
        if self.plan.temporary_state and self.plan.state_dir is not None:
            shutil.rmtree(self.plan.state_dir, ignore_errors=True)

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:
            self.remove_state()


def serve_and_ask(serve_plan: ServePlan, asks: list[tuple[str, dict]], *, console, max_tokens: int, title: str,
                  keep_serving: bool = False) -> list[str]:
    """The recipes' last step: start the plan's server, print its adapter table, send every (model, example) at
    once and print the answers against the expected completions; with `keep_serving`, stay up until Ctrl-C.
    Returns the answers, in the order of `asks`."""
    from esftctl.serve_client import answers_table, ask_all, models, status, status_table

    key = serve_plan.request_key
    with Server(serve_plan) as server:
        with console.status(f"starting vLLM (log: {serve_plan.log_file})"):
            server.wait_ready()
        console.print(status_table(status(serve_plan.url, api_key=key), models(serve_plan.url, api_key=key)))
        answers = ask_all(serve_plan.url, asks, max_tokens=max_tokens, api_key=key)
        console.print(answers_table(asks, answers, title=title))
        if keep_serving:
            server.serve_until_interrupted(console)
    return answers


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """Let SIGTERM, and SIGHUP (its terminal closed), stop the launcher as Ctrl-C does, so the vLLM child is
    stopped in order too."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
