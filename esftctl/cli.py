"""The `esftctl` command line."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from esftctl.bench.cli import app as bench_app
from esftctl.errors import EsftError

app = typer.Typer(
    help="Prepare and serve Expert-Specialized Fine-Tuning (ESFT) adapters of Mixture-of-Experts models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True, highlight=False)


@app.callback()
def _root() -> None:
    """Prepare and serve Expert-Specialized Fine-Tuning (ESFT) adapters of Mixture-of-Experts models."""


app.add_typer(bench_app, name="bench")


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="A model folder (config.json + safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of a table."),
) -> None:
    """Describe a MoE model folder: architecture, MoE layers, experts per layer, top-k, byte sizes."""
    from esftctl.describe import describe_path, render

    description = describe_path(path)
    if as_json:
        print(json.dumps(description, indent=2))
    else:
        console.print(render(description))


def main() -> None:
    """Entry point: user errors become one line on stderr and exit status 1, never a traceback."""
    try:
        app()
    except EsftError as e:
        err_console.print(f"[bold red]error:[/] {e}", markup=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
