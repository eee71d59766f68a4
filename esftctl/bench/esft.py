"""`esftctl bench esft`: ESFT against full fine-tuning and LoRA on the tiny world (arXiv 2407.01906, in miniature).

For every task of the tiny world, five rows: the base (no training) and four fine-tunes of it, all with the
recipe's fine-tuning settings (`esftctl.world.esft.FINETUNE`: steps, batch size, learning rate, and the share of
each batch replayed from the general mixture, for every method alike):
- esft-token, esft-gate: ESFT with the paper's thresholds, token selection ratio p=0.2 and average gate score
  p=0.1 (relevance of every routed expert on the positions of the task's training data that predict the
  completion, `esftctl.relevance.compute_relevance`;
  per layer the fewest best experts reaching p, `esftctl.selection.select_experts`); only the selected experts
  learn; stored as the bundle `esftctl.pack` writes (the selected experts only);
- fft: every weight learns, at its own learning rate `FFT_LR` (1e-3; `fft_lr` / `--fft-lr` to change it): at
  the recipe's 1e-2, which suits the few experts ESFT trains, every weight moving at once wiped out the base
  (general exact match 17-20%, task 28-50%); at 1e-3 FFT reaches 97-100% on every task and keeps 92-97% of
  the general mixture, the strong baseline the paper compares with; stored as the full bf16 checkpoint;
- lora: rank-8 LoRA (peft) on the attention projections, on every routed expert (transformers 5 keeps them
  fused as parameters; peft's `target_parameters` adapts each expert of a fused tensor with its own A and B),
  on the shared experts and on the dense layer's MLP; its own learning rate, `esftctl.world.lora.LR` (3e-3: at
  the recipe's 1e-2 LoRA diverged on arithmetic; the module's docstring has the sweep); stored as the peft
  adapter (bf16 safetensors).
Metrics: exact match on the task's held-out examples (and its completion loss); completion loss and exact match
on the held-out general mixture (what fine-tuning keeps of general ability); trainable parameters; stored bytes
(the files a method must keep per task, tokenizer and model card aside); training time; for ESFT the experts
selected per layer. The paper's headline numbers (DeepSeek-V2-Lite) are printed beside the averages, with a line
per claim saying whether the miniature agrees.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

METHODS = ("esft-token", "esft-gate", "fft", "lora")
FFT_LR = 1e-3  # full fine-tuning's learning rate (the module docstring says why not the recipe's)
SELECTION = {"esft-token": ("token", 0.2), "esft-gate": ("gate", 0.1)}  # the paper's metric and threshold p
EVAL_EXAMPLES = None  # held-out examples per task and of the general mixture (None: all; exact match is one
# teacher-forced pass, so all of them cost seconds)
CLOSE = 0.05  # "close to FFT": task exact match within 5 points (the paper: 0.8 for ESFT-Gate)
SMALLER = 5.0  # "~10x smaller": FFT's storage at least 5x ESFT's (the paper: 28.6 GB vs 2.6-3.2 GB, 9-11x)
# arXiv 2407.01906, Table 1 and Section 4 (DeepSeek-V2-Lite): averages over the tasks (task) and the general
# benchmarks (general), in points; storage per task. None: not quoted here.
PAPER = (
    {"method": "base", "task": None, "general": 62.4, "storage": None},
    {"method": "esft-gate", "task": 50.2, "general": 60.6, "storage": "2.6-3.2 GB (ESFT)"},
    {"method": "fft", "task": 51.0, "general": 58.8, "storage": "28.6 GB"},
    {"method": "lora", "task": 44.9, "general": None, "storage": None},
)

OnStep = Callable[[str, int, int, "float | None"], None]


def stored_bytes(folder: Path) -> int:
    """Bytes of the files in `folder` (not below it) a method stores per task: tokenizer and model card aside."""
    skip = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md", "chat_template.jinja")
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file() and f.name not in skip)


def tensor_params(folder: Path) -> int:
    """Number of parameters in the safetensors files of `folder`."""
    import math

    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def select(relevance, method: str) -> dict[int, list[int]]:
    """The experts an ESFT method trains: {MoE layer: expert ids, most relevant first}."""
    from esftctl.selection import select_experts

    metric, p = SELECTION[method]
    return select_experts(relevance.scores[metric], p)


def evaluate(model_dir: Path, task_test: Sequence[dict], general_test: Sequence[dict] | None) -> dict:
    """Task exact match and loss; with `general_test`, loss and exact match on the general mixture too."""
    from esftctl.world.esft import evaluate as scores  # (exact match, loss) in one pass

    out = dict(zip(("task_exact", "task_loss"), scores(model_dir, task_test)))
    if general_test is not None:
        out |= dict(zip(("general_exact", "general_loss"), scores(model_dir, general_test)))
    return out


def train_method(method: str, *, base_dir: Path, folder: Path, train_set: list, general: list, recipe: dict,
                 experts: dict[int, list[int]] | None, on_step: Callable[[int, float], None]) -> dict:
    """Fine-tune with `method` under `folder`: {model (to evaluate), stored (folder whose bytes count), train_s,
    trainable_params, losses}."""
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.pack import pack
    from esftctl.selection import ExpertConfig
    from esftctl.world.esft import esft_finetune, full_finetune
    from esftctl.world.lora import lora_finetune

    base = MoECheckpoint(base_dir)
    kwargs = dict(general=general, on_step=on_step, **recipe)
    start = time.perf_counter()
    if method in SELECTION:
        config = ExpertConfig(experts)
        losses = esft_finetune(base_dir, config, train_set, folder / "finetuned", **kwargs)
        train_s = time.perf_counter() - start
        config.save(folder / "experts.json")
        pack(base_dir, folder / "finetuned", folder / "bundle", name=f"{folder.parent.name}-{method}",
             config_file=folder / "experts.json")
        expert_params = sum(r * c for r, c in base.expert_shapes().values())
        return {"model": folder / "finetuned", "stored": folder / "bundle", "train_s": train_s, "losses": losses,
                "trainable_params": expert_params * sum(len(ids) for ids in experts.values())}
    if method == "fft":
        losses = full_finetune(base_dir, train_set, folder / "finetuned", **kwargs)
        return {"model": folder / "finetuned", "stored": folder / "finetuned", "losses": losses,
                "train_s": time.perf_counter() - start, "trainable_params": tensor_params(base_dir)}
    if method == "lora":
        from esftctl.world.lora import LR

        losses = lora_finetune(base_dir, train_set, folder, **{**kwargs, "lr": LR})
        return {"model": folder / "merged", "stored": folder / "adapter", "losses": losses,
                "train_s": time.perf_counter() - start, "trainable_params": tensor_params(folder / "adapter")}
    raise ValueError(f"unknown method {method!r}")


def run(world=None, *, tasks: Sequence[str] | None = None, methods: Sequence[str] = METHODS, steps: int | None = None,
        work_dir: Path, fft_lr: float = FFT_LR, replay: float | None = None, eval_examples: int | None = EVAL_EXAMPLES,
        on_step: OnStep = lambda what, step, steps, loss: None) -> dict:
    """Every (task, method) of the comparison, base rows first. `on_step(what, step, steps, loss)` reports each
    training step (step 1..steps and its loss) and every other stage (step = steps = 0, loss None). Models,
    bundles and adapters are written under `work_dir`; `steps` and `replay` override the recipe's; FFT trains at
    `fft_lr`, ESFT at the recipe's learning rate, LoRA at its own (`esftctl.world.lora.LR`)."""
    from esftctl.jsonl import read_jsonl
    from esftctl.relevance import compute_relevance
    from esftctl.world.build import build_world
    from esftctl.world.esft import FINETUNE, RELEVANCE
    from esftctl.world.lora import LR, RANK
    from esftctl.world.models import quiet_transformers

    quiet_transformers()
    world = world if world is not None else build_world()
    tasks = list(tasks or world.task_names)
    recipe = {**FINETUNE, **({"steps": steps} if steps else {}), **({"replay": replay} if replay is not None else {})}
    general_train = list(read_jsonl(world.general_file("train")))
    general_test = list(read_jsonl(world.general_file("test")))[:eval_examples]
    base_general = None
    rows = []
    for task in tasks:
        train_set = list(read_jsonl(world.data_file(task, "train")))
        task_test = list(read_jsonl(world.data_file(task, "test")))[:eval_examples]
        on_step(f"evaluating the base on {task}", 0, 0, None)
        base = evaluate(world.base_dir, task_test, general_test if base_general is None else None)
        base_general = base_general or {k: base[k] for k in ("general_loss", "general_exact")}
        rows.append({"task": task, "method": "base", **base, **base_general, "trainable_params": 0,
                     "stored_bytes": 0, "train_s": 0.0, "experts": None})
        relevance = None
        for method in methods:
            experts = None
            if method in SELECTION:
                if relevance is None:
                    on_step(f"scoring expert relevance on {task}", 0, 0, None)
                    relevance = compute_relevance(world.base_dir, train_set[:RELEVANCE["examples"]],
                                                  scored=RELEVANCE["scored"], data_name=task)
                experts = select(relevance, method)
            label = f"{method} {task}"
            trained = train_method(method, base_dir=world.base_dir, folder=Path(work_dir) / task / method,
                                   train_set=train_set, general=general_train, experts=experts,
                                   recipe={**recipe, "lr": fft_lr} if method == "fft" else recipe,
                                   on_step=lambda step, loss: on_step(label, step + 1, recipe["steps"], loss))
            on_step(f"evaluating {label}", 0, 0, None)
            rows.append({"task": task, "method": method, **evaluate(trained["model"], task_test, general_test),
                         "trainable_params": trained["trainable_params"],
                         "stored_bytes": stored_bytes(trained["stored"]), "train_s": round(trained["train_s"], 2),
                         "first_loss": trained["losses"][0], "last_loss": trained["losses"][-1],
                         "experts": {str(l): ids for l, ids in experts.items()} if experts is not None else None})
    avg = averages(rows)
    return {"benchmark": "esft", "world": str(world.root), "tasks": tasks, "methods": list(methods),
            "recipe": recipe, "fft_lr": fft_lr, "lora": {"rank": RANK, "lr": LR},
            "selection": {m: {"metric": metric, "p": p} for m, (metric, p) in SELECTION.items()},
            "eval_examples": {"task": len(task_test), "general": len(general_test)},
            "base_params": tensor_params(world.base_dir), "rows": rows, "averages": avg, "paper": list(PAPER),
            "agreement": agreement(avg)}


def averages(rows: list[dict]) -> dict[str, dict]:
    """Per method (base first, in row order), the mean over tasks of every numeric metric."""
    keys = ("task_exact", "task_loss", "general_loss", "general_exact", "trainable_params", "stored_bytes", "train_s")
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        out[method] = {k: statistics.fmean(r[k] for r in mine) for k in keys} | {"tasks": len(mine)}
    return out


def _verdict(oks: list[bool]) -> str:
    return "agrees" if all(oks) else "disagrees" if not any(oks) else "partly agrees"


def agreement(avg: dict[str, dict]) -> list[dict]:
    """The paper's three headline claims, each checked on the miniature's averages: a verdict (agrees, partly
    agrees, disagrees, not measured) and the numbers behind it."""
    esft = [m for m in SELECTION if m in avg]
    fft, lora = avg.get("fft"), avg.get("lora")
    claims = []

    def claim(text, needs, check):
        if not esft or not all(needs):
            claims.append({"claim": text, "verdict": "not measured", "detail": "needs ESFT and " +
                           ("FFT and LoRA" if len(needs) > 1 else "FFT") + " in --methods"})
            return
        results = [check(m) for m in esft]
        claims.append({"claim": text, "verdict": _verdict([ok for ok, _ in results]),
                       "detail": "; ".join(d for _, d in results)})

    claim("ESFT close to FFT on tasks and ahead of LoRA", (fft, lora), lambda m: (
        avg[m]["task_exact"] >= fft["task_exact"] - CLOSE and avg[m]["task_exact"] > lora["task_exact"],
        f"{m} {avg[m]['task_exact']:.1%} vs FFT {fft['task_exact']:.1%}, LoRA {lora['task_exact']:.1%}"))
    claim("ESFT keeps more general ability than FFT", (fft,), lambda m: (
        avg[m]["general_exact"] >= fft["general_exact"] and avg[m]["general_loss"] < fft["general_loss"],
        f"{m} exact {avg[m]['general_exact']:.1%} / loss {avg[m]['general_loss']:.3f} vs FFT "
        f"{fft['general_exact']:.1%} / {fft['general_loss']:.3f}"))
    claim("ESFT storage ~10x smaller than FFT", (fft,), lambda m: (
        fft["stored_bytes"] >= SMALLER * avg[m]["stored_bytes"],
        f"{m} {fft['stored_bytes'] / avg[m]['stored_bytes']:.1f}x smaller"))
    return claims


def _experts_per_layer(experts: dict | None) -> str:
    return "-" if experts is None else " ".join(str(len(ids)) for _, ids in sorted(experts.items(),
                                                                                   key=lambda kv: int(kv[0])))


def tables(result: dict) -> list:
    from rich.table import Table
    from rich.text import Text

    from esftctl.units import format_bytes

    out = []
    ev = result["eval_examples"]
    for task in result["tasks"]:
        recipe = result["recipe"]
        t = Table(title=f"{task}: {recipe['steps']} steps per fine-tune, {recipe.get('replay', 0):.0%} of each "
                        f"batch replayed (lr: ESFT {recipe['lr']:g}, FFT {result['fft_lr']:g}, "
                        f"LoRA {result['lora']['lr']:g}); "
                        f"{ev['task']} held-out task and {ev['general']} general examples; loss in nats/token",
                  header_style="bold")
        for col in ("method", "task exact", "task loss", "general loss", "general exact", "trainable params",
                    "stored", "train s", "experts per layer"):
            t.add_column(col, justify="left" if col == "method" else "right")
        for r in (r for r in result["rows"] if r["task"] == task):
            t.add_row(r["method"], f"{r['task_exact']:.1%}", f"{r['task_loss']:.3f}", f"{r['general_loss']:.3f}",
                      f"{r['general_exact']:.1%}", f"{r['trainable_params']:,}",
                      format_bytes(r["stored_bytes"]) if r["stored_bytes"] else "-",
                      f"{r['train_s']:.1f}" if r["train_s"] else "-", _experts_per_layer(r["experts"]))
        out.append(t)
    t = Table(title=f"Averages over {len(result['tasks'])} task(s) (tiny world; base: {result['base_params']:,} "
                    f"parameters)", header_style="bold")
    for col in ("method", "task exact", "general loss", "general exact", "trainable params", "stored", "train s"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for m, a in result["averages"].items():
        t.add_row(m, f"{a['task_exact']:.1%}", f"{a['general_loss']:.3f}", f"{a['general_exact']:.1%}",
                  f"{a['trainable_params']:,.0f}", format_bytes(a["stored_bytes"]) if a["stored_bytes"] else "-",
                  f"{a['train_s']:.1f}" if a["train_s"] else "-")
    out.append(t)
    t = Table(title="The paper (arXiv 2407.01906, DeepSeek-V2-Lite; points) beside the miniature (exact match, %)",
              header_style="bold")
    for col in ("method", "paper task", "ours task", "paper general", "ours general", "paper storage",
                "ours storage"):
        t.add_column(col, justify="left" if col == "method" else "right")
    paper = {p["method"]: p for p in result["paper"]}
    for m in dict.fromkeys([*paper, *result["averages"]]):
        p, a = paper.get(m, {}), result["averages"].get(m)
        t.add_row(m, _num(p.get("task")), f"{100 * a['task_exact']:.1f}" if a else "-", _num(p.get("general")),
                  f"{100 * a['general_exact']:.1f}" if a else "-", p.get("storage") or "-",
                  format_bytes(a["stored_bytes"]) if a and a["stored_bytes"] else "-")
    out.append(t)
    for c in result["agreement"]:
        style = {"agrees": "green", "partly agrees": "yellow", "disagrees": "red"}.get(c["verdict"], "dim")
        out.append(Text.assemble(f"({result['agreement'].index(c) + 1}) {c['claim']}: ", (c["verdict"], style),
                                 f" ({c['detail']})"))
    return out


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    avg = result["averages"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, a in avg.items():
        left.scatter(100 * a["task_exact"], 100 * a["general_exact"], s=60, marker="*" if m == "base" else "o")
        left.annotate(m, (100 * a["task_exact"], 100 * a["general_exact"]), textcoords="offset points",
                      xytext=(5, 4))
    left.set_xlabel("task exact match, mean over tasks (%)")
    left.set_ylabel("general exact match (%)")
    left.set_title("Task skill vs general ability kept")
    stored = {m: a["stored_bytes"] for m, a in avg.items() if a["stored_bytes"]}
    right.bar(list(stored), list(stored.values()), color="tab:blue")
    right.set_yscale("log")
    right.set_ylabel("stored bytes per task (log)")
    right.set_title("Storage per task")
    for i, v in enumerate(stored.values()):
        right.annotate(f"{v / 2**20:.2f} MiB", (i, v), ha="center", textcoords="offset points", xytext=(0, 3))
    fig.suptitle(f"ESFT vs FFT vs LoRA on the tiny world ({result['recipe']['steps']} steps, "
                 f"{len(result['tasks'])} task(s))")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
