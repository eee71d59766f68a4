"""`esftctl bench consolidate`: quality of consolidated variants against their own models and weight averaging.

On the tiny world (the paper's Figure 5 experiment, scaled down): every task gets a fully fine-tuned variant
of the base (cached under the world); for the first 2, 3 and 4 variants, `consolidate` builds a map with a
capacity of one model's worth of experts (every position loaded, each from one variant, most similar first),
and each variant is evaluated on its own held-out data three ways: its own model, the model it runs under the
consolidated map (`materialize`), and the average of the variants' weights. Metrics: completion loss
(nats/token; perplexity = exp) and exact match.

The capacity sweep takes the first `sweep` variants from every position loaded (all hits: the least expert
memory, one model's worth) down to none (every variant its own experts: M models' worth) and reports quality
against the expert memory a server holds for them (`esftctl serve --variants`: every base row plus each
variant's distinct misses). With `serve`, esftctl.bench.variants_serve measures turnaround of the variants
served by one consolidated server (a variant per step, or all in one step) against one plain vLLM server per
variant and whole-model swapping.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from esftctl.consolidate import average, consolidate, materialize
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl
from esftctl.variants import VariantSet
from esftctl.world.build import build_world
from esftctl.world.esft import evaluate as evaluate_model
from esftctl.world.esft import fine_tuned_variants
from esftctl.world.models import quiet_transformers

CAPACITIES = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)  # fractions of the positions loaded, in the sweep
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "16"]


def engine_args() -> list[str]:
    """The servers' engine flags, alike for every set-up: eager (on the CPU build `serve --variants` must be:
    variant_weights; on a GPU the run's eight engine starts then take minutes, not the better part of an hour,
    and a swap costs a lower bound of what it costs with graphs); on a GPU a quarter of its memory per engine, so three
    engines fit side by side."""
    import torch

    gpu = ["--gpu-memory-utilization", "0.25"] if torch.cuda.is_available() else []
    return [*ENGINE_ARGS, "--enforce-eager", *gpu]


def run(root: Path | None = None, counts=(2, 3, 4), steps: int = 200, lr: float = 3e-3, eval_examples: int = 40, *,
        sweep: int = 3, capacities=CAPACITIES, serve: bool = False, serve_fraction: float = 0.5, rate: float = 2.0,
        requests: int = 24, output_len: int = 16, work: Path | None = None, setups: tuple[str, ...] | None = None,
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    quiet_transformers()
    world = build_world(root)
    tasks = world.task_names[: max([*counts, sweep])]
    variants = fine_tuned_variants(world, tasks, steps=steps, lr=lr, on_step=on_step)
    held_out = {t: list(read_jsonl(world.data_file(t, "test")))[:eval_examples] for t in tasks}

    def evaluate(model_dir: Path, task: str) -> dict:
        exact, loss = evaluate_model(model_dir, held_out[task])  # one pass scores both
        return {"loss": loss, "exact": exact}

    own = {}
    for t in tasks:
        on_step(f"evaluating the {t} variant")
        own[t] = evaluate(variants[t], t)
    rows = []
    capacity = len(MoECheckpoint(world.base_dir).moe_layers) * MoECheckpoint(world.base_dir).num_experts
    for n in counts:
        members = tasks[:n]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            on_step(f"consolidating {n} variants")
            consolidate([variants[t] for t in members], tmp / "map", capacity=capacity)
            average([variants[t] for t in members], tmp / "avg")
            for i, t in enumerate(members):
                on_step(f"{n} variants: evaluating {t}")
                materialize(tmp / "map", i, tmp / f"c{i}")
                rows.append({"variants": n, "task": t, "own": own[t], "consolidated": evaluate(tmp / f"c{i}", t),
                             "averaged": evaluate(tmp / "avg", t)})
    result = {"benchmark": "consolidate", "world": str(world.root), "capacity": capacity, "steps": steps,
              "eval_examples": eval_examples, "rows": rows}
    members = tasks[:sweep]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        average([variants[t] for t in members], tmp / "avg")
        averaged = {t: evaluate(tmp / "avg", t) for t in members}
        points = []
        for fraction in capacities:
            c = round(fraction * capacity)
            on_step(f"sweep: capacity {c} of {capacity} positions")
            consolidate([variants[t] for t in members], tmp / f"map{c}", capacity=c)
            quality = {}
            for i, t in enumerate(members):
                materialize(tmp / f"map{c}", i, tmp / f"m{c}_{i}")
                quality[t] = evaluate(tmp / f"m{c}_{i}", t)
                shutil.rmtree(tmp / f"m{c}_{i}")
            misses = VariantSet.open(tmp / f"map{c}", members).miss_counts()
            points.append({"capacity": c, "fraction": fraction, "resident_experts": capacity + sum(map(sum, misses)),
                           "tasks": quality})
        result["sweep"] = {"variants": members, "positions": capacity, "expert_bytes": base_expert_bytes(world),
                           "own": {t: own[t] for t in members}, "averaged": averaged, "points": points}
        if serve:
            from esftctl.bench import variants_serve
            from esftctl.bench.turnaround import Traffic

            c = round(serve_fraction * capacity)
            if not (tmp / f"map{c}").exists():
                consolidate([variants[t] for t in members], tmp / f"map{c}", capacity=c)
            prompts = [e["prompt"] for t in members for e in held_out[t][:8]]
            traffic = Traffic(members, rate, requests, prompts, output_len)
            result["serving"] = variants_serve.measure(
                {t: variants[t] for t in members}, tmp / f"map{c}", Path(work or tmp / "serve"),
                traffic, engine_args(), setups=setups or variants_serve.SETUPS, on_step=on_step)
            result["serving"]["capacity"] = c
    return result


def base_expert_bytes(world) -> int:
    return MoECheckpoint(world.base_dir).expert_nbytes


def table(result: dict):
    from rich.table import Table

    t = Table(title=f"Consolidated vs averaged variants (tiny world; capacity {result['capacity']} expert positions; "
                    f"{result['eval_examples']} held-out examples; loss in nats/token)", header_style="bold")
    for col in ("variants", "task", "own loss", "consolidated", "averaged", "own exact", "consol. exact",
                "avg. exact"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(str(r["variants"]), r["task"], f"{r['own']['loss']:.3f}", f"{r['consolidated']['loss']:.3f}",
                  f"{r['averaged']['loss']:.3f}", f"{r['own']['exact']:.0%}", f"{r['consolidated']['exact']:.0%}",
                  f"{r['averaged']['exact']:.0%}")
    return t


def tables(result: dict) -> list:
    out = [table(result)] if result["rows"] else []
    if result["sweep"]["points"]:
        out.append(sweep_table(result))
    if "serving" in result:
        out.append(serving_table(result))
    return out


def _mean(points: dict, key: str) -> float:
    return sum(q[key] for q in points.values()) / len(points)


def sweep_table(result: dict):
    from rich.table import Table

    sw = result["sweep"]
    m = len(sw["variants"])
    t = Table(title=f"Capacity sweep: {m} variants ({', '.join(sw['variants'])}); expert memory against {m} separate "
                    f"models ({m * sw['positions']} experts); own loss {_mean(sw['own'], 'loss'):.3f}, exact "
                    f"{_mean(sw['own'], 'exact'):.0%}; averaged {_mean(sw['averaged'], 'loss'):.3f}, "
                    f"{_mean(sw['averaged'], 'exact'):.0%}", header_style="bold")
    for col in ("capacity", "loaded", "experts held", "vs separate", "mean loss", "mean exact",
                *(f"{v} exact" for v in sw["variants"])):
        t.add_column(col, justify="right")
    for p in sw["points"]:
        t.add_row(f"{p['capacity']}", f"{p['fraction']:.0%}", f"{p['resident_experts']}",
                  f"{p['resident_experts'] / (m * sw['positions']):.0%}", f"{_mean(p['tasks'], 'loss'):.3f}",
                  f"{_mean(p['tasks'], 'exact'):.0%}", *(f"{p['tasks'][v]['exact']:.0%}" for v in sw["variants"]))
    return t


def serving_table(result: dict):
    from rich.table import Table

    sv = result["serving"]
    tr, setups = sv["traffic"], sv["setups"]
    first = next(iter(setups))
    anchor = setups[first]["summary"]
    t = Table(title=f"Serving {len(tr['models'])} variants (capacity {sv['capacity']}): {tr['requests']} requests, "
                    f"Poisson {tr['rate']:g} rps, {tr['output_len']} tokens each; ratios to the {first} server",
              header_style="bold")
    for col in ("set-up", "ready s", "TTFT mean ms", "TPOT mean ms", "E2E mean ms", "E2E p99 ms", "req/s",
                "E2E ratio", "req/s ratio", "swaps"):
        t.add_column(col, justify="right")
    for name, r in setups.items():
        s = r["summary"]
        t.add_row(name, f"{r['ready_s']:.0f}", f"{s['mean_ttft_ms']:.0f}", f"{s['mean_tpot_ms']:.1f}",
                  f"{s['mean_e2el_ms']:.0f}", f"{s['p99_e2el_ms']:.0f}", f"{s['request_throughput']:.2f}",
                  f"{s['mean_e2el_ms'] / anchor['mean_e2el_ms']:.2f}x",
                  f"{s['request_throughput'] / anchor['request_throughput']:.2f}x",
                  f"{r['swaps']} x {r['swap_s']:.0f} s" if "swaps" in r else "-")
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [bool(result["rows"]), bool(result["sweep"]["points"]), "serving" in result]
    panels = max(sum(shown), 1)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4))
    axes = list(axes) if panels > 1 else [axes]
    if result["rows"]:
        _plot_counts(result, axes[0])
    if result["sweep"]["points"]:
        sw = result["sweep"]
        ax = axes[int(shown[0])]
        m = len(sw["variants"])
        x = [p["resident_experts"] / (m * sw["positions"]) for p in sw["points"]]
        ax.plot(x, [_mean(p["tasks"], "loss") for p in sw["points"]], "o-", label="consolidated")
        for (fx, p) in zip(x, sw["points"]):
            ax.annotate(f"C={p['fraction']:.0%}", (fx, _mean(p["tasks"], "loss")), fontsize=7)
        ax.axhline(_mean(sw["own"], "loss"), color="k", ls="--", label="own models")
        ax.axhline(_mean(sw["averaged"], "loss"), color="tab:red", ls=":", label="weight-averaged")
        ax.set_xlabel(f"expert memory held, fraction of {m} separate models")
        ax.set_ylabel("mean held-out loss (nats/token, log)")
        ax.set_yscale("log")
        ax.set_title("Quality against expert memory")
        ax.legend()
    if "serving" in result:
        ax = axes[-1]
        setups = result["serving"]["setups"]
        names = list(setups)
        ax.bar(names, [setups[n]["summary"]["mean_e2el_ms"] / 1000 for n in names])
        ax.set_ylabel("mean end-to-end latency (s)")
        ax.set_yscale("log")
        ax.set_title("Turnaround, same traffic")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _plot_counts(result: dict, ax) -> None:
    counts = sorted({r["variants"] for r in result["rows"]})
    for key, style in (("own", "k--"), ("consolidated", "o-"), ("averaged", "s-")):
        means = [sum(r[key]["loss"] for r in result["rows"] if r["variants"] == n) /
                 sum(1 for r in result["rows"] if r["variants"] == n) for n in counts]
        ax.plot(counts, means, style, label=key)
    ax.set_xlabel("variants served together")
    ax.set_ylabel("mean held-out loss (nats/token)")
    ax.set_xticks(counts)
    ax.set_title("Consolidation vs weight averaging (every position loaded)")
    ax.legend()
