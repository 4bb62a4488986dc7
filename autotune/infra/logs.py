"""Logging set-up for the ``autotune`` command: human-readable or JSON lines, stderr and a file.

Library modules only *emit* (``logger.info("ceiling fp16 bs=512 → OOM")``); they never add or
remove handlers, so ``import autotune`` leaves an application's logging alone. The command line
calls :func:`setup_logging` once, then :func:`log_to_file` when it knows a study's folder.

Formats:

- human (default): ``19:41:13 | INFO    | trial 3: fp16 bs=16 ... → 1737.9 samples/s``
- JSON lines (``--log-json`` or ``AUTOTUNE_LOG_JSON=1``): one object per line with ``time``,
  ``level``, ``message``, ``logger``, ``function``, ``line`` and any fields bound with
  ``logger.bind(...)`` (the progress lines carry ``elapsed_s``, ``phase``, trial counts ...).

Python warnings and the standard-library loggers (Optuna's) are routed through the same sinks,
so a JSON stream stays JSON and a live progress display is not torn by a stray line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from autotune.infra.files import make_dirs, open_for_writing
from autotune.infra.redact import mask_url

if TYPE_CHECKING:
    from loguru import Record  # only in loguru's stubs

__all__ = [
    "FILE_FORMAT",
    "HUMAN_FORMAT",
    "JSON_ENV",
    "json_from_env",
    "json_line",
    "log_to_file",
    "reset_logging",
    "setup_logging",
]

JSON_ENV = "AUTOTUNE_LOG_JSON"
HUMAN_FORMAT = "{time:HH:mm:ss} | {level: <7} | {message}"
# The file outlives the terminal session: full date, and where each line came from.
FILE_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {name}:{line} | {message}"

# Keys every JSON line has; bound extras never overwrite them.
_BASE_KEYS = ("time", "level", "message", "logger", "function", "line")


def json_from_env(environ: dict[str, str] | None = None) -> bool:
    """True when ``AUTOTUNE_LOG_JSON`` asks for JSON logs (``1``, ``true``, ``yes``, ``on``).

    Example:
        >>> json_from_env({"AUTOTUNE_LOG_JSON": "1"})
        True
    """
    value = (environ if environ is not None else os.environ).get(JSON_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _plain(value: Any) -> Any:
    """A JSON-safe copy: NaN and inf become strings (``json.loads`` rejects bare ``NaN``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def json_line(record: Mapping[str, Any]) -> str:
    """One loguru record as one line of JSON (no newline inside, whatever the message holds).

    Example:
        >>> logger.add(lambda m: print(json_line(m.record)))  # doctest: +SKIP
    """
    payload: dict[str, Any] = {
        "time": record["time"].isoformat(),
        "level": record["level"].name,
        "message": record["message"],
        "logger": record["name"],
        "function": record["function"],
        "line": record["line"],
    }
    for key, value in record["extra"].items():
        if not key.startswith("_") and key not in _BASE_KEYS:
            payload[key] = _plain(value)
    exc = record.get("exception")
    if exc is not None and exc.type is not None:
        payload["exception"] = "".join(
            traceback.format_exception(exc.type, exc.value, exc.traceback)
        )
    return json.dumps(payload, ensure_ascii=False, allow_nan=False)


def _json_format(record: Record) -> str:
    # loguru formats the returned template with the record: hand it the finished line through an
    # extra field, so braces inside messages are never read as placeholders.
    record["extra"]["_json"] = json_line(record)
    return "{extra[_json]}\n"


def _redact(record: Any) -> None:
    record["message"] = mask_url(record["message"])


class _ToLoguru(logging.Handler):
    """Sends standard-library log records (Optuna, ``warnings``) to loguru's sinks."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.patch(
            lambda r: r.update(
                {"name": record.name, "function": record.funcName, "line": record.lineno}
            )
        ).opt(exception=record.exc_info).log(level, record.getMessage())


def _stderr_sink(console: Any, json_lines: bool) -> Any:
    """A sink that writes where stderr is *now*, or through a rich console.

    Through the console, a line printed during a live display lands above it instead of
    through it. JSON lines are written raw: a console could style or wrap them.
    """
    if console is None or json_lines:

        def write(message: Any) -> None:
            sys.stderr.write(str(message))
            sys.stderr.flush()

        return write

    from rich.text import Text

    styles = {"WARNING": "yellow", "ERROR": "red", "CRITICAL": "bold red"}

    def show(message: Any) -> None:
        style = styles.get(message.record["level"].name, "")
        # soft_wrap: a long line stays one line in a pipe or a CI log
        console.print(Text(str(message).rstrip("\n"), style=style), soft_wrap=True)

    return show


# The standard library's root handlers before setup_logging replaced them, for reset_logging.
_saved_root: tuple[list[logging.Handler], int] | None = None


def setup_logging(
    level: str = "INFO", *, json_lines: bool = False, console: Any | None = None
) -> None:
    """Replace all loguru handlers with one stderr sink, and route stdlib logging into it.

    Call it once per command, from the command line only: library code never configures
    logging.

    Args:
        level: the lowest level shown on stderr (``DEBUG``, ``INFO``, ``WARNING``).
        json_lines: one JSON object per line instead of the human format.
        console: a ``rich.console.Console`` on stderr to print human lines through (keeps a live
            display intact); None writes to ``sys.stderr`` directly.

    Example:
        >>> setup_logging("INFO", json_lines=True)  # doctest: +SKIP
    """
    import optuna

    global _saved_root
    if _saved_root is None:
        root = logging.getLogger()
        _saved_root = (list(root.handlers), root.level)
    logger.remove()
    # Every message, from autotune, Optuna or a driver, loses any storage password it holds.
    logger.configure(patcher=_redact)
    logger.add(
        _stderr_sink(console, json_lines),
        level=level,
        format=_json_format if json_lines else HUMAN_FORMAT,
        colorize=False,
        # diagnose would print local variables with a traceback: a storage password among them
        diagnose=False,
        backtrace=False,
    )
    # Optuna's own handler writes to the stderr it saw at import time; route it through ours.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    logging.basicConfig(handlers=[_ToLoguru()], level=logging.WARNING, force=True)
    # Off, then on: re-installs the hook even if something replaced warnings.showwarning since.
    logging.captureWarnings(False)
    logging.captureWarnings(True)


def reset_logging() -> None:
    """Undo :func:`setup_logging`: loguru back to its default stderr handler, the standard
    library's root handlers, Python warnings and Optuna's own handler as they were.

    For a process that runs a command in-process and goes on (tests, a service).
    """
    import optuna

    global _saved_root
    logger.remove()
    logger.configure(patcher=None)
    # Where stderr is at each message, not the stream it was now: a caller that swaps it for a
    # while (a test's capture) may close the one it swapped in.
    logger.add(_stderr_sink(None, False))
    logging.captureWarnings(False)
    optuna.logging.disable_propagation()
    optuna.logging.enable_default_handler()
    if _saved_root is not None:
        root = logging.getLogger()
        root.handlers[:] = _saved_root[0]
        root.setLevel(_saved_root[1])
        _saved_root = None


class _LogFile:
    """A log file that survives a full disk: a line that cannot be written is dropped, and
    stderr says so once (loguru would print a traceback for every line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # The owner's only, unless AUTOTUNE_UMASK says otherwise (autotune.infra.files).
        self._file = open_for_writing(path, "a")
        self._failing = False

    def write(self, message: str) -> None:
        try:
            self._file.write(message)
            self._file.flush()
        except OSError as exc:
            if not self._failing:
                self._failing = True
                with contextlib.suppress(OSError):
                    sys.stderr.write(
                        f"warning: cannot write the log file {str(self.path)!r} "
                        f"({exc.strerror}); its lines are dropped until it can be written\n"
                    )
            return
        self._failing = False

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


def log_to_file(
    path: str | Path,
    *,
    json_lines: bool = False,
    level: str = "DEBUG",
    filter: Any = None,
) -> int:
    """Append every log line of this run to ``path`` (created with its folder); returns the
    handler id to pass to ``logger.remove`` when the run is over.

    The file takes DEBUG by default: every probe, including the ceiling tries, is on record even
    when the terminal shows less. A line that cannot be written (a full disk) is dropped, with
    one warning on stderr, and the run goes on.

    Args:
        path: the log file.
        json_lines: one JSON object per line instead of the file format.
        level: the lowest level written.
        filter: loguru's record filter, e.g. only one study's lines.

    Raises:
        OSError: the folder or the file cannot be created.

    Example:
        >>> handler = log_to_file("studies/tiny/search.log")  # doctest: +SKIP
        >>> logger.remove(handler)  # doctest: +SKIP
    """
    path = Path(path)
    make_dirs(path.parent)
    return logger.add(
        _LogFile(path),
        level=level,
        format=_json_format if json_lines else FILE_FORMAT,
        filter=filter,
        colorize=False,
        diagnose=False,
        backtrace=False,
    )
