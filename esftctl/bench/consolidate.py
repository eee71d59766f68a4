"""`esftctl bench consolidate`: quality of consolidated variants against their own models and weight averaging.

On the tiny world (the paper's Figure 5 experiment, scaled down): every task gets a fully fine-tuned variant
of the base (cached under the world); for the first 2, 3 and 4 variants, `consolidate` builds a map with a
capacity of one model's worth of experts (every position loaded, each from one variant, most similar first),
and each variant is evaluated on its own held-out data three ways: its own model, the model it runs under the
consolidated map (`materialize`), and the average of the variants' weights. Metrics: completion loss
(nats/token; perplexity = exp) and exact match.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from esftctl.checkpoint import MoECheckpoint
from esftctl.consolidate import average, consolidate, materialize
from esftctl.jsonl import read_jsonl
from esftctl.world.build import build_world
from esftctl.world.esft import completion_loss, exact_match, full_finetune


def run(root: Path | None = None, counts=(2, 3, 4), steps: int = 200, lr: float = 3e-3, eval_examples: int = 40,
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    world = build_world(root)
    tasks = world.task_names[: max(counts)]
    variants = {}
    for task in tasks:
        variants[task] = world.root / "variants" / task
        if not variants[task].exists():
            on_step(f"fully fine-tuning a variant on {task}")
            full_finetune(world.base_dir, list(read_jsonl(world.data_file(task, "train"))), variants[task],
                          steps=steps, batch_size=16, lr=lr)
    held_out = {t: list(read_jsonl(world.data_file(t, "test")))[:eval_examples] for t in tasks}

    def evaluate(model_dir: Path, task: str) -> dict:
        return {"loss": completion_loss(model_dir, held_out[task]), "exact": exact_match(model_dir, held_out[task])}

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
    return {"benchmark": "consolidate", "world": str(world.root), "capacity": capacity, "steps": steps,
            "eval_examples": eval_examples, "rows": rows}


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


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["variants"] for r in result["rows"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style in (("own", "k--"), ("consolidated", "o-"), ("averaged", "s-")):
        means = [sum(r[key]["loss"] for r in result["rows"] if r["variants"] == n) /
                 sum(1 for r in result["rows"] if r["variants"] == n) for n in counts]
        ax.plot(counts, means, style, label=key)
    ax.set_xlabel("variants served together")
    ax.set_ylabel("mean held-out loss (nats/token)")
    ax.set_xticks(counts)
    ax.set_title("Consolidation vs weight averaging (tiny world)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
