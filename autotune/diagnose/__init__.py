"""Say *why* a precision fails: per-layer numerics of a few instrumented training steps
(:func:`diagnose`), and what to do about it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.infra.lazy import lazy

if TYPE_CHECKING:
    from autotune.diagnose._diverged_trial import trial_candidate, worst_diverged_trial
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
    "trial_candidate": "_diverged_trial",
    "worst_diverged_trial": "_diverged_trial",
}


__getattr__ = lazy(__name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
