"""TTFT at all-at-once load, wave by wave (issue 29): which requests were prefilled before any finished, when their
first tokens came, and how the first tokens of one engine step reached the clients.

Why: with more requests at once than vLLM's --max-num-seqs, vLLM admits a first wave, and the rest wait for slots
that finishing requests free. TTFT's median then falls between the waves, one or two requests deciding it (bench
serve's 256 over 128 slots, H100, 2026-12-06: 1.61x plain vLLM's by the median, 1.30x by the mean). And where two
servers differ, the waves say where: on that H100 esftctl admitted by adapter had its first wave's first tokens at
a mean of 1,116 ms against 763 in vLLM's order, its steps of 32 prompts 169-189 ms apart against 90-123, and the
first prompt's at 237 ms against 125 (forty-second session); two more starts of each on another H100 put the first
waves at 577 and 549 ms against 590 and 623, and the excess in the second wave (3,106-3,120 ms against 3,324-3,333
and the base's 2,710), so that slow wave was the start, not the order (benchmarks/RESULTS.md, forty-third session).
The first wave is the requests whose first token came before the first request finished (no slot was freed before
them). A delivery is a run of first tokens each within --gap ms of the one before: one engine step's prompts, as the
API server handed them out, so its spread is the API server's time, and the gaps between deliveries the engine's
steps. Times run from the run's first send, not each request's: the client takes 30-80 ms to send 256, which TTFT
carries.
Usage: python benchmarks/lab/ttft_waves.py benchmarks/serve-bench/slices/<model>/<grid>/<device> [--gap 8]
         [--json]    (every server's runs at rate inf)
       python benchmarks/lab/ttft_waves.py benchmarks/serve-bench/side-by-side/<file>.json [--gap 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from side_by_side import ARMS, completed

from esftctl.bench.slices import load_slices

DELIVERIES = 6  # the first wave's first deliveries shown


def waves(requests: dict, gap_ms: float = 8.0) -> dict | None:
    """A run's waves from its requests (start_s, ttft_ms, latency_ms): times in ms from its first send, and the TTFT
    of the request sent first (it meets an idle server, unless others sent after it reached vLLM first); None without
    a completed request."""
    done = completed(requests)
    if not done:
        return None
    t0 = min(s for s, _, _ in done)
    first = sorted((s - t0) * 1000 + t for s, t, _ in done)
    finished = min((s - t0) * 1000 + lat for s, _, lat in done)
    ttft = [t for _, t, _ in done]
    wave = [f for f in first if f < finished]
    rest = first[len(wave):]
    return {"requests": len(done), "ttft_mean": statistics.fmean(ttft), "ttft_median": statistics.median(ttft),
            "first_sent": min(done, key=lambda d: d[0])[1], "first_finish": finished, "wave": _span(wave),
            "rest": _span(rest), "deliveries": deliveries(wave, gap_ms)}


def deliveries(first_tokens: list[float], gap_ms: float) -> list[dict]:
    """First tokens (sorted, ms) in runs each within `gap_ms` of the one before: [{at, spread, count}]."""
    out: list[list[float]] = []
    for f in first_tokens:
        if out and f - out[-1][-1] <= gap_ms:
            out[-1].append(f)
        else:
            out.append([f])
    return [{"at": d[0], "spread": d[-1] - d[0], "count": len(d)} for d in out]


def _span(times: list[float]) -> dict | None:
    return {"count": len(times), "from": times[0], "to": times[-1], "mean": statistics.fmean(times)} if times else None


def _cell(span: dict | None) -> str:
    return f"{span['count']}: {span['from']:.0f}-{span['to']:.0f}" if span else "-"


def runs_of(source: Path) -> list[tuple[str, str, dict]]:
    """(server, run label, requests) for every all-at-once run of a grid's device folder or side_by_side.py's JSON;
    SystemExit with one line naming `source` where it is neither."""
    if source.is_file():
        try:
            data = json.loads(source.read_text())
            return [(arm, f"round {i}", run[arm]) for i, run in enumerate(data["rounds"].get("inf", []))
                    for arm in ARMS]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"error: {source}: not side_by_side.py's JSON ({type(e).__name__}: {e})") from None
    if not source.is_dir():
        raise SystemExit(f"error: {source}: not a grid's device folder or side_by_side.py's JSON")
    out = []
    for folder in sorted(p for p in source.iterdir() if p.is_dir()):
        for s in load_slices(folder, "*.json"):
            for run in s.get("runs", []):
                if math.isinf(run["scenario"]["rate"]) and (run.get("requests") or {}).get("start_s"):
                    out.append((folder.name, f"{run['scenario']['name']} r{run['round']}", run["requests"]))
    return out


def table(rows: list[tuple[str, str, dict]]):
    from rich.table import Table

    t = Table(title="all at once, by wave: times in ms from the run's first send; wave 1: first tokens before the "
                    "first request finished; deliveries: first tokens each within the gap of the one before (one "
                    "engine step's prompts, spread by the API server), at / spread / count", title_justify="left")
    for col in ("server", "run", "req", "TTFT mean", "TTFT median", "first sent's", "wave 1", "its mean", "rest",
                "its mean", "wave 1's deliveries"):
        t.add_column(col, justify="left" if col in ("server", "run", "wave 1's deliveries") else "right")
    for server, label, w in rows:
        t.add_row(server, label, str(w["requests"]), f"{w['ttft_mean']:.0f}", f"{w['ttft_median']:.0f}",
                  f"{w['first_sent']:.0f}", _cell(w["wave"]), f"{w['wave']['mean']:.0f}" if w["wave"] else "-",
                  _cell(w["rest"]), f"{w['rest']['mean']:.0f}" if w["rest"] else "-",
                  ", ".join(f"{d['at']:.0f}/{d['spread']:.0f}/{d['count']}" for d in w["deliveries"][:DELIVERIES]))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a grid's slices on one device (.../slices/<model>/<grid>/<device>), "
                                                  "or side_by_side.py's JSON")
    parser.add_argument("--gap", type=float, default=8.0, help="ms between first tokens of one delivery, at most")
    parser.add_argument("--json", action="store_true", help="the waves as JSON instead of a table")
    args = parser.parse_args()
    if not args.gap > 0:
        raise SystemExit("error: --gap takes milliseconds above 0")
    rows = [(server, label, w) for server, label, requests in runs_of(args.source)
            if (w := waves(requests, args.gap)) is not None]
    if not rows:
        raise SystemExit(f"error: {args.source}: no all-at-once run with kept requests")
    if args.json:
        print(json.dumps([{"server": s, "run": label, **w} for s, label, w in rows], indent=1))
        return
    from rich.console import Console

    Console(width=220).print(table(rows))


if __name__ == "__main__":
    main()
