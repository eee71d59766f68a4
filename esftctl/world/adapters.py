"""One ESFT adapter per task of the tiny world, from relevance to bundle, and the quick start's promise.

Per task, what the CLI's offline commands do (here in one process, saving a Python start-up per step):

    esftctl relevance BASE TASK/train.jsonl --out scores.json --scored-tokens completion  # which experts answer
    esftctl select scores.json --out experts.json -p P --metric token
    esftctl train BASE TASK/train.jsonl --out bundle --name TASK --config experts.json
        --replay general/train.jsonl --replay-share 0.75   # the selected experts only, the router frozen too
    esftctl merge BASE bundle --out finetuned   # the model the held-out scores are taken on

then exact match on held-out task data and, for retention, exact match and loss on the held-out general mixture.
Each step's output is cached in the task's folder with the recipe that made it (`recipe.json`): a second run
with the same recipe reuses it, another recipe starts over.

`PROMISE` is what the quick start promises, and `verdict` checks it: the base weak on every task and competent
on the general mixture, every adapter strong on its task without raising the general loss. A test asserts it on
the world CI builds (tests/test_pipeline_quickstart.py), so a change that breaks the demonstration fails CI.

Retention is compared as perplexity, exp(loss), not as loss: a converged base's general loss is a few thousandths of a
nat per token or less, where one example of 300 going from 99.9% to 99% sure doubles the loss. "Within 5% of the base's"
then measures noise; as perplexity (1.001 against 1.002: +0.1%) it keeps its meaning: 5% more perplexity is 0.049 nats
per token more, whatever the base's loss.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from esftctl.jsonl import read_jsonl
from esftctl.world.build import World
from esftctl.world.esft import FINETUNE, RELEVANCE, SELECTION, evaluate
from esftctl.world.training import THREADS


@dataclass(frozen=True)
class Recipe:
    """How one adapter is made: expert selection (ESFT-Token or -Gate at threshold p) and fine-tuning."""
    metric: str = SELECTION["metric"]
    p: float = SELECTION["p"]
    steps: int = FINETUNE["steps"]
    batch_size: int = FINETUNE["batch_size"]
    lr: float = FINETUNE["lr"]
    replay: float = FINETUNE["replay"]
    seed: int = 0
    trainer: str = "esftctl train"  # what trains (esftctl.train): a recipe of another trainer's cache starts over


@dataclass(frozen=True)
class Scores:
    """Held-out exact match on the task, and on the general mixture with its loss (nats per completion token)."""
    task_exact: float
    general_exact: float
    general_loss: float


@dataclass(frozen=True)
class Adapter:
    task: str
    bundle: Path
    experts_per_layer: list[int]
    base: Scores  # the base on this task (general columns: the base's)
    tuned: Scores
    train_seconds: float | None  # None: reused from the cache


@dataclass(frozen=True)
class Promise:
    base_task_at_most: float = 0.20
    base_general_at_least: float = 0.90
    adapter_task_at_least: float = 0.80
    general_perplexity_rise_at_most: float = 0.05  # exp(adapter's general loss - the base's) - 1


PROMISE = Promise()


def base_scores(world: World, tasks: list[str]) -> dict[str, Scores]:
    """The base's scores on each task, with its general-mixture scores (evaluated once) beside each."""
    general = evaluate(world.base_dir, list(read_jsonl(world.general_file("test"))))
    return {task: Scores(evaluate(world.base_dir, list(read_jsonl(world.data_file(task, "test"))))[0], *general)
            for task in tasks}


def prepare_adapter(world: World, task: str, recipe: Recipe = Recipe(), *, folder: Path | None = None,
                    log: Callable[[str], None] = lambda msg: None,
                    on_step: Callable[[int, float], None] | None = None, threads: int = THREADS) -> Adapter:
    """Relevance, selection, ESFT fine-tuning and packing of `task`'s adapter in `folder` (default: the world's
    adapters/TASK), each step skipped when its output of the same recipe exists; then its held-out scores."""
    from esftctl.merge import merge
    from esftctl.relevance import Relevance, compute_relevance
    from esftctl.selection import ExpertConfig, select_experts
    from esftctl.train import TrainSettings, train_adapter
    from esftctl.world.training import torch_threads

    folder = folder or world.root / "adapters" / task
    _start_over_unless(folder, recipe)
    scores, config, tuned, bundle = (folder / "scores.json", folder / "experts.json", folder / "finetuned",
                                     folder / "bundle")
    train = list(read_jsonl(world.data_file(task, "train")))
    seconds = None
    with torch_threads(threads):
        if not scores.exists():
            log(f"{task}: expert relevance on {RELEVANCE['examples']} training examples")
            compute_relevance(world.base_dir, train[:RELEVANCE["examples"]], scored=RELEVANCE["scored"],
                              batch_size=100).save(scores)
        if not config.exists():
            chosen = select_experts(Relevance.load(scores).scores[recipe.metric], recipe.p)
            ExpertConfig(chosen).save(config)
        experts = ExpertConfig.load(config)
        if not bundle.exists():
            log(f"{task}: ESFT fine-tuning of {sum(map(len, experts.experts.values()))} experts (esftctl train)")
            start = time.time()
            settings = TrainSettings(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed,
                                     eval_share=0.0, save_every=0, replay_share=recipe.replay)
            train_adapter(world.base_dir, world.data_file(task, "train"), bundle, task, settings, config_file=config,
                          replay=world.general_file("train"), on_step=lambda step, loss, tps: on_step(step, loss)
                          if on_step is not None else None)
            seconds = time.time() - start
        if not tuned.exists():  # the merged model, for the held-out scores
            merge(world.base_dir, bundle, tuned)
        log(f"{task}: held-out exact match and retention")
        held_out = list(read_jsonl(world.data_file(task, "test")))
        general = list(read_jsonl(world.general_file("test")))
        tuned_scores = Scores(evaluate(tuned, held_out)[0], *evaluate(tuned, general))
        base = base_scores(world, [task])[task]
    return Adapter(task, bundle, [len(ids) for ids in experts.experts.values()], base, tuned_scores, seconds)


def _start_over_unless(folder: Path, recipe: Recipe) -> None:
    """Keep `folder`'s cached steps only if the same recipe made them."""
    made = folder / "recipe.json"
    wanted = asdict(recipe)
    if folder.exists() and (not made.exists() or json.loads(made.read_text()) != wanted):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not made.exists():
        made.write_text(json.dumps(wanted, indent=1))


def perplexity_rise(a: Adapter) -> float:
    """How much higher the adapter's perplexity on the general mixture is than the base's (0.05: 5%)."""
    return math.exp(a.tuned.general_loss - a.base.general_loss) - 1


@dataclass(frozen=True)
class Check:
    what: str
    target: str
    measured: str
    met: bool


def verdict(adapters: list[Adapter], promise: Promise = PROMISE) -> list[Check]:
    """Every target of the promise against what was measured."""
    base_general = adapters[0].base.general_exact
    checks = [Check("base: general mixture exact", f">= {promise.base_general_at_least:.0%}", f"{base_general:.0%}",
                    base_general >= promise.base_general_at_least)]
    for a in adapters:
        rise = perplexity_rise(a)
        checks += [
            Check(f"base: {a.task} exact", f"<= {promise.base_task_at_most:.0%}", f"{a.base.task_exact:.1%}",
                  a.base.task_exact <= promise.base_task_at_most),
            Check(f"ESFT {a.task}: {a.task} exact", f">= {promise.adapter_task_at_least:.0%}",
                  f"{a.tuned.task_exact:.1%}", a.tuned.task_exact >= promise.adapter_task_at_least),
            Check(f"ESFT {a.task}: general perplexity against the base's",
                  f"<= +{promise.general_perplexity_rise_at_most:.0%}", f"{rise:+.2%}",
                  rise <= promise.general_perplexity_rise_at_most),
        ]
    return checks
