"""vLLM's scheduler with adapter groups: each engine step runs the requests of at most G adapters
(`esftctl serve --group-adapters G`), none held back more than about W steps (`--group-wait W`).

The policy (which adapters run this step, and why that can read fewer expert rows) is engine-free:
esftctl.runtime.adapter_groups. This mixin applies it the way the variants' turns do
(esftctl.runtime.vllm.variant_turns): vLLM's Scheduler or AsyncScheduler is kept whole (`--scheduler-cls` names
`grouping_scheduler`), and the groups held back sit out one schedule() call (esftctl.runtime.vllm.scheduling).
Under continuous batching a group's new requests join as soon as the group runs.

What it did is written beside the server's status file (`adapter_groups.json`, when a maximum grew, else at most
once a second, off the scheduler's thread: esftctl.runtime.engine_status.StatusFile): steps, steps that held
something back, the most adapters vLLM scheduled in one step, the longest a request was held.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from esftctl.runtime.adapter_groups import AdapterGroups, Work, stats_file
from esftctl.runtime.engine_status import StatusFile
from esftctl.runtime.serve_config import ServeConfig
from esftctl.runtime.vllm.scheduling import holding_back, waiting_queues

STATS_EVERY_S = 1.0


def group_of(request) -> int:
    """A request's adapter group: its LoRA id, 0 for the base."""
    lora = request.lora_request
    return lora.lora_int_id if lora is not None else 0


class AdapterGroupsMixin:
    def _init_groups(self) -> None:
        config = ServeConfig.from_env()
        self.groups = AdapterGroups(most=config.settings.group_adapters, wait=config.settings.group_wait)
        self.groups_file = StatusFile(stats_file(config.status_file) if config.status_file else None)

    def schedule(self, *args, **kwargs):
        work = {r.request_id: Work(group_of(r), True) for r in self.running}
        work.update({r.request_id: Work(group_of(r)) for q in waiting_queues(self) for r in q})
        before = self._maxima()
        allowed = self.groups.choose(work)
        with holding_back(self, lambda r: group_of(r) in allowed):
            output = super().schedule(*args, **kwargs)
        self._record(output, before)
        return output

    def _maxima(self) -> tuple[int, int]:
        return self.groups.stats.most_groups_scheduled, self.groups.stats.longest_wait

    def _record(self, output, before: tuple[int, int]) -> None:
        """Count the groups vLLM scheduled; write the statistics when a maximum grew, else at most once a second."""
        self.groups.scheduled({group_of(self.requests[rid]) for rid in output.num_scheduled_tokens
                               if rid in self.requests})
        if self._maxima() != before or time.monotonic() - self.groups_file.written > STATS_EVERY_S:
            stats = asdict(self.groups.stats)
            stats["held"] = {str(k): v for k, v in stats["held"].items()}
            self.groups_file.write({"most": self.groups.most, "wait": self.groups.wait, **stats}, wait=False)


class GroupingScheduler(AdapterGroupsMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_groups()


class AsyncGroupingScheduler(AdapterGroupsMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_groups()


def grouping_scheduler(*, vllm_config, **kwargs):
    """What `--scheduler-cls` names: vLLM's scheduler of the kind its config chose (async or not), with groups."""
    cls = AsyncGroupingScheduler if vllm_config.scheduler_config.async_scheduling else GroupingScheduler
    return cls(vllm_config=vllm_config, **kwargs)
