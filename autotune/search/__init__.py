"""The search: an Optuna study over precision, batch size, learning rate, init_scale and the
knobs a spec turns on, a private module per phase behind one face, :func:`run_search`."""

from __future__ import annotations

from autotune.search._artifact import FALLING_BACK
from autotune.search._budget import (
    Budget,
    BudgetTooShort,
    SearchInterrupted,
    SearchStopped,
    finishing_seconds,
)
from autotune.search._context import Gate
from autotune.search._coordination import settle
from autotune.search._events import (
    CeilingFound,
    Event,
    EventSink,
    HardwareChecked,
    PhaseStarted,
    Standing,
    TrialFinished,
    TrialStarted,
)
from autotune.search._run_search import SearchResult, run_search
from autotune.search._space import batch_ladder, lr_for, reference_factor

__all__ = [
    "FALLING_BACK",
    "Budget",
    "BudgetTooShort",
    "CeilingFound",
    "Event",
    "EventSink",
    "Gate",
    "HardwareChecked",
    "PhaseStarted",
    "SearchInterrupted",
    "SearchResult",
    "SearchStopped",
    "Standing",
    "TrialFinished",
    "TrialStarted",
    "batch_ladder",
    "finishing_seconds",
    "lr_for",
    "reference_factor",
    "run_search",
    "settle",
]
