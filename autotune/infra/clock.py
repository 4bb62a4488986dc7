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
    >>> from autotune.infra import clock
    >>> with clock.use(clock.VirtualClock()) as c:
    ...     t0 = clock.now()
    ...     clock.sleep(90.0)
    ...     clock.now() - t0
    90.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = [
    "Clock",
    "EventClock",
    "SystemClock",
    "VirtualClock",
    "current",
    "notify",
    "now",
    "sleep",
    "start_thread",
    "use",
    "wait",
    "wall",
]


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

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        """Wait ``seconds``, or until :meth:`notify` of ``cond``."""
        ...

    def notify(self, cond: threading.Condition) -> None:
        """Wake every thread waiting on ``cond``."""
        ...

    def start_thread(
        self, target: Callable[..., None], *args: object, name: str
    ) -> threading.Thread:
        """Start a daemon thread running ``target(*args)`` whose waits this clock may keep."""
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

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        with cond:
            cond.wait(seconds)

    def notify(self, cond: threading.Condition) -> None:
        with cond:
            cond.notify_all()

    def start_thread(
        self, target: Callable[..., None], *args: object, name: str
    ) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread


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

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        """One thread on this clock: nobody else could notify, so the whole wait passes."""
        self.sleep(seconds)

    def notify(self, cond: threading.Condition) -> None:
        pass

    # A thread of its own: its waits pass as the one thread's do (see EventClock for several).
    start_thread = SystemClock.start_thread


class EventClock(VirtualClock):
    """A virtual clock several threads share: simulated time as a sequence of events.

    The threads that *take part* (started by :meth:`start_thread`, or inside
    :meth:`taking_part`) run one at a time, each until it waits on the clock (``sleep``,
    ``advance``, ``wait``); work between two waits takes no simulated time. When the one
    running waits, the clock moves to the earliest wake-up and that thread runs next (in the
    order they fell due). So eight simulated devices run side by side on one clock, each probe
    taking its simulated time, a run of hours takes seconds, and the same run goes the same way
    again: nothing happens at once.

    A thread that takes part must never block on something only another taking-part thread can
    release (joining it, say): leave first.

    Example:
        >>> c = EventClock()
        >>> seen = []
        >>> def device(name, seconds):
        ...     c.sleep(seconds)
        ...     seen.append((name, c.monotonic()))
        >>> with c.taking_part():
        ...     a = c.start_thread(device, "a", 30.0, name="a")
        ...     b = c.start_thread(device, "b", 10.0, name="b")
        ...     c.sleep(60.0)
        >>> seen
        [('b', 10.0), ('a', 30.0)]
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        super().__init__(start)
        self._cond = threading.Condition()
        self._members: set[int] = set()
        self._running: set[int] = set()
        self._starting = 0
        self._seq = 0
        # thread → (simulated time it is due, order it fell due in, the condition that may
        # make it due sooner)
        self._sleepers: dict[int, tuple[float, int, threading.Condition | None]] = {}

    def advance(self, seconds: float) -> None:
        """For a thread that takes part, a wait of ``seconds``: the others catch up first."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back, got seconds={seconds}")
        self._wait(seconds, None)

    def sleep(self, seconds: float) -> None:
        self._wait(max(0.0, seconds), None)

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        self._wait(max(0.0, seconds), cond)

    def notify(self, cond: threading.Condition) -> None:
        """The threads waiting on ``cond`` are due now (they run once the caller waits)."""
        with self._cond:
            now = self.monotonic()
            for ident, (at, _, key) in list(self._sleepers.items()):
                if key is cond and at > now:
                    self._seq += 1
                    self._sleepers[ident] = (now, self._seq, None)

    def start_thread(
        self, target: Callable[..., None], *args: object, name: str
    ) -> threading.Thread:
        """Start a thread that takes part from its first instruction to its last; it first runs
        once the caller waits."""

        def body() -> None:
            with self._cond:
                self._starting -= 1
                self._members.add(threading.get_ident())
            try:
                self._wait(0.0, None)
                target(*args)
            finally:
                self._leave()

        with self._cond:
            self._starting += 1
        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        return thread

    @contextmanager
    def taking_part(self) -> Iterator[EventClock]:
        """The calling thread takes part for the ``with`` block."""
        with self._cond:
            self._members.add(threading.get_ident())
        try:
            self._wait(0.0, None)
            yield self
        finally:
            self._leave()

    # ---- the events ---------------------------------------------------------------------------

    def _leave(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._members.discard(me)
            self._running.discard(me)
            self._step()

    def _wait(self, seconds: float, cond: threading.Condition | None) -> None:
        me = threading.get_ident()
        with self._cond:
            if not self._members and not self._starting:
                super().advance(seconds)  # nobody takes part: a plain virtual clock
                return
            self._seq += 1
            self._sleepers[me] = (self.monotonic() + seconds, self._seq, cond)
            self._running.discard(me)
            self._step()
            while me in self._sleepers:
                self._cond.wait()

    def _step(self) -> None:
        """Nobody runs: move to the earliest wake-up and let the thread due first run."""
        while not self._running and not self._starting and self._sleepers:
            ident, (at, _, _) = min(self._sleepers.items(), key=lambda item: item[1][:2])
            gap = at - self.monotonic()
            if gap > 0:
                super().advance(gap)
            del self._sleepers[ident]
            if ident in self._members:
                self._running.add(ident)
            self._cond.notify_all()


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


def wait(cond: threading.Condition, seconds: float) -> None:
    """Wait ``seconds`` on the current clock, or until :func:`notify` of ``cond``."""
    _current.wait(cond, seconds)


def notify(cond: threading.Condition) -> None:
    """Wake the threads waiting on ``cond`` through :func:`wait`."""
    _current.notify(cond)


def start_thread(target: Callable[..., None], *args: object, name: str) -> threading.Thread:
    """Start a daemon thread running ``target(*args)``; on an :class:`EventClock` it takes
    part in simulated time."""
    return _current.start_thread(target, *args, name=name)
