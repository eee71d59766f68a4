"""Each request's TPOT (or TTFT) over plain vLLM's beside the expert rows its steps read (issue 29).

Why: esftctl's 20 adapters on an H100 (2026-12-05) gave TPOT 1.004, 1.017 and 1.031x plain vLLM's at 1, 2 and 5
requests/s, request by request: the cost rises with load. A decode step reads every expert row some token routes
to. A token of adapter a routed to an expert that a replaced reads a's row, and the base's row is still read if
another token needs it. So adapters add rows only where several sequences decode together. If that is the cost,
a request's TPOT ratio follows the rows of the steps it decoded in, and a request that decoded alone pays nothing.
This sets each request's measured ratio beside the rows the sequences around it predict.

The rows, for the generated model's router (about uniform: top-k of E), each bundle file f replacing k_f experts of a
layer at random. A step of n_0 base sequences and n_a of each adapter name a reads, in expectation,
    E (1 - q^n_0 prod_f (r_f + (1 - r_f) q^n_f)) + E sum_a r_a (1 - q^n_a)
rows a layer, with q = 1 - k/E, r_f = k_f/E, n_f the sequences of the names on file f, and r_a its file's: names on
one file replace the same experts, so the base's row of one of them is skipped unless some other name's token needs
it, while each name reads its own copies (the server loads each name into its own slot). The base alone with n
sequences reads E (1 - q^n). (benchmarks/lab/rows_model.py draws the same by simulation.) The bundles of `bench
serve --adapter-shape deepseek` have 83 to 153 experts over the 26 layers (esftctl.bench.serve_models.
esft_sized_totals): k_f is file f's total / 26. The grid's names i and i + 10 share file i mod 10.

For each request of an esftctl run, the rows excess over the base (rows / base rows - 1) is averaged over its decode,
from its first token to its last in that run, with the sequences then decoding (their adapters from the run's
draw). Its TPOT ratio is over the same request in plain vLLM's base run of its round on its machine
(esftctl.bench.load.request_ratios). The share s of a step that moves with the rows is fitted through the origin:
ratio - 1 = s x excess. Decode steps only: prefill steps and the prompts' own rows are left out.
Requests that decoded alone (no other sequence from their first token to their last) read the base's rows, so their
ratio is what an adapter costs a step without rows: a fixed cost, or the server's start (Inductor's per-process picks).
`--ttft` sets each request's TTFT ratio beside the rows of the step that prefilled it instead: its prompt (every
expert, its adapter's copies where it replaced one) with the sequences decoding halfway through its wait. A prompt
prefilled alone reads the base's rows; beside adapters' decodes it reads their copies and the base rows they replace
(side by side on an H100, 2026-12-05: TTFT 1.00-1.01x for prompts prefilled alone, 1.03-1.06x where the step read 3%
more rows or more).
It reads a grid's slices, or side_by_side.py's JSON, where each esftctl run pairs with both plain vLLM runs of its
round on the same card. The rows are those of the sequences in flight, as an ungrouped server steps them: a run
served with `--group-adapters` held some back, so its steps read fewer than this predicts.
Usage: python benchmarks/lab/tpot_rows.py benchmarks/serve-bench/slices/<model>/<grid>/<device> [--ttft]
         [--server esftctl|admitted-0|max-loras-K] [--json]
       python benchmarks/lab/tpot_rows.py benchmarks/serve-bench/side-by-side/<file>.json [--ttft] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import NamedTuple

from ttft_runs import base_runs

from esftctl.bench.load import request_ratios
from esftctl.bench.serve import PROFILES
from esftctl.bench.serve_models import esft_sized_totals
from esftctl.bench.serve_runs import Scenario
from esftctl.bench.slices import load_slices

E, TOP_K, LAYERS = 64, 6, 26  # DeepSeek-V2-Lite's routed experts, top-k and MoE layers
BUCKETS = (0.0, 0.005, 0.015, 0.03, 0.05)  # predicted rows excess, lower bounds


class Swap(NamedTuple):
    """What one adapter name replaces: its bundle file, and the experts a layer that file replaces."""

    file: int
    experts: float


def adapter_experts(adapters: int, distinct: int = 10) -> list[Swap]:
    """Each grid name's file and experts a layer (bench serve's DeepSeek-sized bundles, name i on file
    i mod distinct)."""
    totals = esft_sized_totals(min(adapters, distinct))
    return [Swap(i % len(totals), totals[i % len(totals)] / LAYERS) for i in range(adapters)]


def rows(counts: dict[int | None, int], replaced: list[Swap]) -> float:
    """Expected distinct rows a layer for `counts` sequences a name (None: base requests), uniform routing."""
    q = 1 - TOP_K / E
    on_file: dict[int, tuple[float, int]] = {}  # file: (its share of the experts, its names' sequences)
    own = 0.0
    for a, n in counts.items():
        if a is None:
            continue
        r = replaced[a].experts / E
        on_file[replaced[a].file] = (r, on_file.get(replaced[a].file, (r, 0))[1] + n)
        own += r * (1 - q ** n)
    miss = q ** counts.get(None, 0)
    for r, n in on_file.values():
        miss *= r + (1 - r) * q ** n
    return E * (1 - miss) + E * own


def excess(counts: dict[int | None, int], replaced: list[Swap]) -> float:
    """rows / the base's rows for as many sequences, less 1: never below 0 (every token reads one row of each
    expert it routes to, a copy or the base's), so rounding's -1e-16 is 0 and lands in the first bucket."""
    n = sum(counts.values())
    return max(0.0, rows(counts, replaced) / rows({None: n}, replaced) - 1) if n else 0.0


def decode_spans(requests: dict) -> list[tuple[float, float] | None]:
    """Each request's decode, from its first token to its last (s from the run's first send); None where it did
    not complete."""
    return [(s + t / 1000, s + lat / 1000) if 0 < t < lat else None
            for s, t, lat in zip(requests["start_s"], requests["ttft_ms"], requests["latency_ms"])]


def decode_excess(requests: dict, drawn: list[int], replaced: list[Swap]) -> list[tuple[float, float] | None]:
    """Per request: (the rows excess averaged over its decode, the mean sequences decoding then), None where it did
    not complete."""
    spans = decode_spans(requests)
    out = []
    for span in spans:
        if span is None:
            out.append(None)
            continue
        lo, hi = span
        cuts = sorted({lo, hi, *(x for sp in spans if sp for x in sp if lo < x < hi)})
        area = seqs = 0.0
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            counts: dict[int | None, int] = {}
            for sp, name in zip(spans, drawn):
                if sp and sp[0] <= mid < sp[1]:
                    counts[name] = counts.get(name, 0) + 1
            area += (b - a) * excess(counts, replaced)
            seqs += (b - a) * sum(counts.values())
        out.append((area / (hi - lo), seqs / (hi - lo)))
    return out


def prefill_excess(requests: dict, drawn: list[int], replaced: list[Swap],
                   prompt_len: int) -> list[tuple[float, float] | None]:
    """Per request: (the rows excess of the step that prefilled it, the sequences in that step counting its prompt),
    None where it did not complete. The step is taken halfway through its wait for the first token."""
    spans = decode_spans(requests)
    out = []
    for start, span, name in zip(requests["start_s"], spans, drawn):
        if span is None:
            out.append(None)
            continue
        mid = (start + span[0]) / 2
        counts: dict[int | None, int] = {name: prompt_len}
        decoding = 0
        for sp, other in zip(spans, drawn):
            if sp and sp[0] <= mid < sp[1]:
                counts[other] = counts.get(other, 0) + 1
                decoding += 1
        out.append((excess(counts, replaced), 1 + decoding))
    return out


def record(scenario: dict, rnd: int, requests: dict, anchors: list[dict], drawn: list[int], *, output_len: int,
           prompt_len: int, kind: str) -> dict | None:
    """One esftctl run against plain vLLM's runs of the same traffic (`anchors`): each request's ratio of `kind`
    (TPOT or TTFT) over each anchor, beside the rows excess of its decode (decode_excess) or its prefill
    (prefill_excess) and the sequences in those steps; None where no request pairs."""
    replaced = adapter_experts(scenario["adapters"])
    predicted = (decode_excess(requests, drawn, replaced) if kind == "tpot"
                 else prefill_excess(requests, drawn, replaced, prompt_len))
    kept = [(r, p) for anchor in anchors
            for r, p in zip(request_ratios(requests, anchor, output_len, aligned=True)[kind], predicted)
            if r is not None and p is not None]
    if not kept:
        return None
    return {"scenario": scenario["name"], "round": rnd, "rate": scenario["rate"], "ratios": [r for r, _ in kept],
            "excess": [p[0] for _, p in kept], "seqs": [p[1] for _, p in kept]}


def paired(folder: Path, kind: str = "tpot", server: str = "esftctl") -> list[dict]:
    """Every run of `server` (its slices' folder: esftctl, admitted-0, max-loras-4, ...) under `folder` that pairs
    with a base run of its round on its machine (record)."""
    bases, out = base_runs(folder), []
    for s in load_slices(folder / server, "*.json"):
        profile = s.get("profile", {})
        for run in s.get("runs", []):
            scenario = run["scenario"]
            anchor = bases.get((s.get("machine"), run["round"], scenario["rate"]))
            requests = run.get("requests") or {}
            if anchor and requests.get("start_s") and scenario.get("adapters"):
                out.append(record(scenario, run["round"], requests, [anchor], run["drawn"], kind=kind,
                                  output_len=profile.get("output_len", 0), prompt_len=profile.get("input_len", 0)))
    return [r for r in out if r]


def paired_side(path: Path, kind: str = "tpot") -> list[dict]:
    """side_by_side.py's esftctl runs, each against both plain vLLM runs of its round (pooled, as side_by_side
    pools them); each run's adapters as it kept them ("drawn"), or for a run kept before it did, drawn again as
    side_by_side drew them (Scenario.draw)."""
    data = json.loads(path.read_text())
    args = data["args"]
    adapters, alpha, profile = int(args["adapters"]), float(args["alpha"]), PROFILES[args["model"]]
    out = []
    for rate, rounds in data.get("rounds", {}).items():
        scenario = Scenario(f"{adapters} adapters @ {rate} rps", float(rate), adapters=adapters, alpha=alpha)
        for rnd, runs in enumerate(rounds):
            requests = runs["esftctl"]
            drawn = requests.get("drawn") or scenario.draw(rnd, len(requests["start_s"]))
            out.append(record({"name": scenario.name, "rate": scenario.rate, "adapters": adapters}, rnd, requests,
                              [runs["plain"], runs["plain again"]], drawn, kind=kind,
                              output_len=profile.output_len, prompt_len=profile.input_len))
    return [r for r in out if r]


def fit(runs: list[dict]) -> float:
    """s in ratio - 1 = s x excess, least squares through the origin over every request (0 where no request's
    steps read extra rows)."""
    xs = [x for r in runs for x in r["excess"]]
    ys = [y - 1 for r in runs for y in r["ratios"]]
    spread = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / spread if spread else 0.0


def buckets(runs: list[dict]) -> list[dict]:
    pairs = [(x, y) for r in runs for x, y in zip(r["excess"], r["ratios"])]
    out = []
    for lo, hi in zip(BUCKETS, (*BUCKETS[1:], float("inf"))):
        inside = [(x, y) for x, y in pairs if lo <= x < hi]
        if inside:
            out.append({"from": lo, "to": hi, "requests": len(inside),
                        "excess": statistics.median(x for x, _ in inside),
                        "ratio": statistics.median(y for _, y in inside)})
    return out


def alone(runs: list[dict]) -> dict | None:
    """The requests that decoded (or were prefilled) alone, one sequence in their steps: how many, their median
    ratio."""
    ratios = [y for r in runs for y, n in zip(r["ratios"], r["seqs"]) if abs(n - 1) < 1e-9]
    return {"requests": len(ratios), "ratio": statistics.median(ratios)} if ratios else None


def load_runs(source: Path, kind: str = "tpot", server: str = "esftctl") -> list[dict]:
    """The paired runs of a grid folder (paired, `server`'s slices) or of side_by_side.py's JSON (paired_side);
    SystemExit with one line naming `source` where it is neither."""
    if source.is_file():
        try:
            return paired_side(source, kind)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {source}: not side_by_side.py's JSON ({type(e).__name__}: {e})") from None
    if not (source / "base").is_dir() or not (source / server).is_dir():
        raise SystemExit(f"error: {source}: needs base/ and {server}/ folders of slices, or side_by_side.py's JSON")
    return paired(source, kind, server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path,
                        help="a grid's slices on one device (.../slices/<model>/<grid>/<device>), or side_by_side.py's "
                             "JSON")
    parser.add_argument("--ttft", action="store_true",
                        help="TTFT beside the rows of each request's prefill step, instead of TPOT beside its decode's")
    parser.add_argument("--server", default="esftctl",
                        help="in a grid, which server's slices (its folder: esftctl, admitted-0 for vLLM's order, "
                             "max-loras-K, grouped-G-W, ...)")
    parser.add_argument("--json", action="store_true", help="the runs, buckets and fit as JSON instead of tables")
    args = parser.parse_args()
    kind = "ttft" if args.ttft else "tpot"
    runs = load_runs(args.source, kind, args.server)
    if not runs:
        raise SystemExit(f"error: {args.source}: no {args.server} run pairs with a plain vLLM run of its round on its "
                         "machine")
    s = fit(runs)
    summary = [{"scenario": r["scenario"], "round": r["round"], "requests": len(r["ratios"]),
                "seqs": statistics.mean(r["seqs"]), "excess": statistics.median(r["excess"]),
                "ratio": statistics.median(r["ratios"]), "predicted": 1 + s * statistics.median(r["excess"])}
               for r in runs]
    if args.json:
        print(json.dumps({"share": s, "runs": summary, "buckets": buckets(runs), "alone": alone(runs)}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    name, steps = ("TPOT", "decode steps") if kind == "tpot" else ("TTFT", "prefill step")
    t = Table(title=f"each esftctl run: sequences in a request's {steps} (mean), the rows excess they read (median "
                    f"over requests), its {name} over plain vLLM's same request (median), and 1 + s x excess with "
                    f"s = {s:.2f} fitted over every request", title_justify="left")
    for col in ("scenario", "round", "requests", "sequences", "rows excess", f"{name} x", "1 + s x excess"):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    for r in summary:
        t.add_row(r["scenario"], str(r["round"]), str(r["requests"]), f"{r['seqs']:.1f}", f"{r['excess']:+.2%}",
                  f"{r['ratio']:.3f}", f"{r['predicted']:.3f}")
    b = Table(title=f"every request by its predicted rows excess: the median {name} ratio", title_justify="left")
    for col in ("rows excess", "requests", "median excess", f"{name} x"):
        b.add_column(col, justify="right")
    for row in buckets(runs):
        b.add_row(f"{row['from']:.1%}-{row['to']:.1%}", str(row["requests"]), f"{row['excess']:+.2%}",
                  f"{row['ratio']:.3f}")
    if lone := alone(runs):
        b.add_row("of which alone", str(lone["requests"]), f"{0:+.2%}",
                  f"{lone['ratio']:.3f}")
    Console(width=160).print(t, b)


if __name__ == "__main__":
    main()
