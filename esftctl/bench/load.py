"""Load runs through vLLM's own serving benchmark (`vllm bench serve`), so every number is one vLLM users publish.

Its `main` runs in this process (importing vLLM costs 10-30 s; a subprocess per run would pay it every time)
with the arguments the console command would parse: the random dataset (token ids drawn from the model's
tokenizer, re-aligned on the server), `--request-rate` (Poisson arrivals; inf = all at once), greedy,
ignore_eos, TTFT/TPOT/ITL/E2EL with mean, median and p99. Which model each request names is vLLM's
`random.choice` over `--lora-modules`, seeded: a name listed k times gets k shares, which is how power-law
request shares are expressed. Its result JSON is kept beside our own, and its printed summary goes to a log.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 99)


@dataclass(frozen=True)
class Load:
    """One load-generator run's traffic."""

    rate: float  # requests per second (Poisson); math.inf sends them all at once
    prompts: int
    input_len: int
    output_len: int
    seed: int = 0


def weighted_names(names: list[str], alpha: float | None) -> list[str]:
    """`names` repeated by share for vLLM's random.choice: once each (uniform, alpha None), or about
    proportional to 1 / rank^alpha (power law, ExpertWeave 5.2): rank 1 gets 60 entries."""
    if alpha is None:
        return list(names)
    return [n for rank, n in enumerate(names, 1) for _ in range(max(1, round(60 / rank ** alpha)))]


def shares(weighted: list[str]) -> dict[str, float]:
    return {n: weighted.count(n) / len(weighted) for n in dict.fromkeys(weighted)}


def bench_args(url: str, *, model: str, tokenizer: Path, load: Load, models: list[str], result_dir: Path,
               result_file: str) -> list[str]:
    """The `vllm bench serve` command line of one run (`models` empty: every request to `model`)."""
    args = ["--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(load.prompts), "--request-rate", "inf" if math.isinf(load.rate) else str(load.rate),
            "--seed", str(load.seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file, "--disable-tqdm"]
    return args + (["--lora-modules", *models] if models else [])


def run_load(url: str, *, model: str, tokenizer: Path, load: Load, models: list[str], result_dir: Path,
             name: str) -> dict:
    """One run of vLLM's serving benchmark; its result dict (vLLM's keys), its printed output in NAME.log."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(bench_args(url, model=model, tokenizer=tokenizer, load=load, models=models,
                                        result_dir=result_dir, result_file=f"{name}.json"))
    result_dir.mkdir(parents=True, exist_ok=True)
    with open(result_dir / f"{name}.log", "w") as log, contextlib.redirect_stdout(log):
        result = main(args)
    if result.get("failed"):
        raise RuntimeError(f"{name}: {result['failed']} of {load.prompts} requests failed "
                           f"(first error: {next((e for e in result.get('errors', []) if e), '?')})")
    return result


def summary(result: dict) -> dict:
    """The numbers we report from one vLLM result: throughput and each metric's mean, median and p99 (ms)."""
    out = {"duration_s": result["duration"], "completed": result["completed"],
           "output_throughput": result["output_throughput"], "request_throughput": result["request_throughput"]}
    for m in METRICS:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            out[f"{stat}_{m}_ms"] = result[f"{stat}_{m}_ms"]
    return out
