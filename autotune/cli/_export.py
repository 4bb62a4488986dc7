"""``autotune export``: a config as a file or flags Lightning, Hugging Face or accelerate read."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app, err_console, fail
from autotune.cli._train import autotune_warnings_as_lines
from autotune.errors import AutotuneError, SpecError


@app.command()
def export(
    config: Annotated[
        Path, typer.Argument(help="The best.json a search wrote.", show_default=False)
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to", help="lightning, hf (TrainingArguments) or accelerate.", show_default=False
        ),
    ],
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="json or yaml (a LightningCLI --config file, a file HfArgumentParser parses, an "
            "accelerate launch --config_file), or args (their command-line flags).",
        ),
    ] = "json",
    device: Annotated[
        str | None,
        typer.Option(help="cpu or cuda: the device it will train on; the config's by default."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Your LightningModule as package.module:Class: the lr goes to its init argument "
            "(lr or learning_rate) in the file's model: section.",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="Your LightningDataModule as package.module:Class: the batch size goes to its "
            "batch_size init argument in the file's data: section.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the config as a trainer's config file or flags on stdout; notes go to stderr."""
    from autotune.exports import FORMATS
    from autotune.exports import export as build
    from autotune.schema.config import load_config

    try:
        if format_ not in FORMATS:
            raise SpecError(
                f"unknown format {format_!r}; use one of {', '.join(FORMATS)}, e.g. --format yaml"
            )
        if (model or data) and to != "lightning":
            raise SpecError("--model and --data are for --to lightning; leave them out for " + to)
        # Warnings wait for the export: a refused one is its error line alone (a config tuned
        # on another machine warned first, above the error, on every GPU machine).
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("default")
            cfg = load_config(config)
            out = build(cfg, to, device=device, model=model, datamodule=data)
            text = out.render(format_)
    except AutotuneError as exc:
        fail(str(exc))
        return
    with autotune_warnings_as_lines():
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    # Plain print: stdout must stay exactly the JSON/YAML/flags, for pipes and $(...).
    typer.echo(text)
    for note in out.notes:
        err_console.print(f"note: {note}", highlight=False, markup=False)
