"""Adapter groups (issue 29, item 3): each engine step runs at most G adapters' requests, no request is held back
longer than the bound, and every request runs to its end. The policy alone (esftctl.runtime.adapter_groups),
then the scheduler mixin over a stand-in for vLLM's scheduler (esftctl.runtime.vllm.adapter_groups)."""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from esftctl.runtime.adapter_groups import AdapterGroups, Work, admission_order
from esftctl.runtime.serve_config import ServeSettings


def simulate(policy: AdapterGroups, *, groups: int, steps: int, arrive: float, seed: int,
             skew: float = 1.0) -> dict:
    """Requests arrive at random (each step with probability `arrive`, adapters skewed by `skew`), each needing
    1-20 steps of service; a request runs in every step its group is allowed. Checks every step's bounds; returns
    what happened. After `steps`, arrivals stop and the simulation runs until every request has finished."""
    rng = random.Random(seed)
    weights = [1 / (g + 1) ** skew for g in range(groups)]
    need: dict[str, int] = {}
    work: dict[str, Work] = {}
    held = {}
    done, longest, step = [], 0, 0
    while step < steps or work:
        step += 1
        if step <= steps and rng.random() < arrive:
            rid = f"r{step}"
            work[rid], need[rid], held[rid] = Work(rng.choices(range(groups), weights)[0]), rng.randint(1, 20), 0
        if not work:
            continue
        with_work = len({w.group for w in work.values()})
        allowed = policy.choose(work)
        assert len(allowed) <= policy.most and allowed <= {w.group for w in work.values()}
        for rid in list(work):
            if work[rid].group not in allowed:
                held[rid] += 1
                assert held[rid] <= policy.bound(groups), (rid, held[rid], with_work)
                continue
            longest, held[rid] = max(longest, held[rid]), 0
            need[rid] -= 1
            work[rid] = Work(work[rid].group, running=True)
            if need[rid] == 0:
                done.append(rid)
                del work[rid]
        assert step < steps + 100 * len(need), "requests starve"
    return {"done": done, "arrived": len(need), "longest": longest}


@pytest.mark.parametrize("most, wait, groups, skew", [(1, 1, 4, 0.0), (1, 4, 4, 1.0), (2, 8, 10, 1.0),
                                                      (4, 8, 21, 2.0), (4, 2, 21, 0.0)])
def test_steps_hold_at_most_g_adapters_and_no_request_waits_past_the_bound(most, wait, groups, skew):
    policy = AdapterGroups(most=most, wait=wait)
    out = simulate(policy, groups=groups, steps=3000, arrive=0.6, seed=most * 100 + groups, skew=skew)
    assert len(set(out["done"])) == len(out["done"]) == out["arrived"] > 1000  # every request ran to its end
    assert out["longest"] == policy.stats.longest_wait <= policy.bound(groups)
    assert policy.stats.grouped_steps > 0  # the bound was tested: steps did hold requests back


def test_the_wait_bound_is_reached_and_kept_under_pressure():
    """Twenty busy adapters, one step each at a time, held back at most 3 steps before they are overdue: the longest
    any request waited is at least the wait (grouping held it) and at most the bound."""
    policy = AdapterGroups(most=1, wait=3)
    busy = {f"g{g}-{k}": Work(g, running=True) for g in range(20) for k in range(g + 1)}
    seen = set()
    for _ in range(400):
        seen |= policy.choose(busy)
    assert seen == set(range(20))  # every adapter ran: none starved
    assert 3 <= policy.stats.longest_wait <= policy.bound(20) == 3 + 19


def test_at_most_g_adapters_with_work_run_together_and_big_groups_go_first():
    policy = AdapterGroups(most=2, wait=5)
    assert policy.choose({"a": Work(1), "b": Work(2)}) == {1, 2}  # fits: nothing held
    assert policy.stats.grouped_steps == 0
    work = {"a": Work(1), "b": Work(2, running=True), "c": Work(3), "d": Work(3), "e": Work(None)}
    assert policy.choose(work) == {2, 3}  # the running request's group, then the largest
    for _ in range(4):
        assert policy.choose(work) == {2, 3}
    assert policy.choose(work) == {1, None}  # held back 5 steps: overdue, whatever their size
    assert policy.stats.held == {1: 5, None: 5, 2: 1, 3: 1} and policy.stats.longest_wait == 5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        AdapterGroups(most=0, wait=1)
    with pytest.raises(ValueError):
        AdapterGroups(most=1, wait=0)


def test_admission_order_puts_running_adapters_first_each_together_and_overdue_requests_before_all():
    waiting = [("a", 3, 0.5), ("b", None, 0.4), ("c", 2, 0.3), ("d", 3, 0.2), ("e", 1, 0.1), ("f", 2, 0.05)]
    running = {2: 3, 1: 1}
    # adapter 2 (3 running), its longest waiting first; adapter 1; then those not running, the oldest's group first
    assert admission_order(waiting, running, wait=10.0) == ["c", "f", "e", "a", "d", "b"]
    # a and b have waited their bound: they go first, the longest waiting first
    assert admission_order(waiting, running, wait=0.35) == ["a", "b", "c", "f", "e", "d"]
    assert admission_order([], running, wait=1.0) == []


def admit(order_by, *, slots: int, groups: int, steps: int, seed: int, wait: float | None) -> dict:
    """Requests arrive at random over `groups` adapters, each running 5-30 steps once admitted to one of `slots`; the
    queue is put in admission_order (`wait` its bound, in steps) or left first come first served (None). Checks at
    each admission that no request left waiting is overdue while one that is not was let in; returns the mean
    distinct adapters among the running requests and the longest any request waited."""
    rng = random.Random(seed)
    queue, running, distinct, longest, arrived, step = [], {}, [], 0, 0, 0
    while step < steps or queue or running:
        step += 1
        if step <= steps:
            for _ in range(rng.choice((0, 1, 2))):
                arrived += 1
                queue.append((f"r{arrived}", rng.randrange(groups), step, rng.randint(5, 30)))
        running = {rid: (g, left - 1) for rid, (g, left) in running.items() if left > 1}
        if wait is not None and len(queue) > 1:
            counts = {}
            for g, _ in running.values():
                counts[g] = counts.get(g, 0) + 1
            by_id = {q[0]: q for q in queue}
            queue = [by_id[rid] for rid in order_by([(q[0], q[1], step - q[2]) for q in queue], counts, wait=wait)]
        free = slots - len(running)
        let_in, queue = queue[:free], queue[free:]
        if wait is not None and any(step - q[2] < wait for q in let_in):
            assert all(step - q[2] < wait for q in queue), "an overdue request was passed over"
        for rid, g, since, need in let_in:
            running[rid], longest = (g, need), max(longest, step - since)
        if running:
            distinct.append(len({g for g, _ in running.values()}))
        assert step < steps * 10, "requests starve"
    return {"distinct": sum(distinct) / len(distinct), "longest": longest, "arrived": arrived}


@pytest.mark.parametrize("groups, wait", [(4, 200.0), (20, 200.0), (20, 400.0)])
def test_admitting_by_adapter_gathers_running_requests_on_fewer_adapters_and_passes_over_none_for_long(groups, wait):
    """More work than 16 slots take (a request a step, each 5-30 steps), so the queue grows to hundreds of steps of
    waiting: admitted in admission_order, the running requests hold fewer distinct adapters than first come first
    served (21-63% fewer with these bounds), and none waits longer than its bound plus what first come first served
    makes it wait, plus one request's steps. A bound below the queue's own wait would change nothing: every
    request would be overdue."""
    fcfs = admit(admission_order, slots=16, groups=groups, steps=3000, seed=groups, wait=None)
    ours = admit(admission_order, slots=16, groups=groups, steps=3000, seed=groups, wait=wait)
    assert ours["arrived"] == fcfs["arrived"] > 2500
    assert ours["distinct"] < 0.9 * fcfs["distinct"]
    assert ours["longest"] <= wait + fcfs["longest"] + 30


class Queue(list):
    """vLLM's first-come-first-served request queue, as the mixin uses it: prepend_requests is a deque's extendleft
    there (vLLM 0.25 and 0.32), which puts what it is given in front in reverse."""

    def remove_requests(self, requests):
        for r in requests:
            self.remove(r)

    def prepend_requests(self, requests: deque):
        self[:0] = list(reversed(requests))


class StandIn:
    """vLLM's scheduler as the mixin sees it: running and waiting requests, a step counter, and a schedule() that
    runs every eligible running request and admits every waiting one."""

    def __init__(self, running, waiting):
        self.running, self.waiting, self.current_step = running, Queue(waiting), 0
        self.requests = {r.request_id: r for r in (*running, *waiting)}

    def schedule(self):
        self.current_step += 1
        ids = [r.request_id for r in self.running if self.current_step >= r.next_decode_eligible_step]
        admitted = list(self.waiting)
        self.waiting.remove_requests(admitted)
        self.running += admitted
        return SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in ids + [r.request_id for r in admitted]})


def request(rid: str, lora: int | None):
    return SimpleNamespace(request_id=rid, next_decode_eligible_step=0,
                           lora_request=SimpleNamespace(lora_int_id=lora) if lora else None)


@pytest.mark.vllm
def test_the_mixin_hides_other_adapters_for_one_call_and_puts_everything_back():
    from esftctl.runtime.vllm.adapter_groups import AdapterGroupsMixin

    class Grouped(AdapterGroupsMixin, StandIn):
        pass

    running = [request("r1", 1), request("r2", 2), request("r3", 2)]
    waiting = [request("w1", 3), request("w2", None), request("w3", 2), request("w4", 3)]
    scheduler = Grouped(running, waiting)
    scheduler._init_groups(ServeSettings(base=Path("base"), group_adapters=1, group_wait=8,
                                         admit_by_adapter=0.0), None)  # grouping alone: vLLM's order
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"r2", "r3", "w3"}  # adapter 2 only: the most running requests
    assert [r.next_decode_eligible_step for r in running] == [0, 0, 0, 0]  # restored
    assert [r.request_id for r in scheduler.waiting] == ["w1", "w2", "w4"]  # back in front, in their order
    out = scheduler.schedule()  # adapter 2 again (3 running now); the others were held one step
    assert set(out.num_scheduled_tokens) == {"r2", "r3", "w3"}
    assert scheduler.groups.stats.most_groups_scheduled == 1 and scheduler.groups.stats.held == {1: 2, 3: 2, 0: 2}


@pytest.mark.vllm
def test_the_mixin_puts_vllms_queue_in_admission_order_while_a_slot_is_free():
    import time

    from vllm.v1.request import RequestStatus

    from esftctl.runtime.vllm.adapter_groups import AdapterGroupsMixin

    class Admitting(AdapterGroupsMixin, StandIn):
        max_num_running_reqs, policy = 4, SimpleNamespace(value="fcfs")

    def queued(rid, lora, waited, status=RequestStatus.WAITING):
        r = request(rid, lora)
        r.status, r.arrival_time = status, time.time() - waited
        return r

    running = [request("r1", 1), request("r2", 2), request("r3", 2)]
    waiting = [queued("p1", 3, 0.0, RequestStatus.PREEMPTED), queued("w1", 3, 5.0), queued("w2", None, 2.0),
               queued("w3", 2, 1.0), queued("w4", 1, 0.5)]
    scheduler = Admitting(running, waiting)
    scheduler._init_groups(ServeSettings(base=Path("base"), admit_by_adapter=60.0), None)
    scheduler._admit_by_adapter()
    # the preempted request keeps its place in front; then adapter 2 (2 running), 1 (1), and those not running
    assert [r.request_id for r in scheduler.waiting] == ["p1", "w3", "w4", "w1", "w2"] and scheduler.reordered == 1
    scheduler.running.append(request("r4", 5))  # every slot taken: nothing is admitted, so nothing is moved
    scheduler.waiting[:] = waiting
    scheduler._admit_by_adapter()
    assert [r.request_id for r in scheduler.waiting] == ["p1", "w1", "w2", "w3", "w4"] and scheduler.reordered == 1
    scheduler.running.pop()
    scheduler.policy = SimpleNamespace(value="priority")  # vLLM's heap is left alone
    scheduler._admit_by_adapter()
    assert scheduler.reordered == 1
    scheduler.policy, scheduler.admit_wait = SimpleNamespace(value="fcfs"), 3.0  # w1 has waited past its bound
    scheduler._admit_by_adapter()
    assert [r.request_id for r in scheduler.waiting] == ["p1", "w1", "w3", "w4", "w2"] and scheduler.reordered == 2
    out = scheduler.schedule()  # the whole step: the stand-in admits the queue; no grouping set, none held
    assert set(out.num_scheduled_tokens) == {"r1", "r2", "r3", "p1", "w1", "w2", "w3", "w4"}
    assert scheduler._stats() == {"admit_by_adapter": 3.0, "reordered": 2}


def test_serve_option_reaches_the_engine(world):
    """`serve --group-adapters` and `--admit-by-adapter`: checked once in the settings, carried to the engine, and
    vLLM is told to build the grouping scheduler (grouping off by default, admitting on within ADMIT_BY_ADAPTER_S;
    both refused beside --variants, which has its own turns; a --scheduler-cls of the user's after `--` refused
    while esftctl names one, since vLLM would take the last)."""
    from esftctl.errors import EsftError
    from esftctl.runtime.serve_config import ADMIT_BY_ADAPTER_S
    from esftctl.serve import free_port, plan

    grouped = plan(world.base_dir, [], port=free_port(), group_adapters=2, group_wait=3, admit_by_adapter=0.0)
    command = grouped.command()
    assert command[command.index("--scheduler-cls") + 1] == "esftctl.runtime.vllm.adapter_groups.grouping_scheduler"
    settings = ServeSettings.from_json(grouped.settings.to_json())
    assert (settings.group_adapters, settings.group_wait, settings.admit_by_adapter) == (2, 3, 0.0)
    default = plan(world.base_dir, [], port=free_port())
    assert default.settings.admit_by_adapter == ADMIT_BY_ADAPTER_S > 0
    assert default.command()[default.command().index("--scheduler-cls") + 1].endswith("grouping_scheduler")
    assert ServeSettings.from_json(default.settings.to_json()).admit_by_adapter == ADMIT_BY_ADAPTER_S
    fcfs = plan(world.base_dir, [], port=free_port(), admit_by_adapter=0.0, vllm_args=["--scheduler-cls", "mine"])
    assert fcfs.command().count("--scheduler-cls") == 1 and fcfs.command()[-1] == "mine"  # the user's, alone
    with pytest.raises(EsftError, match="--scheduler-cls after `--`"):
        plan(world.base_dir, [], port=free_port(), vllm_args=["--scheduler_cls=mine"])
    plain = plan(world.base_dir, [], port=free_port(), esft=False)  # plain vLLM: its own scheduler, nothing to admit
    assert plain.settings.admit_by_adapter == 0.0 and "--scheduler-cls" not in plain.command()
    assert ServeSettings(variants=Path("map")).admit_by_adapter == 0.0
    with pytest.raises(EsftError, match="cannot be combined with --variants"):
        ServeSettings(variants=Path("map"), group_adapters=2)
    with pytest.raises(EsftError, match="--group-wait 0"):
        ServeSettings(base=Path("base"), group_adapters=1, group_wait=0)
    admitting = plan(world.base_dir, [], port=free_port(), admit_by_adapter=30.0)  # alone, it needs the scheduler too
    command = admitting.command()
    assert command[command.index("--scheduler-cls") + 1].endswith("adapter_groups.grouping_scheduler")
    assert ServeSettings.from_json(admitting.settings.to_json()).admit_by_adapter == 30.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(EsftError, match="--admit-by-adapter"):
            ServeSettings(base=Path("base"), admit_by_adapter=bad)
    with pytest.raises(EsftError, match="--admit-by-adapter cannot be combined with --variants"):
        ServeSettings(variants=Path("map"), admit_by_adapter=5.0)
