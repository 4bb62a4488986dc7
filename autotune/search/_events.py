"""What a search tells its watcher, as typed events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.measure.ceilings import Ceiling
from autotune.schema.spec import Candidate

__all__ = [
    "CeilingFound",
    "Event",
    "EventSink",
    "HardwareChecked",
    "PhaseStarted",
    "Standing",
    "TrialFinished",
    "TrialStarted",
]


@dataclass(frozen=True)
class Standing:
    """The best feasible trial so far and the fp32 reference, as the search sees them."""

    # The objective value of the best feasible trial (its speedup, or its time to loss).
    best: float | None = None
    best_params: dict[str, Any] | None = None
    best_throughput: float | None = None
    best_speedup: float | None = None
    reference_throughput: float | None = None


@dataclass(frozen=True)
class HardwareChecked:
    """The modes the device really runs, and the ones cut with the reason."""

    modes: list[str]
    cut: dict[str, str]
    # The device the worker runs on, as it resolved it (``auto`` becomes ``cpu`` or ``cuda:0``).
    device: str = ""
    kind: str = field(default="hardware", init=False)


@dataclass(frozen=True)
class PhaseStarted:
    """A phase began: ``ceilings`` (per ``mode``), ``reference``, ``search`` or ``validation``."""

    phase: str
    mode: str | None = None
    kind: str = field(default="phase", init=False)


@dataclass(frozen=True)
class CeilingFound:
    """A mode's batch ceiling, with every try."""

    mode: str
    ceiling: Ceiling
    kind: str = field(default="ceiling", init=False)


@dataclass(frozen=True)
class TrialStarted:
    """A trial asked for a probe of ``candidate``."""

    number: int
    candidate: Candidate
    kind: str = field(default="trial", init=False)


@dataclass(frozen=True)
class TrialFinished:
    """A trial ended. ``outcome``: ``completed``, ``infeasible``, ``reused`` (a twin's
    measurement), ``crashed`` (FAIL), or why it was pruned (``diverged``, ``oom``, ...)."""

    number: int
    outcome: str
    reason: str = ""
    throughput: float | None = None
    speedup: float | None = None
    gap: float | None = None
    # The best so far after this trial; None when the event does not say.
    standing: Standing | None = None
    kind: str = field(default="result", init=False)


Event = HardwareChecked | PhaseStarted | CeilingFound | TrialStarted | TrialFinished
EventSink = Callable[[Event], None]
