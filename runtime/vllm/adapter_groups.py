"""vLLM's scheduler with adapter groups: each engine step runs the requests of at most G adapters
(`esftctl serve --group-adapters G`), none held back more than about W steps (`--group-wait W`); and, when requests
queue for batch slots, those of the adapters already running admitted first (`--admit-by-adapter S`), none passed
over for more than S seconds.

The policies (which adapters run this step, in which order queued requests are admitted, and why that can read
fewer expert rows) are engine-free: esftctl.runtime.adapter_groups. This mixin applies them the way the variants'
turns do (esftctl.runtime.vllm.variant_turns): vLLM's Scheduler or AsyncScheduler is kept whole (`--scheduler-cls`
names `grouping_scheduler`). The groups held back sit out one schedule() call (esftctl.runtime.vllm.scheduling),
and the admission order is vLLM's own waiting queue, put in order before it admits. Under continuous batching a
group's new requests join as soon as the group runs.

What they did is written beside the server's status file (`adapter_groups.json`, when a maximum grew, else at most
once a second, off the scheduler's thread: esftctl.runtime.engine_status.StatusFile): steps, steps that held
something back, the most adapters vLLM scheduled in one step, the longest a request was held, and the steps whose
queue the admission order changed.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import asdict

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from esftctl.runtime.adapter_groups import AdapterGroups, GroupStats, Work, admission_order, stats_file
from esftctl.runtime.engine_status import StatusFile
from esftctl.runtime.serve_config import ServeConfig, ServeSettings
from esftctl.runtime.vllm.scheduling import holding_back, waiting_queues

STATS_EVERY_S = 1.0
NO_GROUPS = GroupStats()  # the maxima without --group-adapters: none (read, never written)


def group_of(request) -> int:
    """A request's adapter group: its LoRA id, 0 for the base."""
    lora = request.lora_request
    return lora.lora_int_id if lora is not None else 0


class AdapterGroupsMixin:
    def _init_groups(self, settings: ServeSettings, status_file: str | None) -> None:
        self.groups = (AdapterGroups(most=settings.group_adapters, wait=settings.group_wait)
                       if settings.group_adapters else None)
        self.groups_file = StatusFile(stats_file(status_file) if status_file else None)
        self.admit_wait = settings.admit_by_adapter  # seconds; 0: vLLM's own order
        self.reordered = 0  # steps whose waiting queue admission_order changed

    def schedule(self, *args, **kwargs):
        before = self._maxima()
        if self.admit_wait:
            self._admit_by_adapter()
        if self.groups is None:
            output = super().schedule(*args, **kwargs)
        else:
            work = {r.request_id: Work(group_of(r), True) for r in self.running}
            work.update({r.request_id: Work(group_of(r)) for q in waiting_queues(self) for r in q})
            allowed = self.groups.choose(work)
            with holding_back(self, lambda r: group_of(r) in allowed):
                output = super().schedule(*args, **kwargs)
        self._record(output, before)
        return output

    def _admit_by_adapter(self) -> None:
        """Put vLLM's waiting queue in admission_order before it admits: its new requests (status WAITING), behind
        the others it holds (preempted, waiting for grammar or KV), which keep their place. Only while a batch slot
        is free (else nothing is admitted) and under vLLM's first-come-first-served policy (its priority policy
        keeps a heap of its own)."""
        queue = self.waiting
        if (len(queue) < 2 or len(self.running) >= self.max_num_running_reqs
                or getattr(self.policy, "value", "fcfs") != "fcfs"):
            return
        now = time.time()  # vLLM stamps a request's arrival_time with time.time()
        new = [r for r in queue if r.status == RequestStatus.WAITING]
        running = Counter(group_of(r) for r in self.running)
        order = admission_order([(r.request_id, group_of(r), now - r.arrival_time) for r in new], running,
                                wait=self.admit_wait)
        if order == [r.request_id for r in new]:
            return
        held, by_id = [r for r in queue if r.status != RequestStatus.WAITING], {r.request_id: r for r in new}
        queue.remove_requests(list(queue))
        queue.prepend_requests(deque(reversed([*held, *(by_id[rid] for rid in order)])))  # extendleft reverses
        self.reordered += 1

    def _maxima(self) -> tuple[int, int, bool]:
        stats = self.groups.stats if self.groups is not None else NO_GROUPS
        return stats.most_groups_scheduled, stats.longest_wait, self.reordered > 0

    def _record(self, output, before: tuple[int, int, bool]) -> None:
        """Count the groups vLLM scheduled; write the statistics when a maximum grew (or the first reorder came),
        else at most once a second."""
        if self.groups is not None:
            self.groups.scheduled({group_of(self.requests[rid]) for rid in output.num_scheduled_tokens
                                   if rid in self.requests})
        if self._maxima() != before or time.monotonic() - self.groups_file.written > STATS_EVERY_S:
            self.groups_file.write(self._stats(), wait=False)

    def _stats(self) -> dict:
        stats = {}
        if self.groups is not None:
            stats = {"most": self.groups.most, "wait": self.groups.wait, **asdict(self.groups.stats)}
            stats["held"] = {str(k): v for k, v in stats["held"].items()}
        if self.admit_wait:
            stats |= {"admit_by_adapter": self.admit_wait, "reordered": self.reordered}
        return stats


def _configured() -> tuple[ServeSettings, str | None]:
    """The server's settings and status file, as esftctl serve handed them to the engine."""
    config = ServeConfig.from_env()
    return config.settings, config.status_file


class GroupingScheduler(AdapterGroupsMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_groups(*_configured())


class AsyncGroupingScheduler(AdapterGroupsMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_groups(*_configured())


def grouping_scheduler(*, vllm_config, **kwargs):
    """What `--scheduler-cls` names: vLLM's scheduler of the kind its config chose (async or not), with groups."""
    cls = AsyncGroupingScheduler if vllm_config.scheduler_config.async_scheduling else GroupingScheduler
    return cls(vllm_config=vllm_config, **kwargs)
