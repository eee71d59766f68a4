"""vLLM's scheduler with turns: every engine step runs the requests of one variant only.

Consolidated variants share the experts but each has its own non-expert weights, which the worker puts in
place before a step (esftctl.runtime.vllm.variant_weights). So a step must not mix variants. vLLM's scheduler is
kept whole (`--scheduler-cls` names `variant_scheduler`, which builds vLLM's own Scheduler or AsyncScheduler
with this mixin); the mixin only picks whose turn it is and holds the others' requests back for that step, through
the scheduler's own means (esftctl.runtime.vllm.scheduling).

Turns are round-robin over the variants with work, `quantum` steps each (ESFTCTL_SERVE's `quantum`): within a
turn, vLLM's continuous batching runs as always (new requests of that variant join at once); a variant with
work waits at most (variants - 1) x quantum steps, so nothing starves. ESFT adapters and the plain base name
run with the home variant. With quantum 4 and a switch costing about 1.3 ms on an H100 (DeepSeek-V2-Lite's
non-expert weights) against 20-30 ms per decode step, switching costs at most 1.6% of the time.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from esftctl.runtime.serve_config import ServeConfig
from esftctl.runtime.vllm.scheduling import holding_back, waiting_queues
from esftctl.variants import HOME


class Turns:
    """Whose turn it is: round-robin over the variants with work, `quantum` steps per turn."""

    def __init__(self, variants: int, quantum: int):
        self.variants, self.quantum = variants, max(1, quantum)
        self.current, self.steps = HOME, 0

    def next(self, with_work: set[int]) -> int:
        if with_work and (self.current not in with_work or self.steps >= self.quantum):
            following = [(self.current + k) % self.variants for k in range(1, self.variants + 1)]
            self.current = next(v for v in following if v in with_work)  # the current one comes last
            self.steps = 0
        self.steps += 1
        return self.current


class VariantTurnsMixin:
    def _init_turns(self) -> None:
        config = ServeConfig.from_env()
        self.variant_of_lora = {name: i for i, name in enumerate(config.variant_names) if i != HOME}
        self.turns = Turns(len(config.variant_names), config.settings.quantum)
        self.turn = HOME

    def variant_of(self, request) -> int:
        lora = request.lora_request
        return self.variant_of_lora.get(lora.lora_name, HOME) if lora is not None else HOME

    def schedule(self, *args, **kwargs):
        queued = (r for q in waiting_queues(self) for r in q)
        self.turn = self.turns.next({self.variant_of(r) for r in (*self.running, *queued)})
        with holding_back(self, lambda r: self.variant_of(r) == self.turn):
            return super().schedule(*args, **kwargs)


class VariantScheduler(VariantTurnsMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_turns()


class AsyncVariantScheduler(VariantTurnsMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_turns()


def variant_scheduler(*, vllm_config, **kwargs):
    """What `--scheduler-cls` names: vLLM's scheduler of the kind its config chose (async or not), with turns."""
    cls = AsyncVariantScheduler if vllm_config.scheduler_config.async_scheduling else VariantScheduler
    return cls(vllm_config=vllm_config, **kwargs)
