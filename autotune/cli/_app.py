"""Shared pieces of the ``autotune`` command: the app, consoles, logging and error exits."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer
from loguru import logger
from rich.console import Console
from rich.markup import escape

import autotune
from autotune.errors import SpecError, short_repr
from autotune.schema.spec import StudySpec

__all__ = [
    "DEFAULT_STORAGE",
    "app",
    "console",
    "err_console",
    "fail",
    "parse_sets",
    "setup_logging",
    "warn",
]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find the fastest numerically safe mixed-precision training setup, measured.",
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)


class Launch:
    """Whether this process was started for the one command it runs (:func:`autotune.cli.main`
    says so): then its imports count against a search's budget, from ``autotune.STARTED``; a
    command invoked in a process that lives on (the app called from Python, as the tests do)
    counts from its own start (from the import, an hour-old process had spent its budget)."""

    for_this_command = False


# The spec owns the default; a study name is looked up where `autotune search` stores it.
DEFAULT_STORAGE: str = StudySpec.model_fields["storage"].default


# Set by setup_logging: with JSON logs on stderr, error lines go out as JSON too.
_json_logs = False


def setup_logging(verbose: bool = False, quiet: bool = False, *, json_lines: bool = False) -> None:
    """Logs on stderr, human-readable or one JSON object per line (see :mod:`autotune.infra.logs`).

    Only the command line configures logging; the library never does.
    """
    from autotune.infra.logs import setup_logging as configure

    global _json_logs
    _json_logs = json_lines
    level = "DEBUG" if verbose else ("WARNING" if quiet else "INFO")
    configure(level, json_lines=json_lines, console=err_console)


def warn(message: str) -> None:
    """One warning line for the person at the terminal (a JSON log line under --log-json)."""
    if _json_logs:
        logger.warning(message)
    else:
        err_console.print(f"[yellow]{escape(message)}[/]", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one ``error:`` line (no traceback; a JSON log line under --log-json), exit non-zero."""
    if _json_logs:
        logger.error("error: {}", message)
    else:
        err_console.print(
            f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True
        )
    raise typer.Exit(code)


def parse_sets(values: list[str] | None) -> dict[str, Any]:
    """``["probe.steps=10"]`` → ``{"probe.steps": 10}`` (values parsed as YAML; text that is
    not YAML stays text). Values too deep or too large are refused like a spec's."""
    from autotune.infra.inputs import load_text

    out: dict[str, Any] = {}
    for item in values or []:
        if "=" not in item:
            raise SpecError(
                f"--set takes FIELD=VALUE, got --set {short_repr(item)}; e.g. --set probe.steps=10"
            )
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = load_text(raw, "yaml", f"--set {key.strip()}")
        except SpecError as exc:
            if "is not valid YAML" not in str(exc):
                raise
            out[key.strip()] = raw
    return out


def _print_version(value: bool) -> None:
    if value:
        console.print(autotune.__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
        ),
    ] = False,
) -> None:
    from autotune.infra.files import umask_applied

    # What the command creates (the study database, best.json, report.html, logs, and what its
    # workers write) is the owner's only, unless AUTOTUNE_UMASK says otherwise; restored after.
    try:
        ctx.with_resource(umask_applied())
    except SpecError as exc:
        fail(str(exc))
