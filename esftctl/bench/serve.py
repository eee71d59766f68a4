"""`esftctl bench serve`: serving latency and throughput of ESFT adapters against the base and merged models.

vLLM's serving-benchmark conventions: streamed completions, TTFT (time to first token), TPOT (time per
output token after the first = (latency - TTFT) / (output tokens - 1)), output throughput (all output
tokens / wall time), means and p50/p99 over requests; a fixed number of requests, `concurrency` in flight,
every request `output_len` tokens (ignore_eos). Each server's scenarios run `repeats` times, interleaved,
and the median run is reported with the range of the runs' means.

Servers, one after another on the same machine:
- `base`: plain vLLM serving the base alone (the anchor of every ratio);
- `merged`: plain vLLM serving one adapter merged into a full model (what serving a fine-tune costs today);
- `esft`: `esftctl serve` with `max(adapters)` synthetic adapters; on it, runs with requests spread over the
  first N adapters (N = 0 means all to the base through the ESFT runtime), uniformly or skewed by a power
  law (share of adapter i proportional to 1 / i^alpha, as in ExpertWeave 5.2).
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from esftctl.jsonl import read_jsonl
from esftctl.merge import merge
from esftctl.serve import Server, free_port, plan
from esftctl.world.build import build_world
from esftctl.world.synthetic import write_synthetic_adapter

ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "32"]


def stream_completion(url: str, model: str, prompt: str, output_len: int) -> dict:
    """One streamed completion: TTFT, latency and the number of output tokens."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"{model}: HTTP {reply.status}: {reply.read()[:300]!r}")
    ttft, tokens = None, 0
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    conn.close()
    return {"ttft": ttft if ttft is not None else latency, "latency": latency, "tokens": tokens}


def run_load(url: str, models: list[str], prompts: list[str], output_len: int, concurrency: int) -> dict:
    jobs = list(zip(models, prompts))
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda job: stream_completion(url, job[0], job[1], output_len), jobs))
    duration = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "duration_s": duration, "output_tokens": tokens,
            "output_throughput": tokens / duration,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * _quantile(ttft, 0.99),
            "tpot_mean_ms": 1e3 * statistics.mean(tpot), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "tpot_p99_ms": 1e3 * _quantile(tpot, 0.99)}


def _median(reps: list[dict]) -> dict:
    """Per metric, the median over repeated runs, and the spread (min, max) of the means."""
    out = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    for k in ("ttft_mean_ms", "tpot_mean_ms", "output_throughput"):
        out[f"{k}_range"] = [min(r[k] for r in reps), max(r[k] for r in reps)]
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request_models(adapters: list[str], n: int, share: str, alpha: float, count: int, seed: int,
                   base: str) -> list[str]:
    """Which model each request asks for: the first n adapters, uniform or power-law shares; n = 0: the base."""
    if n == 0:
        return [base] * count
    weights = [1.0] * n if share == "uniform" else [1.0 / (i + 1) ** alpha for i in range(n)]
    return random.Random(seed).choices(adapters[:n], weights=weights, k=count)


def run(counts=(1, 5, 20), requests: int = 64, output_len: int = 32, concurrency: int = 8, alpha: float = 1.0,
        experts_per_layer: int = 4, repeats: int = 5, root: Path | None = None,
        on_step: Callable[[str], None] = lambda msg: None) -> dict:
    world = build_world(root)
    examples = [e["prompt"] for t in world.task_names for e in read_jsonl(world.data_file(t, "test"))]
    prompts = [examples[i % len(examples)] for i in range(requests)]
    work = Path(tempfile.mkdtemp(prefix="esftctl-bench-serve-"))
    n_max = max(counts)
    on_step(f"writing {n_max} synthetic adapters")
    bundles = {f"adapter{i}": write_synthetic_adapter(world.base_dir, work / f"adapter{i}", f"adapter{i}", seed=i,
                                                      experts_per_layer=experts_per_layer) for i in range(n_max)}
    merged = merge(world.base_dir, bundles["adapter0"], work / "merged")
    runs = []

    def measure(label: str, serve_plan, scenarios: list[tuple[str, list[str]]]) -> None:
        on_step(f"starting vLLM: {label}")
        with Server(serve_plan) as server:
            server.wait_ready()
            run_load(serve_plan.url, [serve_plan.name] * concurrency, prompts[:concurrency], 4, concurrency)  # warm-up
            measured: dict[str, list[dict]] = {name: [] for name, _ in scenarios}
            for rep in range(repeats):  # scenarios interleaved, in a rotated order each round
                for name, models in scenarios[rep % len(scenarios):] + scenarios[: rep % len(scenarios)]:
                    on_step(f"{label}: {name} ({rep + 1}/{repeats})")
                    measured[name].append(run_load(serve_plan.url, models, prompts, output_len, concurrency))
            for name, reps in measured.items():
                runs.append({"server": label, "scenario": name, **_median(reps), "repeats": reps})

    def settings(label: str) -> dict:
        return dict(state_dir=work / label, port=free_port(), vllm_args=ENGINE_ARGS)

    measure("base", plan(world.base_dir, [], name="base", esft=False, **settings("base")),
            [("base alone", ["base"] * requests)])
    measure("merged", plan(merged, [], name="merged", esft=False, **settings("merged")),
            [("one merged model", ["merged"] * requests)])
    esft_plan = plan(world.base_dir, [f"{n}={p}" for n, p in bundles.items()], name="base", **settings("esft"))
    names = list(bundles)
    scenarios = [("base via ESFT runtime", request_models(names, 0, "uniform", alpha, requests, 0, "base"))]
    for n in counts:
        for share in ("uniform", "skewed"):
            if n == 1 and share == "skewed":
                continue
            scenarios.append((f"{n} adapters, {share}", request_models(names, n, share, alpha, requests, n, "base")))
    measure("esft", esft_plan, scenarios)
    anchor = runs[0]
    for r in runs:
        r["ttft_ratio"] = r["ttft_mean_ms"] / anchor["ttft_mean_ms"]
        r["tpot_ratio"] = r["tpot_mean_ms"] / anchor["tpot_mean_ms"]
        r["throughput_ratio"] = r["output_throughput"] / anchor["output_throughput"]
    return {"config": {"requests": requests, "output_len": output_len, "concurrency": concurrency, "alpha": alpha,
                       "experts_per_layer": experts_per_layer, "repeats": repeats, "base": str(world.base_dir),
                       "engine_args": ENGINE_ARGS},
            "runs": runs}


def table(result: dict):
    from rich.table import Table

    c = result["config"]
    t = Table(title=f"serving, {c['requests']} requests x {c['output_len']} tokens, {c['concurrency']} in flight, "
                    f"median of {c['repeats']} runs (ratios against plain vLLM serving the base alone)",
              title_justify="left")
    for col in ("server", "scenario", "TTFT ms", "TPOT ms", "TPOT range", "tok/s", "TTFT x", "TPOT x",
                "throughput x"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for r in result["runs"]:
        low, high = r["tpot_mean_ms_range"]
        t.add_row(r["server"], r["scenario"], f"{r['ttft_mean_ms']:.1f}", f"{r['tpot_mean_ms']:.2f}",
                  f"{low:.2f}-{high:.2f}", f"{r['output_throughput']:.1f}", f"{r['ttft_ratio']:.3f}",
                  f"{r['tpot_ratio']:.3f}", f"{r['throughput_ratio']:.3f}")
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['server']}: {r['scenario']}" for r in runs]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(runs) + 1.5))
    y = range(len(runs))
    ax.barh([i - 0.2 for i in y], [r["ttft_ratio"] for r in runs], height=0.4, label="TTFT")
    ax.barh([i + 0.2 for i in y], [r["tpot_ratio"] for r in runs], height=0.4, label="TPOT")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("mean, relative to plain vLLM serving the base alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
