"""The ``autotune`` command: a thin shell that parses into models, calls the library, prints.

A user's mistake prints one ``error:`` message naming the field and the fix, and exits 2;
Ctrl-C exits 130 after saying how to resume. Each group of commands lives in its own module
and registers itself on the shared app. A command imports torch, optuna, the storage and the
web service in its body, never at the top: ``--help`` answers without them
(tests/test_cli_imports.py).
"""

from __future__ import annotations

import sys

from autotune._leave import leave
from autotune.cli import _diagnose, _export, _report, _search, _service, _train, _worker  # noqa: F401  (register their commands)
from autotune.cli._app import app, err_console

__all__ = ["app", "main", "run"]


def main() -> None:
    """The command line: runs the command ``sys.argv`` names, and exits with its code
    (SystemExit, which a caller in Python may catch)."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


def run() -> None:
    """Console-script entry point (and ``python -m autotune``): :func:`main`, then the process
    ends without the interpreter's teardown (:func:`autotune._leave.leave`), about a second of a
    core after every command."""
    try:
        main()
    except SystemExit as exc:
        leave(exc.code)
    leave(0)
