"""``autotune export``: a config as Lightning, Hugging Face or accelerate arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app, err_console, fail
from autotune.cli._train import load_config_for_cli
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
        str, typer.Option("--format", help="json, yaml or args (command-line flags).")
    ] = "json",
) -> None:
    """Print the config as a trainer's arguments on stdout; notes go to stderr."""
    from autotune.export import FORMATS
    from autotune.export import export as build

    try:
        if format_ not in FORMATS:
            raise SpecError(
                f"unknown format {format_!r}; use one of {', '.join(FORMATS)}, e.g. --format yaml"
            )
        cfg = load_config_for_cli(config)
        out = build(cfg, to)
        text = out.render(format_)
    except AutotuneError as exc:
        fail(str(exc))
        return
    # Plain print: stdout must stay exactly the JSON/YAML/flags, for pipes and $(...).
    typer.echo(text)
    for note in out.notes:
        err_console.print(f"note: {note}", highlight=False, markup=False)
