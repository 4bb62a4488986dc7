"""Shared pieces of the ``autotune`` command: the app, consoles, logging and error exits."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from loguru import logger
from rich.console import Console

import autotune
from autotune.errors import SpecError

__all__ = ["app", "console", "err_console", "fail", "parse_sets", "setup_logging"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find the fastest numerically safe mixed-precision training setup, measured.",
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """Human-readable logs on stderr; the library itself never configures logging."""
    import optuna

    logger.remove()
    level = "DEBUG" if verbose else ("WARNING" if quiet else "INFO")
    logger.add(sys.stderr, level=level, format="{time:HH:mm:ss} | {level: <7} | {message}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def fail(message: str, code: int = 2) -> None:
    """Print one ``error:`` line (no traceback) and exit non-zero."""
    err_console.print(
        f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True
    )
    raise typer.Exit(code)


def parse_sets(values: list[str] | None) -> dict[str, Any]:
    """``["probe.steps=10"]`` → ``{"probe.steps": 10}`` (values parsed as YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in values or []:
        if "=" not in item:
            raise SpecError(
                f"--set takes FIELD=VALUE, got --set {item!r}; e.g. --set probe.steps=10"
            )
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        console.print(autotune.__version__)
        raise typer.Exit(0)
