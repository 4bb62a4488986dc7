"""Ceilings the search moves after the ceiling phase: an OOM in a trial lowers one, and where
the phase ran out of time the search's own peaks (or a short budget's opening pair) raise it."""

from __future__ import annotations

import math
from collections.abc import Callable

from loguru import logger
from optuna.trial import FrozenTrial

from autotune.measure.result import ProbeResult
from autotune.search._context import SearchContext
from autotune.search._hardware import fits_budget, jump_size, scaled_fits, where_of
from autotune.study.store import StudyStore
from autotune.study.trials import record

__all__ = [
    "ceiling_from_opening",
    "lower_ceiling",
    "raise_ceiling",
    "scaled_ceiling",
    "time_limited",
]

# A size the line through two measured peaks reaches may use this share of the budget: the line
# holds what does not scale with the batch apart, and a try past the budget runs out of memory
# at the margin and lowers the ceiling again.
_LINE_MEMORY_SHARE = 0.9


def lower_ceiling(ctx: SearchContext, store: StudyStore, mode: str, batch_size: int) -> None:
    """An OOM at ``batch_size`` during the search: the mode's ceiling drops below it."""
    lower = max([b for b in ctx.space.ladder if b < batch_size], default=0)
    if lower < ctx.found.ceilings.get(mode, 0):
        logger.info("{} bs={} → OOM, ceiling now {}", mode, batch_size, lower)
        ctx.found.ceilings[mode] = lower
        where = where_of(ctx)
        store.set_ceilings(*where, ctx.found.ceilings)
        store.set_ceiling_limits(*where, {**store.ceiling_limits(*where), mode: "memory"})


def time_limited(ctx: SearchContext, store: StudyStore, mode: str) -> bool:
    """Whether ``mode``'s ceiling is where the ceiling phase ran out of time (not memory, the
    margin or the space's cap): the search's own peaks may raise it."""
    return store.ceiling_limits(*where_of(ctx)).get(mode) == "time"


def raise_ceiling(ctx: SearchContext, store: StudyStore, trial: FrozenTrial) -> int | None:
    """A trial at or below a mode's ceiling, where the ceiling phase ran out of time: the peaks
    the search's own trials of that mode measured at its ceiling and at a smaller size give
    the memory a batch takes, a fixed part and a part per sample, and the ceiling rises to the
    largest size of the ladder that line keeps within 90% of the memory budget (a try past the
    budget runs out of memory at the margin, and lowers it again). The proportional rule of the
    ceiling phase, from one size, charges the fixed part (weights, optimizer state, workspaces)
    to every sample: with 4.4 GB fixed and 2.4 MB a sample it stopped at 256 where 1024 takes
    6.8 GB of the 15 GB kept for it. Returns the new ceiling, or None where it stays (an OOM in
    the search still lowers it)."""
    p = trial.params
    mode, size = p.get("precision"), p.get("batch_size")
    if not isinstance(mode, str) or not isinstance(size, int):
        return None
    bs = ctx.found.ceilings.get(mode)
    if bs is None or size > bs:
        return None
    if record(trial).fp32_modules:
        return None
    if not time_limited(ctx, store, mode):
        return None  # memory or the margin set it, or it is the space's cap already
    budget = ctx.facts.memory_budget(ctx.spec.memory_margin)
    peaks = _peaks(store, mode, {k: v for k, v in p.items() if k in _KNOBS})
    if budget is None or bs not in peaks:
        return None
    smaller = [b for b in peaks if b < bs]
    if not smaller:
        return None
    lo = max(smaller)
    per_sample = max(0.0, (peaks[bs] - peaks[lo]) / (bs - lo))
    room = _LINE_MEMORY_SHARE * budget

    def takes(b: int) -> float:
        return peaks[bs] + per_sample * (b - bs)

    return _raise_to(
        ctx, store, mode, bs, lambda b: takes(b) <= room, f"raised from {bs} by the search's peaks",
        lambda new: f"trials at bs={lo} and {bs} peaked at {peaks[lo] / 2**20:.0f} and "
        f"{peaks[bs] / 2**20:.0f} MiB, {per_sample / 2**20:.2f} MiB more a sample; bs={new} "
        f"takes about {takes(new) / 2**20:.0f} MiB of the {room / 2**20:.0f} MiB kept for it",
    )  # fmt: skip


def _raise_to(  # noqa: PLR0913 - one raise's rule and words, from raise_ceiling and scaled_ceiling
    ctx: SearchContext,
    store: StudyStore,
    mode: str,
    bs: int,
    fits: Callable[[int], bool],
    why: str,
    detail: Callable[[int], str],
) -> int | None:
    """The ceiling ``bs`` rises to the largest size of the ladder above it that ``fits``, and
    the log says why (``detail`` of the new size); None where none does."""
    new = max((b for b in ctx.space.ladder if b > bs and fits(b)), default=None)
    if new is None:
        return None
    _raise(ctx, store, mode, bs, new, why)
    logger.info("{} ceiling {} → {}: {}", mode, bs, new, detail(new))
    return new


# The knobs a trial's peak memory depends on beside its precision and batch.
_KNOBS = ("compile", "compile_mode", "channels_last")


def _peaks(store: StudyStore, mode: str, knobs: dict[str, object]) -> dict[int, int]:
    """The largest peak the search's trials of ``mode`` (with ``knobs``, no fp32 islands)
    measured at each batch size."""
    peaks: dict[int, int] = {}
    for t in store.trials():
        rec = record(t)
        same = all(t.params.get(k) == v for k, v in knobs.items())
        ours = t.params.get("precision") == mode and same and not rec.fp32_modules
        if ours and rec.peak_memory_bytes:
            at = int(t.params["batch_size"])
            peaks[at] = max(peaks.get(at, 0), rec.peak_memory_bytes)
    return peaks


def scaled_ceiling(ctx: SearchContext, store: StudyStore, mode: str) -> int | None:
    """A ceiling the ceiling phase left for lack of time, its own size alone measured by the
    search's trials: the largest peak there, scaled with the batch, vouches for what it keeps
    within half the memory budget, as a ceiling's first try does, and the ceiling rises that
    far (no try below it is needed for a second peak). Returns the new ceiling, or None where
    it stays."""
    bs = ctx.found.ceilings.get(mode)
    budget = ctx.facts.memory_budget(ctx.spec.memory_margin)
    if bs is None or budget is None or not time_limited(ctx, store, mode):
        return None
    peak = _peaks(store, mode, {}).get(bs)
    if not peak:
        return None
    return _raise_to(
        ctx, store, mode, bs, lambda b: scaled_fits(peak, bs, b, budget),
        f"its peak at bs={bs}, scaled, vouches for it",
        lambda new: f"its peak at bs={bs} ({peak / 2**20:.0f} MiB), scaled with the batch, "
        "leaves half the memory budget free there",
    )  # fmt: skip


def ceiling_from_opening(ctx: SearchContext, store: StudyStore, arm: ProbeResult) -> None:
    """A short budget's ceiling phase tried nothing: an opening pair's candidate arm, its peak
    scaled with the batch, vouches for its mode's larger batches as a ceiling's first try does
    (within half the memory budget), and for its own batch, and the search may try them."""
    mode, start = arm.candidate.precision, arm.candidate.batch_size
    budget = ctx.facts.memory_budget(ctx.spec.memory_margin)
    old = ctx.found.ceilings.get(mode, 0)
    if old > start or not fits_budget(arm, budget):
        return
    reach = jump_size(arm, start, max(ctx.space.ladder), budget, math.inf)
    if reach <= old:
        return
    why = f"not measured above it: the opening pair's peak at bs={start}, scaled, vouches for it"
    _raise(ctx, store, mode, old, reach, why)
    logger.info("ceiling {} = {} (the opening pair's peak at bs={}, scaled)", mode, reach, start)


def _raise(  # noqa: PLR0913 - one raise, from raise_ceiling and ceiling_from_opening
    ctx: SearchContext, store: StudyStore, mode: str, old: int, new: int, why: str
) -> None:
    """A ceiling the ceiling phase left at ``old`` for lack of time rises to ``new``: in the
    search's context (what it cuts) and in the study (a resumed search reads it back)."""
    ctx.found.ceilings[mode] = new
    ctx.found.cut.pop(f"{mode} batch>{old}", None)
    if new < ctx.spec.space.batch_size.max:
        ctx.found.cut[f"{mode} batch>{new}"] = f"{mode} ceiling is {new} (limited by time; {why})"
    where = where_of(ctx)
    limit = "cap" if new >= max(ctx.space.ladder) else "time"
    store.set_ceilings(*where, ctx.found.ceilings)
    store.set_ceiling_limits(*where, {**store.ceiling_limits(*where), mode: limit})
