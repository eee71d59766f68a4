"""How many paged layers stay resident: the policy (ResidencyPlanner) and its driver while a model serves
(AdaptiveResidency), which between engine steps reads how long paged layers took to compute and to load.

rho = compute / load of a paged layer. Above 1 the load hides under the compute, so a resident layer can
give its memory back; below 0.9 loads show, so one more layer stays resident, up to what the device can
spare: the memory free once the engine has taken its own (vLLM allocates its KV cache at start-up, before
any request), less a margin for activations. Resident layers are spread evenly over the stack, so the
loads between them get the most compute to hide under, until no more layers stay paged than the window has
blocks: then each has a block of its own and loads nothing (resident_choice). Every decision is logged and kept
for the status.

vLLM sizes its KV cache once, from what its memory share leaves once the model is loaded, so the layers the
planner may keep resident are decided then (start_resident): a KV cache beyond max_num_seqs x max_model_len
tokens holds nothing the scheduler can run, and the memory past that need goes to resident layers. Without
that start (H100, DeepSeek-V2-Lite, memory to spare) vLLM took 48.5 GiB for 1.67M KV tokens, 2.4% of them in
use at batch 32, the planner found nothing free, and every layer stayed paged: 0.18x of resident.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from esftctl.runtime.paging.pager import PagedExperts

log = logging.getLogger("esftctl.paging")


def spread(order: Sequence[int], count: int) -> list[int]:
    """`count` layers of `order`, evenly spaced."""
    if count <= 0:
        return []
    return sorted({order[(k * len(order)) // count] for k in range(count)})


def resident_choice(order: Sequence[int], count: int, window: int) -> list[int]:
    """Which `count` layers of `order` stay resident: spread evenly, except that where no more than `window` stay
    paged, the last ones do, each alone in its block of the window (forward positions mod `window`), where the pager
    parks it: filled once, fetching nothing (esftctl.runtime.paging.pager). Spread, two of them could share a block
    and fetch every step: 4 layers, 2 blocks, layers 0 and 2 resident leave 1 and 3 in block 1."""
    if 0 < len(order) - count <= window:
        return sorted(order[:count])
    return spread(order, count)


def spare_layers(device: torch.device, layer_bytes: int, margin: float = 0.1) -> int:
    """How many more layers of `layer_bytes` fit in the device memory nobody holds now, keeping `margin` of it."""
    if device.type != "cuda":
        return 1 << 30  # host memory: the planner's cap is the number of layers
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * (1 - margin) // max(1, layer_bytes))


@dataclass(frozen=True)
class KvNeed:
    """The most KV cache the engine can use (max_num_seqs x max_model_len tokens) and the share of the device
    it fills (vLLM's gpu_memory_utilization): what start_resident leaves to the KV cache."""

    tokens: int
    bytes_per_token: int
    utilization: float


def start_resident(need: KvNeed, *, free: int, total: int, layer_bytes: int, cap: int,
                   margin: float = 0.1) -> int:
    """How many paged layers stay resident from the start: those that fit in the engine's memory share once
    the model is loaded (`free` of `total` now) and the KV cache has its need, keeping `margin` of the share
    for activations and CUDA graphs. 0 where memory binds (the need alone fills the share)."""
    share = need.utilization * total
    room = share - (total - free) - need.tokens * need.bytes_per_token - margin * share
    return max(0, min(cap, int(room // max(1, layer_bytes))))


class ResidencyPlanner:
    """How many layers to keep resident, from rho = compute time / load time of a paged layer.

    rho > 1: compute hides the load, so memory can be given back (one layer fewer resident); rho < 0.9:
    loads show, so one more layer stays resident, but never beyond `max_resident` (what the memory left
    after the KV cache's share can hold). Between 0.9 and 1 nothing changes, so it does not oscillate.

    `store_experts` picks the tiers (either compressed tier: the Huffman store or the fixed-rate codes, whose
    decoders both run masked beside the host copies): the decoder shares the GPU's SMs with the layer it overlaps
    (measured: ~5% of a large prefill's time on an H100), so it is used only while host copies alone would
    show (rho of the host tier below 1), and then with the bandwidth split.
    """

    SHRINK_ABOVE, GROW_BELOW = 1.0, 0.9

    def __init__(self, num_layers: int, max_resident: int, resident: int = 0):
        self.num_layers, self.max_resident = num_layers, min(max_resident, num_layers)
        self.resident = min(resident, self.max_resident)
        self.decisions: list[dict] = []

    def update(self, compute_ms: float, load_ms: float) -> int:
        rho = compute_ms / load_ms if load_ms > 0 else float("inf")
        before = self.resident
        if rho > self.SHRINK_ABOVE and self.resident > 0:
            self.resident -= 1
        elif rho < self.GROW_BELOW and self.resident < self.max_resident:
            self.resident += 1
        self.decisions.append({"compute_ms": compute_ms, "load_ms": load_ms, "rho": rho, "resident_before": before,
                               "resident": self.resident})
        return self.resident

    @staticmethod
    def store_experts(compute_ms: float, host_load_ms: float, split: int) -> int:
        return 0 if compute_ms > host_load_ms else split


class AdaptiveResidency:
    """Runs the planner every `every` engine steps (between steps, outside any CUDA graph) on the timings the
    pager measured meanwhile. Steps replayed from CUDA graphs run no host code, so they time nothing: with no
    timings the planner takes loads to show and keeps more layers resident as far as memory allows (a captured
    step cannot hide a load it does not see)."""

    def __init__(self, pager: PagedExperts, layer_bytes: Callable[[], int], every: int = 16,
                 measure: Callable[[], tuple[list[float], list[float]]] | None = None,
                 spare: Callable[[], int] | None = None):
        """`layer_bytes`: what one more resident layer would take now (adapters change it)."""
        self.pager, self.order, self.every = pager, list(pager.order), every
        self.layer_bytes, self.measure = layer_bytes, measure or pager.times.take
        pager.times.enabled = True
        self.spare = spare or (lambda: spare_layers(pager.device, layer_bytes()))
        self.planner = ResidencyPlanner(len(self.order), self._cap(), resident=len(pager.resident))
        self.steps = 0
        pager.between_steps = self.on_step

    def _outside_window(self) -> int:
        return len(self.order) - self.pager.window.size

    def _cap(self) -> int:
        """What may stay resident: the layers outside the window, as far as those resident now plus what fits
        in free memory now allow (memory can have been taken meanwhile)."""
        return max(0, min(self._outside_window(), len(self.pager.resident) + self.spare()))

    def start(self, need: KvNeed, *, free: int, total: int) -> None:
        """Before vLLM sizes its KV cache (`free` of `total` device bytes now): keep resident the layers that fit
        beside the KV cache's need (start_resident); the planner goes on from them."""
        count = start_resident(need, free=free, total=total, layer_bytes=self.layer_bytes(),
                               cap=self._outside_window())
        log.info("paging planner: %d of %d layers resident from the start (the KV cache's need: %s tokens)",
                 count, len(self.order), f"{need.tokens:,}")
        self.pager.set_resident(resident_choice(self.order, count, self.pager.window.size))
        self.planner.resident = count

    def on_step(self) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        compute, load = self.measure()
        self.planner.max_resident = self._cap()
        before = len(self.pager.resident)
        timed = bool(compute and load)
        after = self.planner.update(statistics.median(compute) if timed else 0.0,
                                    statistics.median(load) if timed else 1.0)
        decision = self.planner.decisions[-1]
        decision["timed"] = timed
        log.info("paging planner: rho %.2f (compute %.3f ms, load %.3f ms%s): %d -> %d resident layers",
                 decision["rho"], decision["compute_ms"], decision["load_ms"], "" if timed else ", untimed",
                 before, after)
        if after != before:
            self.pager.set_resident(resident_choice(self.order, after, self.pager.window.size))

    @property
    def decisions(self) -> list[dict]:
        return self.planner.decisions
