"""Ending a process without the interpreter's teardown.

Once torch is loaded, the interpreter's own teardown at exit (finalizing every module and the
objects they hold) takes seconds of a core and keeps nothing: 3.5 s on a slow CPU for a probe
worker, about 1 s for the command line's process, which loads no torch. :func:`leave` runs what
the process registered for its end (``atexit`` hooks: log sinks closed, a workload's temporary
files removed), flushes the output, and exits with the code.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["leave"]


def leave(code: str | int | None = 0) -> NoReturn:
    """Exit with ``code`` (as ``sys.exit`` reads it) after the exit hooks and a flush.

    Where another thread still runs, or the code is a message, it is a plain ``sys.exit``: the
    interpreter waits for those threads, and prints the message.
    """
    if code is None:
        code = 0
    if not isinstance(code, int) or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
