"""Expert rows a step reads with trained ESFT adapters' routing against the random router (issue 29, item 1).

`bench serve`'s generated DeepSeek-V2-Lite-shaped model routes every token about uniformly, and rows_model.py
counts the rows a step reads under that router. Trained adapters differ: ESFT selects the experts its task's
tokens choose most, so a task's tokens land on their adapter's replaced experts more often than chance, and
other tasks' tokens less often. Whether that costs a step more rows or fewer than the random router was only
claimed (RESULTS.md's issue 29 table: "random routing is the worst case"); serve_runs.py's docstring says why the
bench does not build a router to imitate it and where it can be measured honestly. This measures it there: the
tiny world (64 routed experts, top 6, as DeepSeek-V2-Lite) and the quick start's four adapters (token selection
at p=0.5, fine-tuned; `recipes/esft_adapters.py` makes them).

Each task's held-out examples are routed twice at the positions a decode step feeds (the last prompt token up to
the completion's last but one: what predicts the completion, as ESFT's relevance scores it): by the adapter's
fine-tuned model, as a served adapter request routes, and by the base, as the same request served by plain vLLM
routes. A step holds `seqs` sequences, each a request of one of n adapters (n tasks drawn at random, shares by
S-LoRA's power law) contributing one of its task's tokens at one MoE layer. It reads (a, e) for every expert e
its adapter a replaced and a token chose, (base, e) for every other; plain vLLM reads each chosen e once. Two
causes part the counts: the adapters' own routing (distinct experts the fine-tuned models choose, every row
counted once: "moved") and the copies (esftctl's rows over that). The random router reads the same replaced sets
with every token's six experts drawn uniformly.

Columns: rows per layer and step of plain vLLM, of the adapters' routing counted once ("moved"), of esftctl; x:
esftctl over plain; copies: esftctl over moved; then the random router's plain, esftctl and x; with `--groups G`,
esftctl's rows with at most G adapters a step over plain's (the step's adapters drawn by share, as rows_model.py's
`--groups`), trained and random.

Usage: python benchmarks/lab/rows_trained.py [--world DIR] [--trials 4000] [--groups G] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from esftctl.bench.traffic import slora_shares
from esftctl.formats.checkpoint import MoECheckpoint
from esftctl.jsonl import read_jsonl
from esftctl.relevance import completion_positions
from esftctl.routing import routing_scores
from esftctl.selection import ExpertConfig
from esftctl.world.build import World, default_world_dir

SEQS = (1, 2, 4, 8, 16, 64)
MIXES = ((1, 1.0), (2, 1.0), (4, 1.0), (4, 0.1))  # (adapters, alpha)


@torch.no_grad()
def routed(model_dir: Path, tokenizer_dir: Path, examples: list[dict]) -> np.ndarray:
    """Chosen experts [tokens, MoE layers, top_k] through `model_dir` at the positions of `examples` a decode step
    feeds (the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ckpt = MoECheckpoint(model_dir)
    enc = tokenizer([e["prompt"] + e["completion"] for e in examples], padding=True, return_tensors="pt")
    chosen = routing_scores(model, ckpt, enc["input_ids"], enc["attention_mask"])
    keep = completion_positions(tokenizer, examples, enc["attention_mask"])[enc["attention_mask"].bool()].bool()
    return torch.stack([chosen[layer][1][keep] for layer in ckpt.moe_layers], dim=1).numpy()


def distinct(ids: np.ndarray) -> np.ndarray:
    """Distinct values per row of [trials, k]."""
    s = np.sort(ids, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


def _steps(tokens: dict[str, tuple[np.ndarray, np.ndarray]], *, experts: int, seqs: int, n: int, shares: np.ndarray,
           groups: int, trials: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """`trials` steps: each sequence's task index [trials, seqs], each step's layer [trials], and the experts its
    token chose through the base, through its adapter and at random [trials, seqs, top_k]. With `groups` < n a
    step holds the requests of `groups` adapters drawn by share (`serve --group-adapters`, `--max-loras`)."""
    tasks = list(tokens)
    layers, top_k = tokens[tasks[0]][0].shape[1:]
    step_tasks = np.array([rng.permutation(len(tasks))[:n] for _ in range(trials)])  # [trials, n]
    if groups and groups < n:
        held = [rng.choice(n, groups, replace=False, p=shares) for _ in range(trials)]
        slot = np.stack([rng.choice(h, seqs, p=shares[h] / shares[h].sum()) for h in held])
    else:
        slot = rng.choice(n, size=(trials, seqs), p=shares)
    owner = step_tasks[np.arange(trials)[:, None], slot]
    layer = rng.integers(layers, size=trials)
    base_e = np.empty((trials, seqs, top_k), dtype=np.int64)
    tuned_e = np.empty_like(base_e)
    for t, task in enumerate(tasks):
        base, tuned = tokens[task]
        where = owner == t
        pick = rng.integers(len(base), size=int(where.sum()))
        rows_layer = np.broadcast_to(layer[:, None], owner.shape)[where]
        base_e[where], tuned_e[where] = base[pick, rows_layer], tuned[pick, rows_layer]
    random_e = np.argsort(rng.random((trials, seqs, experts)), axis=2)[:, :, :top_k]
    return owner, layer, base_e, tuned_e, random_e


def step_rows(tokens: dict[str, tuple[np.ndarray, np.ndarray]], replaced: dict[str, np.ndarray], *, seqs: int,
              n: int, alpha: float, trials: int, rng: np.random.Generator, groups: int = 0) -> dict[str, float]:
    """Mean distinct rows per layer and step over `trials` steps: plain vLLM's (the base's routing), the adapters'
    routing with every row counted once ("moved"), esftctl's, and the same two under the random router; with
    `groups`, esftctl's with at most that many adapters a step, trained and random."""
    table = np.stack([replaced[task] for task in tokens])  # [tasks, layers, experts] bool
    experts = table.shape[2]
    shares = np.array(slora_shares(n, alpha))

    def rows(owner, layer, e) -> float:  # (adapter, e) where the token's adapter replaced e, else (base, e)
        mine = table[owner[:, :, None], layer[:, None, None], e]
        return float(distinct(np.where(mine, (owner[:, :, None] + 1) * experts + e, e).reshape(len(e), -1)).mean())

    def once(e) -> float:
        return float(distinct(e.reshape(len(e), -1)).mean())

    draw = dict(experts=experts, seqs=seqs, n=n, shares=shares, trials=trials, rng=rng)
    owner, layer, base_e, tuned_e, random_e = _steps(tokens, groups=0, **draw)
    out = {"plain": once(base_e), "moved": once(tuned_e), "trained": rows(owner, layer, tuned_e),
           "random_plain": once(random_e), "random": rows(owner, layer, random_e)}
    if groups:
        owner, layer, _, tuned_e, random_e = _steps(tokens, groups=groups, **draw)
        out |= {"grouped": rows(owner, layer, tuned_e), "random_grouped": rows(owner, layer, random_e)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Rows a step reads under trained adapters' routing vs random.")
    parser.add_argument("--world", type=Path, default=None, help="the tiny world (default: the quick start's)")
    parser.add_argument("--trials", type=int, default=4000, help="steps drawn per cell")
    parser.add_argument("--groups", type=int, default=0, help="also the rows with at most this many adapters a step")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    world = World(args.world or default_world_dir())
    ckpt = MoECheckpoint(world.base_dir)
    tokens, replaced = {}, {}
    for task in world.task_names:
        folder = world.root / "adapters" / task
        if not (folder / "finetuned").exists():
            raise SystemExit(f"{folder}: no fine-tuned model; run recipes/esft_adapters.py first")
        held_out = list(read_jsonl(world.data_file(task, "test")))
        tokens[task] = (routed(world.base_dir, world.base_dir, held_out),
                        routed(folder / "finetuned", world.base_dir, held_out))
        chosen = ExpertConfig.load(folder / "experts.json").experts
        mask = np.zeros((len(ckpt.moe_layers), ckpt.num_experts), dtype=bool)
        for i, layer in enumerate(ckpt.moe_layers):
            mask[i, chosen.get(layer, [])] = True
        replaced[task] = mask
        hit = mask[np.arange(mask.shape[0])[None, :, None], tokens[task][1]].mean()
        print(f"{task}: {mask.sum(1).mean():.1f} experts replaced per layer; {hit:.1%} of its {len(tokens[task][1])} "
              f"decode tokens' top-6 slots land on them (random: {mask.mean():.1%})")
    rng = np.random.default_rng(0)
    results = []
    grouped = f" {f'G={args.groups} x':>8} {'random':>7}" if args.groups else ""
    print(f"{'adapters':>8} {'alpha':>5} {'seqs':>4} {'plain':>6} {'moved':>6} {'esftctl':>7} {'x':>6} {'copies':>6} "
          f"{'random':>7} {'esftctl':>7} {'x':>6}{grouped}")
    for n, alpha in MIXES:
        for seqs in SEQS:
            r = step_rows(tokens, replaced, seqs=seqs, n=n, alpha=alpha, trials=args.trials, rng=rng,
                          groups=args.groups if n > args.groups else 0)
            results.append({"adapters": n, "alpha": alpha, "seqs": seqs, **r})
            bounded = (f" {r['grouped'] / r['plain']:8.3f} {r['random_grouped'] / r['random_plain']:7.3f}"
                       if "grouped" in r else f" {'':8} {'':7}" if args.groups else "")
            print(f"{n:8} {alpha:5} {seqs:4} {r['plain']:6.1f} {r['moved']:6.1f} {r['trained']:7.1f} "
                  f"{r['trained'] / r['plain']:6.3f} {r['trained'] / r['moved']:6.3f} {r['random_plain']:7.1f} "
                  f"{r['random']:7.1f} {r['random'] / r['random_plain']:6.3f}{bounded}")
    if args.json:
        args.json.write_text(json.dumps({"world": str(world.root), "trials": args.trials, "groups": args.groups,
                                         "rows": results}, indent=1))


if __name__ == "__main__":
    main()
