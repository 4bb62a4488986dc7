"""How much of this machine's CPU other processes took while a search ran, read from ``/proc``
(our own process tree left out)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from autotune.errors import SpecError
from autotune.infra import clock

__all__ = ["BUSY_ENV", "CoreMeter", "CpuContention", "busy_cores", "cores", "others_text"]

# Others' cores worth a word: half a core kept busy (a neighbour's build, a stray loop).
NOTABLE = 0.5

_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _stat(pid: str) -> tuple[int, float] | None:
    """A process's parent and its CPU seconds (user + system), from ``/proc/<pid>/stat``."""
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:
        return None
    # The command sits in parentheses and may hold spaces: the fields follow the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK
    except (IndexError, ValueError):
        return None


def _snapshot() -> dict[int, tuple[int, float]]:
    """Every process: its parent and its CPU seconds."""
    out = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            out[int(entry.name)] = stat
    return out


def _ours(snapshot: dict[int, tuple[int, float]], roots: set[int] | None = None) -> set[int]:
    """``roots`` (this process by default) and their descendants."""
    tree, grown = set(roots or {os.getpid()}), True
    while grown:
        more = {pid for pid, (parent, _) in snapshot.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return tree


@dataclass
class CpuContention:
    """Started when made; :meth:`report` says what other processes took since."""

    started: float = field(default_factory=time.monotonic)
    before: dict[int, tuple[int, float]] | None = None

    def __post_init__(self) -> None:
        # A simulated device's clock is virtual: the real machine's load says nothing of it.
        if isinstance(clock.current(), clock.SystemClock) and _PROC.joinpath("stat").exists():
            self.before = _snapshot()

    def others_cores(self) -> float | None:
        """Cores other processes kept busy on average since the start; None where not measured
        or over less than a second."""
        seconds = time.monotonic() - self.started
        if self.before is None or seconds < 1.0:
            return None
        now = _snapshot()
        return _others(self.before, now, _ours(now) | _ours(self.before)) / seconds

    def report(self) -> float | None:
        """:meth:`others_cores`, logged where it is notable."""
        taken = self.others_cores()
        if taken is not None and taken >= NOTABLE:
            logger.warning("{}", others_text(taken, cores()))
        return taken


def _others(
    before: dict[int, tuple[int, float]], now: dict[int, tuple[int, float]], ours: set[int]
) -> float:
    """CPU seconds the processes outside ``ours`` used between two snapshots."""
    used = 0.0
    for pid, (_, cpu) in now.items():
        if pid in ours:
            continue
        then = before.get(pid)
        # A process started since counts whole; a reused pid whose time fell, from zero.
        used += cpu - then[1] if then is not None and then[1] <= cpu else cpu
    return max(0.0, used)


class CoreMeter:
    """Cores other processes kept busy between one reading and the next (the service's view of
    a CPU device): each :meth:`read` measures since the last one at least ``window`` seconds
    before, and repeats its figure in between."""

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self._last: tuple[float, dict[int, tuple[int, float]]] | None = None
        self.taken: float | None = None
        self.seconds = 0.0

    def read(self, own: set[int]) -> float | None:
        """Others' cores since the last reading (None before a second reading, or off Linux);
        ``own``: our processes, whose descendants are ours too."""
        if not _PROC.joinpath("stat").exists():
            return None
        at = time.monotonic()
        if self._last is not None and at - self._last[0] < self.window:
            return self.taken
        now = _snapshot()
        if self._last is not None:
            then, before = self._last
            ours = _ours(now, own | {os.getpid()}) | _ours(before, own | {os.getpid()})
            self.seconds = max(at - then, 1e-6)
            self.taken = _others(before, now, ours) / self.seconds
        self._last = (at, now)
        return self.taken


# The environment variable that sets how many cores others may keep busy before a CPU device
# counts as busy ("off": never).
BUSY_ENV = "AUTOTUNE_CPU_BUSY_CORES"


def busy_cores(value: str | None = None) -> float | None:
    """Others' cores at which a CPU device is busy: ``AUTOTUNE_CPU_BUSY_CORES`` (a number, or
    ``off``), by default half the cores and at least one.

    Raises:
        SpecError: the variable is neither a positive number nor ``off``.

    Example:
        >>> busy_cores("1.5"), busy_cores("off")
        (1.5, None)
    """
    text = (os.environ.get(BUSY_ENV, "") if value is None else value).strip().lower()
    if not text:
        return max(1.0, cores() / 2)
    if text == "off":
        return None
    try:
        limit = float(text)
    except ValueError:
        limit = -1.0
    if not 0 < limit < float("inf"):
        raise SpecError(
            f"{BUSY_ENV}={text!r}: give the cores other processes may keep busy before a CPU "
            f"device counts as busy (a positive number, e.g. {BUSY_ENV}=1), or off"
        )
    return limit


def others_text(taken: float, total: int) -> str:
    """What other processes took, in words.

    Example:
        >>> print(others_text(1.02, 2))
        other processes kept 1.0 of this machine's 2 cores busy during the search: its timings ran beside them (noisier, and slower where a core was shared); a quieter machine gives steadier figures
    """
    return (
        f"other processes kept {taken:.1f} of this machine's {total} cores busy during the "
        "search: its timings ran beside them (noisier, and slower where a core was shared); a "
        "quieter machine gives steadier figures"
    )
