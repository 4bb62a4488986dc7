"""Phases 1 and 2: which modes the device really runs, and each mode's batch ceiling."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable

from loguru import logger

from autotune.measure.ceilings import Ceiling, CeilingTry, find_ceiling
from autotune.measure.result import ProbeResult
from autotune.schema.enums import Outcome, Phase
from autotune.schema.spec import ProbeSettings
from autotune.search._budget import CEILING_SHARE, SAFE_PLAN, WRITE_RESERVE
from autotune.search._context import SearchContext
from autotune.search._events import CeilingFound, HardwareChecked, PhaseStarted
from autotune.study.store import StudyStore
from autotune.study.study_keys import ceilings_key

__all__ = [
    "check_hardware",
    "find_ceilings",
    "fits_budget",
    "jump_size",
    "scaled_fits",
    "vouched_size",
    "where_of",
]

# An autocast mode fp32 vouched for past the base batch tries on only where its share holds
# this many tries (its own first one, then doubling past fp32's size).
_TRIES_WORTH = 4

# Modes that hold the same tensors as another, which is measured for both: tf32 only changes
# how fp32's matmuls round; fp16 and bf16 autocast cast to 16 bits alike (fp16's GradScaler
# adds a few scalars).
_TWINS = {"tf32": "fp32", "fp16": "bf16"}

# A skipped-to size's peak memory, scaled from the first try, may use this share of the budget:
# the margin for what does not scale with the batch (workspaces, allocator rounding).
_JUMP_MEMORY_SHARE = 0.5


def scaled_fits(peak: float, at: int, size: int, budget_bytes: float) -> bool:
    """Whether a peak measured at batch ``at``, taken as proportional to the batch, leaves half
    of ``budget_bytes`` free at ``size``: an upper bound (weights, optimizer state and
    workspaces do not grow with the batch), so such a size needs no try of its own.

    Example:
        >>> scaled_fits(2**20, 32, 256, 2**24), scaled_fits(2**20, 32, 512, 2**24)
        (True, False)
    """
    return peak * size <= _JUMP_MEMORY_SHARE * budget_bytes * at


def check_hardware(ctx: SearchContext, modes: list[str]) -> list[str]:
    """The modes of ``modes`` the device runs; the others go to ``ctx.found.cut`` with the reason."""
    runnable = []
    for name in modes:
        why = ctx.facts.unsupported.get(name)
        if why is not None:
            ctx.found.cut[name] = why
            logger.info("cut {}: {}", name, why)
        else:
            runnable.append(name)
    ctx.emit(HardwareChecked(modes=list(runnable), cut=dict(ctx.found.cut), device=ctx.device))
    return runnable


def where_of(ctx: SearchContext) -> tuple[str, str]:
    """The machine and device ceilings are stored for: workers on other boxes may have other
    GPUs."""
    return socket.gethostname(), ctx.device


def _key(ctx: SearchContext, *, limits: bool = False) -> str:
    # The study attribute this machine's and device's ceilings are stored under (tests write one).
    return ceilings_key(*where_of(ctx), limits=limits)


def find_ceilings(
    ctx: SearchContext, store: StudyStore, modes: list[str], *, keep: float = SAFE_PLAN
) -> None:
    """Measure (or read back) each mode's batch ceiling into ``ctx.found.ceilings``, keeping ``keep``
    seconds of the budget for what comes after."""
    space = ctx.spec.space
    where = where_of(ctx)
    stored = store.ceilings(*where)
    if stored is not None and all(m in stored for m in modes):
        ctx.found.ceilings.update({m: stored[m] for m in modes})
        logger.info("ceilings from the stored study: {}", ctx.found.ceilings)
        return
    ctx.runner.start()
    # Never so long that what the safe rule needs (the reference, the base batch's first
    # trials, one validation) and the config no longer fit: a short budget measures no
    # ceiling, and its trials stay at the base batch.
    left = ctx.budget.left()
    room = left - keep - WRITE_RESERVE - 1.0
    phase_end = ctx.budget.elapsed() + max(0.0, min(CEILING_SHARE * left, room))
    base = ctx.space.base_batch
    start = min(max(base, space.batch_size.min), space.batch_size.max)
    cap = max(space.batch_sizes) if space.batch_sizes else space.batch_size.max
    limits: dict[str, str] = {}
    vouched, try_seconds = 0, 0.0
    # fp32 first: what it runs vouches for the autocast modes' memory. A mode whose twin is
    # measured takes the twin's ceiling without a try of its own.
    measured = sorted((m for m in modes if _TWINS.get(m) not in modes), key=lambda m: m != "fp32")
    for i, mode in enumerate(measured):
        ctx.emit(PhaseStarted(phase=Phase.CEILINGS, mode=mode))
        share = (phase_end - ctx.budget.elapsed()) / (len(measured) - i)
        if mode != "fp32" and vouched >= cap:
            # fp32 ran the cap with half the memory free: nothing to try, so it costs no
            # ceiling time (its first trial pays the mode's first-use costs).
            logger.info("ceiling {} = {} (not tried: fp32 ran bs={} with half the memory "
                        "budget free)", mode, cap, vouched)  # fmt: skip
            ceiling = Ceiling(precision=mode, batch_size=cap, limited_by="cap")
        elif share < max(0.5, try_seconds) or (
            mode != "fp32" and vouched > start and share < _TRIES_WORTH * try_seconds
        ):
            # Out of ceiling time (or short of the tries that would take it past what fp32
            # vouched for): the mode keeps the base batch size, which the baselines run, or
            # the size fp32 vouched for, if larger.
            for m in (mode, *(m for m in modes if _TWINS.get(m) == mode)):
                ctx.found.ceilings[m], limits[m] = max(start, vouched), "time"
                _out_of_time(ctx, m, max(start, vouched))
            continue
        else:
            ceiling = _mode_ceiling(ctx, mode, share=share, start=start, cap=cap)
        if mode == "fp32":
            vouched = vouched_size(ceiling, ctx.facts.memory_budget(ctx.spec.memory_margin))
            # What one try took (a build and a first step): a share shorter has no room for one.
            try_seconds = ctx.found.probe_seconds[-1] if ctx.found.probe_seconds else 0.0
        # A try cut short by the stop says nothing about memory: store no ceiling.
        ctx.stop_if_asked()
        if ceiling.limited_by == "busy":
            # Other processes held the margin: the mode keeps the base batch size this time,
            # and no ceiling is stored, so a resumed search measures it again.
            ceiling = ceiling.model_copy(update={"batch_size": max(ceiling.batch_size, start)})
        ctx.found.ceilings[mode], limits[mode] = ceiling.batch_size, ceiling.limited_by
        _note_ceiling(ctx, mode, ceiling, start=start)
        _twins_take(ctx, modes, mode, ceiling, limits, start=start)
    if "busy" in limits.values():
        return
    store.set_ceilings(*where, ctx.found.ceilings)
    store.set_ceiling_limits(*where, limits)


def _twins_take(  # noqa: PLR0913 - the phase's state, keyword-only start
    ctx: SearchContext,
    modes: list[str],
    mode: str,
    ceiling: Ceiling,
    limits: dict[str, str],
    *,
    start: int,
) -> None:
    """The modes of ``modes`` that twin ``mode`` take its measured ceiling."""
    for twin in (m for m in modes if _TWINS.get(m) == mode):
        ctx.emit(PhaseStarted(phase=Phase.CEILINGS, mode=twin))
        ctx.found.ceilings[twin], limits[twin] = ceiling.batch_size, ceiling.limited_by
        logger.info(
            "ceiling {} = {} ({}'s: a step holds the same tensors)", twin, ceiling.batch_size, mode
        )
        _note_ceiling(ctx, twin, ceiling.model_copy(update={"precision": twin}), start=start)


def _out_of_time(ctx: SearchContext, mode: str, start: int) -> None:
    """Say that a mode's ceiling was not measured above ``start``: no time was left for it."""
    ctx.found.cut[f"{mode} batch>{start}"] = (
        f"{mode} ceiling not measured above {start}: no time left"
    )
    logger.info("ceiling {} = {} (not measured: the ceiling phase is out of time)", mode, start)
    ctx.emit(
        CeilingFound(
            mode=mode, ceiling=Ceiling(precision=mode, batch_size=start, limited_by="time")
        )
    )


def _mode_ceiling(  # noqa: PLR0913 - one mode's bounds, keyword-only
    ctx: SearchContext, mode: str, *, share: float, start: int, cap: int
) -> Ceiling:
    """One mode's ceiling, measured within ``share`` seconds."""
    # Per try: a slice of this mode's share; a try that runs out of it stops the doubling.
    # The first try pays the mode's first-use costs (on some CPUs seconds for bf16): it
    # gets half the share.
    limit = max(0.5, min(ctx.spec.probe.time_limit, share / 4))
    first_limit = max(1.0, min(ctx.spec.probe.time_limit, share / 2))
    # One untimed step (first-use costs of the mode's kernels), one timed step: counted,
    # not timed by min_time.
    settings = ProbeSettings(
        warmup_steps=1,
        steps=1,
        check_every=1,
        min_time=0,
        time_limit=limit,
        seed=ctx.spec.probe.seed,
    )
    first = settings.model_copy(update={"time_limit": first_limit})
    tried: list[int] = []
    deadline = ctx.budget.elapsed() + share
    took: list[float] = []

    def try_batch(bs: int) -> ProbeResult:
        use = settings if tried else first
        tried.append(bs)
        started = ctx.budget.elapsed()
        result = ctx.run_probe(ctx.space.candidate(mode, bs), use)
        took.append(ctx.budget.elapsed() - started)
        return result

    def stop_when(r: ProbeResult) -> bool:
        # Stop doubling once a try at twice this size would not fit in the limit, or a try
        # as long as the last (its build and first step) would end past the mode's share. A
        # first try cut short in its warm-up timed its first-use costs, not a step (its
        # memory, after a whole step, still counts); a later one cut short stops the doubling.
        if r.outcome == Outcome.CRASHED or ctx.budget.elapsed() + max(took, default=0.0) > deadline:
            return True
        if r.truncated and r.outcome == Outcome.COMPLETED:
            return len(tried) > 1
        return (r.step_time or 0.0) * 2 * 2 > limit

    return _measure(
        try_batch,
        mode,
        start=start,
        cap=cap,
        budget_bytes=ctx.facts.memory_budget(ctx.spec.memory_margin),
        stop_when=stop_when,
    )


def _note_ceiling(ctx: SearchContext, mode: str, ceiling: Ceiling, *, start: int) -> None:
    """Cut a mode that could not run at all; note a ceiling below the space's largest batch."""
    if ceiling.batch_size == 0:
        # Not even the first size ran: the mode cannot run here (or not within this budget).
        first = ceiling.tries[0] if ceiling.tries else None
        ctx.found.cut[mode] = f"{mode} could not run one step at batch_size={start}" + (
            f": {first.outcome}: {first.note}" if first is not None else ""
        )
        logger.info("cut {}: {}", mode, ctx.found.cut[mode])
    elif ceiling.batch_size < ctx.spec.space.batch_size.max:
        ctx.found.cut[f"{mode} batch>{ceiling.batch_size}"] = (
            f"{mode} ceiling is {ceiling.batch_size} (limited by {ceiling.limited_by})"
        )
    ctx.emit(CeilingFound(mode=mode, ceiling=ceiling))


def jump_size(
    first: ProbeResult, start: int, cap: int, budget_bytes: int | None, limit: float
) -> int:
    """The size the doubling may skip ahead to after its first try, at ``start``.

    The largest doubling of ``start`` (up to ``cap``) whose peak memory, taken as proportional
    to the batch, stays within half of ``budget_bytes``, and whose try (two steps, also taken
    as proportional) fits in ``limit`` seconds (unless the first try was cut short in its
    warm-up: it timed first-use costs, not a step). Proportional over-estimates both: a model's own
    memory and a step's fixed costs do not grow with the batch. ``start`` when the first try
    says too little (no peak, no timed step, no memory budget).

    Example:
        >>> from autotune.schema.spec import Candidate
        >>> cand = Candidate(precision="fp32", batch_size=32, learning_rate=0.1)
        >>> r = ProbeResult(candidate=cand, workload="w", device="cpu", outcome=Outcome.COMPLETED,
        ...                 step_time=0.01, peak_memory_allocated=2**20)
        >>> jump_size(r, 32, 256, 2**30, 1.0), jump_size(r, 32, 256, 2**30, 0.1)
        (256, 128)
    """
    peak, step = first.peak_memory, first.step_time
    if not first.ok or not peak or budget_bytes is None or not (step or first.truncated):
        return start
    size = start
    while size < cap:
        scale = min(size * 2, cap) / start
        # A try cut short in its warm-up timed no step: memory alone decides.
        slow = not first.truncated and 2 * (step or 0.0) * scale > limit
        if not scaled_fits(peak, start, min(size * 2, cap), budget_bytes) or slow:
            break
        size = min(size * 2, cap)
    return size


def vouched_size(fp32: Ceiling, budget_bytes: int | None) -> int:
    """The largest size fp32 ran with half of ``budget_bytes`` free (0: none), for
    which the autocast modes need not try: they keep fp32's weights, gradients and optimizer
    state, add at most a 16-bit copy of the weights (the cast cache), and keep no activation
    wider than fp32 does — about a twentieth more than fp32's peak, at most.

    Example:
        >>> t = [CeilingTry(batch_size=32, fits=True, outcome=Outcome.COMPLETED, peak_memory=10),
        ...      CeilingTry(batch_size=256, fits=True, outcome=Outcome.COMPLETED, peak_memory=80)]
        >>> c = Ceiling(precision="fp32", batch_size=256, limited_by="cap", tries=t)
        >>> vouched_size(c, 200), vouched_size(c, 100), vouched_size(c, None)
        (256, 32, 0)
    """
    if budget_bytes is None:
        return 0
    ran = [
        t
        for t in fp32.tries
        if t.fits
        and t.peak_memory
        and scaled_fits(t.peak_memory, t.batch_size, t.batch_size, budget_bytes)
    ]
    sizes = [t.batch_size for t in ran]
    # A ceiling taken without its try (a try's peak, scaled with the batch, left half the
    # budget free there) vouches as far as a try would have.
    if any(
        scaled_fits(t.peak_memory or 0, t.batch_size, fp32.batch_size, budget_bytes) for t in ran
    ):
        sizes.append(fp32.batch_size)
    return max(sizes, default=0)


def fits_budget(result: ProbeResult, budget_bytes: int | None) -> bool:
    """What :func:`find_ceiling` calls a fit: it ran, and its peak left the margin free."""
    peak = result.peak_memory
    over = budget_bytes is not None and peak is not None and peak > budget_bytes
    return result.outcome not in (Outcome.OOM, Outcome.CRASHED) and not over


def _measure(  # noqa: PLR0913 - one mode's bounds, keyword-only, as find_ceiling takes them
    try_batch: Callable[[int], ProbeResult],
    mode: str,
    *,
    start: int,
    cap: int,
    budget_bytes: int | None,
    stop_when: Callable[[ProbeResult], bool],
) -> Ceiling:
    """One mode's ceiling: the first try, then the doubling from the size its peak memory,
    scaled with the batch, vouches for (the cap: no more tries)."""
    tried: dict[int, ProbeResult] = {}

    def once(bs: int) -> ProbeResult:
        if bs not in tried:
            tried[bs] = try_batch(bs)
        return tried[bs]

    first = once(start)
    own = CeilingTry(
        batch_size=start, fits=True, outcome=first.outcome, peak_memory=first.peak_memory
    )
    # Its peak scaled with the batch is an upper bound (weights, optimizer state and
    # workspaces do not grow with it): what stays within half the budget needs no try of its
    # own (an OOM in the search lowers the ceiling all the same).
    reach = (
        jump_size(first, start, cap, budget_bytes, math.inf)
        if fits_budget(first, budget_bytes)
        else 0
    )
    if reach >= cap > start:
        logger.info(
            "ceiling {} = {} (limited by cap; not tried above bs={}: its peak memory there, "
            "scaled with the batch, leaves half the memory budget free at bs={})",
            mode,
            cap,
            start,
            cap,
        )
        return Ceiling(precision=mode, batch_size=cap, limited_by="cap", tries=[own])
    if reach > start:
        logger.info("ceiling {} bs={} → fits; bs={} fits by its peak scaled", mode, start, reach)
        tried[reach] = _scaled(first, reach)
        if stop_when(first):
            # No time for a try above it: the size its peak vouches for is the ceiling.
            scaled = CeilingTry(batch_size=reach, fits=True, outcome=first.outcome,
                                peak_memory=tried[reach].peak_memory, note="its peak scaled")  # fmt: skip
            logger.info("ceiling {} = {} (limited by time, 1 tries)", mode, reach)
            return Ceiling(precision=mode, batch_size=reach, limited_by="time",
                           tries=[own, scaled])  # fmt: skip
        ceiling = find_ceiling(
            once, mode, start=reach, cap=cap, budget_bytes=budget_bytes, stop_when=stop_when
        )
        return ceiling.model_copy(update={"tries": [own, *ceiling.tries]})
    return find_ceiling(
        once, mode, start=start, cap=cap, budget_bytes=budget_bytes, stop_when=stop_when
    )


def _scaled(first: ProbeResult, size: int) -> ProbeResult:
    """The first try's figures scaled to ``size`` (peak memory and step time in proportion):
    what a try there is taken to show, without running it."""
    scale = size / first.candidate.batch_size
    peak, step = first.peak_memory, first.step_time
    return first.model_copy(
        update={
            "candidate": first.candidate.model_copy(update={"batch_size": size}),
            "batch_size": size,
            "peak_memory_allocated": int(peak * scale) if peak else None,
            "peak_memory_reserved": None,
            "step_time": step * scale if step else None,
        }
    )
