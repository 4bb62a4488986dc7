"""The largest batch size that fits, per precision mode, with a safety margin: doubling, then a
binary search, each try a real two-step probe."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field

from autotune.measure.oom import MARGIN_TAKEN
from autotune.measure.result import ProbeResult
from autotune.schema.enums import Outcome

if TYPE_CHECKING:
    import torch

__all__ = ["Ceiling", "CeilingTry", "find_ceiling", "memory_budget"]

# What counts as "does not fit": an OOM or a crash, or a peak that eats into the shared margin.
_FAILS = (Outcome.OOM, Outcome.CRASHED)


class CeilingTry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int
    fits: bool
    outcome: Outcome
    peak_memory: int | None = None
    note: str = ""


class Ceiling(BaseModel):
    """The result of a ceiling search for one precision mode."""

    model_config = ConfigDict(extra="forbid")

    precision: str
    batch_size: int = Field(ge=0, description="largest size that fit; 0 when none did")
    limited_by: str = Field(
        description="cap, memory, margin, time, or busy (other processes held the margin)"
    )
    tries: list[CeilingTry] = Field(default_factory=list)

    @property
    def sizes_tried(self) -> list[int]:
        return [t.batch_size for t in self.tries]


def memory_budget(device: torch.device, margin: float) -> int | None:
    """Bytes a probe may use so that ``margin`` of the device's total memory stays free.

    CUDA: free memory as the driver reports it (other processes count) minus the margin.
    CPU: MemAvailable minus the margin of MemTotal. None when it cannot be read.
    """
    if device.type == "cuda":
        # Only here: a caller holding a CUDA device has torch loaded; the search's parent reads
        # its budget from the worker's facts and imports this module without torch.
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - margin * total))
    try:
        info = {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
        }
        return max(0, int(info["MemAvailable"] - margin * info["MemTotal"]))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def find_ceiling(  # noqa: PLR0913 - public API: the try function, then keyword-only search bounds
    try_batch: Callable[[int], ProbeResult],
    precision: str,
    *,
    start: int,
    cap: int,
    budget_bytes: int | None = None,
    granularity: int = 8,
    stop_when: Callable[[ProbeResult], bool] | None = None,
) -> Ceiling:
    """Find the largest batch size in ``[1, cap]`` whose probe fits.

    Args:
        try_batch: runs a short probe at a batch size and returns its result.
        precision: the mode being measured (for the record and the logs).
        start: the first size tried (the workload's base batch size is a good start).
        cap: the largest size ever tried.
        budget_bytes: peak memory a fitting size may use; None skips the margin check.
        granularity: the binary search stops when the bracket is this narrow; multiples of 8
            suit tensor cores. Sizes below it are searched at 1.
        stop_when: a try for which this is true ends the search (e.g. a probe that ran out of
            its time limit: larger batches only take longer); the ceiling is then the largest
            size that fit so far, limited by ``time``.

    Returns:
        A Ceiling with the size, what limited it and every try in order.

    Example:
        >>> from autotune.schema.enums import Outcome
        >>> from autotune.measure.result import ProbeResult
        >>> from autotune.schema.spec import Candidate
        >>> def probe(bs):  # a device where anything above 80 runs out of memory
        ...     cand = Candidate(precision="fp32", batch_size=bs, learning_rate=0.1)
        ...     return ProbeResult(candidate=cand, workload="w", device="cpu",
        ...                        outcome=Outcome.OOM if bs > 80 else Outcome.COMPLETED)
        >>> c = find_ceiling(probe, "fp32", start=16, cap=1024)
        >>> c.sizes_tried, c.batch_size, c.limited_by
        ([16, 32, 64, 128, 96, 80, 88], 80, 'memory')
    """
    tries: list[CeilingTry] = []
    stopped = [False]

    def fits(bs: int) -> bool:
        result = try_batch(bs)
        if stop_when is not None and stop_when(result):
            stopped[0] = True
        peak = result.peak_memory
        ok = result.outcome not in _FAILS
        note = result.reason if not ok else ""
        if ok and budget_bytes is not None and peak is not None and peak > budget_bytes:
            ok = False
            note = f"peak {peak / 2**20:.0f} MiB leaves less than the margin free ({budget_bytes / 2**20:.0f} MiB allowed)"
        if MARGIN_TAKEN in note:
            # Other processes held the margin before the try began: no size would have fit,
            # and this says nothing about the mode's ceiling.
            stopped[0] = True
        tries.append(
            CeilingTry(batch_size=bs, fits=ok, outcome=result.outcome, peak_memory=peak, note=note)
        )
        verdict = "fits" if ok else f"does not fit ({note or result.outcome})"
        logger.info("ceiling {} bs={} → {}", precision, bs, verdict)
        return ok

    start = max(1, min(start, cap))
    lo, hi = 0, None
    bs = start
    # 1. Doubling.
    while True:
        if fits(bs):
            lo = bs
            if bs >= cap or stopped[0]:
                break
            bs = min(bs * 2, cap)
        else:
            hi = bs
            break
    # 2. Binary search inside (lo, hi).
    if hi is not None:
        while not stopped[0] and hi - lo > (granularity if lo >= granularity else 1):
            step = granularity if lo >= granularity else 1
            mid = lo + max(step, ((hi - lo) // 2) // step * step)
            if mid >= hi:
                break
            if fits(mid):
                lo = mid
            else:
                hi = mid
    limited_by = _limited_by(tries, hit_cap=hi is None and lo >= cap, stopped=stopped[0])
    logger.info("ceiling {} = {} (limited by {}, {} tries)", precision, lo, limited_by, len(tries))
    return Ceiling(precision=precision, batch_size=lo, limited_by=limited_by, tries=tries)


def _limited_by(tries: list[CeilingTry], *, hit_cap: bool, stopped: bool) -> str:
    """What ended the search: the cap, the stop (time), or the last size that did not fit."""
    if hit_cap:
        return "cap"
    if any(MARGIN_TAKEN in t.note for t in tries):
        return "busy"
    if stopped:
        return "time"
    last_fail = next(t for t in reversed(tries) if not t.fits)
    return {Outcome.OOM: "memory", Outcome.CRASHED: "crash"}.get(last_fail.outcome, "margin")
