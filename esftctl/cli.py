"""The `esftctl` command line."""

from __future__ import annotations

import contextlib
import json
from itertools import islice
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from esftctl.atomic import check_output
from esftctl.bench.cli import app as bench_app
from esftctl.errors import EsftError
from esftctl.runtime.serve_config import API_KEY_ENV

app = typer.Typer(
    help="Prepare and serve Expert-Specialized Fine-Tuning (ESFT) adapters of Mixture-of-Experts models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True, highlight=False)


# Options many commands share, declared once.
AsJson = Annotated[bool, typer.Option("--json", metavar="", help="Print the result as JSON (for scripts).")]
OVERWRITE_HELP = "Replace an existing output (checked, with the rest of the output path, before any work)."
Overwrite = Annotated[bool, typer.Option("--overwrite", metavar="", help=OVERWRITE_HELP)]


def _must_exist(ctx: typer.Context, param, value):
    """A path argument or option that must exist, checked as the command line is parsed: before any heavy import,
    so a mistyped path is one line within a second, naming the path and what it was given as."""
    import os

    for path in value if isinstance(value, (list, tuple)) else [value]:
        if path is not None and not os.path.lexists(path):
            what = param.opts[0] if param.param_type_name == "option" else param.name.upper()
            raise EsftError(f"no such file or folder ({what} of `{ctx.command_path}`)", path)
    return value


def _version(value: bool) -> None:
    if value:
        from esftctl import __version__

        print(f"esftctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.", metavar=""),
          allow_unprotected: bool = typer.Option(
              False, "--allow-unprotected", metavar="",
              help="Also read files of older format versions that carry no checksum over their headers (version 1 "
                   "bundles, version 2 stores): refused otherwise, since a change to them would go unnoticed. "
                   "Give it before the command: `esftctl --allow-unprotected inspect OLD_BUNDLE`.")) -> None:
    """Prepare and serve Expert-Specialized Fine-Tuning (ESFT) adapters of Mixture-of-Experts models."""
    if allow_unprotected:
        from esftctl.formats import unprotected

        unprotected.allow()  # in the environment: a server's engine processes read bundles too


app.add_typer(bench_app, name="bench")


@app.command()
def inspect(
    paths: list[Path] = typer.Argument(..., help="A model folder, an adapter bundle, or several bundles of one base.",
                                       callback=_must_exist),
    as_json: AsJson = False,
) -> None:
    """Describe a MoE model folder or adapter bundles (experts per layer, sparsity, padding's fragmentation)."""
    from esftctl.describe import describe_bundle_set, describe_path, render

    descriptions = [describe_path(p) for p in paths]
    if len(descriptions) == 1:
        description = descriptions[0]
    elif all(d["kind"] == "bundle" for d in descriptions):
        description = describe_bundle_set(descriptions)
    else:
        raise EsftError("several paths must all be adapter bundles")
    if as_json:
        print(json.dumps(description, indent=2))
    else:
        console.print(render(description))


@app.command()
def relevance(
    model: Path = typer.Argument(..., help="The base model folder.", callback=_must_exist),
    data: Path = typer.Argument(..., help="Task data: JSONL with 'prompt' and 'completion' per line.",
                                callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Scores file to write (JSON)."),
    max_examples: int = typer.Option(1000, min=1, help="Score at most this many examples (the file's first)."),
    batch_size: int = typer.Option(16, min=1, help="Examples per forward pass."),
    scored_tokens: str = typer.Option("all", metavar="[all|completion]",
                                      help="Tokens to score: all (prompt and completion) or completion (the "
                                           "positions that predict the completion, which fine-tuning trains)."),
    metric: str = typer.Option("gate", metavar="[gate|token]",
                               help="Metric shown in the table: gate (average gate score) or token (token selection "
                                    "ratio). The file holds both."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Score every routed expert of every MoE layer on task data with both ESFT metrics."""
    from rich.progress import Progress

    from esftctl.jsonl import read_jsonl
    from esftctl.relevance import METRICS, SCORED, compute_relevance, relevance_table

    if metric not in METRICS:
        raise EsftError(f"unknown metric {metric!r} (choose gate or token)")
    if scored_tokens not in SCORED:
        raise EsftError(f"unknown --scored-tokens {scored_tokens!r} (choose all or completion)")
    check_output(out, overwrite=overwrite)  # before scoring, which takes a while
    examples = list(islice(read_jsonl(data), max_examples))  # the lines past it are not read
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("scoring", total=len(examples))
        rel = compute_relevance(model, examples, scored=scored_tokens, batch_size=batch_size, data_name=str(data),
                                on_batch=lambda n: progress.advance(task, n))
    rel.save(out, overwrite=overwrite)
    if as_json:
        print(json.dumps({"out": str(out), **rel.to_json()}, indent=1))
        return
    console.print(relevance_table(rel, metric))
    console.print(f"wrote {out}")


@app.command()
def select(
    scores: Path = typer.Argument(..., help="A scores file from `esftctl relevance`.", callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Expert config to write (DeepSeek ESFT layout)."),
    threshold: float = typer.Option(0.2, "--threshold", "-p", help="Per layer, the fewest best experts whose "
                                                                      "scores sum to at least p (0 < p <= 1)."),
    metric: str = typer.Option("gate", metavar="[gate|token]",
                               help="gate (average gate score) or token (token selection ratio)."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Choose the experts to fine-tune per layer: the smallest set reaching score mass p."""
    from esftctl.relevance import METRICS, Relevance
    from esftctl.selection import ExpertConfig, select_experts

    if metric not in METRICS:
        raise EsftError(f"unknown metric {metric!r} (choose gate or token)")
    check_output(out, overwrite=overwrite)
    rel = Relevance.load(scores)
    config = ExpertConfig(select_experts(rel.scores[metric], threshold))
    config.save(out, overwrite=overwrite)
    counts = [len(ids) for ids in config.experts.values()]
    if as_json:
        print(json.dumps({"out": str(out), "threshold": threshold, "metric": metric, **config.to_json()}, indent=1))
        return
    console.print(f"selected {sum(counts)} experts over {len(counts)} MoE layers (per layer: "
                  f"{' '.join(map(str, counts))}) at p={threshold} ({metric}); wrote {out}")


@app.command()
def pack(
    base: Path = typer.Argument(..., help="The base model folder.", callback=_must_exist),
    finetuned: Path = typer.Argument(..., help="The ESFT fine-tuned model folder (a full checkpoint), or a DeepSeek "
                                               "ESFT adapter folder (expert_cfg.json + safetensors of the trained "
                                               "parameters).", callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Bundle folder to create."),
    name: str = typer.Option(..., "--name", "-n", help="Adapter name (what requests will ask for)."),
    config: Path = typer.Option(None, "--config", "-c", help="Expert config of the fine-tune (DeepSeek ESFT "
                                                              "layout); without it the changed experts are found "
                                                              "(an adapter folder brings its own).",
                                callback=_must_exist),
    include_non_expert: bool = typer.Option(False, help="Pack changed router/non-expert weights (and an adapter "
                                                        "folder's changed shared experts) too instead of "
                                                        "refusing the fine-tune.", metavar=""),
    layer_base: int = typer.Option(None, "--layer-base", metavar="[0|1]",
                                   help="How the expert config (--config, or an adapter folder's expert_cfg.json) "
                                        "numbers layers: 0 (DeepSeek's ESFT code) or 1 (some other tools). Default: "
                                        "the one numbering under which its keys are MoE layers of the base; where "
                                        "both fit, a full fine-tune decides (the numbering under which exactly the "
                                        "listed experts changed), and an adapter folder's config is refused."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Pack a fine-tuned checkpoint's fine-tuned experts into an adapter bundle, verified against the base; or
    import a DeepSeek ESFT adapter folder (expert_cfg.json + the trained tensors) the same way."""
    from rich.progress import Progress

    from esftctl.describe import render
    from esftctl.formats.bundle import Bundle
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.pack import pack as do_pack

    check_output(out, overwrite=overwrite, folder=True)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("comparing experts", total=len(MoECheckpoint(base, fp8=True).moe_layers))
        report = do_pack(base, finetuned, out, name, config, include_non_expert=include_non_expert, overwrite=overwrite,
                         layer_base=layer_base, on_layer=lambda layer: progress.advance(task))
    description = Bundle.open(out).describe()
    if as_json:
        print(json.dumps({**description, "config_layer_base": report.layer_base,
                          "config_layer_base_decided_by_finetune": report.layer_base_decided}, indent=2))
        return
    console.print(render(description))
    if report.layer_base_decided:
        console.print(f"[yellow]note:[/] the expert config's layer keys fit the base both 0- and 1-based; read "
                      f"{report.layer_base}-based, the numbering under which the fine-tune changed exactly the listed "
                      "experts (--layer-base overrides)")
    elif layer_base is None and report.layer_base == 1:
        console.print("[yellow]note:[/] the expert config's layer keys were read 1-based (only that way are they "
                      "MoE layers of the base)")
    if report.unchanged_listed:
        console.print(f"[yellow]note:[/] {len(report.unchanged_listed)} expert(s) listed in the config are identical "
                      f"to the base, e.g. (layer, expert) {report.unchanged_listed[0]}")
    if report.non_expert_changed:
        console.print(f"[yellow]note:[/] packed {len(report.non_expert_changed)} changed non-expert tensor(s)")
    console.print(f"wrote {out}")


@app.command()
def train(
    base: Path = typer.Argument(..., help="The base model folder (a Hugging Face MoE checkpoint).",
                                callback=_must_exist),
    data: Path = typer.Argument(..., help="Task data: JSONL of {\"prompt\", \"completion\"} lines, or of "
                                          "{\"messages\": [{\"role\", \"content\"}, ...]} lines ending with the "
                                          "assistant's turn (rendered with the base's chat template; the loss is on "
                                          "that turn).", callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Bundle folder to create."),
    name: str = typer.Option(..., "--name", "-n", help="Adapter name (what requests will ask for)."),
    config: Path = typer.Option(None, "--config", "-c", help="Expert config to train (DeepSeek ESFT layout, 0- or "
                                                              "1-based); without it, experts are selected by "
                                                              "relevance on the training data.",
                                callback=_must_exist),
    metric: str = typer.Option("token", help="Without --config: token (ESFT-Token: share of the completion tokens "
                                             "routed to an expert) or gate (ESFT-Gate: mean gate score)."),
    threshold: float = typer.Option(0.2, "-p", "--threshold", help="Without --config: per layer, the fewest experts "
                                                                   "whose scores sum to at least p."),
    layer_base: int = typer.Option(None, "--layer-base", metavar="[0|1]",
                                   help="How --config numbers layers, where its keys fit the base both ways."),
    steps: int = typer.Option(300, min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(16, min=1, help="Examples per step (drawn with replacement, seeded by step)."),
    lr: float = typer.Option(1e-4, help="Peak learning rate (AdamW, linear warm-up over a tenth of the steps, then "
                                        "cosine decay)."),
    seed: int = typer.Option(0, help="Seeds the held-out split and the batches: the same seed, the same run."),
    eval_share: float = typer.Option(0.05, help="Share of the examples held out for evaluation (loss and exact "
                                                "match), at least one where there are two or more; 0: none."),
    shared_experts: bool = typer.Option(False, "--shared-experts", help="Also train every MoE layer's shared experts "
                                        "(ESFT's shared_experts: true; a --config with that switch set does too): "
                                        "the bundle carries them, and `esftctl serve` applies them per request."),
    non_expert_modules: bool = typer.Option(False, "--non-expert-modules",
                                            help="Also train every weight outside the experts: attention, norms, "
                                                 "routers, dense MLPs, embeddings and output head (ESFT's "
                                                 "non_expert_modules: true; a --config with that switch set does "
                                                 "too). `esftctl serve` applies them per request (--module-copies)."),
    replay: Path = typer.Option(None, help="General data (the same JSONL shapes) mixed back into every batch, so that "
                                           "the selected experts keep serving general text.", callback=_must_exist),
    replay_share: float = typer.Option(0.5, help="With --replay: the share of every batch drawn from it."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing",
                                                help="Recompute each layer's activations in the backward pass: less "
                                                     "memory for longer sequences or larger batches, more time (each "
                                                     "layer's forward runs twice)."),
    pack_length: int = typer.Option(0, min=0, help="Pack each batch's short examples into rows of at most this many "
                                                   "tokens (each example attending to itself alone, at its own "
                                                   "positions): the same loss over fewer padded positions. 0: one "
                                                   "example a row. Refused for bases with sliding-window or linear "
                                                   "attention layers."),
    save_every: int = typer.Option(50, min=0, help="Steps between checkpoints (in OUT.ckpt, removed once the bundle "
                                                   "is written); the same command run again resumes from the last "
                                                   "one; 0: none."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Fine-tune the experts a task uses (ESFT) and write them as an adapter bundle: expert relevance and selection
    on the data (or --config), training of the selected routed experts only (everything else frozen), the bundle
    verified as `pack` writes it. No whole model is written. On several GPUs, one process each, the model sharded by
    PyTorch's FSDP2: `torchrun --nproc-per-node 8 -m esftctl train ...` (the first process reports and writes)."""
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from esftctl.train import TrainSettings, train_adapter
    from esftctl.world.models import quiet_transformers

    check_output(out, overwrite=overwrite, folder=True)
    settings = TrainSettings(steps=steps, batch_size=batch_size, lr=lr, seed=seed, eval_share=eval_share,
                             save_every=save_every, replay_share=replay_share if replay is not None else 0.0,
                             gradient_checkpointing=gradient_checkpointing, pack_length=pack_length)
    quiet_transformers()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    first = int(os.environ.get("RANK", "0")) == 0  # torchrun's other processes say nothing
    with Progress(*columns, console=console, transient=True, disable=not first) as progress:
        task = progress.add_task("preparing", total=steps, info="")
        report = train_adapter(base, data, out, name, settings, config_file=config, metric=metric, threshold=threshold,
                               layer_base=layer_base, shared_experts=shared_experts,
                               non_expert_modules=non_expert_modules, replay=replay,
                               overwrite=overwrite,
                               log=lambda msg: progress.update(task, description=msg),
                               on_step=lambda step, loss, tps: progress.update(
                                   task, completed=step + 1, description="training",
                                   info=f"loss {loss:.3f}, {tps:,.0f} tokens/s"))
    if not first:
        return
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    layers = " ".join(str(n) for n in report.experts_per_layer.values())
    resumed = f", resumed at step {report.resumed_from}" if report.resumed_from else ""
    console.print(f"trained {report.trained_parameters:,} of {report.model_parameters:,} parameters "
                  f"({report.trained_parameters / report.model_parameters:.1%}: experts per MoE layer {layers}) for "
                  f"{report.steps} steps in {report.seconds:.0f} s{resumed}, {report.tokens_per_second:,.0f} tokens/s")
    if report.losses:
        console.print(f"training loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}")
    if report.eval_loss is not None:
        console.print(f"held out ({report.eval_examples} examples): loss {report.eval_loss:.3f}, exact match "
                      f"{report.eval_exact:.0%}")
    console.print(f"wrote {out}")


@app.command()
def merge(
    base: Path = typer.Argument(..., help="The base model folder.", callback=_must_exist),
    bundle: Path = typer.Argument(..., help="An adapter bundle packed for this base.", callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Merged model folder to create."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Write base + adapter as one full checkpoint (the merged model that serving is checked against)."""
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.merge import merge as do_merge

    check_output(out, overwrite=overwrite, folder=True)
    with _tensor_progress("merging", len(MoECheckpoint(base, fp8=True).tensors)) as advance:
        do_merge(base, bundle, out, overwrite=overwrite, on_tensor=advance)
    _wrote(out, as_json)


@app.command()
def export(
    bundle: Path = typer.Argument(..., help="An adapter bundle.", callback=_must_exist),
    fmt: str = typer.Option(..., "--format", "-f", metavar="[esft]",
                            help="Format to write: esft (DeepSeek ESFT's adapter folder: expert_cfg.json + "
                                 "model.safetensors, which its esft.py add_adapter / load_esft_model load)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to create."),
    base: Path = typer.Option(None, help="The bundle's base model folder; needed only for a bundle with non-expert "
                                         "tensors (DeepSeek's loader takes every tensor of the modules an adapter "
                                         "trains: the unchanged ones come from the base).", callback=_must_exist),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Write an adapter bundle in another tool's adapter format (esft: DeepSeek's ESFT code)."""
    from esftctl.formats.esft_adapter import export_adapter

    if fmt != "esft":
        raise EsftError(f"unknown format {fmt!r} (choose esft)")
    check_output(out, overwrite=overwrite, folder=True)
    config = export_adapter(bundle, out, base_dir=base, overwrite=overwrite)
    if as_json:
        _wrote(out, as_json, format=fmt, **config.to_json())
        return
    counts = [len(ids) for ids in config.experts.values()]
    console.print(f"wrote {out}: {sum(counts)} experts over {len(counts)} MoE layers (per layer: "
                  f"{' '.join(map(str, counts))}), shared_experts {str(config.shared_experts).lower()}, "
                  f"non_expert_modules {str(config.non_expert_modules).lower()}")


@app.command()
def compress(
    source: Path = typer.Argument(..., help="A model folder (all its routed experts) or an adapter bundle.",
                                  callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Store folder to create."),
    table_scope: str = typer.Option("layer", metavar="[layer|tensor]",
                                    help="One Huffman code per layer (shared by its experts) or per tensor."),
    chunk: int = typer.Option(1024, min=16, help="Values per independently decodable chunk, a multiple of 16 "
                                                 "(the GPU decoder gives each chunk a lane; 32 chunks share a "
                                                 "block of values, taking turns by 16)."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Write a Huffman-coded expert store: bf16 exponents entropy-coded, sign+mantissa raw; lossless."""
    import time

    from rich.progress import Progress

    from esftctl.describe import render
    from esftctl.formats.store import ExpertStore, source_tensors, write_store

    check_output(out, overwrite=overwrite, folder=True)
    start = time.time()
    origin, tensors = source_tensors(source)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("compressing", total=len(tensors))
        write_store(origin, tensors, out, chunk, table_scope, overwrite=overwrite,
                    on_tensor=lambda name: progress.advance(task))
    description = {**ExpertStore(out).describe(), "seconds": time.time() - start}
    if as_json:
        print(json.dumps(description, indent=2))
    else:
        console.print(render(description))
        console.print(f"wrote {out} in {description['seconds']:.1f}s")


@app.command()
def decompress(
    store: Path = typer.Argument(..., help="An expert store from `esftctl compress`.", callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to create: the bundle again, or experts.safetensors."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Decode a store back to safetensors, bit for bit (a bundle's store becomes the same bundle, byte for byte)."""
    from esftctl.formats.store import ExpertStore
    from esftctl.formats.store import decompress as do_decompress

    check_output(out, overwrite=overwrite, folder=True)
    with _tensor_progress("decoding", len(list(ExpertStore(store, verify=False)))) as advance:
        do_decompress(store, out, overwrite=overwrite, on_tensor=advance)
    _wrote(out, as_json)


@app.command()
def consolidate(
    models: list[Path] = typer.Argument(..., help="Two or more fine-tuned variants of one MoE architecture.",
                                        callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for expert_map.json, ranking.json, distances.png."),
    capacity: int = typer.Option(None, min=0, help="Expert positions to load (across all MoE layers); give this or "
                                                   "--budget, exactly one."),
    budget: str = typer.Option(None, help="Or a memory budget for the loaded experts, e.g. 12GiB or 500MB (exactly one "
                                          "of --capacity and --budget)."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Rank expert positions by summed pairwise L2 distance and assign them round-robin under a capacity (give
    exactly one of --capacity and --budget)."""
    from rich.progress import Progress
    from rich.table import Table

    from esftctl.consolidate import consolidate as do_consolidate
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.units import format_bytes

    if (capacity is None) == (budget is None):
        raise EsftError("give exactly one of --capacity N (expert positions to load) and --budget SIZE (memory for "
                        "them, e.g. 12GiB)")
    if len(models) < 2:
        raise EsftError("consolidate needs two or more fine-tuned variants")
    budget_bytes = _parse_bytes(budget, "--budget") if budget is not None else None
    check_output(out, overwrite=overwrite, folder=True)
    first = MoECheckpoint(models[0])
    positions = len(first.moe_layers) * first.num_experts
    if capacity is not None and capacity > positions:  # a mistake (another model? experts per layer?), not a wish
        raise EsftError(f"--capacity {capacity}: the variants have {positions} expert positions "
                        f"({len(first.moe_layers)} MoE layers x {first.num_experts} experts); give 0..{positions}")
    if budget_bytes is not None and budget_bytes >= positions * first.expert_nbytes:  # more memory than needed
        err_console.print(f"note: --budget {budget} holds all {positions} expert positions "
                          f"({format_bytes(positions * first.expert_nbytes)}): capacity {positions}")
        capacity, budget_bytes = positions, None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("distances", total=len(first.moe_layers))
        emap, distances = do_consolidate(models, out, capacity, budget_bytes, overwrite=overwrite,
                                         on_layer=lambda layer: progress.advance(task))
    if as_json:
        print(json.dumps({"out": str(out), **emap.to_json(), "distances": distances.tolist()}, indent=1))
        return
    table = Table(title=f"Consolidated expert map: {len(models)} variants, capacity {emap.capacity} of "
                        f"{emap.owner.size} positions", header_style="bold")
    table.add_column("layer", justify="right")
    for i in range(len(models)):
        table.add_column(f"from #{i}", justify="right")
    for col in ("not loaded", "mean distance", "min", "max"):
        table.add_column(col, justify="right")
    for li, layer in enumerate(emap.moe_layers):
        row = emap.owner[li]
        table.add_row(str(layer), *(str(int((row == i).sum())) for i in range(len(models))), str(int((row < 0).sum())),
                      f"{distances[li].mean():.3f}", f"{distances[li].min():.3f}", f"{distances[li].max():.3f}")
    console.print(table)
    console.print(f"wrote {out}")


@app.command()
def materialize(
    map_dir: Path = typer.Argument(..., help="A folder written by `esftctl consolidate`.", callback=_must_exist),
    variant: int = typer.Option(..., help="Index of the variant (order given to consolidate)."),
    out: Path = typer.Option(..., "--out", "-o", help="Model folder to create."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Write the checkpoint a variant runs under a consolidated map (plain vLLM can serve it)."""
    from esftctl.consolidate import MAP_FILE, ExpertMap
    from esftctl.consolidate import materialize as do_materialize
    from esftctl.formats.checkpoint import MoECheckpoint

    check_output(out, overwrite=overwrite, folder=True)
    models = ExpertMap.load(map_dir / MAP_FILE).models
    total = len(MoECheckpoint(models[variant]).tensors) if 0 <= variant < len(models) else 0
    with _tensor_progress("materializing", total) as advance:
        do_materialize(map_dir, variant, out, overwrite=overwrite, on_tensor=advance)
    _wrote(out, as_json)


@app.command()
def average(
    models: list[Path] = typer.Argument(..., help="Two or more fine-tuned variants of one MoE architecture.",
                                        callback=_must_exist),
    out: Path = typer.Option(..., "--out", "-o", help="Model folder to create."),
    overwrite: Overwrite = False,
    as_json: AsJson = False,
) -> None:
    """Write the weight-averaging baseline of several variants."""
    from esftctl.consolidate import average as do_average
    from esftctl.formats.checkpoint import MoECheckpoint

    if len(models) < 2:
        raise EsftError("average needs two or more fine-tuned variants to average")
    check_output(out, overwrite=overwrite, folder=True)
    with _tensor_progress("averaging", 2 * len(MoECheckpoint(models[0]).tensors)) as advance:
        do_average(models, out, overwrite=overwrite, on_tensor=advance)
    _wrote(out, as_json)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    base: Path = typer.Argument(None, help="The base model folder (a Hugging Face MoE checkpoint); omit it with "
                                           "--variants.", callback=_must_exist),
    adapter: list[str] = typer.Option([], "--adapter", "-a", help="NAME=BUNDLE: serve this adapter under NAME "
                                                                   "(repeat for more).",
                                rich_help_panel="Adapters"),
    name: str = typer.Option(None, help="The base model's name in requests (default: the folder's name).",
                                rich_help_panel="Adapters"),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default).",
                                rich_help_panel="Server and access"),
    port: int = typer.Option(8000, help="Port to listen on (1-65535).",
                                rich_help_panel="Server and access"),
    slots: int = typer.Option(None, min=1, help="Adapters resident at once (default: the given ones + 2, at "
                                                "least 4).",
                                rich_help_panel="Adapters"),
    experts_per_slot: int = typer.Option(None, min=1, help="Expert rows reserved per slot and layer, pooled: a "
                                                           "layer has slots x this many rows, and an adapter takes "
                                                           "the free rows it needs, at start and when loaded "
                                                           "later (address space only) (default: the most any "
                                                           "given adapter has in one layer).",
                                rich_help_panel="Adapters"),
    adapter_memory: str = typer.Option(None, help="Adapter experts loaded at once, as a size (e.g. 12GiB): their GPU "
                                                  "memory is set aside before vLLM sizes its KV cache, and a load "
                                                  "past it is refused (default: --slots times the largest given "
                                                  "adapter; with none given, two adapters of an eighth of the base's "
                                                  "experts each).",
                                rich_help_panel="Adapters"),
    shared_expert_copies: int = typer.Option(None, min=0, max=64,
                                             help="Copies of every MoE layer's shared experts kept for adapters that "
                                                  "replace them (ESFT's shared_experts: true, packed with "
                                                  "--include-non-expert): each such adapter loaded holds one, and "
                                                  "each copy costs its memory and one more shared-expert product "
                                                  "per layer and step (default: one per such adapter given).",
                                rich_help_panel="Adapters"),
    module_copies: int = typer.Option(None, min=0, max=64,
                                      help="Copies of the non-expert modules (attention projections, norms, routers) "
                                           "that the adapters given with --adapter change (ESFT's "
                                           "non_expert_modules: true): each adapter that changes such modules holds "
                                           "one while loaded, and each copy costs those modules' memory and one more "
                                           "product of each per step (default: one per such adapter given).",
                                rich_help_panel="Adapters"),
    state_dir: Path = typer.Option(None, help="Folder for the vLLM log and the status file, kept (default: a new "
                                              "temporary folder, removed when the server stops, kept after a "
                                              "failure for its log). Created private (0700); an existing one must "
                                              "be yours and writable by you alone.",
                                rich_help_panel="Server and access"),
    ready_timeout: float = typer.Option(900, help="Seconds to wait for vLLM to come up.",
                                rich_help_panel="Server and access"),
    paging_window: int = typer.Option(0, help="Page the experts, base and adapters': the MoE layers share this many "
                                              "layers' worth of GPU memory, and each layer's experts come in from "
                                              "host memory (or --paging-store) just before it runs; CUDA graphs "
                                              "stay on (0: off).",
                                rich_help_panel="Paging (when experts do not fit)"),
    paging_fetch: str = typer.Option("auto", help="With --paging-window: `routed` brings in only the experts a step's "
                                                  "tokens route to, just before the layer; `layer` brings in the next "
                                                  "layer whole while the current one computes; `auto` routes while "
                                                  "tokens x top-k are at most the experts per layer.",
                                rich_help_panel="Paging (when experts do not fit)"),
    paging_store: Path = typer.Option(None, help="With --paging-window: a Huffman store of the base (`esftctl "
                                                 "compress BASE`); its GPU decoder delivers some base experts "
                                                 "of each layer beside the host copies (needs an engine that "
                                                 "keeps experts in the checkpoint's layout: vLLM on CUDA).",
                                      callback=_must_exist,
                                rich_help_panel="Paging (when experts do not fit)"),
    paging_codec: str = typer.Option(None, help="With --paging-window: the compressed tier. `huffman` (the "
                                                "default with --paging-store) decodes the store; `fixed` encodes "
                                                "every paged layer's base experts at start, from the loaded "
                                                "weights, in a fixed-rate code kept on the GPU (75% of bf16, "
                                                "decoded about 1.4x faster than the store's 68%) and needs no "
                                                "store; `fixed-host` keeps those codes in pinned host memory and "
                                                "decodes them over the bus (no GPU memory for base experts, 0.75 "
                                                "of a bf16 host copy's bytes to move).",
                                rich_help_panel="Paging (when experts do not fit)"),
    store_experts: int = typer.Option(None, help="With --paging-store or --paging-codec fixed: base experts per "
                                                 "layer taken from the compressed tier (default: split by the two "
                                                 "tiers' speeds, measured at start; with fixed-host, all).",
                                rich_help_panel="Paging (when experts do not fit)"),
    paging_adaptive: bool = typer.Option(False, help="With --paging-window: keep more layers resident while loads "
                                                     "show (compute / load < 0.9) and fewer while compute hides "
                                                     "them (> 1), within the memory vLLM left free; from the start "
                                                     "those that fit once the KV cache has what it can use "
                                                     "(--max-num-seqs x --max-model-len tokens).", metavar="",
                                rich_help_panel="Paging (when experts do not fit)"),
    host_cache: str = typer.Option("8GiB", help="Adapters kept in (pinned) host memory after loading, as a size: "
                                                "loading one of them again skips reading, verifying and "
                                                "converting it and is one copy to the GPU (0 turns it off).",
                                rich_help_panel="Adapters"),
    cpu_kv_cache_gib: float = typer.Option(None, min=0.1, help="KV cache size on vLLM's CPU build, GiB (default: "
                                                               "$VLLM_CPU_KVCACHE_SPACE if set, else 1; GPU builds "
                                                               "size it with vLLM's --gpu-memory-utilization).",
                                rich_help_panel="Server and access"),
    variants: Path = typer.Option(None, help="Serve the fine-tuned variants of a consolidated map (a folder of "
                                             "`esftctl consolidate`) instead of BASE: each answers to its folder's "
                                             "name, shares the experts the map loaded and keeps its own elsewhere "
                                             "and its own non-expert weights; each engine step runs one variant.",
                                  callback=_must_exist,
                                rich_help_panel="Consolidated variants"),
    variant_names: str = typer.Option(None, help="With --variants: comma-separated names for the variants, in the "
                                                 "map's order (default: their folders' names).",
                                rich_help_panel="Consolidated variants"),
    quantum: int = typer.Option(4, help="With --variants: engine steps a variant runs before the next one with "
                                        "requests takes its turn (each switch copies non-expert weights).",
                                rich_help_panel="Consolidated variants"),
    one_step: bool = typer.Option(False, "--one-step",
                                  help="With --variants: run every variant's requests in the same engine steps, each "
                                       "token with its variant's non-expert weights (a copy per variant of every "
                                       "module that differs, each costing one more product per step; where MLA's "
                                       "kv_b_proj differs, a copy of that layer's attention op, one more attention "
                                       "per step) instead of one variant per step.",
                                  rich_help_panel="Consolidated variants"),
    api_key: str = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True, metavar="KEY",
                                help="Require this key (`Authorization: Bearer KEY`) on every request, esftctl's "
                                     "own endpoints and /health included; handed to vLLM in its environment. "
                                     "Prefer the environment variable: an option shows in `ps`.",
                                rich_help_panel="Server and access"),
    adapter_root: Path = typer.Option(None, help="Load adapters at run time (`esftctl adapters load`, "
                                                 "/v1/load_lora_adapter) only from bundles under this folder: each "
                                                 "is read through its folder opened beneath this one, and no "
                                                 "symbolic link may lead out of it; others get HTTP 403 (default: "
                                                 "any path the server can read; bundles given with --adapter are "
                                                 "not restricted).", callback=_must_exist,
                                rich_help_panel="Server and access"),
    group_adapters: int = typer.Option(0, help="Group requests by adapter: each engine step runs the requests of at "
                                               "most this many adapters (the base counts as one), so it reads "
                                               "fewer expert rows, and the others wait (0: off, the default; "
                                               "measure it first with `esftctl bench serve --group-adapters`).",
                                rich_help_panel="Scheduling"),
    group_wait: int = typer.Option(8, help="With --group-adapters: engine steps a request may be held back in a row "
                                           "before its adapter must run (more adapters with work than fit a step "
                                           "add a few steps: esftctl.runtime.adapter_groups).",
                                rich_help_panel="Scheduling"),
    admit_by_adapter: float = typer.Option(None, min=0.0, metavar="SECONDS",
                                           help="When requests queue for batch slots, admit those of the adapters "
                                                "already running first, so that a step reads fewer adapters' "
                                                "experts; none is passed over for longer than SECONDS (default 10; "
                                                "0: vLLM's first-come-first-served order; off with --variants). No "
                                                "slot is left empty for it; without a queue it changes nothing "
                                                "(`esftctl bench serve --admit-by-adapter` measures it).",
                                rich_help_panel="Scheduling"),
) -> None:
    """Serve BASE (or the variants of a consolidated map) and ESFT adapters through vLLM's OpenAI-compatible API;
    a request picks a model by its `model` field. Arguments after `--` go to vLLM (e.g. `-- --enforce-eager
    --max-model-len 256`)."""
    from esftctl import serve_client
    from esftctl.runtime.serve_config import ServeSettings
    from esftctl.serve import Server, plan_serving, stop_on_sigterm

    settings = ServeSettings(
        base=base, adapters=tuple(adapter), name=name, slots=slots, experts_per_slot=experts_per_slot,
        adapter_memory=_parse_bytes(adapter_memory, "--adapter-memory") if adapter_memory is not None else None,
        host=host, port=port, state_dir=state_dir, vllm_args=tuple(ctx.args), cpu_kv_cache_gib=cpu_kv_cache_gib,
        paging_window=paging_window, paging_store=paging_store, paging_codec=paging_codec, store_experts=store_experts,
        paging_adaptive=paging_adaptive, paging_fetch=paging_fetch, host_cache=_parse_bytes(host_cache, "--host-cache"),
        variants=variants,
        variant_names=tuple(variant_names.split(",")) if variant_names else None, quantum=quantum,
        api_key=api_key or None, adapter_root=adapter_root, group_adapters=group_adapters, group_wait=group_wait,
        admit_by_adapter=admit_by_adapter, shared_expert_copies=shared_expert_copies, module_copies=module_copies,
        one_step=one_step)
    serve_plan = plan_serving(settings)
    server, key = Server(serve_plan), serve_plan.request_key
    server.start()
    stopped_cleanly = False
    try:
        with console.status(f"starting vLLM (log: {serve_plan.log_file})") as status:
            server.wait_ready(ready_timeout, lambda s: status.update(f"starting vLLM, {s:.0f} s (log: "
                                                                     f"{serve_plan.log_file})"))
        served = serve_client.models(serve_plan.url, api_key=key)
        console.print(serve_client.status_table(serve_client.status(serve_plan.url, api_key=key), served))
        console.print(f"serving at {serve_plan.url}/v1 (models: {', '.join(served)}); Ctrl-C stops")
        stop_on_sigterm()
        server.process.wait()
        raise EsftError(f"vLLM exited with status {server.process.returncode}: {server.last_error()}",
                        serve_plan.log_file)
    except KeyboardInterrupt:
        console.print("stopping")
        stopped_cleanly = True
    finally:
        server.stop()
    if stopped_cleanly:
        server.remove_state()  # a temporary state folder goes; one after a failure stays, for its log


adapters_app = typer.Typer(help="List, load and unload the adapters of a running `esftctl serve`.",
                           no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
URL_HELP = "The server's address."
API_KEY_HELP = "The server's API key, if it has one (prefer the environment variable: an option shows in `ps`)."


def _api_key_option():
    return typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True, metavar="KEY", help=API_KEY_HELP)


@adapters_app.command("list")
def adapters_list(
    url: str = typer.Option("http://127.0.0.1:8000", help=URL_HELP),
    api_key: str = _api_key_option(),
    as_json: AsJson = False,
) -> None:
    """The served models and the adapter table (slots, experts per layer, memory, KV-cache room)."""
    from esftctl import serve_client

    served, status = serve_client.models(url, api_key=api_key), serve_client.status(url, api_key=api_key)
    if as_json:
        print(json.dumps({"models": served, **status}, indent=1))
    else:
        console.print(serve_client.status_table(status, served))


@adapters_app.command("load")
def adapters_load(
    name: str = typer.Argument(..., help="The name requests will use."),
    bundle: Path = typer.Argument(..., help="The adapter bundle folder (a path the server can read).",
                                  callback=_must_exist),
    url: str = typer.Option("http://127.0.0.1:8000", help=URL_HELP),
    api_key: str = _api_key_option(),
    as_json: AsJson = False,
) -> None:
    """Load an adapter bundle into a running server."""
    from esftctl import serve_client

    message = serve_client.load(url, name, bundle, api_key=api_key)
    if as_json:
        print(json.dumps({"loaded": name, "bundle": str(bundle.resolve()), "message": message}))
    else:
        console.print(message)


@adapters_app.command("unload")
def adapters_unload(
    name: str = typer.Argument(..., help="The adapter's name."),
    url: str = typer.Option("http://127.0.0.1:8000", help=URL_HELP),
    api_key: str = _api_key_option(),
    as_json: AsJson = False,
) -> None:
    """Unload an adapter from a running server (its slot and expert memory are freed)."""
    from esftctl import serve_client

    message = serve_client.unload(url, name, api_key=api_key)
    if as_json:
        print(json.dumps({"unloaded": name, "message": message}))
    else:
        console.print(message)


@contextlib.contextmanager
def _tensor_progress(what: str, total: int):
    """A progress bar over `total` tensors; yields the callback that advances it by one."""
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda name: progress.advance(task)


def _wrote(out: Path, as_json: bool, **fields) -> None:
    """The last line of a command that writes a folder: its path, or for scripts its path and files as JSON (and
    the command's own `fields`)."""
    if as_json:
        files = sorted(p for p in out.rglob("*") if p.is_file())
        print(json.dumps({**fields, "out": str(out), "files": [str(p.relative_to(out)) for p in files],
                          "bytes": sum(p.stat().st_size for p in files)}, indent=1))
    else:
        console.print(f"wrote {out}")


def _parse_bytes(text: str, option: str = "size") -> int:
    from esftctl.units import parse_bytes

    return parse_bytes(text, option)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    """Entry point: user errors become one line on stderr and exit status 1, never a traceback. SIGTERM stops a
    command as Ctrl-C does, so an output being written is removed, not left as a hidden temporary folder."""
    import signal

    # typer vendors click; its UsageError (bad flags, missing or unparsable arguments) is BadParameter's base.
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(prog_name="esftctl", standalone_mode=False)
    except EsftError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", markup=True)  # a message's [...] is text
        raise SystemExit(1)
    except usage_error as e:  # a bad flag or argument: one line too, with where to look
        if not e.format_message().strip():  # no arguments at all: the help was printed
            raise SystemExit(0)
        where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        err_console.print(f"[bold red]error:[/] {' '.join(e.format_message().split())}{where}", markup=True)
        raise SystemExit(1)
    except typer.Abort:
        err_console.print("stopped")
        raise SystemExit(130)
    except OSError as e:  # a full disk, a file gone or unreadable mid-command: the output was removed (atomic_dir)
        where = f"{e.filename}: " if e.filename else ""
        err_console.print(f"[bold red]error:[/] {where}{e.strerror or e} (nothing was written)", markup=True)
        raise SystemExit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller's own handler (main() called in-process) comes back
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
