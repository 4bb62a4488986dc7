"""The study's keys: every user attribute autotune stores on an Optuna study, named once.

As optuna keeps ``_CONSTRAINTS_KEY`` beside the one rule that reads it, autotune keeps the name of
everything it stores on a study here, and the study store (:mod:`autotune.study.store`) reads
and writes through these names: a reader never spells a key. What a *trial* stores is :class:`autotune.study.trials.TrialRecord`'s
fields; the one trial attribute outside it (:data:`MEASUREMENT`) is named here too.

Older studies may also hold ``time_spent`` (wall seconds by phase): nothing read it, so it is no
longer written; the search logs the figures and returns them (``SearchResult.spent``).

=============================  =============================================================
study attribute                meaning
=============================  =============================================================
space_fingerprint              the search space's fingerprint: a changed space is a new study
workload                       the workload the study tunes (its spec's ``workload``)
spec                           the study's spec, as JSON (the storage URL's password hidden)
best_config                    where the search wrote ``best.json``
tuned_config                   the tuned config itself, as JSON text (see ``crown.store_config``)
budget_window                  ``{"started_at", "seconds", "id"}``: the job's budget, shared by workers
precision_choices              the precision modes the first worker offered the sampler
fp16_diagnosis                 what diagnosing fp16's divergence found (its modules, its advice)
ceilings:<host>:<device>       the batch ceiling of each mode on one device of one machine
ceiling_limits:<host>:<device> what limited each ceiling: memory, margin, time, cap, crash
reference:<host>:<device>      the fp32 reference of one device of one machine
ceilings:<device>              older studies: the batch ceilings of a device, without the machine
=============================  =============================================================
"""

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
