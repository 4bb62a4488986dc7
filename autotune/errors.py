"""The exceptions autotune raises for a user's mistake, and the warnings it issues.

Every user-facing error is one message that names the field, the bad value and a fix.
Bugs in autotune itself are ordinary Python exceptions and are not caught here.

    AutotuneError                 root: catch this to handle any user mistake
    ├── SpecError                 a study spec, a candidate or a CLI flag is invalid
    ├── WorkloadError             a workload reference cannot be loaded, or breaks its contract
    ├── DeviceError               a device does not exist or cannot run what was asked
    ├── ConfigError               a TunedConfig file is missing, malformed or tampered with
    ├── ExportError               an export cannot hand a trainer what the config was tuned with
    ├── StorageError              the study storage cannot be opened or holds a different study
    │   └── StorageIOError        it failed a read or write mid-run (a full disk, a lost server)
    └── ServiceError              the tuning service cannot be reached, or refused a request

    AutotuneWarning (UserWarning)     root of autotune's warnings: filter this to silence them
    ├── EnvironmentMismatchWarning    a config is used on another GPU model, capability or torch
    └── ExportWarning                 an export, or the run it feeds, leaves a tuned value behind
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "AutotuneError",
    "AutotuneWarning",
    "ConfigError",
    "DeviceError",
    "EnvironmentMismatchWarning",
    "ExportError",
    "ExportWarning",
    "ServiceError",
    "SpecError",
    "StorageError",
    "StorageIOError",
    "WorkloadError",
    "format_validation_error",
    "short_repr",
]


class AutotuneError(Exception):
    """Root of the errors autotune raises for a user's mistake."""


class SpecError(AutotuneError, ValueError):
    """A study spec, candidate or command-line value is invalid."""


class WorkloadError(AutotuneError):
    """A workload reference cannot be loaded, or the workload breaks its contract."""


class DeviceError(AutotuneError):
    """A device does not exist or cannot run what was asked."""


class ConfigError(AutotuneError, ValueError):
    """A TunedConfig file is missing, malformed or has been tampered with."""


class ExportError(AutotuneError):
    """An export cannot hand its trainer what the config was tuned with (the optimizer the lr
    belongs to, its settings), so it refuses rather than train something else."""


class StorageError(AutotuneError):
    """The study storage cannot be opened, or holds a study that conflicts with the spec."""


class StorageIOError(StorageError):
    """The study storage failed a read or a write mid-run: its disk is full, its server went
    away. What it held before is kept; the same command (or the service, by itself) resumes
    once it works again."""


class ServiceError(AutotuneError):
    """The tuning service (``autotune serve``) cannot be reached, or refused a request.

    ``status`` is the HTTP status the service answered with; None when it could not be reached.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AutotuneWarning(UserWarning):
    """Root of the warnings autotune issues; ``warnings.filterwarnings`` on it silences them."""


class EnvironmentMismatchWarning(AutotuneWarning):
    """A TunedConfig is used on a GPU model, compute capability or torch version it was not
    tuned on: it still loads, but its measured speedup may not hold."""


class ExportWarning(AutotuneWarning):
    """An export could not place a tuned value (a batch size, an lr) where the trainer takes it,
    or a run fed by one trains with another value than the config's."""


class _ShortRepr(reprlib.Repr):
    """``repr`` that stops early: a few items, two levels, short strings, and never the digits
    of a huge integer (``repr`` itself refuses those past 4,300 digits)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = 4
        self.maxstring = self.maxother = self.maxlong = limit

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:
            return f"<an integer of about {x.bit_length() * 0.30103:.0f} digits>"
        return super().repr_int(x, level)


def short_repr(value: Any, limit: int = 80) -> str:
    """A value as error messages quote it: at most about ``limit`` characters, whatever its size.

    The cost is bounded too: nested containers are cut after a few items and two levels, so
    quoting a huge (or self-repeating) input costs nothing.

    Example:
        >>> short_repr("x" * 500, 20)
        "'xxxxxxx...xxxxxxxx'"
        >>> short_repr([[[[1]]]])
        '[[[...]]]'
    """
    shown = _ShortRepr(limit).repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# Lines a validation message lists at most.
_MAX_LINES = 20


def format_validation_error(exc: object, source: str) -> str:
    """Turn a pydantic ``ValidationError`` into one readable message per bad field.

    Args:
        exc: the ``pydantic.ValidationError``.
        source: what was being validated, e.g. ``"study spec studies/x.yaml"``.

    Returns:
        A multi-line message: one line per error naming the field path, the value and the
        reason.
    """
    lines = [f"invalid {source}:"]
    errors = exc.errors()  # type: ignore[attr-defined]
    # A body of thousands of unknown fields gets a message, not thousands of lines.
    shown_errors, more = errors[:_MAX_LINES], len(errors) - _MAX_LINES
    for err in shown_errors:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            lines.append(f"  {loc}: unknown field; remove it or check its spelling")
            continue
        shown = short_repr(err.get("input"))
        if err.get("type") == "missing":
            lines.append(f"  {loc}: required field is missing")
        elif err.get("type") == "finite_number":
            # inf or nan where a number bounds a check: the check would never fire.
            lines.append(
                f"  {loc}: must be a finite number, got {loc.rsplit('.', 1)[-1]}={shown}; inf "
                "and nan would switch its check off: write a number, or leave the field out for "
                "its default"
            )
        elif err.get("type") == "value_error":
            # Our own validators already name the field, the value and the fix.
            lines.append(f"  {loc}: {msg.removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {msg}, got {loc.rsplit('.', 1)[-1]}={shown}")
    if more > 0:
        lines.append(f"  ... and {more} more")
    return "\n".join(lines)
