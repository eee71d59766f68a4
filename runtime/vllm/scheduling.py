"""What the two scheduler mixins share (the variants' turns: esftctl.runtime.vllm.variant_turns; adapter groups:
esftctl.runtime.vllm.adapter_groups): holding requests back for one schedule() call through vLLM's scheduler's
own means, so that its scheduler stays whole. A held-back running request is not eligible this call
(`next_decode_eligible_step`, restored afterwards; schedule() first advances current_step, hence + 2), and a
held-back waiting one leaves its queue for the call and comes back in front, in its order, as vLLM puts back the
requests it skipped (the same in vLLM 0.25 and 0.32). The first-come-first-served queue's prepend_requests is a
deque's extendleft, which reverses what it is given: vLLM hands it the skipped requests in reverse, and so does
this (without it, requests held two steps came back in reverse order).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterator

# The scheduler's queues of requests not running: vLLM 0.25 has `waiting` and `skipped_waiting`, 0.32 `waiting`
# and `kv_holding_waiting`.
QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")


def waiting_queues(scheduler) -> list:
    return [q for q in (getattr(scheduler, name, None) for name in QUEUES) if q is not None]


@contextlib.contextmanager
def holding_back(scheduler, runs: Callable[[object], bool]) -> Iterator[None]:
    """For the schedule() call inside: only requests for which `runs` is true may be scheduled."""
    held = [(r, r.next_decode_eligible_step) for r in scheduler.running if not runs(r)]
    for request, step in held:
        request.next_decode_eligible_step = max(step, scheduler.current_step + 2)
    hidden = [(q, [r for r in q if not runs(r)]) for q in waiting_queues(scheduler)]
    for queue, requests in hidden:
        if requests:
            queue.remove_requests(requests)
    try:
        yield
    finally:
        for request, step in held:
            request.next_decode_eligible_step = step
        for queue, requests in hidden:
            if requests:
                queue.prepend_requests(deque(reversed(requests)))  # extendleft: vLLM's own callers hand it reversed
