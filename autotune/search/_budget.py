"""The whole job's wall-clock budget, and the shares its phases may take of it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from autotune.errors import AutotuneError
from autotune.infra import clock
from autotune.schema.spec import MIN_BUDGET
from autotune.study.store import BudgetWindow, StudyStore

__all__ = [
    "CEILING_SHARE",
    "HARD_GRACE",
    "OPENING_LEAST",
    "OPENING_PLAN",
    "SAFE_PLAN",
    "TRIAL_SHARE",
    "VALIDATION_SHARE",
    "WRITE_RESERVE",
    "Budget",
    "SearchInterrupted",
    "SearchStopped",
    "finishing_seconds",
    "open_window",
]

# Share of the budget the ceiling phase may use at most.
CEILING_SHARE = 0.15
# Share of the budget held back for validation until the search's own figures size it.
VALIDATION_SHARE = 0.3
# Seconds held back for writing the artifact.
WRITE_RESERVE = 0.5
# Seconds the fp32 reference's first run gets at the least, however little is left.
REFERENCE_FLOOR = 3.0
# Seconds a short budget keeps, past the ceilings, for what the safe rule needs: the
# reference's floor, a first trial of two modes at the base batch, one short validation.
SAFE_PLAN = 4 * REFERENCE_FLOOR
# Seconds left after the worker's start below which the search opens with one pair: the safe
# rule's candidate beside the fp32 reference, whose arm is the reference and whose pair is that
# candidate's validation (a reference, a trial and a pair, each with its own set-up, do not fit).
OPENING_PLAN = 25.0
# ... and at or above which one fits (two arms' set-up and six pairs; below it, the reference
# runs alone).
OPENING_LEAST = 2 * REFERENCE_FLOOR
# A probe may overrun its soft limit by about one step; the hard limit adds this much.
HARD_GRACE = 15.0
# No ordinary trial may take more than this share of the budget.
TRIAL_SHARE = 0.1
# A study left without a config (its validator died, or every worker) gets this share of its
# budget to validate what it measured, at least the shortest budget a spec may have.
FINISH_SHARE = 0.1


class SearchInterrupted(AutotuneError):
    """Ctrl-C: the trials done so far are saved in the storage; running again resumes."""


class SearchStopped(AutotuneError):
    """The caller asked the search to stop (a cancel, or a service draining)."""


class BudgetTooShort(AutotuneError):
    """The budget ran out before the fp32 reference was measured: nothing compares, so no
    config is written. ``elapsed``: the seconds the search ran (the worker's start among them)."""

    def __init__(self, message: str, *, elapsed: float) -> None:
        super().__init__(message)
        self.elapsed = elapsed


@dataclass
class Budget:
    """The whole job's wall-clock budget, counted from ``started`` (a ``clock.now()``).

    Time spent inside :meth:`paused` (waiting for a busy device) does not count: a study's
    budget is probe time, not queue time.

    Example:
        >>> b = Budget(60.0)
        >>> 59.0 < b.left() <= 60.0
        True
    """

    total: float
    started: float = field(default_factory=clock.now)
    paused_seconds: float = 0.0

    def elapsed(self) -> float:
        return clock.now() - self.started - self.paused_seconds

    def left(self) -> float:
        return self.total - self.elapsed()

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = clock.now()
        try:
            yield
        finally:
            self.paused_seconds += clock.now() - t0

    @classmethod
    def shared(cls, store: StudyStore) -> Budget | None:
        """The budget window the study's current run opened, as seen by a joining worker.

        Returns None when the study has no open window (nobody started a search on it).
        """
        window = store.budget_window()
        if window is None:
            return None
        ago = clock.wall() - float(window.started_at)
        return cls(total=float(window.seconds), started=clock.now() - ago)


def open_window(store: StudyStore, budget: Budget) -> str:
    """Record the budget window this run opens, so joining workers share its clock.

    Returns:
        The window's id: validation runs once per window.
    """
    started_at = clock.wall() - budget.elapsed()
    # Its own id: two windows opened at one (virtual) time are two windows all the same.
    window = BudgetWindow(started_at=started_at, seconds=budget.total, id=uuid.uuid4().hex[:12])
    store.set_budget_window(window)
    return window_id(store)


def window_id(store: StudyStore) -> str:
    """The id of the study's open budget window (``"0"`` when none is open)."""
    window = store.budget_window()
    return window.name if window is not None else "0"


def finishing_seconds(total: float) -> float:
    """Seconds a study of budget ``total`` gets to validate what it measured when the worker
    that was to do it is gone (:data:`FINISH_SHARE` of it, at least the least budget)."""
    return max(MIN_BUDGET, FINISH_SHARE * total)
