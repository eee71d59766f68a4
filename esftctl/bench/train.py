"""`esftctl bench train`: what ESFT costs to train against full fine-tuning and LoRA, on one GPU.

The ESFT paper's efficiency table, re-run on the user's card: a synthetic checkpoint of a real model's shape
(esftctl.bench.synthetic_model: DeepSeek-V2-Lite or Qwen3-30B-A3B, its first `layers` layers, trained-like random
weights, generated on the GPU, never downloaded), the same data for every method (prompt/completion lines of random
words of a fixed length, so every batch holds the same tokens), the same batches, steps and kernels
(esftctl.train.deterministic), each method in a process of its own so that its peak memory is its own:

- esft-token, esft-gate: `esftctl train` itself (esftctl.train.train_adapter): relevance on the data, selection at
  threshold p, the selected experts' rows trained in float32 masters, the bundle written and verified;
- fft: every weight trained, bf16 weights and AdamW's state in bf16 (the leanest full fine-tune: mixed precision's
  float32 masters would double its memory);
- lora: peft, rank 8 (alpha 16) on every linear layer (attention, dense and shared-expert MLPs; transformers holds
  the routed experts as fused tensors, which peft's LoRA does not wrap), bf16.

Measured: tokens per second over the steps after `warmup` (trained tokens, padding excluded), peak GPU memory
(torch.cuda.max_memory_allocated, weights included), parameters trained, and bytes stored (ESFT: the bundle's
files, beside the selected experts' bytes; FFT: the whole model's weights; LoRA: the adapter's). A method that
runs out of GPU memory is reported as such. Targets (issue 86): ESFT at least 1.3x full fine-tuning's tokens per
second at most half its peak memory; the bundle's bytes those of the selected experts (bf16 rows) and a manifest.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path
from typing import Callable

METHODS = ("esft-token", "esft-gate", "fft", "lora")
MODELS = ("deepseek-v2-lite", "qwen3-30b-a3b")


def write_data(path: Path, vocab: int, examples: int, prompt_len: int, completion_len: int, seed: int) -> Path:
    """Prompt/completion lines of random words of the synthetic tokenizer ("w123" is one token): every example the
    same number of tokens."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(1000, vocab - 1000)}" for _ in range(n))

    with open(path, "w") as f:
        for _ in range(examples):
            f.write(json.dumps({"prompt": words(prompt_len), "completion": " " + words(completion_len)}) + "\n")
    return path


def model_config(model: str, layers: int, **overrides):
    from esftctl.bench import synthetic_model

    make = {"deepseek-v2-lite": synthetic_model.deepseek_v2_lite_config,
            "qwen3-30b-a3b": synthetic_model.qwen3_30b_a3b_config}[model]
    return make(num_hidden_layers=layers, **overrides)


def _timed_steps(times: list[float]) -> Callable:
    def on_step(step: int, loss: float, tps: float) -> None:
        times.append(time.perf_counter())
    return on_step


def _per_second(times: list[float], tokens_per_step: int, warmup: int) -> float:
    """Tokens per second over the steps after the first `warmup` (each step's end is a synchronised time: the loss
    is read back)."""
    timed = times[warmup:]
    if len(timed) < 2:
        raise ValueError("too few steps to time: give more --steps than --warmup + 1")
    return tokens_per_step * (len(timed) - 1) / (timed[-1] - timed[0])


def _esft(method: str, base_dir: Path, data: Path, work: Path, settings, threshold: float, times: list) -> dict:
    from esftctl.train import train_adapter

    out = work / f"bundle-{method}"
    report = train_adapter(base_dir, data, out, method, settings, metric=method.split("-")[1], threshold=threshold,
                           on_step=_timed_steps(times))
    config = json.loads((base_dir / "config.json").read_text())
    experts = sum(report.experts_per_layer.values())
    return {"trained_parameters": report.trained_parameters, "model_parameters": report.model_parameters,
            "stored_bytes": sum(f.stat().st_size for f in out.iterdir()), "experts": experts,
            "expert_bytes": experts * 3 * config["moe_intermediate_size"] * config["hidden_size"] * 2,
            "experts_per_layer": report.experts_per_layer, "tokens": report.tokens}


def _baseline(method: str, base_dir: Path, data: Path, settings, times: list) -> dict:
    """FFT or LoRA over the batches `esftctl train` draws (the same examples, seeds and encoding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from esftctl.train import (
        _encode,
        deterministic,
        draw_batch,
        held_out,
        optimizer_step,
        read_examples,
        training_tokenizer,
    )

    tokenizer = training_tokenizer(base_dir)
    train, _ = held_out(read_examples(data, tokenizer), settings.eval_share, settings.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).to(device)
    total = sum(p.numel() for p in model.parameters())
    stored = 2 * total
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
        params = [p for p in model.parameters() if p.requires_grad]
        stored = sum(p.numel() * p.element_size() for p in params)
    else:
        params = list(model.parameters())
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    model.train()
    tokens = 0
    with deterministic():
        for step in range(settings.steps):
            enc = {k: v.to(device) for k, v in _encode(tokenizer, draw_batch(train, [], settings, step)).items()}
            loss = optimizer_step(model, enc, params, opt, settings.lr_at(step))
            tokens += int(enc["attention_mask"].sum())
            loss.item()  # the step's end, synchronised
            times.append(time.perf_counter())
    return {"trained_parameters": sum(p.numel() for p in params), "model_parameters": total, "stored_bytes": stored,
            "tokens": tokens}


def run_method(method: str, base_dir: str, data: str, work: str, settings: dict, threshold: float,
               warmup: int) -> dict:
    """One method's run in this process (a fresh one per method): its numbers, or {"error": ...} where it ran out of
    GPU memory. On a machine without a GPU (the tests) it trains on the CPU, and peak memory is not measured."""
    import os

    import torch

    from esftctl.train import TrainSettings

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    s = TrainSettings(**settings)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    try:
        if method.startswith("esft-"):
            out = _esft(method, Path(base_dir), Path(data), Path(work), s, threshold, times)
        else:
            out = _baseline(method, Path(base_dir), Path(data), s, times)
    except torch.OutOfMemoryError:
        return {"method": method, "error": "out of memory"}
    tokens_per_step = out["tokens"] // s.steps
    return {"method": method, **out, "tokens_per_second": _per_second(times, tokens_per_step, warmup),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if gpu else None, "steps": s.steps, "warmup": warmup}


def run(model: str = "deepseek-v2-lite", layers: int = 8, methods=METHODS, *, steps: int = 12, warmup: int = 3,
        batch_size: int = 8, prompt_len: int = 256, completion_len: int = 256, examples: int = 64,
        threshold: float = 0.2, gradient_checkpointing: bool = False, work: Path | None = None,
        config_overrides: dict | None = None, on_step: Callable[[str], None] = lambda msg: None) -> dict:
    """Train `model`'s shape (`config_overrides`: a smaller one, for tests) with each method, one process each."""
    import torch

    from esftctl.bench.synthetic_model import write_model

    gpu = torch.cuda.is_available()
    config = model_config(model, layers, **(config_overrides or {}))
    settings = {"steps": steps, "batch_size": batch_size, "lr": 1e-5, "eval_share": 0.0, "save_every": 0,
                "gradient_checkpointing": gradient_checkpointing}
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tmp = Path(tmp)
        on_step(f"writing a {model} checkpoint of {layers} layers")
        base_dir = write_model(tmp / "base", config, device="cuda" if gpu else "cpu")
        data = write_data(tmp / "data.jsonl", config.vocab_size, examples, prompt_len, completion_len, seed=0)
        rows = []
        ctx = multiprocessing.get_context("spawn")
        for method in methods:
            on_step(f"{method}: {steps} steps of {batch_size} examples")
            with ctx.Pool(1) as pool:
                rows.append(pool.apply(run_method, (method, str(base_dir), str(data), str(tmp), settings, threshold,
                                                    warmup)))
    return {"benchmark": "train", "model": model, "layers": layers,
            "device": torch.cuda.get_device_name() if gpu else "CPU",
            "steps": steps, "warmup": warmup, "batch_size": batch_size, "tokens_per_example": prompt_len +
            completion_len, "threshold": threshold, "gradient_checkpointing": gradient_checkpointing, "rows": rows}


def table(result: dict):
    from rich.table import Table

    fft = next((r for r in result["rows"] if r["method"] == "fft" and "error" not in r), None)

    def ratio(r: dict, key: str) -> str:
        return f"{r[key] / fft[key]:.2f}x" if fft and r[key] is not None and fft[key] else "-"

    t = Table(title=f"Training {result['model']} ({result['layers']} layers) on {result['device']}: "
                    f"{result['batch_size']} x {result['tokens_per_example']} tokens a step, "
                    f"{result['steps'] - result['warmup']} steps timed", header_style="bold")
    for col in ("method", "tokens/s", "vs FFT", "peak GB", "vs FFT ", "trained params", "stored GB", "experts"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        if "error" in r:
            t.add_row(r["method"], r["error"], "-", "-", "-", "-", "-", "-")
            continue
        t.add_row(r["method"], f"{r['tokens_per_second']:,.0f}", ratio(r, "tokens_per_second"),
                  f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-", ratio(r, "peak_gb"),
                  f"{r['trained_parameters'] / 1e6:,.1f} M ({r['trained_parameters'] / r['model_parameters']:.1%})",
                  f"{r['stored_bytes'] / 1e9:.3f}", str(r.get("experts", "-")))
    return t


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar([r["method"] for r in ok], [r["tokens_per_second"] for r in ok])
    a.set_ylabel("tokens / s")
    b.bar([r["method"] for r in ok], [r["peak_gb"] or 0 for r in ok])
    b.set_ylabel("peak GPU memory, GB")
    fig.suptitle(f"{result['model']}, {result['layers']} layers, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
