"""The exceptions autotune raises for a user's mistake.

Every user-facing error is one message that names the field, the bad value and a fix.
Bugs in autotune itself are ordinary Python exceptions and are not caught here.

    AutotuneError                 root: catch this to handle any user mistake
    ├── SpecError                 a study spec, a candidate or a CLI flag is invalid
    ├── WorkloadError             a workload reference cannot be loaded, or breaks its contract
    ├── DeviceError               a device does not exist or cannot run what was asked
    ├── ConfigError               a TunedConfig file is missing, malformed or tampered with
    └── StorageError              the study storage cannot be opened or holds a different study
"""

from __future__ import annotations

__all__ = [
    "AutotuneError",
    "ConfigError",
    "DeviceError",
    "SpecError",
    "StorageError",
    "WorkloadError",
    "format_validation_error",
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


class StorageError(AutotuneError):
    """The study storage cannot be opened, or holds a study that conflicts with the spec."""


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
    for err in exc.errors():  # type: ignore[attr-defined]
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            lines.append(f"  {loc}: unknown field; remove it or check its spelling")
            continue
        value = err.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if err.get("type") == "missing":
            lines.append(f"  {loc}: required field is missing")
        elif err.get("type") == "value_error":
            # Our own validators already name the field, the value and the fix.
            lines.append(f"  {loc}: {msg.removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {msg}, got {loc.rsplit('.', 1)[-1]}={shown}")
    return "\n".join(lines)
