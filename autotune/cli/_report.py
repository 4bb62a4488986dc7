"""``autotune report``: a study's HTML report, or a short summary in the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from autotune.cli._app import DEFAULT_STORAGE, app, console, fail, setup_logging
from autotune.errors import AutotuneError


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="Study name, e.g. tiny.", show_default=False)],
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL the search wrote to.")
    ] = DEFAULT_STORAGE,
    out: Annotated[
        Path | None,
        typer.Option(help="Folder for report.html (and best.json); studies/<name>/ by default."),
    ] = None,
    text: Annotated[
        bool, typer.Option("--text", help="Print a short summary here instead of writing HTML.")
    ] = False,
) -> None:
    """Write a study's report.html (plots, every trial), or print a summary with --text."""
    setup_logging(quiet=True)
    from autotune.report import collect, load_study, render_text, write_report

    try:
        if text:
            data = collect(load_study(study, storage), out_dir=out, storage=storage)
            console.print(render_text(data), highlight=False, markup=False, soft_wrap=True)
            return
        path = write_report(study, storage=storage, out_dir=out)
    except AutotuneError as exc:
        fail(str(exc))
        return
    console.print(f"report written to [bold]{escape(str(path))}[/]", highlight=False)
