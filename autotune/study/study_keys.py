"""The study's keys: every user attribute autotune stores on an Optuna study, named once."""

from __future__ import annotations

__all__ = [
    "BEST_CONFIG",
    "BUDGET_WINDOW",
    "CONFIG",
    "DIAGNOSIS",
    "MEASUREMENT",
    "PRECISION_CHOICES",
    "SPACE_FINGERPRINT",
    "SPEC",
    "WORKLOAD",
    "ceilings_key",
    "parse_ceilings_key",
    "parse_legacy_ceilings_key",
    "parse_reference_key",
    "reference_key",
]

SPACE_FINGERPRINT = "space_fingerprint"
WORKLOAD = "workload"
SPEC = "spec"
BEST_CONFIG = "best_config"
CONFIG = "tuned_config"
BUDGET_WINDOW = "budget_window"
PRECISION_CHOICES = "precision_choices"
DIAGNOSIS = "fp16_diagnosis"
_CEILINGS = "ceilings"
_LIMITS = "ceiling_limits"
_REFERENCE = "reference"

# The trial attribute naming the reference measurement a trial's speedup was divided by:
# ``{"key": "reference:<host>:<device>", "index": i}``, ``i`` counting the record's measurements
# from 0 (the long first run), oldest first.
MEASUREMENT = "reference_measurement"


def ceilings_key(host: str, device: str, *, limits: bool = False) -> str:
    """The study attribute the ceilings of one device of one machine are stored under (with
    ``limits``: what limited each, ``{mode: "memory"}``; absent in older studies).

    Example:
        >>> ceilings_key("box1", "cuda:0")
        'ceilings:box1:cuda:0'
        >>> ceilings_key("box1", "cuda:0", limits=True)
        'ceiling_limits:box1:cuda:0'
    """
    return f"{_LIMITS if limits else _CEILINGS}:{host}:{device}"


def reference_key(host: str, device: str) -> str:
    """The study attribute the fp32 reference of one device of one machine is stored under.

    Example:
        >>> reference_key("box1", "cpu")
        'reference:box1:cpu'
    """
    return f"{_REFERENCE}:{host}:{device}"


def _parse(prefix: str, key: str) -> tuple[str, str] | None:
    if not key.startswith(f"{prefix}:"):
        return None
    host, sep, device = key[len(prefix) + 1 :].partition(":")
    if not sep or not device:
        return None
    return host, device


def parse_ceilings_key(key: str) -> tuple[str, str] | None:
    """``(host, device)`` of a ceilings key, or None when ``key`` is not one.

    Example:
        >>> parse_ceilings_key("ceilings:box1:cuda:0")
        ('box1', 'cuda:0')
        >>> parse_ceilings_key("ceiling_limits:box1:cuda:0") is None
        True
    """
    return _parse(_CEILINGS, key)


def parse_legacy_ceilings_key(key: str) -> str | None:
    """The device of an older study's ceilings key (``ceilings:<device>``, one table per device
    without the machine), or None when ``key`` is not one.

    Example:
        >>> parse_legacy_ceilings_key("ceilings:cuda")
        'cuda'
        >>> parse_legacy_ceilings_key("ceilings:box1:cuda:0") is None
        True
    """
    if not key.startswith(f"{_CEILINGS}:") or parse_ceilings_key(key) is not None:
        return None
    return key[len(_CEILINGS) + 1 :]


def parse_reference_key(key: str) -> tuple[str, str] | None:
    """``(host, device)`` of a reference key, or None when ``key`` is not one.

    Example:
        >>> parse_reference_key("reference:box1:cpu")
        ('box1', 'cpu')
    """
    return _parse(_REFERENCE, key)
