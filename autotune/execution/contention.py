"""How much of this machine's CPU other processes took while a search ran.

A probe's timings are its own only where nothing else competes for the cores: on a 2-core box
beside a build at load 5-8, short searches fell back to fp32 with nothing saying why. This reads
every process's CPU time from ``/proc`` at the start and at the end, and counts what the
processes outside our own tree (this process and its descendants: the probe worker, its
compile workers) used in between, as cores: 1.0 is one core kept busy the whole time.

Linux only (``/proc``); elsewhere, and on a simulated device's virtual clock, it measures
nothing (``None``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from autotune import clock

__all__ = ["CpuContention", "cores", "others_text"]

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


def _ours(snapshot: dict[int, tuple[int, float]]) -> set[int]:
    """This process and its descendants."""
    tree, grown = {os.getpid()}, True
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
        ours = _ours(now) | _ours(self.before)
        used = 0.0
        for pid, (_, cpu) in now.items():
            if pid in ours:
                continue
            before = self.before.get(pid)
            # A process started since counts whole; a reused pid whose time fell, from zero.
            used += cpu - before[1] if before is not None and before[1] <= cpu else cpu
        return max(0.0, used / seconds)

    def report(self) -> float | None:
        """:meth:`others_cores`, logged where it is notable."""
        taken = self.others_cores()
        if taken is not None and taken >= NOTABLE:
            logger.warning("{}", others_text(taken, cores()))
        return taken


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
