"""Where a run's TTFT excess sits (issue 29): each run of a grid's slices against plain vLLM's base run of its round
on its machine, request by request (esftctl.bench.load.request_ratios), cut by sixth of the run, by adapter, and
by whether the prompt met other requests.

Why: on one H200 (2026-12-04) esftctl's TTFT came to 1.02x-1.15x plain vLLM's request by request, with no
pattern in the adapter count, the runs of one server start included. An excess that sits in some requests (each
adapter's first, say: vLLM's LoRA bookkeeping in the step that prefills it) shows in the cuts as one high cell;
one that moves the whole run shows in every sixth and every adapter alike, and then the run's minute moved it, not
the code its requests ran through. A prompt with no other request in flight from its arrival to its first token, in
both servers' runs, is prefilled alone: it reads the rows the base reads, so an excess that other requests bring
(the rows a step adds where a prompt meets adapters' decodes, queueing behind them) leaves it out. The machine's
state over the run (esftctl.bench.conditions), where the slice recorded it, sits at the end of the line.
Usage: python benchmarks/lab/ttft_runs.py benchmarks/serve-bench/slices/<model>/<grid>/<device> [--base DIR]
[--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from esftctl.bench.load import request_ratios
from esftctl.bench.serve_report import number
from esftctl.bench.slices import load_slices

PARTS = 6


def base_runs(folder: Path) -> dict[tuple, dict]:
    """Plain vLLM's base runs under `folder`/base by (machine, round, rate): each run's kept requests."""
    out = {}
    for s in load_slices(folder / "base", "*.json"):
        for run in s.get("runs", []):
            out.setdefault((s.get("machine"), run["round"], run["scenario"]["rate"]), run.get("requests") or {})
    return out


def cuts(run: dict, base: dict, output_len: int) -> dict | None:
    """One run against its base run: the TTFT ratios' median, the medians of each sixth of the run (in sending
    order), of each adapter's requests (fewest 3), of each adapter's first request against its later ones, and of
    the prompts prefilled alone in both runs against the others."""
    ratios_of = request_ratios(run.get("requests") or {}, base, output_len, aligned=True)
    each, lone = ratios_of["ttft"], ratios_of["ttft_alone"]
    drawn = run.get("drawn") or [0] * len(each)
    kept = [(adapter, ratio) for adapter, ratio in zip(drawn, each) if ratio is not None]  # both servers completed
    if not kept:  # unpaired: not the same traffic
        return None
    ratios = [ratio for _, ratio in kept]
    size = -(-len(ratios) // PARTS)
    by_adapter: dict[int, list[float]] = {}
    first, later = [], []
    for adapter, ratio in kept:
        (later if adapter in by_adapter else first).append(ratio)
        by_adapter.setdefault(adapter, []).append(ratio)
    adapters = [statistics.median(v) for v in by_adapter.values() if len(v) >= 3]
    alone = [r for r in lone if r is not None]
    beside = [r for r, a in zip(each, lone) if r is not None and a is None]
    return {"median": statistics.median(ratios),
            "sixths": [statistics.median(ratios[k:k + size]) for k in range(0, len(ratios), size)],
            "adapters": [min(adapters), max(adapters)] if adapters else None,
            "first": statistics.median(first), "later": statistics.median(later) if later else None,
            "alone": _median(alone), "beside": _median(beside), "alone_requests": len(alone),
            "requests": len(ratios), "sm_mhz": (run.get("result") or {}).get("gpu_sm_mhz")}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def lines(folder: Path, base: Path | None = None) -> list[dict]:
    """Every non-base run under `folder` that pairs with a base run (under `base`, else `folder`), in the order the
    slices ran them."""
    bases = base_runs(base or folder)
    out = []
    for server in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "base"):
        for s in load_slices(server, "*.json"):
            output_len = s.get("profile", {}).get("output_len", 0)
            for place, run in enumerate(s.get("runs", [])):  # a slice lists its runs in the order they ran
                anchor = bases.get((s.get("machine"), run["round"], run["scenario"]["rate"]))
                c = cuts(run, anchor, output_len) if anchor else None
                if c:
                    out.append({"server": server.name, "scenario": run["scenario"]["name"], "round": run["round"],
                                "finished": s.get("finished", 0), "place": place, **c})
    return sorted(out, key=lambda x: (x["server"], x["finished"], x["place"]))


def table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="TTFT over plain vLLM's same request (its base run of the round on the machine): the run's median, "
                    "each sixth of the run's medians in sending order, the adapters' medians (low-high; 3 requests "
                    "or more), each adapter's first request against its later ones, the prompts prefilled alone in "
                    "both runs (their count) against those that met others; SM MHz: the card's mean clock over the "
                    "run where the slice kept it", title_justify="left")
    for col in ("server", "scenario", "round", "requests", "TTFT x", "by sixth", "adapters", "first", "later",
                "alone", "beside", "SM MHz"):
        t.add_column(col, justify="left" if col in ("server", "scenario", "by sixth") else "right")
    for r in rows:
        t.add_row(r["server"], r["scenario"], str(r["round"]), str(r["requests"]), f"{r['median']:.3f}",
                  " ".join(f"{x:.2f}" for x in r["sixths"]),
                  "-" if not r["adapters"] else f"{r['adapters'][0]:.2f}-{r['adapters'][1]:.2f}",
                  f"{r['first']:.3f}", number(r["later"], ".3f"),
                  "-" if r["alone"] is None else f"{r['alone']:.3f} ({r['alone_requests']})",
                  number(r["beside"], ".3f"),
                  number(r["sm_mhz"], ".0f"))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a grid's slices on one device: .../slices/<model>/<grid>/<device>")
    parser.add_argument("--base", type=Path, help="the folder whose base/ holds plain vLLM's runs (default: FOLDER; "
                                                   "for stale-slices/, the live grid's)")
    parser.add_argument("--json", action="store_true", help="the lines as JSON instead of the table")
    args = parser.parse_args()
    base = args.base or args.folder
    if not (base / "base").is_dir():
        raise SystemExit(f"error: {base}: no base/ folder of plain vLLM's runs")
    rows = lines(args.folder, base)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console

    Console(width=200).print(table(rows))


if __name__ == "__main__":
    main()
