"""Validation: re-measure the best candidates paired with the fp32 reference, and select.

The best of many noisy figures is biased upward (the winner's curse), so a candidate's search
figure is expected to come out lower when measured again: validation re-measures to *correct*
the figure, not to punish the candidate for it.

1. :func:`shortlist` (pure): the feasible, measured trials that could clearly beat the
   reference, best first, plus the fastest one with a clear parity margin.
2. Each is measured again in one worker, its timed blocks interleaved with the reference's
   (:meth:`autotune.execution.worker.Runner.compare`), with a fresh seed and a longer horizon.
3. :func:`select` (pure): among the reruns that completed with at least six pairs (fewer
   give no 95% interval: the smaller of two ratios is a 50% bound), keep loss parity with the
   reference rerun (tolerance plus the reference's own seed-to-seed noise) and whose speedup's
   *lower* bound clears ``min_speedup``, the best lower bound wins. None clears it: the fp32
   reference is the config, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import optuna
from loguru import logger
from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import clearly_off, parity_gap
from autotune.measure.result import PairedResult
from autotune.measure.stats import MIN_VALUES
from autotune.search._budget import VALIDATION_SHARE, WRITE_RESERVE
from autotune.search._context import SearchContext
from autotune.study.reference import ReferenceRecord
from autotune.study.trials import (
    Rejection,
    candidate,
    constraints,
    feasible_trials,
    is_feasible,
    label,
    record,
)

__all__ = [
    "Rerun",
    "Selection",
    "select",
    "shortlist",
    "validate",
    "measure_spread",
    "validation_reserve",
]


def shortlist(  # noqa: PLR0913 - the shortlist's rules, keyword-only
    trials: Iterable[FrozenTrial],
    *,
    top_k: int,
    min_speedup: float,
    parity_tolerance: float,
    maximize: bool = True,
    parity_allowance: float | None = None,
    reference_batch: int | None = None,
) -> list[FrozenTrial]:
    """The trials worth validating, best first.

    Feasible, measured (not copied from a twin) trials whose search speedup reaches
    ``min_speedup`` (a candidate that does not even look faster is not worth validating),
    ranked by their objective; the first ``top_k``, plus the fastest feasible one when none of
    those is (see below), plus the fastest one with a clear parity margin (half the tolerance)
    when none of those has one: the fastest candidates often sit at the edge of the tolerance,
    where a fresh seed can tip them over.

    With ``parity_allowance`` (when maximizing), a trial that failed only parity, by a gap
    within it, competes too: it was judged early in the search, against the seed-to-seed spread
    known then; validation measures its parity again, at a longer horizon.

    With ``reference_batch`` too, a trial at a larger batch may be off by up to the gap the
    search calls clearly off for its batch (:func:`~autotune.measure.parity.clearly_off`) plus
    the band: early in training it lags by more than any seed explains, a lag a full run
    erases. Validation's horizon is longer; its verdict stands.

    Example:
        >>> shortlist([], top_k=2, min_speedup=1.05, parity_tolerance=0.05)
        []
    """
    allowance = parity_allowance if maximize else None
    ranked = []
    for t in trials:
        speedup = record(t).speedup
        limit = allowance
        batch = t.params.get("batch_size", 0)
        if allowance is not None and reference_batch and batch > reference_batch:
            # The batch's clearly-off level (always above the tolerance), the band on top.
            lag = clearly_off(parity_tolerance, batch / reference_batch)
            limit = lag + allowance - parity_tolerance
        if speedup is None or speedup < min_speedup or not _eligible(t, limit):
            continue
        ranked.append(t)
    ranked.sort(key=_rank, reverse=maximize)
    seen: set[tuple] = set()
    unique = []
    for t in ranked:
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            unique.append(t)
    best = unique[:top_k]
    if not any(is_feasible(t) for t in best):
        # Those judged off parity early may be refused again: the fastest feasible one stands by.
        standby = next((t for t in unique[top_k:] if is_feasible(t)), None)
        if standby is not None:
            best.append(standby)

    def clear(t: FrozenTrial) -> bool:
        gap = record(t).parity_gap
        return is_feasible(t) and gap is not None and gap <= parity_tolerance / 2

    if not any(clear(t) for t in best):
        margin = next((t for t in unique[top_k:] if clear(t)), None)
        if margin is not None:
            best.append(margin)
    return best


def _eligible(trial: FrozenTrial, parity_allowance: float | None) -> bool:
    """May ``trial`` be shortlisted: feasible, or off only by its parity gap, within the
    allowance? A twin's copied measurement never is."""
    if feasible_trials([trial]):
        return True
    rec = record(trial)
    if parity_allowance is None or trial.state != TrialState.COMPLETE or rec.parity_gap is None:
        return False
    if rec.tuned_config or rec.duplicate_of is not None:
        return False
    failed = {name for name, value in constraints(trial).items() if value > 0}
    return failed == {"parity"} and rec.parity_gap <= parity_allowance


def _rank(trial: FrozenTrial) -> float:
    """A shortlisted trial's objective; a borderline one's speedup (its stored value is the
    worst there is)."""
    return cast(float, trial.value) if is_feasible(trial) else record(trial).speedup or 0.0


@dataclass
class Rerun:
    """A shortlisted trial and its paired re-measurement (None: no time was left for it)."""

    trial: FrozenTrial
    paired: PairedResult | None
    gap: tuple[float, float, float] | None = None
    share: float = 0.0  # the seconds it was given


@dataclass
class Selection:
    """What validation decided: the winner (or None: fall back to the reference), and why
    the others were not chosen: ``rejected``, and ``notes`` for what was not validated at all
    (no time left; too few pairs, noted only when nothing won, as the fallback's reason)."""

    winner: Rerun | None
    accepted: list[Rerun] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def select(
    reruns: list[Rerun],
    *,
    min_speedup: float,
    parity_tolerance: float,
    seed_noise: float = 0.0,
) -> Selection:
    """Choose among paired reruns: at least six pairs, parity kept, lower bound above
    ``min_speedup``, best lower bound wins. Pure: it reads only the reruns.

    A rerun with fewer pairs than a 95% interval needs (:data:`autotune.measure.stats.MIN_VALUES`)
    is refused whatever its figures: its "interval" is the range of a few ratios, and its lower
    bound clears ``min_speedup`` far more often than 5% of the time by chance.

    Args:
        reruns: the shortlisted trials with their paired reruns.
        min_speedup: the lower bound a winner's speedup must clear (1.05: 5% faster).
        parity_tolerance: the spec's loss-parity tolerance.
        seed_noise: the reference's own seed-to-seed loss gap, allowed on top.

    Returns:
        The Selection.
    """
    out = Selection(winner=None)
    too_few: list[str] = []
    for rerun in reruns:
        name = label(rerun.trial.params)
        paired = rerun.paired
        if paired is None:
            out.notes.append(f"{name}: no time left to validate")
        elif not paired.candidate.ok:
            c = paired.candidate
            out.rejected.append(_rejection(name, c.outcome, f"{c.outcome}: {c.reason}"))
        elif paired.reference.ok and paired.pairs < MIN_VALUES:
            refused, note = _too_few_pairs(name, paired)
            out.rejected.append(refused)
            too_few.append(note)
        elif not paired.ok:
            r = paired.reference
            out.notes.append(f"{name}: the fp32 reference arm {r.outcome}: {r.reason}")
        else:
            rejection = _judge(
                name,
                paired,
                rerun.gap,
                min_speedup=min_speedup,
                parity_tolerance=parity_tolerance,
                seed_noise=seed_noise,
            )
            if rejection is None:
                out.accepted.append(rerun)
            else:
                out.rejected.append(rejection)
    if out.accepted:
        out.winner = max(out.accepted, key=_speedup_low)
    else:
        # The fallback's reason: it would have been measured, given the time.
        out.notes.extend(too_few)
    return out


def _rejection(name: str, kind: str, detail: str) -> Rejection:
    return Rejection(label=name, stage="validation", kind=kind, detail=detail)


def _too_few_pairs(name: str, paired: PairedResult) -> tuple[Rejection, str]:
    """A rerun cut short of the pairs a 95% interval needs, whatever its figures: rejected,
    with the note the fallback gives when nothing won."""
    shown = ""
    if paired.speedup is not None:
        shown = (
            f" ({paired.speedup:.2f}x, range {paired.speedup_low:.2f}–{paired.speedup_high:.2f})"
        )
    rejection = _rejection(
        name,
        "pairs",
        f"{_pairs(paired.pairs)} where {MIN_VALUES} are needed for a 95% "
        f"interval on its speedup{shown}; give the search more time",
    )
    note = (
        f"{name}: not validated: {_pairs(paired.pairs)} where {MIN_VALUES} are "
        "needed; give the search more time"
    )
    return rejection, note


def _judge(
    name: str,
    paired: PairedResult,
    gap: tuple[float, float, float] | None,
    *,
    min_speedup: float,
    parity_tolerance: float,
    seed_noise: float,
) -> Rejection | None:
    """A complete rerun's verdict: rejected for parity, then for speed; None: accepted."""
    if gap is None or gap[0] > parity_tolerance + seed_noise:
        shown = "not comparable" if gap is None else f"{gap[0]:+.1%}"
        return _rejection(
            name,
            "parity",
            f"loss parity {shown} vs the fp32 reference (tolerance "
            f"{parity_tolerance:.0%} + seed noise {seed_noise:.1%})",
        )
    assert paired.speedup is not None and paired.speedup_low is not None
    if paired.speedup_low < min_speedup:
        return _rejection(
            name,
            "speed",
            f"{paired.speedup:.2f}x ({paired.speedup_low:.2f}–"
            f"{paired.speedup_high:.2f}) the fp32 reference side by side: its lower "
            f"bound does not clear {min_speedup:.2f}x",
        )
    return None


def _pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"


def _speedup_low(rerun: Rerun) -> float:
    # Only a paired rerun whose lower bound cleared min_speedup is accepted.
    assert rerun.paired is not None and rerun.paired.speedup_low is not None
    return rerun.paired.speedup_low


def with_gap(rerun: Rerun) -> Rerun:
    """The rerun with its parity gap against its own reference arm, at equal samples seen."""
    paired = rerun.paired
    if paired is not None and paired.ok:
        c, r = paired.candidate, paired.reference
        rerun.gap = parity_gap(c.losses, c.batch_size, r.losses, r.batch_size)
    return rerun


# How many times longer than a pair of a feasible trial a pair of one judged off parity at the
# probe's horizon measures (its share of validation's time, and so its horizon).
_LONGER = 4


def _weight(trial: FrozenTrial) -> int:
    """A shortlisted trial's shares of validation's time: ``_LONGER`` for one judged off parity
    at the probe's horizon (a lag fades over its first steps), else one."""
    return 1 if is_feasible(trial) else _LONGER


def validation_reserve(
    ctx: SearchContext, study: optuna.Study, reference: ReferenceRecord | None = None
) -> float:
    """Seconds validation will need: a paired rerun of each shortlisted candidate (or of one,
    before any), from the search's own probe times, with room to spare."""
    val, probe = ctx.spec.validation, ctx.spec.probe
    picked = _shortlist(ctx, study, reference)
    typical = ctx.typical_probe(default=0.0)
    if not typical:
        return VALIDATION_SHARE * ctx.budget.total
    ratio = max(1.0, (probe.warmup_steps + val.steps) / (probe.warmup_steps + probe.steps))
    # Both arms of a pair run, each about as long as a probe scaled to the longer horizon; a
    # compiled candidate compiles again.
    per_pair = 2.5 * ratio * typical + 1.0
    # Nothing worth validating yet: keep room for one short pair (a late winner still gets
    # validated), and give the rest to the search; each by its weight (see _weight).
    need = (
        sum(max(per_pair, _six_pairs(ctx, t)) * _weight(t) for t in picked)
        if picked
        else 0.5 * per_pair
    )
    need += sum(record(t).compile_seconds or 0.0 for t in picked)
    return min(VALIDATION_SHARE * ctx.budget.total, need + 1.0)


def _shortlist(
    ctx: SearchContext, study: optuna.Study, reference: ReferenceRecord | None
) -> list[FrozenTrial]:
    """The study's shortlist, with the parity allowance the reference's repeats give now."""
    tol = ctx.spec.parity_tolerance
    noise = reference.seed_noise(tol) if reference is not None else 0.0
    return shortlist(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
        top_k=ctx.spec.validation.top_k,
        min_speedup=ctx.spec.validation.min_speedup,
        parity_tolerance=tol,
        maximize=ctx.maximize,
        parity_allowance=tol + noise if reference is not None else None,
        reference_batch=reference.batch_size if reference is not None else None,
    )


# The seed-to-seed band a parity decision rests on is measured from at least this many repeats.
SPREAD_REPEATS = 3


def measure_spread(
    ctx: SearchContext,
    study: optuna.Study,
    reference: ReferenceRecord,
    remeasure: Callable[[], object],
    end_at: float,
) -> None:
    """Before validation picks by parity: when a trial failed only parity, by less than the
    band could ever allow (the tolerance again), the band rests on :data:`SPREAD_REPEATS`
    repeats of the reference (each a fresh seed), time allowing. Fewer leave it to chance: one
    repeat that happened to land close gives a band of a few tenths of a percent."""
    tol = ctx.spec.parity_tolerance
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    val = ctx.spec.validation
    if not any(
        not is_feasible(t) and _eligible(t, 2 * tol) and (record(t).speedup or 0) >= val.min_speedup
        for t in trials
    ):
        return
    for _ in range(SPREAD_REPEATS):
        gaps = [m for m in reference.measurements if m.seed_gap is not None]
        left = end_at - ctx.budget.elapsed() - validation_reserve(ctx, study, reference)
        if len(gaps) >= SPREAD_REPEATS or left < ctx.typical_probe():
            return
        remeasure()


def _six_pairs(ctx: SearchContext, trial: FrozenTrial) -> float:
    """Seconds a paired rerun of ``trial`` needs at the least to measure the pairs a 95%
    interval needs: each arm's warm-up (its warm-up steps, its first step, a settling step)
    and six pairs of one-step blocks, at the steps' times the search measured, with a quarter
    to spare; 0 when they are unknown. Slow steps need more than a probe's time scaled."""
    rec = record(trial)
    if not rec.throughput or not rec.reference_throughput:
        return 0.0
    step = trial.params.get("batch_size", ctx.space.base_batch) / rec.throughput
    ref_step = ctx.space.base_batch / rec.reference_throughput
    steps = ctx.spec.probe.warmup_steps + 2 + MIN_VALUES
    return 1.25 * steps * (step + ref_step) + 1.0


# Each arm of a validation pair measures for about this share of the pair's slice.
_PAIR_SHARE = 0.3


def validate(
    ctx: SearchContext, study: optuna.Study, reference: ReferenceRecord, end_at: float
) -> tuple[Selection | None, PairedResult | None, float]:
    """Phase 4: paired reruns of the shortlist, then the selection.

    Returns:
        ``(selection, reference_run, seed_noise)``; selection None when nothing was worth
        validating.
    """
    spec, val = ctx.spec, ctx.spec.validation
    picked = _shortlist(ctx, study, reference)
    if not picked:
        return None, None, 0.0
    reruns: list[Rerun] = []
    for i, trial in enumerate(picked):
        left = end_at - ctx.budget.elapsed()
        if left < 1.0:
            reruns.append(Rerun(trial, None))
            continue
        # Each candidate gets its share of what is left (one judged off parity at the probe's
        # horizon, _LONGER shares); a pair cut short by its share is still compared, on the
        # blocks and samples both arms saw.
        share = left * _weight(trial) / sum(_weight(t) for t in picked[i:])
        reruns.append(with_gap(_rerun(ctx, trial, reference, share=share)))
    ref_run = next(
        (
            r.paired
            for r in reruns
            if r.paired is not None and r.paired.reference.ok and r.paired.reference.throughput > 0
        ),
        None,
    )
    # The larger of two estimates of one thing: this run's reference arm against the first
    # run, and the band of the search's repeats (the rule the search judged by).
    tol = spec.parity_tolerance
    noise = max(_seed_noise(ref_run, reference, tol), reference.seed_noise(tol))
    reruns = [_recheck(ctx, reference, r, noise) for r in reruns]
    selection = select(
        reruns,
        min_speedup=val.min_speedup,
        parity_tolerance=spec.parity_tolerance,
        seed_noise=noise,
    )
    for rejection in selection.rejected:
        logger.info("rejected in validation: {}", rejection)
    if selection.winner is not None and selection.winner.paired is not None:
        ref_run = selection.winner.paired
    return selection, ref_run, noise


def _rerun(
    ctx: SearchContext, trial: FrozenTrial, reference: ReferenceRecord, *, share: float
) -> Rerun:
    """One candidate measured again, paired with the reference, inside ``share`` seconds."""
    probe = ctx.spec.probe
    settings = probe.model_copy(update={"steps": ctx.spec.validation.steps, "seed": probe.seed + 1})
    # The pair measures for most of its share (each arm about a third of it; warm-ups and
    # the reference's catch-up to the horizon fit in the rest): the budget kept for
    # validation buys a tighter interval instead of going unused.
    min_time = max(ctx.default_min_time if settings.min_time is None else settings.min_time,
                   _PAIR_SHARE * share)  # fmt: skip
    paired = ctx.run_compare(
        candidate(trial),
        reference.candidate(),
        settings.model_copy(
            update={
                "time_limit": max(1.0, share - 1.0),
                "min_time": min_time,
                "precision": 0.005,
            }
        ),
        timeout=share + ctx.hard_grace(),
    )
    logger.info("validation of {}: {}", trial.number, paired.summary())
    return Rerun(trial, paired, share=share)


def _recheck(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun, noise: float) -> Rerun:
    """A larger batch off parity at validation's horizon by no more than its early lag can
    explain is measured once more over a horizon ``_LONGER`` times as long, time allowing (up
    to the budget's end: a search that measured its space through leaves time unspent)."""
    tol, gap = ctx.spec.parity_tolerance, rerun.gap
    ratio = rerun.trial.params.get("batch_size", 0) / reference.batch_size
    if gap is None or ratio <= 1 or not tol + noise < gap[0] <= clearly_off(tol, ratio) + noise:
        return rerun
    share = min(_LONGER * rerun.share, ctx.budget.total - WRITE_RESERVE - ctx.budget.elapsed())
    if share < 2 * rerun.share:
        return rerun
    logger.info(
        "validation of {}: {:+.1%} off parity at {:,} samples, within a larger batch's early "
        "lag: measuring it over a longer horizon",
        rerun.trial.number,
        gap[0],
        _shared_samples(rerun.paired),
    )
    return with_gap(_rerun(ctx, rerun.trial, reference, share=share))


def _shared_samples(paired: PairedResult | None) -> int:
    """The samples both arms of a pair saw: the horizon its parity gap is taken at."""
    if paired is None:
        return 0
    c, r = paired.candidate, paired.reference
    return min(len(c.losses) * c.batch_size, len(r.losses) * r.batch_size)


def _seed_noise(
    ref_run: PairedResult | None, reference: ReferenceRecord, parity_tolerance: float
) -> float:
    """How far a fresh seed moves the reference's loss curve by itself (its search and
    validation curves): a candidate is allowed that much on top of the tolerance."""
    if ref_run is None or not reference.finite_losses:
        return 0.0
    r = ref_run.reference
    seed_gap = parity_gap(r.losses, r.batch_size, reference.finite_losses, reference.batch_size)
    return min(abs(seed_gap[0]), parity_tolerance) if seed_gap else 0.0
