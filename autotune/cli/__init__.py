"""The ``autotune`` command: a thin shell that parses into models, calls the library, prints; a
user's mistake is one ``error:`` line and exit 2."""

from __future__ import annotations

import sys

from autotune.cli import _diagnose, _export, _report, _search, _service, _train, _worker  # noqa: F401  (register their commands)
from autotune.cli._app import Launch, app, err_console
from autotune.infra.leave import leave

__all__ = ["app", "main", "run"]


def main() -> None:
    """The command line: runs the command ``sys.argv`` names, and exits with its code
    (SystemExit, which a caller in Python may catch)."""
    Launch.for_this_command = True
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


def run() -> None:
    """Console-script entry point (and ``python -m autotune``): :func:`main`, then the process
    ends without the interpreter's teardown (:func:`autotune.infra.leave.leave`), about a second
    of a core after every command."""
    try:
        main()
    except SystemExit as exc:
        leave(exc.code)
    leave(0)
