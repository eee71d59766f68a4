"""Server benchmarks run in slices, so that a long run survives an interruption and resumes where it stopped.

Why: a whole server benchmark on a DeepSeek-V2-Lite-sized model takes hours, and a run that is interrupted (a
Ctrl-C, a crash, a machine that goes away, a time limit on the machine) would otherwise lose everything not yet
written. So it is cut into slices, one server started for one round (repeat) of its traffic, or a part of that
round, and each slice's JSON is written whole (atomically: esftctl.jsonfile.write_json) to
OUT/slices/MODEL/GROUP/SERVER/[PART.]rROUND.json the moment it ends. A rerun skips the slices already there (on
another machine too, with the folder copied), `budget_s` lets a user give the run a time limit: it passes over a
slice whose estimate would overrun what is left (later, shorter ones still run), and a report merges whatever
slices are present. Consecutive slices one server can serve (bench serve: the adapter counts of
one round of esftctl or multi-LoRA, every count served by the same server) share one start, still each written as
it ends: a DeepSeek-V2-Lite server takes minutes to start, about as long as a count's runs.
Rounds interleave the servers (round r starts r servers further down the list): a drift of the machine over
time spreads over every server instead of landing on whichever ran last.

Each slice records the machine it ran on (machine_id): a resumed run may continue on another machine, and two
cards of one kind differ by a few percent, as much as the effects measured. And a round is its traffic (vLLM's
seed for the prompts and arrivals, ours for the adapters): at 1 request/s two rounds of 60 requests differ by more
than the servers do (plain vLLM's median TPOT and the share of its prompts prefilled alone move by a tenth between
rounds on one H200). So both benches pair like with like: a
slice runs after its anchor (what its ratios are set against) ran the same round on the same machine (anchored:
the anchor's planned slice of that round, or a run of it once more on this machine, part copy_part), and each
ratio is taken against that run only (pair_by_machine).

Used by `esftctl bench paging --serve` (esftctl.bench.serve_paging: GROUP is the regime) and `esftctl bench
serve` (esftctl.bench.serve_slices: GROUP is the grid's key and the device, PART an adapter count or the
microbenchmarks).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Iterable

import numpy as np

from esftctl.errors import EsftError
from esftctl.jsonfile import read_json, write_json

PREPARE_S = 120  # generating a base on the GPU (31-41 GB into /dev/shm) when it is not there yet


@dataclass(frozen=True)
class Slice:
    group: str  # what the servers of a slice share: the paging bench's regime, bench serve's grid and device
    server: str
    round: int
    part: str = ""  # a share of the server's round (bench serve: one adapter count, or "micro"); "": all of it

    @property
    def name(self) -> str:
        return f"{self.part}.r{self.round}" if self.part else f"r{self.round}"

    @property
    def label(self) -> str:
        return f"{self.group}/{self.server} {self.name}"

    def path(self, out: Path, model: str) -> Path:
        return Path(out) / "slices" / model / self.group / self.server / f"{self.name}.json"


def machine_id() -> str:
    """The machine a slice runs on: the GPU's UUID (the host's name on the CPU build) and the host kernel's boot,
    so that the same card after a reboot counts as another machine, and another card surely does."""
    import platform

    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        card = str(getattr(props, "uuid", "") or props.name)
    else:
        card = platform.node()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{card}/{boot}"


def pair_by_round(runs: list[tuple[int, str | None]], anchors: list[tuple[int, str | None]], *,
                  same_machine: bool = False) -> list[tuple[int, list[int]]]:
    """Runs and anchor runs as (round, machine): for each run that has anchor runs of its round (the same traffic),
    on its own machine where `same_machine` (pair_by_machine), its index and theirs."""
    def pairs(rnd: int, machine: str | None, r: int, m: str | None) -> bool:
        return r == rnd and (not same_machine or (machine is not None and m == machine))
    return [(i, same) for i, (rnd, machine) in enumerate(runs)
            if (same := [j for j, (r, m) in enumerate(anchors) if pairs(rnd, machine, r, m)])]


def pair_by_machine(runs: list[tuple[int, str | None]], anchors: list[tuple[int, str | None]]
                    ) -> list[tuple[int, list[int]]]:
    """pair_by_round on each run's own machine (the same traffic on the same card). A run of no known machine
    (slices written before machines were recorded) pairs with nothing, and neither does one whose machine ran the
    anchor on other rounds only: another round's traffic differs by more than the servers do at low load."""
    return pair_by_round(runs, anchors, same_machine=True)


def ratio_by_run(runs: list[tuple[int, str | None, float | None]], anchors: list[tuple[int, str | None, float | None]],
                 pairs: Callable = pair_by_machine) -> dict[int, float | None]:
    """Runs and anchor runs as (round, machine, value): for each run that pairs (`pairs`: pair_by_machine, or
    pair_by_round), its index -> its value over the median of the anchor values it pairs with, None where a value
    is missing."""
    return {i: runs[i][2] / statistics.median(anchors[j][2] for j in js)
            if runs[i][2] is not None and all(anchors[j][2] for j in js) else None
            for i, js in pairs([r[:2] for r in runs], [a[:2] for a in anchors])}


def ratios_within_machines(runs: list[tuple[int, str | None, float | None]],
                           anchors: list[tuple[int, str | None, float | None]],
                           pairs: Callable = pair_by_machine) -> list[float]:
    """ratio_by_run's ratios, for the runs that pair and whose values are all there."""
    return [v for v in ratio_by_run(runs, anchors, pairs).values() if v is not None]


def clustered_median(groups: list[list[float]], *, draws: int = 2000, seed: int = 0
                     ) -> tuple[float, float, float] | None:
    """The median of every group's values pooled, with a 95% interval from a two-level bootstrap (the groups drawn
    with replacement, then each drawn group's values): a group is one round's paired requests, which share their
    servers' starts, so the interval widens with what differs between rounds as well as between requests. With one
    group it covers the requests only. None without values."""
    groups = [np.asarray(g, dtype=np.float64) for g in groups if len(g)]
    if not groups:
        return None
    rng = np.random.default_rng(seed)
    medians = np.empty(draws)
    for d in range(draws):
        picked = rng.integers(len(groups), size=len(groups))
        medians[d] = np.median(np.concatenate([rng.choice(groups[k], size=len(groups[k])) for k in picked]))
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(np.concatenate(groups))), float(low), float(high)


COPY = "on-"  # the part of an anchor's run of a round it has already: the same traffic on one more machine


def copy_part(machine: str) -> str:
    """The part that names an anchor's run of a round on `machine`, beside the round's planned slice (which ran
    elsewhere): `on-` and a hash of the machine, so that the cards of one host never write the same file."""
    return COPY + hashlib.sha256(machine.encode()).hexdigest()[:8]


def measured_part(part: str) -> str:
    """What a slice's part runs: a copy runs its whole round, like the planned slice it repeats."""
    return "" if part.startswith(COPY) else part


def anchored(todo: list[Slice], *, out: Path, model: str, machine: str, anchors: dict[str, tuple[str, ...]],
             needs_anchor: Callable[[Slice], bool] = lambda sl: True) -> list[Slice]:
    """`todo` so ordered that every slice that `needs_anchor` follows a run of its round by its group's anchor
    servers (`anchors`: group -> servers) on this machine: where this machine has none (written, or earlier in
    the order), the anchor's planned slice of that round is put before it if it is not written yet, else a run of
    the round once more (part copy_part(machine)). Rounds whose anchor runs here anyway (its slice still to run,
    or run here) go first, in their order: a machine that measures them pays for no extra anchor run."""
    here = {(group, key, d.get("round")) for group, keys in anchors.items() for key in keys
            for d in map(read_slice, sorted(Slice(group, key, 0).path(out, model).parent.glob("*.json")))
            if d.get("machine") == machine and measured_part(d.get("part", "")) == ""}  # not the microbenchmarks
    planned = {(t.group, t.server, t.round) for t in todo if t.server in anchors.get(t.group, ()) and not t.part}
    anyway = here | planned

    def cheap(sl: Slice) -> bool:
        return all((sl.group, key, sl.round) in anyway for key in anchors.get(sl.group, ()))

    ordered: list[Slice] = []
    for sl in sorted(todo, key=lambda sl: not cheap(sl)):  # stable
        keys = anchors.get(sl.group, ())
        if sl.server in keys:
            if measured_part(sl.part) == "":
                here.add((sl.group, sl.server, sl.round))
        elif needs_anchor(sl):
            for key in keys:
                if (sl.group, key, sl.round) not in here:
                    own = Slice(sl.group, key, sl.round)
                    written = own.path(out, model).exists()
                    ordered.append(Slice(sl.group, key, sl.round, copy_part(machine)) if written else own)
                    here.add((sl.group, key, sl.round))
        if sl not in ordered:
            ordered.append(sl)
    return ordered


def anchor_runs(ordered: list[Slice], anchors: dict[str, tuple[str, ...]],
                needs_anchor: Callable[[Slice], bool] = lambda sl: True) -> Callable[[Slice], tuple[Slice, ...]]:
    """run_pending's `after` for an `anchored` order: for each slice that needs an anchor, the anchor runs of its
    round that the order holds (this machine's to run). Such a slice waits while one of them is not written: with
    its anchor passed over for the budget, it would pair with no base run on its machine."""
    def after(sl: Slice) -> tuple[Slice, ...]:
        keys = anchors.get(sl.group, ())
        if sl.server in keys or not needs_anchor(sl):
            return ()
        return tuple(a for a in ordered if (a.group, a.round) == (sl.group, sl.round) and a.server in keys
                     and measured_part(a.part) == "")
    return after


def slice_order(groups: dict[str, tuple[str, ...]], rounds: int,
                parts: Callable[[str], tuple[str, ...]] = lambda server: ("",)) -> list[Slice]:
    """Every slice, round by round: in round r each group's servers rotated by r (interleaved repeats), and each
    server's parts too, so that no part is always the first after its server's start (a part always run first
    carries whatever a fresh start costs: once it was the round's one outlying TTFT)."""
    def rotated(items: tuple[str, ...], r: int) -> tuple[str, ...]:
        k = r % len(items)
        return items[k:] + items[:k]
    return [Slice(group, s, r, p) for r in range(rounds) for group, servers in groups.items()
            for s in rotated(servers, r) for p in rotated(parts(s), r)]


def pending(order: Iterable[Slice], out: Path, model: str) -> list[Slice]:
    """The slices of `order` whose file is not there yet."""
    return [s for s in order if not s.path(out, model).exists()]


def read_slice(path: Path) -> dict:
    """One slice file; one line naming the file if it is not a slice (esftctl.errors.EsftError)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise EsftError("not a slice of a bench (a JSON object was expected)", path)
    return data


def load_slices(root: Path, pattern: str) -> list[dict]:
    """Every slice file under `root` matching `pattern`, in path order."""
    return [read_slice(p) for p in sorted(Path(root).glob(pattern))]


def measured_walls(folder: Path, part: str | None = None) -> list[float]:
    """Wall seconds of the slices written in `folder` (one server's), of one part only when `part` is given;
    slices that failed are left out (their time says nothing of a slice that runs)."""
    names = sorted(Path(folder).glob("*.json"))
    done = [read_slice(p) for p in names]
    return [d.get("wall_s", 0.0) for d in done if not d.get("error")
            and (part is None or d.get("part", "") == part)]


def batches(todo: list[Slice], together: Callable[[Slice, Slice], bool]) -> list[list[Slice]]:
    """`todo` cut into runs of consecutive slices that one server start serves (`together(a, b)`: b may follow a
    on a's server)."""
    out: list[list[Slice]] = []
    for sl in todo:
        if out and together(out[-1][-1], sl):
            out[-1].append(sl)
        else:
            out.append([sl])
    return out


def run_pending(todo: list[Slice], *, out: Path, model: str, budget_s: float,
                estimate_s: Callable[[Slice, bool], float], run: Callable[[list[Slice]], Generator[dict, None, None]],
                setup_s: float = 0.0, on_step: Callable[[str], None] = lambda msg: None,
                together: Callable[[Slice, Slice], bool] = lambda a, b: False,
                after: Callable[[Slice], tuple[Slice, ...]] = lambda sl: ()) -> list[Slice]:
    """Run the slices of `todo` in order, each one whose estimate fits what is left of `budget_s`: estimate_s(sl, warm),
    warm when its server is up already, and the first to run also `setup_s` (what its run prepares first). One that does
    not fit is passed over for later ones that do (stopping at the first that does not fit would leave most of a short
    budget unused behind one long slice). Consecutive slices that `together` pairs share one server start (batches):
    `run(batch)` yields their results in order and is closed, which stops its server, after the last or before one that
    does not fit (the rest of its batch then waits for a later run); when it ends early (a slice failed and was written
    so), the rest of its batch gets a start of its own. A slice waits, like one that does not fit, while a slice `after`
    names for it is not written (anchor_runs). Each result is written atomically to its path as soon as it is there.
    Returns the slices that ran; a slice that raises stops the run with nothing written for it."""
    started, ran = time.monotonic(), []
    queue = batches(todo, together)
    while queue:
        batch, results, taken = queue.pop(0), None, 0
        try:
            for i, sl in enumerate(batch):
                left = budget_s - (time.monotonic() - started)
                need = estimate_s(sl, results is not None) + (0.0 if ran else setup_s)
                unwritten = [a.label for a in after(sl) if not a.path(out, model).exists()]
                if need > left or unwritten:
                    on_step(f"passed over: {sl.label} " + (f"waits for {unwritten[0]}, which did not run" if unwritten
                                                           else f"needs about {need:.0f} s, {left:.0f} s left"))
                    if results is None:
                        continue
                    break
                if results is None:
                    results = run(batch[i:])
                result = next(results, None)
                if result is None:  # its server stopped (a failure, written as the slice before): a new start
                    if taken:
                        queue.insert(0, batch[i:])
                    break
                write_json(sl.path(out, model), result)
                ran.append(sl)
                taken += 1
        finally:
            if results is not None:
                results.close()
    return ran
