"""What `esftctl serve` tells the engine's processes, through one environment variable.

vLLM starts its engine in processes of its own; they inherit the environment, and the plugin
(esftctl.runtime.vllm.plugin) turns the ESFT runtime on only where `ESFTCTL_SERVE` is set, so a plain
`vllm serve --enable-lora` with esftctl installed keeps vLLM's own LoRA.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from esftctl.errors import EsftError
from esftctl.formats.bundle import Bundle
from esftctl.formats.checkpoint import MoECheckpoint

ENV = "ESFTCTL_SERVE"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for its API key: `esftctl serve --api-key` hands it on there


@dataclass(frozen=True)
class ServeConfig:
    slots: int  # adapters resident at once
    experts_per_slot: int  # address space reserved per slot and layer (rows are pooled across slots)
    status_file: str  # where the engine writes its adapter and memory table
    adapter_budget: int | None = None  # adapter experts (all layers) loaded at once, reserved before the KV cache
    paging_window: int = 0  # > 0: experts (base and adapters) paged through this many layers' worth of memory
    paging_store: str | None = None  # a Huffman store of the base: the GPU tier of paging
    store_experts: int | None = None  # base experts per layer taken from it (None: split by measured speeds)
    paging_adaptive: bool = False  # the residency planner keeps layers resident while loads show
    host_cache_bytes: int = 8 << 30  # adapters kept staged in (pinned) host memory for fast reloads
    variant_map: str | None = None  # `serve --variants`: the consolidated map's folder (esftctl.variants)
    variant_names: tuple[str, ...] = ()  # served names of its variants, the home one (vLLM's --model) first
    quantum: int = 4  # engine steps per variant turn (esftctl.runtime.vllm.variant_turns)
    adapter_root: str | None = None  # `serve --adapter-root`: adapters load at run time only from under this folder

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> "ServeConfig | None":
        raw = os.environ.get(ENV)
        if not raw:
            return None
        fields = json.loads(raw)
        fields["variant_names"] = tuple(fields.get("variant_names", ()))
        return cls(**fields)


def rank_status_file(status_file: str | Path, rank: int) -> Path:
    """Where tensor-parallel rank `rank` writes its status: rank 0 the status file itself (every field of the
    table), rank r > 0 a file beside it (the API server adds its memory to rank 0's: esftctl.runtime.vllm.status)."""
    path = Path(status_file)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def open_servable_bundle(path: str | Path, base: MoECheckpoint) -> Bundle:
    """A verified bundle of `base` that changes routed experts only (what the runtime serves)."""
    bundle = Bundle.open(path)
    bundle.check_base(base)
    if bundle.non_expert_tensors:
        raise EsftError(f"bundle {bundle.name!r} also changes {len(bundle.non_expert_tensors)} non-expert tensors; "
                        "serving swaps routed experts only (merge it into a full model instead)", bundle.path)
    return bundle
