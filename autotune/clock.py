"""The one clock every decision on time reads: the budget, probe limits, re-measuring the
reference, waiting for other workers, the service's scheduling and preemption.

Real runs read the system's clocks (:class:`SystemClock`, the default). A simulated run swaps
in a :class:`VirtualClock` that moves only when something advances it: the simulated device
advances it by the time each probe would have taken, and a wait (``sleep``) advances it by the
time waited, so a search of an hour runs in milliseconds and ends exactly where its budget
says.

Measurement itself (the timed blocks inside a probe) keeps ``time.perf_counter``: a probe
measures the device, not a decision.

Example:
    >>> from autotune import clock
    >>> with clock.use(clock.VirtualClock()) as c:
    ...     t0 = clock.now()
    ...     clock.sleep(90.0)
    ...     clock.now() - t0
    90.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["Clock", "SystemClock", "VirtualClock", "current", "now", "sleep", "use", "wall"]


class Clock(Protocol):
    """What a clock offers: a monotonic reading, the wall time, and a wait."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for durations and deadlines)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (for what is stored and compared across processes)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...


class SystemClock:
    """The system's clocks: ``time.monotonic``, ``time.time`` and ``time.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A clock that moves only when advanced; thread-safe.

    Args:
        start: its wall time at creation (seconds since the epoch); a fixed value makes a
            simulated run repeatable.

    Example:
        >>> c = VirtualClock(start=1_800_000_000.0)
        >>> c.advance(2.5)
        >>> c.monotonic(), c.time()
        (2.5, 1800000002.5)
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._lock = threading.Lock()
        self._elapsed = 0.0
        self._start = start

    def monotonic(self) -> float:
        with self._lock:
            return self._elapsed

    def time(self) -> float:
        with self._lock:
            return self._start + self._elapsed

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (a negative value is refused)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back, got seconds={seconds}")
        with self._lock:
            self._elapsed += seconds

    def sleep(self, seconds: float) -> None:
        """A wait costs no real time: the clock moves by what was waited."""
        if seconds > 0:
            self.advance(seconds)


_current: Clock = SystemClock()


def current() -> Clock:
    """The clock in use (the system's unless :func:`use` swapped in another)."""
    return _current


@contextmanager
def use(clock: Clock) -> Iterator[Clock]:
    """Make ``clock`` the one every decision reads, for the ``with`` block; restored after.

    Process-wide (the service's device threads read it too); simulations run one at a time.
    """
    global _current
    previous = _current
    _current = clock
    try:
        yield clock
    finally:
        _current = previous


def now() -> float:
    """The current clock's monotonic reading (seconds)."""
    return _current.monotonic()


def wall() -> float:
    """The current clock's wall time (seconds since the epoch)."""
    return _current.time()


def sleep(seconds: float) -> None:
    """Wait on the current clock."""
    _current.sleep(seconds)
