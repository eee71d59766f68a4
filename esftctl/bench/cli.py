"""`esftctl bench ...` subcommands: run a measurement, print its tables, write JSON and a PNG plot."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from esftctl.atomic import atomic_file
from esftctl.bench.turnaround import SETUPS as SERVE_SETUPS
from esftctl.errors import EsftError

app = typer.Typer(help="Measure esftctl against its baselines (tables, JSON and plots).", no_args_is_help=True)
console = Console(width=None if sys.stdout.isatty() else 220)  # logs keep whole table rows
EXTRA = ("peft", "zstandard")  # what only the benchmarks use: the [bench] extra (pyproject.toml)


@app.callback()
def _needs_the_extra() -> None:
    """Every `esftctl bench` command needs the [bench] extra: without it, one line saying what to install."""
    missing = [m for m in EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise EsftError(f"esftctl bench needs {', '.join(missing)}, which a plain install leaves out: "
                        "pip install 'esftctl[bench]'")


OUT_HELP = "Folder for the JSON results and the PNG plot (created if missing)."


def _save(result: dict, out: Path, name: str, plot) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    with atomic_file(out / f"{name}.png") as tmp:
        plot(result, tmp)
    console.print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")


def _measure(bench, name: str, out: Path, as_json: bool, *args, **kwargs) -> None:
    """Run `bench.run(*args, **kwargs)` under a status line, print its table(s) or JSON, save JSON and plot."""
    with console.status("measuring") as status:
        def step(msg: str) -> None:
            if console.is_terminal:
                status.update(f"measuring: {msg}")
            else:  # a log line per step where no one watches a spinner (CI, nohup)
                print(time.strftime("%H:%M:%S"), msg, flush=True)
        result = bench.run(*args, **kwargs, on_step=step)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        for table in bench.tables(result) if hasattr(bench, "tables") else [bench.table(result)]:
            console.print(table)
    _save(result, out, name, bench.plot)


def _counts(option: str, text: str, minimum: int = 1) -> tuple[int, ...]:
    """A comma-separated list of whole numbers of at least `minimum`, or a one-line error naming the option."""
    from esftctl.errors import EsftError

    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise EsftError(f"{option} takes comma-separated whole numbers (such as 1,8,64), not {text!r}") from None
    if min(counts) < minimum:
        raise EsftError(f"{option} {text!r}: every number must be at least {minimum}")
    return counts


@app.command()
def memory(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    backend: str = typer.Option("auto", metavar="[auto|cuda|accounting]",
                                help="cuda (real GPU mappings and counters), accounting (allocator only, any machine), "
                                     "or auto (cuda when a GPU is present)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
) -> None:
    """Adapter expert memory: padding vs virtual weight tensors vs merged models (DeepSeek-V2-Lite, Table 1
    adapters)."""
    from esftctl.bench import memory as bench
    from esftctl.errors import EsftError

    if backend not in ("auto", "cuda", "accounting"):
        raise EsftError(f"unknown backend {backend!r} (choose auto, cuda or accounting)")
    _measure(bench, "memory", out, as_json, backend)


@app.command()
def reroute(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of tables.", metavar=""),
) -> None:
    """Rerouting cost in a DeepSeek-V2-Lite MoE layer on the GPU: fused vs unfused, and 1-20 adapters vs base."""
    from esftctl.bench import reroute as bench

    _measure(bench, "reroute", out, as_json)


@app.command()
def compress(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    experts: str = typer.Option("1,8,64", help="Comma-separated expert counts (64 = one DeepSeek-V2-Lite layer)."),
    table_scope: str = typer.Option("layer", metavar="[layer|tensor]", help="Code tables per layer or per tensor."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
) -> None:
    """Huffman expert stores: size vs entropy bound and general-purpose compressors; GPU decode vs bandwidth."""
    from esftctl.bench import compress as bench

    _measure(bench, "compress", out, as_json, counts=_counts("--experts", experts), table_scope=table_scope)


@app.command()
def offline(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    layers: int = typer.Option(27, min=2, help="Layers of the generated DeepSeek-V2-Lite-shaped checkpoint (27: the "
                                                "real model, 31.4 GB each; about 1.2 GB per MoE layer)."),
    root: Path = typer.Option(None, help="Where the generated checkpoints are cached (default: "
                                         "~/.cache/esftctl/offline-bench). The base, an ESFT fine-tune and three full "
                                         "fine-tunes: five checkpoints."),
    work: Path = typer.Option(None, help="Scratch folder for the commands' outputs (default: a folder under --root); "
                                         "needs about two checkpoints free."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
) -> None:
    """Every offline command (inspect, pack, merge, compress, decompress, consolidate, materialize) on a generated
    DeepSeek-V2-Lite-shaped checkpoint, each timed with its peak memory against the disk's measured speed."""
    import shutil

    from esftctl.bench import offline as bench

    root = root or Path.home() / ".cache" / "esftctl" / "offline-bench"
    work = work or root / f"work-{layers}l"
    if work.exists():
        shutil.rmtree(work)  # the outputs of an earlier (perhaps interrupted) run
    try:
        _measure(bench, "offline", out, as_json, layers=layers, root=root, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@app.command()
def consolidate(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    steps: int = typer.Option(200, min=1, help="Full fine-tuning steps per variant (cached in the world)."),
    eval_examples: int = typer.Option(40, min=1, help="Held-out examples per task."),
    capacities: str = typer.Option("100,90,75,50,25,0", help="The sweep's capacities, in percent of the expert "
                                                             "positions loaded (100: every position shared)."),
    serve: bool = typer.Option(False, "--serve", metavar="",
                               help="Also serve the sweep's variants: `esftctl serve --variants` (a variant per "
                                    "step, and with --one-step all in one step) against one plain vLLM server per "
                                    "variant and whole-model swapping, same traffic (a few minutes more)."),
    setups: str = typer.Option(",".join(SERVE_SETUPS), help="With --serve: the set-ups served, comma-separated: "
                                                            + "; ".join(f"{k} ({v})" for k, v in SERVE_SETUPS.items())
                                                            + "."),
    serve_capacity: int = typer.Option(50, min=0, max=100, help="With --serve: the map served, in percent of the "
                                                                "positions loaded."),
    rate: float = typer.Option(2.0, min=0.01, help="With --serve: Poisson request rate, requests per second (inf: "
                                                    "every request at once, for throughput)."),
    requests: int = typer.Option(24, min=1, help="With --serve: requests in the run."),
    serve_only: bool = typer.Option(False, "--serve-only", help="Only the serving part (implies --serve): the quality "
                                                                "runs are the same on any machine.", metavar=""),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
) -> None:
    """Consolidated vs own vs weight-averaged variants of the tiny world: for 2, 3 and 4 variants with every
    position loaded, then for 3 variants over a sweep of capacities (quality against expert memory), and with
    --serve their turnaround served three ways."""
    from esftctl.bench import consolidate as bench

    fractions = tuple(c / 100 for c in _counts("--capacities", capacities, minimum=0))
    if max(fractions) > 1:
        from esftctl.errors import EsftError

        raise EsftError(f"--capacities {capacities!r}: percentages run from 0 to 100")
    chosen = tuple(x.strip() for x in setups.split(","))
    unknown = [x for x in chosen if x not in SERVE_SETUPS]
    if unknown or not chosen:
        from esftctl.errors import EsftError

        raise EsftError(f"--setups: {unknown[0] if unknown else setups!r} is not a set-up; pick from "
                        + ", ".join(SERVE_SETUPS))
    quality = {"counts": (), "capacities": ()} if serve_only else {"capacities": fractions}
    _measure(bench, "consolidate", out, as_json, steps=steps, eval_examples=eval_examples, **quality,
             serve=serve or serve_only, serve_fraction=serve_capacity / 100, rate=rate, requests=requests,
             work=out / "serve-work", setups=chosen)


def _rates(text: str) -> tuple[float, ...]:
    from esftctl.errors import EsftError

    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise EsftError(f"--rates takes comma-separated requests per second (such as 1,2,5,inf), not {text!r}"
                        ) from None
    if not all(r > 0 for r in rates):  # also refuses nan
        raise EsftError(f"--rates {text!r}: every rate must be above 0 (inf: all requests at once)")
    return rates


def _alphas(text: str) -> tuple[float, ...]:
    from esftctl.errors import EsftError

    try:
        alphas = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise EsftError(f"--alphas takes comma-separated S-LoRA skews (such as 1,0.6,0.3,0.1), not {text!r}") from None
    if not all(0 < a < 1e6 for a in alphas):  # also refuses nan and inf
        raise EsftError(f"--alphas {text!r}: every alpha must be above 0 (1: uniform; smaller: more skewed)")
    return alphas


@app.command()
def serve(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP + " Also the slices' folder "
                                                                    "(slices/MODEL/GRID/DEVICE/SERVER/[PART.]rN.json): "
                                                                    "slices found there are not run again; the "
                                                                    "report is serve-GRID-DEVICE.json and .png. "
                                                                    "vLLM's own result files go beside, in "
                                                                    "vllm-results/ (and vllm-micro/)."),
    model: str = typer.Option("tiny", help="tiny (the tiny world, CPU-sized) or deepseek-v2-lite (GPU only: a 31 GB "
                                           "model generated on demand; its default 20 Table 1 adapters plus 5 "
                                           "DeepSeek-sized ones take 69 GB more: an H200, or --adapter-shape "
                                           "deepseek (20 adapters, 41 GB) or --adapters up to 10 on an 80 GB GPU)."),
    work: Path = typer.Option(None, help="Folder for the generated base and the servers' state (default "
                                         "~/.cache/esftctl/bench-serve-MODEL); a generated base is reused."),
    scratch: Path = typer.Option(None, help="Folder for the merged copy, adapter bundles and LoRA adapters "
                                            "(default: --work); put it on another disk if one lacks room."),
    adapters: str = typer.Option(None, help="Comma-separated adapter counts to spread requests over; 0 = the base "
                                            "through the runtime (default per model: tiny 0,1,2; "
                                            "deepseek-v2-lite 0,1,5,10,20)."),
    adapter_shape: str = typer.Option(None, metavar="[table1|deepseek]",
                                      help="deepseek-v2-lite: the adapters the counts use: table1 (ExpertWeave's "
                                           "Table 1, 100-247 experts; 5 DeepSeek-sized ones run beside at the "
                                           "highest rate) or deepseek (DeepSeek's published sizes, 83-153 experts) "
                                           "(default table1)."),
    rates: str = typer.Option(None, help="Comma-separated request rates per second, inf = all at once "
                                         "(default: tiny 8,inf; deepseek-v2-lite 1,2,5,inf)."),
    duration: float = typer.Option(None, min=0.1, help="Seconds of arrivals per run at a finite rate: rate x "
                                                       "duration requests (default: tiny 1.5, deepseek-v2-lite 60; "
                                                       "ExpertWeave ran 100)."),
    prompts: int = typer.Option(None, min=2, help="Requests per run at rate inf (default per model: 12 or 256)."),
    repeats: int = typer.Option(None, min=1, help="Rounds: every server started anew for each, the servers "
                                                  "interleaved; the median over rounds is reported with ranges and "
                                                  "TTFT's spread (default: tiny 2, deepseek-v2-lite 3). More rounds "
                                                  "later add to the slices already there."),
    alphas: str = typer.Option(None, help="Comma-separated S-LoRA skews of the request shares: adapter i of N gets "
                                          "((i+1)/N)^alpha - (i/N)^alpha, drawn per request (1: uniform, 0.1: the "
                                          "first of 20 gets 74%); the first at every count, the others at the "
                                          "largest (default: tiny 1,0.3; deepseek-v2-lite 1,0.6,0.3,0.1)."),
    cv: float = typer.Option(None, help="Coefficient of variation of the gaps between arrivals, Gamma-distributed "
                                        "(1: Poisson, the default; above 1 burstier; vLLM's --burstiness 1/cv^2)."),
    micro_runs: int = typer.Option(None, min=0, help="Requests per prompt length and batch size in the "
                                                     "microbenchmarks (batch-1 TTFT by prompt length, TPOT after a "
                                                     "long prompt by batch size; 0 skips them; default: tiny 3, "
                                                     "deepseek-v2-lite 10)."),
    capture_size: int = typer.Option(None, min=0, help="vLLM's --max-cudagraph-capture-size for every server: "
                                                       "steps of up to this many tokens replay CUDA graphs, longer "
                                                       "ones run eagerly (0: vLLM's default, twice --max-num-seqs "
                                                       "up to 512; default: tiny 0, deepseek-v2-lite 512, so that "
                                                       "a 256-token prompt's prefill beside decodes is graphed). "
                                                       "Part of the grid's key."),
    servers: str = typer.Option(None, help="Comma-separated servers to measure, of base (plain vLLM, the anchor: "
                                           "always), merged, esftctl and lora (vLLM multi-LoRA, GPU only: vLLM's "
                                           "CPU build has no MoE LoRA kernel; --max-loras is the largest "
                                           "--adapters count); default all there are."),
    merged_copies: int = typer.Option(0, min=0, help="Merged copies served side by side, each with its share of "
                                                     "the device, adapter i's requests to copy i mod copies (0: as "
                                                     "many as fit, one fewer after a failed start; 1 on the CPU "
                                                     "build)."),
    group_adapters: int = typer.Option(0, min=0, help="Also measure `esftctl serve --group-adapters N`: at most N "
                                                      "adapters (the base counts as one) per engine step (0: "
                                                      "not)."),
    group_wait: int = typer.Option(8, min=1, help="With --group-adapters: `esftctl serve --group-wait`, engine "
                                                  "steps a request may be held back before it must run."),
    max_loras: int = typer.Option(0, min=0, help="Also measure esftctl serve with vLLM's --max-loras N, below the "
                                                 "adapter count: at most N adapters among the running requests, "
                                                 "the others wait to be admitted (0: not)."),
    admit_by_adapter: float = typer.Option(None, min=0.0, metavar="SECONDS",
                                           help="Also measure `esftctl serve --admit-by-adapter SECONDS`: queued "
                                                "requests of the adapters already running admitted first, none "
                                                "passed over longer (esftctl's own server does so within 10 s, its "
                                                "default; 0 measures vLLM's first-come-first-served order)."),
    parallel: str = typer.Option("1", help="Comma-separated tensor-parallel sizes: every server is measured at "
                                           "each (1,2: what a second GPU buys, as tok/s against the first size). On "
                                           "the CPU build each rank of a larger size gets one core "
                                           "(VLLM_CPU_OMP_THREADS_BIND, unless set)."),
    expert_parallel: bool = typer.Option(False, "--expert-parallel", metavar="",
                                         help="Sizes above 1 run vLLM's expert parallelism (GPU only: vLLM's CPU "
                                              "MoE kernel ignores expert maps)."),
    slice_by: str = typer.Option(None, metavar="[server|adapters]",
                                 help="One slice (one JSON, written as it ends) is a server's whole round, or one "
                                      "adapter count of esftctl's and multi-LoRA's round, the counts of a round on "
                                      "one server start (default: tiny server; deepseek-v2-lite adapters: a "
                                      "run interrupted mid-round keeps the counts it finished)."),
    budget: float = typer.Option(None, min=0, help="Seconds of slices to run now: a slice whose estimate (its "
                                                   "server's longest measured slice, else defaults) would overrun "
                                                   "is left for the next run, later ones that fit still run "
                                                   "(default: no limit)."),
    only_rounds: str = typer.Option(None, metavar="R[,R]",
                                    help="Run only these rounds of the grid here (0-based; the microbenchmarks "
                                         "belong to round 0), the base's too: the cards of one host each take "
                                         "their own, and each pairs with the base's run of the same round on "
                                         "its own card (benchmarks/lab/gpu_cards.sh). Default: every round."),
    report_only: bool = typer.Option(False, "--report", metavar="",
                                     help="Only merge the slices of this grid found under --out into the report "
                                          "(no GPU needed): the same options as the run that wrote them."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of tables.", metavar=""),
) -> None:
    """ExpertWeave's protocol: TTFT, TPOT, prefill and decode speed (vLLM bench serve; power-law adapter shares,
    Gamma arrivals) of plain vLLM (base, merged copies), esftctl serve over 0-20 adapters (and grouped, admitted by
    adapter, or under --max-loras) and vLLM multi-LoRA; microbenchmarks; KV-cache room; adapter load time. Runs in
    slices that resume: a rerun skips what is under --out."""
    from esftctl.bench import serve as bench
    from esftctl.bench.serve_models import SHAPES
    from esftctl.errors import EsftError

    if slice_by is not None and slice_by not in bench.SLICE_BY:
        raise EsftError(f"unknown --slice-by {slice_by!r} (choose {' or '.join(bench.SLICE_BY)})")
    if model not in bench.PROFILES:
        raise EsftError(f"unknown --model {model!r} (choose {' or '.join(bench.PROFILES)})")
    if adapter_shape is not None and adapter_shape not in SHAPES:
        raise EsftError(f"unknown --adapter-shape {adapter_shape!r} (choose {' or '.join(SHAPES)})")
    if cv is not None and not 0 < cv < 100:
        raise EsftError(f"--cv {cv}: choose a coefficient of variation above 0 (1: Poisson) and below 100")
    counts = tuple(sorted(set(_counts("--adapters", adapters, minimum=0)))) if adapters else None
    chosen = tuple(servers.split(",")) if servers else None
    unknown = [s for s in chosen or () if s not in bench.SERVERS]
    if unknown:
        raise EsftError(f"--servers: unknown {', '.join(repr(s) for s in unknown)} (choose from "
                        f"{', '.join(bench.SERVERS)})")
    most = max(counts or bench.PROFILES[model].counts)
    if max_loras and max_loras >= most:
        raise EsftError(f"--max-loras {max_loras}: choose fewer than the largest adapter count ({most}), or it "
                        "bounds nothing")
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not report_only and (model != "tiny" or "lora" in (chosen or ()) or expert_parallel):
        raise EsftError("--model deepseek-v2-lite, --servers lora and --expert-parallel need a GPU (vLLM's CPU build "
                        "would take hours on the first, and has no MoE LoRA kernel and no expert maps in its MoE "
                        "kernel for the others)")
    sizes = tuple(dict.fromkeys(_counts("--parallel", parallel, minimum=1)))
    available = torch.cuda.device_count() if gpu else len(os.sched_getaffinity(0))
    if max(sizes) > available and not report_only:
        raise EsftError(f"--parallel {parallel!r}: {max(sizes)} ranks, but this machine has {available} "
                        f"{'GPUs' if gpu else 'cores'}")
    profile, options = bench.configure(
        model, gpu=gpu or (report_only and model != "tiny"), counts=counts, rates=_rates(rates) if rates else None,
        duration=duration, prompts=prompts, repeats=repeats, alphas=_alphas(alphas) if alphas else None, cv=cv,
        shape=adapter_shape, micro_runs=micro_runs, slice_by=slice_by, capture_size=capture_size, servers=chosen,
        group_adapters=group_adapters, group_wait=group_wait, max_loras=max_loras,
        admit_by_adapter=admit_by_adapter, merged_copies=merged_copies,
        parallel=sizes, expert_parallel=expert_parallel)
    rounds = tuple(_counts("--only-rounds", only_rounds, minimum=0)) if only_rounds else None
    if rounds and max(rounds) >= profile.repeats:
        raise EsftError(f"--only-rounds {only_rounds}: the grid has rounds 0 to {profile.repeats - 1} (--repeats)")
    _serve_slices(bench, profile, options, out=out, work=work, scratch=scratch, gpu=gpu, budget=budget,
                  rounds=rounds, report_only=report_only, as_json=as_json)


def _serve_slices(bench, profile, options, *, out: Path, work: Path | None, scratch: Path | None, gpu: bool,
                  budget: float | None, rounds: tuple[int, ...] | None, report_only: bool,
                  as_json: bool) -> None:
    """Run the grid's pending slices (unless `report_only`), then merge the slices there into one report per
    device: tables (or JSON), serve-GRID-DEVICE.json and .png."""
    import math

    from esftctl.bench import serve_slices
    from esftctl.bench.serve_models import default_work

    out.mkdir(parents=True, exist_ok=True)
    if not report_only:
        def step(msg: str) -> None:
            print(time.strftime("%H:%M:%S"), msg, file=sys.stderr if as_json else sys.stdout, flush=True)
        work = work or default_work(profile.model)
        done = serve_slices.run(profile, options, out=out, work=work, scratch=scratch or work, gpu=gpu,
                                budget_s=math.inf if budget is None else budget, rounds=rounds,
                                on_step=step)
        step(f"{len(done['ran'])} slices ran, {len(done['left'])} left")
    results = serve_slices.report(out, profile, options)
    if not results:
        raise EsftError(f"no slices of grid {serve_slices.grid_key(profile)} under {out / 'slices' / profile.model}: "
                        "run it first, or give the options of the run that wrote them")
    if as_json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    for result in results:
        if not as_json:
            for table in bench.tables(result):
                console.print(table)
        _save(result, out, "serve-" + result["grid"].replace("/", "-"), bench.plot)


@app.command()
def paging(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP + " With --serve: the slices' folder too "
                                                                    "(slices/MODEL/REGIME/SERVER/rN.json); slices "
                                                                    "found there are not run again."),
    layers: int = typer.Option(None, min=3, help="MoE layers in the stack (default 8); with --serve, the generated "
                                                 "model's layers (default: deepseek-v2-lite 27, qwen3-30b-a3b 32)."),
    window: int = typer.Option(2, min=1, help="Physical blocks (layers of experts) the paged stack holds."),
    batches: str = typer.Option("1,4,32,256", help="Comma-separated batch sizes (sequences)."),
    prompt_len: int = typer.Option(512, min=1, help="Tokens per sequence in prefill."),
    eager: bool = typer.Option(False, "--eager", help="Time decode steps eagerly instead of replaying CUDA graphs "
                                                      "(on both sides).", metavar=""),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
    serve: bool = typer.Option(False, "--serve", metavar="",
                               help="(GPU) Instead of the stack: FluxMoE's evaluation end to end, whole servers under "
                                    "vLLM's bench serve (esftctl.bench.serve_paging), run in slices of one server "
                                    "and round each, then merged into tables, paging_serve.json and .png."),
    model: str = typer.Option("deepseek-v2-lite", help="--serve: deepseek-v2-lite or qwen3-30b-a3b (generated)."),
    regimes: str = typer.Option("memory-bound,spare,machinery", help="--serve: comma-separated regimes."),
    servers: str = typer.Option(None, help="--serve: comma-separated servers, each regime keeping those of its own "
                                           "(vllm, resident, compressed, host, adaptive, machinery, "
                                           "machinery-store; NAME+adapters for esftctl ones; default: all)."),
    rounds: int = typer.Option(3, min=1, help="--serve: rounds (interleaved repeats) of every server."),
    budget: float = typer.Option(540, min=0, help="--serve: seconds of slices to run now; a slice whose estimate "
                                                  "would overrun is left for the next run, later ones that fit "
                                                  "still run."),
    prompts: int = typer.Option(None, min=1, help="--serve: requests of the memory-bound point (default 256)."),
    work: Path = typer.Option(None, help="--serve: folder of the generated base, its store and the servers' state "
                                         "(default ~/.cache/esftctl/bench-paging-serve-MODEL)."),
    scratch: Path = typer.Option(None, help="--serve: folder of the adapter bundles (default: --work)."),
    report_only: bool = typer.Option(False, "--report", metavar="",
                                     help="--serve: only merge the slices found under --out (no GPU needed)."),
) -> None:
    """(GPU) DeepSeek-V2-Lite-sized MoE stack: resident vs the pager alone, paged from host, from a compressed tier
    on the GPU, both, and planned; decode from CUDA graphs. With --serve: the same pager end to end in vLLM."""
    from esftctl.bench import paging as bench
    from esftctl.errors import EsftError

    if serve or report_only:
        _paging_serve(out, model=model, regimes=regimes, servers=servers, rounds=rounds, budget=budget,
                      prompts=prompts, layers=layers, work=work, scratch=scratch, report_only=report_only,
                      as_json=as_json)
        return
    layers = layers or 8
    sizes = _counts("--batches", batches)
    if window >= layers:
        raise EsftError(f"--window {window} must be smaller than --layers {layers}, or nothing is paged")
    _measure(bench, "paging", out, as_json, layers=layers, batches=sizes, prompt_len=prompt_len, window=window,
             eager=eager)


def _paging_serve(out: Path, *, model: str, regimes: str, servers: str | None, rounds: int, budget: float,
                  prompts: int | None, layers: int | None, work: Path | None, scratch: Path | None,
                  report_only: bool, as_json: bool) -> None:
    from esftctl.bench import serve_paging as bench
    from esftctl.errors import EsftError

    chosen = tuple(regimes.split(","))
    unknown = [r for r in chosen if r not in bench.REGIMES]
    if unknown or model not in ("deepseek-v2-lite", "qwen3-30b-a3b"):
        raise EsftError(f"--regimes {regimes} / --model {model}: regimes of {', '.join(bench.REGIMES)}; models "
                        "deepseek-v2-lite or qwen3-30b-a3b")
    names = tuple(servers.split(",")) if servers else None
    for name in names or ():
        try:
            bench.server_spec(name)
        except ValueError as e:
            raise EsftError(f"--servers: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    if not report_only:
        def step(msg: str) -> None:
            print(time.strftime("%H:%M:%S"), msg, flush=True)
        work = work or Path.home() / ".cache" / "esftctl" / f"bench-paging-serve-{model}"
        done = bench.run(model, out=out, work=work, scratch=scratch, regimes=chosen, servers=names, rounds=rounds,
                         budget_s=budget, layers=layers, prompts=prompts, on_step=step)
        print(f"{len(done['ran'])} slices ran, {len(done['left'])} left", flush=True)
    result = bench.report(out)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        for table in bench.tables(result):
            console.print(table)
    bench.plot(result, out / "paging_serve.png")


@app.command()
def esft(
    out: Path = typer.Option(Path("bench-results"), help="Folder for results.json and results.png (created if "
                                                         "missing)."),
    tasks: str = typer.Option(None, help="Comma-separated tasks of the tiny world (default: all of them)."),
    methods: str = typer.Option("esft-token,esft-gate,fft,lora",
                                help="Comma-separated methods: esft-token (token selection ratio, p=0.2), esft-gate "
                                     "(average gate score, p=0.1), fft (every weight), lora (rank 8, peft)."),
    steps: int = typer.Option(None, help="Fine-tuning steps per run (default: the recipe's, "
                                         "esftctl.world.esft.FINETUNE)."),
    fft_lr: float = typer.Option(1e-3, help="Learning rate of full fine-tuning only (ESFT trains at the recipe's "
                                            "1e-2, which wipes out the base when every weight moves)."),
    replay: float = typer.Option(None, help="Share of every batch drawn from the general mixture, for every method "
                                            "alike (default: the recipe's, esftctl.world.esft.FINETUNE: 0.75; 0 "
                                            "trains on task data alone, as the paper's fine-tunes do)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of tables.", metavar=""),
) -> None:
    """The ESFT paper's comparison in miniature: ESFT (token, gate) vs full fine-tuning vs LoRA on every task of
    the tiny world: task exact match, general ability kept, trainable parameters, storage, training time."""
    import tempfile

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from esftctl.bench import esft as bench
    from esftctl.errors import EsftError
    from esftctl.world.build import World, build_world, default_world_dir

    known = World(default_world_dir()).task_names
    chosen_tasks = tasks.split(",") if tasks else known
    chosen_methods = methods.split(",")
    for option, chosen, allowed in (("--tasks", chosen_tasks, known), ("--methods", chosen_methods, bench.METHODS)):
        unknown = [x for x in chosen if x not in allowed]
        if unknown:
            raise EsftError(f"{option}: unknown {', '.join(repr(x) for x in unknown)} (choose from "
                            f"{', '.join(allowed)})")
    if steps is not None and steps < 1:
        raise EsftError(f"--steps {steps}: must be at least 1")
    if not fft_lr > 0:
        raise EsftError(f"--fft-lr {fft_lr}: must be above 0")
    if replay is not None and not 0 <= replay < 1:
        raise EsftError(f"--replay {replay}: must be at least 0 and below 1")
    err = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not err.is_terminal) as progress, \
            tempfile.TemporaryDirectory(prefix="esftctl-bench-esft-") as work:
        stage = progress.add_task("building the tiny world", total=None, loss="")
        bars: dict[str, int] = {}

        def on_step(what: str, step: int, total: int, loss: float | None) -> None:
            if not total:  # a stage other than training
                progress.update(stage, description=what)
                if not err.is_terminal:
                    print(time.strftime("%H:%M:%S"), what, file=sys.stderr, flush=True)
                return
            if what not in bars:
                bars[what] = progress.add_task(f"training {what}", total=total, loss="")
            progress.update(bars[what], completed=step, loss=f"loss {loss:.3f}")
            if not err.is_terminal and (step == 1 or step == total or step % max(1, total // 4) == 0):
                print(time.strftime("%H:%M:%S"), f"training {what}: step {step}/{total}, loss {loss:.3f}",
                      file=sys.stderr, flush=True)

        world = build_world(log=lambda msg: on_step(msg, 0, 0, None))
        result = bench.run(world, tasks=chosen_tasks, methods=chosen_methods, steps=steps, work_dir=Path(work),
                           fft_lr=fft_lr, replay=replay, on_step=on_step)
        progress.update(stage, description="done", total=1, completed=1)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        for table in bench.tables(result):
            console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "results.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    with atomic_file(out / "results.png") as tmp:
        bench.plot(result, tmp)
    print(f"wrote {out / 'results.json'} and {out / 'results.png'}", file=sys.stderr if as_json else sys.stdout)


@app.command()
def train(
    out: Path = typer.Option(Path("bench-results"), help=OUT_HELP),
    model: str = typer.Option("deepseek-v2-lite", metavar="[deepseek-v2-lite|qwen3-30b-a3b]",
                              help="The shape trained: a synthetic checkpoint of this model's structure (random "
                                   "trained-like weights, written to a temporary folder under --work)."),
    layers: int = typer.Option(8, min=2, help="Decoder layers of the checkpoint (the first dense ones included): as "
                                              "many as full fine-tuning fits on the card, to compare with it."),
    methods: str = typer.Option("esft-token,esft-gate,fft,lora",
                                help="Comma-separated: esft-token / esft-gate (`esftctl train`, --metric token or "
                                     "gate at -p), fft (every weight, bf16 AdamW), lora (peft, rank 8, every linear "
                                     "layer)."),
    steps: int = typer.Option(12, min=2, help="Optimizer steps per method."),
    warmup: int = typer.Option(3, min=0, help="Steps left out of the timing (compilation, allocator warm-up)."),
    batch_size: int = typer.Option(8, min=1, help="Examples a step."),
    seq_len: int = typer.Option(512, min=4, help="Tokens an example (half prompt, half completion)."),
    threshold: float = typer.Option(0.2, "-p", "--threshold", help="ESFT's selection threshold (esftctl train -p)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing",
                                                help="Recompute activations in the backward pass, for every method.",
                                                metavar=""),
    work: Path = typer.Option(None, help="Folder for the checkpoint and bundles while measuring (default: the "
                                         "system's temporary folder; DeepSeek-V2-Lite's 27 layers take 31 GB)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table.", metavar=""),
) -> None:
    """ESFT's training cost against full fine-tuning and LoRA on this GPU: tokens per second, peak memory, parameters
    trained and bytes stored, the same data, batches and steps for every method (GPU only)."""
    from esftctl.bench import train as bench

    chosen = tuple(m.strip() for m in methods.split(","))
    unknown = [m for m in chosen if m not in bench.METHODS]
    if unknown:
        raise EsftError(f"--methods: unknown {unknown[0]!r} (choose from {', '.join(bench.METHODS)})")
    if model not in bench.MODELS:
        raise EsftError(f"--model {model!r}: choose from {', '.join(bench.MODELS)}")
    if warmup + 2 > steps:
        raise EsftError(f"--steps {steps}: at least --warmup + 2 ({warmup + 2}), so that some steps are timed")
    import torch

    if not torch.cuda.is_available():
        raise EsftError("esftctl bench train measures training on a GPU, and this machine has no CUDA GPU")
    _measure(bench, "train", out, as_json, model=model, layers=layers, methods=chosen, steps=steps, warmup=warmup,
             batch_size=batch_size, prompt_len=seq_len // 2, completion_len=seq_len - seq_len // 2,
             threshold=threshold, gradient_checkpointing=gradient_checkpointing, work=work)
