"""Say *why* a precision fails: per-layer numerics of a few instrumented training steps.

:func:`diagnose` trains a workload for a few steps under one candidate with hooks on every leaf
module and records, per layer, how close its activations and gradients come to the limits of
the precision's dtype, which layer first produced a non-finite value, and what to do about it.
It is the step engine's training step (:class:`autotune.measure.step.StepEngine`) with
instruments on: slower, never timed. ``run_probe`` installs no hooks.

Each step runs two passes on the same batch and the same weights:

1. a **shadow pass** in fp32 (no autocast, loss not scaled) shows the true size of every
   activation and gradient: an fp16 value past 65 504 is just ``inf``, only fp32 can say it
   would have been 71 000. Its gradients, multiplied by the GradScaler's scale and cast to the
   dtype, count exactly how many values that dtype would flush to zero;
2. the **real pass**, as the probe does it (autocast, scaled loss, ``scaler.step``), shows
   which layers produce non-finite values, in which dtype and in which order.

fp32 and tf32 have nothing to compare against, so they run the real pass only.

The package, one file per concept: ``_models`` (what a diagnosis reports), ``_hooks`` (the
instruments), ``_run`` (the instrumented run), ``_advice`` (figures into recommendations),
``_fp32`` (keeping modules in fp32), ``_trials`` (which trial of a study to diagnose).

The names load on first use: all but the models need torch, which a command that only needs
``DEFAULT_STEPS`` (``autotune diagnose --help``) should not wait for.

Example:
    >>> from autotune.diagnose import diagnose
    >>> from autotune.spec import Candidate
    >>> from autotune.workloads import load_workload
    >>> d = diagnose(load_workload("autotune.testing.workloads:fp16_overflow"),
    ...              Candidate(precision="fp16", batch_size=64, learning_rate=1e-3), "cpu")
    >>> d.verdict, d.first_nonfinite
    ('fails', 'amplify')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._lazy import lazy

if TYPE_CHECKING:
    from autotune.diagnose._fp32 import fp32_modules, keep_in_fp32
    from autotune.diagnose._instrumented import diagnose
    from autotune.diagnose._models import (
        DEFAULT_STEPS,
        NEAR_LIMIT,
        UNDERFLOW_SHARE,
        Diagnosis,
        LayerStats,
        Recommendation,
    )
    from autotune.diagnose._trials import trial_candidate, worst_diverged_trial

__all__ = [
    "DEFAULT_STEPS",
    "NEAR_LIMIT",
    "UNDERFLOW_SHARE",
    "Diagnosis",
    "LayerStats",
    "Recommendation",
    "diagnose",
    "fp32_modules",
    "keep_in_fp32",
    "trial_candidate",
    "worst_diverged_trial",
]

# The private module each name lives in.
_LAZY = {
    "DEFAULT_STEPS": "_models",
    "NEAR_LIMIT": "_models",
    "UNDERFLOW_SHARE": "_models",
    "Diagnosis": "_models",
    "LayerStats": "_models",
    "Recommendation": "_models",
    "diagnose": "_instrumented",
    "fp32_modules": "_fp32",
    "keep_in_fp32": "_fp32",
    "trial_candidate": "_trials",
    "worst_diverged_trial": "_trials",
}


__getattr__ = lazy(__name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
