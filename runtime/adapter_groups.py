"""Which adapters' requests may run in an engine step when steps group requests by adapter
(`esftctl serve --group-adapters G --group-wait W`), and in which order queued requests are admitted when they are
admitted by adapter (`--admit-by-adapter S`, admission_order); the scheduler side is
esftctl.runtime.vllm.adapter_groups.

Why: a step's MoE layers read every expert row some token routes to, and a token of adapter a routed to an expert a
replaced reads a's row while the base's is still read for the others. So rows grow with the distinct adapters in a step:
with 64 sequences over 20 Table 1 adapters, 97.7 rows per layer against the base's 63.9 (benchmarks/lab/rows_model.py),
and a decode step's cost moves with the rows it reads: the fitted share of a step that moves with them is 0.46-0.52
(benchmarks/RESULTS.md, Adapters against the base). Holding each step to G adapters caps the rows at about what G
adapters add. The price: a request whose adapter is not among a step's G waits that step out (its TPOT or TTFT grows),
and a step runs fewer tokens for the weights it reads. Whether that trade wins is for `esftctl bench serve
--group-adapters` to say, against vLLM's `--max-loras` (which bounds the adapters among running requests at admission
instead).

The rule, per step, over the requests with work (running or waiting), grouped by adapter (the base is a group):
1. if at most G groups have work, all run: nothing is held back;
2. else overdue groups first (holding a request that has been held back W steps in a row), the longest held
   first; then the groups with the most running requests, then the most requests; ties to the longest held, then
   the lower group key. The first G run.
Bound: once a request is overdue, only groups held at least as long rank before it, and every step runs G of
them, so no request is held more than W + floor((k - 1) / G) consecutive steps, k the most groups with work
meanwhile. vLLM may still leave an eligible request out (token budget, KV cache): that is its own scheduling,
as without groups.

Modelled with this class (benchmarks/lab/group_trade.py), holding steps to G adapters loses at every load: vLLM
keeps a held request in its batch slot, so a step loses tokens faster than rows (at 5 requests/s over 5 adapters,
TPOT 1.44x the base's with G = 2 against 1.009x). Admitting by adapter leaves no slot empty: it only chooses which
queued request takes a free one, and it gains where requests queue (bench serve's 256 at once: throughput 0.91x
the base's against 0.87x over 5 adapters, 0.80x against 0.76x over 20). Measured at that load over 5 adapters on
an H200, both servers up on one card (benchmarks/lab/side_by_side.py), groups of 2 lost throughput and doubled TPOT's
p99, while admitting by adapter took throughput from 0.912x plain vLLM's in vLLM's order to 0.958x, so `serve` admits
by adapter by default (esftctl.runtime.serve_config.ADMIT_BY_ADAPTER_S). Over 20 adapters on an H100 (bench serve,
three starts, medians), admitting by adapter brings TPOT to 1.218x and throughput to 0.82x the base's, where vLLM's
--max-loras 4 gives TPOT 0.852x but throughput 0.483x, leaving slots empty (benchmarks/RESULTS.md, Adapters against
the base).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

STATS_FILE = "adapter_groups.json"  # the scheduler's statistics, beside the server's status file


def stats_file(status_file: str | Path) -> Path:
    """Where a server's grouping statistics go: beside its status file."""
    return Path(status_file).with_name(STATS_FILE)


@dataclass(frozen=True)
class Work:
    """One request with work this step: its group (adapter; the base is one too) and whether it is running."""

    group: Hashable
    running: bool = False


@dataclass
class GroupStats:
    """What the grouping did: steps, steps that held something back, the most groups a step ran (as scheduled),
    and the longest a request was held back (consecutive steps)."""

    steps: int = 0
    grouped_steps: int = 0
    most_groups_scheduled: int = 0
    longest_wait: int = 0
    held: dict = field(default_factory=dict)  # group -> steps some of its requests were held back


class AdapterGroups:
    """The policy: `most` groups (G) per step at most, requests held back at most `wait` (W) steps before they are
    overdue."""

    def __init__(self, *, most: int, wait: int):
        if most < 1 or wait < 1:
            raise ValueError(f"need at least one group per step and one step of waiting, not {most} and {wait}")
        self.most, self.wait = most, wait
        self.step = 0
        self.since: dict[str, int] = {}  # request id -> the last step it was eligible (or the one before it came)
        self.stats = GroupStats()

    def bound(self, groups: int) -> int:
        """The longest any request is held back while `groups` groups have work."""
        return 0 if groups <= self.most else self.wait + (groups - 1) // self.most

    def choose(self, work: Mapping[str, Work]) -> set[Hashable]:
        """The groups whose requests may run this step (every request of them); `work` maps request id -> Work."""
        self.step += 1
        since = {rid: self.since.get(rid, self.step - 1) for rid in work}
        held = {rid: self.step - 1 - s for rid, s in since.items()}  # consecutive steps held back before this one
        groups: dict[Hashable, list[str]] = {}
        for rid, w in work.items():
            groups.setdefault(w.group, []).append(rid)
        allowed = set(groups) if len(groups) <= self.most else set(self._rank(groups, work, held)[:self.most])
        for g in allowed:
            for rid in groups[g]:
                self.stats.longest_wait = max(self.stats.longest_wait, held[rid])
                since[rid] = self.step
        self.since = since
        self._count(groups, allowed)
        return allowed

    def _rank(self, groups: dict, work: Mapping[str, Work], held: dict[str, int]) -> list[Hashable]:
        def key(g):
            longest = max(held[rid] for rid in groups[g])
            running = sum(work[rid].running for rid in groups[g])
            overdue = longest >= self.wait
            return (not overdue, -longest if overdue else 0, -running, -len(groups[g]), -longest, _order(g))
        return sorted(groups, key=key)

    def _count(self, groups: dict, allowed: set) -> None:
        self.stats.steps += 1
        if len(allowed) < len(groups):
            self.stats.grouped_steps += 1
            for g in set(groups) - allowed:
                self.stats.held[g] = self.stats.held.get(g, 0) + 1

    def scheduled(self, groups: set[Hashable]) -> None:
        """Record the groups vLLM actually scheduled in the step just chosen."""
        self.stats.most_groups_scheduled = max(self.stats.most_groups_scheduled, len(groups))


def admission_order(waiting: Sequence[tuple[str, Hashable, float]], running: Mapping[Hashable, int], *,
                    wait: float) -> list[str]:
    """The order to admit waiting requests in (`esftctl serve --admit-by-adapter S`): requests of the adapters with
    the most running requests first, each adapter's requests together, so that when requests queue for batch
    slots the running ones gather on fewer adapters and a step reads fewer adapter copies. No slot is left empty
    for it (vLLM's --max-loras leaves them empty). A request that has waited `wait` is overdue, and overdue requests
    go first, the longest waiting first, so none is passed over for longer. Modelled at bench serve's all-at-once
    load (benchmarks/lab/group_trade.py), it takes throughput from 0.87 to 0.91x the base's over 5 adapters;
    measured there on an H200, from 0.912 to 0.958x plain vLLM's (benchmarks/RESULTS.md, Adapters against the
    base), so `serve` admits so by default.
    `waiting`: (request id, group, time it has waited) for each request; `running`: running requests per group.
    The groups are ranked once, then the requests sorted by plain tuples: 1,000 queued take 0.65 ms on the dev
    CPU (a key function per request took 2.4 ms)."""
    oldest: dict[Hashable, float] = {}
    for _, group, waited in waiting:
        oldest[group] = max(oldest.get(group, 0.0), waited)
    ranked = sorted(oldest, key=lambda g: (-running.get(g, 0), -oldest[g], _order(g)))
    rank = {g: i for i, g in enumerate(ranked)}
    keyed = [((0, 0, -waited) if waited >= wait else (1, rank[group], -waited), rid) for rid, group, waited in waiting]
    keyed.sort(key=itemgetter(0))  # stable: ties keep the queue's order
    return [rid for _, rid in keyed]


def _order(group: Hashable) -> tuple:
    """A total order over group keys of mixed types (None for the base, ints for LoRA ids)."""
    return (group is not None, str(type(group)), group if isinstance(group, (int, float, str)) else str(group))
