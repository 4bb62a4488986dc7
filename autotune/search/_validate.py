"""Validation: re-measure the best candidates paired with the fp32 reference, and select the best
lower bound that clears ``min_speedup``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import (
    parity_gap,
    parity_gap_error,
    parity_growth,
    projected_gap,
    samples_seen,
)
from autotune.measure.result import PairedResult, ProbeResult
from autotune.measure.stats import (
    CLAIM_FLOOR,
    CONFIDENCE,
    MIN_VALUES,
    claimed,
    min_values,
    paired_ratios,
    serial_interval,
)
from autotune.search._budget import VALIDATION_SHARE
from autotune.search._context import SearchContext
from autotune.search._risk import steps_run, verdict_horizon
from autotune.search._shortlist import candidates, eligible, shortlist
from autotune.search._validation_time import (
    endurance_seconds,
    least_pair,
    proof_seconds,
    rerun_need,
)
from autotune.study.reference import ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.trials import Rejection, is_feasible, label, record

__all__ = [
    "Rerun",
    "Selection",
    "judge",
    "select",
    "speedup_of",
    "shortlist",
    "measure_spread",
    "pooled_gap",
    "projected_within",
    "validation_reserve",
]


@dataclass
class Rerun:
    """A shortlisted trial and its paired re-measurement (None: no time was left for it)."""

    trial: FrozenTrial
    paired: PairedResult | None
    gap: tuple[float, float, float] | None = None
    # How the gap grew over the second half of its horizon, with its standard error.
    growth: tuple[float, float] | None = None
    share: float = 0.0  # the seconds it was given
    # fp16's run alone to its overflow horizon, after a pair that would be accepted (None:
    # not run).
    endurance: ProbeResult | None = None
    # Why it was not measured, when it was not (None: no time was left).
    skipped: str | None = None
    # The steps an fp16 verdict had to cover (0: none asked).
    horizon: int = 0
    # The gap's standard error from the curves' step noise, and how many seeds' pairs the gap
    # is the mean of (each its own draw of the seed's offset).
    gap_error: float = 0.0
    seeds: int = 1
    # The gap at its first, shorter horizon, where it was measured again over a longer one (a
    # lag, or a gap still growing, there); None where it was not.
    first_gap: float | None = None
    # The samples seen at which ``gap`` compares the curves: the horizon its verdict holds for.
    gap_samples: int = 0
    # The gap projected to the real run's length where an early lag still fades where the
    # curves end (:func:`~autotune.measure.parity.projected_gap`: as measured, and the least
    # fall the noise allows), and that length in samples (0: the spec names none).
    projected: tuple[float, float] | None = None
    run_samples: int = 0
    # Not measured because its verdict cannot fit in this budget at all (fp16's run alone past
    # the share of the budget one may take): a later round measures the next candidates.
    beyond_budget: bool = False
    # The paired runs its speedup pools (:func:`~autotune.measure.result.pooled`): 2 where one
    # refused for its interval alone was paired again for more pairs.
    runs: int = 1


@dataclass
class Selection:
    """What validation decided: the winner (or None: fall back to the reference), and why
    the others were not chosen: ``rejected``, and ``notes`` for what was not validated at all
    (no time left; too few pairs, noted only when nothing won, as the fallback's reason)."""

    winner: Rerun | None
    accepted: list[Rerun] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The one with the best lower bound, where the winner is another whose lower bound lies
    # within the claim floor of it and whose figure is higher by more (None where it wins).
    steadiest: Rerun | None = None


def select(
    reruns: list[Rerun],
    *,
    min_speedup: float,
    parity_tolerance: float,
    seed_noise: float = 0.0,
) -> Selection:
    """Choose among paired reruns: at least six pairs, parity kept, lower bound above
    ``min_speedup``; the best lower bound wins, unless another's lies within
    :data:`~autotune.measure.stats.CLAIM_FLOOR` of it (a tie) and its figure is more than that
    above. Pure: it reads only the reruns.

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
    for rerun in reruns:
        name = label(rerun.trial.params)
        paired, endurance = rerun.paired, rerun.endurance
        if endurance is not None and not endurance.ok:
            detail = f"{endurance.outcome} in a run of {len(endurance.losses)} steps alone: "
            out.rejected.append(_rejection(name, endurance.outcome, detail + endurance.reason))
        elif paired is None:
            out.notes.append(f"{name}: {rerun.skipped or 'no time left to validate'}")
        elif not paired.candidate.ok:
            c = paired.candidate
            out.rejected.append(_rejection(name, c.outcome, f"{c.outcome}: {c.reason}"))
        elif paired.reference.ok and paired.pairs < MIN_VALUES:
            out.rejected.append(_too_few_pairs(name, paired))
        elif not paired.ok:
            r = paired.reference
            out.notes.append(f"{name}: the fp32 reference arm {r.outcome}: {r.reason}")
        else:
            rejection = judge(
                name,
                rerun,
                min_speedup=min_speedup,
                parity_tolerance=parity_tolerance,
                seed_noise=seed_noise,
            )
            if rejection is None and covered(rerun) < rerun.horizon:
                rejection = _rejection(
                    name,
                    "horizon",
                    f"fp16 ran {covered(rerun)} steps where its verdict needs {rerun.horizon} "
                    "(fp16's range may run out late); give the search more time",
                )
            if rejection is None:
                out.accepted.append(rerun)
            else:
                out.rejected.append(rejection)
    if out.accepted:
        # The best of several intervals is the luckiest: each is widened to cover all of them
        # at once (95% together), and the winner is claimed with its widened one.
        together = [for_choice(r, len(out.accepted)) for r in out.accepted]
        steadiest = max(together, key=_speedup_low)
        out.winner = _winner(together, steadiest)
        out.steadiest = steadiest if out.winner is not steadiest else None
    return out


def covered(rerun: Rerun) -> int:
    """The most steps any run of an fp16 rerun's settings took with its loss in range (the
    search's probe, its pair, its run alone); ``horizon`` for another mode."""
    if rerun.trial.params.get("precision") != "fp16":
        return rerun.horizon
    runs = [steps_run(rerun.trial)]
    if rerun.paired is not None and rerun.paired.candidate.ok:
        runs.append(len(rerun.paired.candidate.losses))
    if rerun.endurance is not None and rerun.endurance.ok:
        runs.append(len(rerun.endurance.losses))
    return max(runs)


def _rejection(name: str, kind: str, detail: str) -> Rejection:
    return Rejection(label=name, stage="validation", kind=kind, detail=detail)


def _too_few_pairs(name: str, paired: PairedResult) -> Rejection:
    """A rerun cut short of the pairs a 95% interval needs, whatever its figures: rejected."""
    shown = ""
    if paired.speedup is not None:
        shown = (
            f" ({paired.speedup:.2f}x, range {paired.speedup_low:.2f}–{paired.speedup_high:.2f})"
        )
    return _rejection(
        name,
        "pairs",
        f"{_pairs(paired.pairs)} where {MIN_VALUES} are needed for a 95% "
        f"interval on its speedup{shown}; give the search more time",
    )


# A gap's growth over the pair's second half counts when it is this many standard errors.
_GROWING = 2.0
# A gap is judged by its upper bound: this many standard errors of the curves' step noise
# above it (about 97.5% one-sided). Judged by the figure itself, a candidate whose lasting gap
# is a little past the tolerance measured within it one seed in three (5.3-9.1% validated at
# 5%); with a seed's spread allowed on top of the tolerance, one run in 240 (5.0-6.2%); with
# the spread counted in the bound, a lasting gap of 3.7% (an A100's ResNet-18 at 8x the batch)
# was refused in most runs.
UPPER = 2.0


def gap_bound(rerun: Rerun, seed_noise: float = 0.0) -> float:
    """The upper bound of ``rerun``'s gap: ``UPPER`` standard errors above it, of its curves'
    step noise and of the seed's draw (``seed_noise``: what a seed alone moves the loss by,
    less for the mean of several seeds' gaps)."""
    assert rerun.gap is not None
    error = math.hypot(rerun.gap_error, seed_noise / math.sqrt(rerun.seeds))
    return rerun.gap[0] + UPPER * error


def pooled_gap(first: Rerun, second: Rerun, spread: float) -> tuple[float, float]:
    """Two seeds' gaps as one, and its error: each gap weighted by its own variance (its
    curves' step noise and the seed's ``spread``), and the error of that mean, the seed's share
    in it counted again by the bound (:func:`gap_bound`; a spread measured from a few repeats
    can be half what it is). A short second pair's noisy read no longer outweighs a long first
    one's (+3.4% over 38 pairs and +4.9% over 16, truly +3.1%: refused at their plain mean).
    Where the two lie further apart than their noise allows (two standard errors of their
    difference), the spread is wider than measured: their plain mean, half their distance its
    error (+3.0% and +4.6% at one batch whose true gap was 5.25%)."""
    assert first.gap is not None and second.gap is not None
    (g1, e1), (g2, e2) = (first.gap[0], first.gap_error), (second.gap[0], second.gap_error)
    v1, v2 = e1 * e1 + spread * spread, e2 * e2 + spread * spread
    if min(v1, v2) <= 0 or abs(g1 - g2) > 2 * math.sqrt(v1 + v2):
        return (g1 + g2) / 2, max(math.hypot(e1, e2), abs(g1 - g2)) / 2
    w1, w2 = 1 / v1, 1 / v2
    return (w1 * g1 + w2 * g2) / (w1 + w2), math.sqrt(1 / (w1 + w2))


def projected_within(rerun: Rerun, parity_tolerance: float, seed_noise: float = 0.0) -> bool:
    """Whether ``rerun``'s gap projected to the real run's length (the least fall its noise
    allows, :func:`~autotune.measure.parity.projected_gap`) keeps its upper bound within the
    bar: a larger batch's early lag that the run outlasts."""
    if rerun.projected is None:
        return False
    projected = replace(rerun, gap=(rerun.projected[1], 0.0, 0.0))
    bar = parity_bar(parity_tolerance, seed_noise, rerun.seeds)
    return gap_bound(projected, charged(parity_tolerance, seed_noise)) <= bar


def charged(parity_tolerance: float, seed_noise: float) -> float:
    """The seed's spread a gap's bound carries: all of it while the bar is the tolerance, less
    as the bar widens for it (a bar ``UPPER`` spreads wide has taken it in already)."""
    if not seed_noise:
        return 0.0
    return seed_noise * min(1.0, max(0.0, parity_tolerance / (UPPER * seed_noise) - 1.0))


def parity_bar(parity_tolerance: float, seed_noise: float, seeds: int = 1) -> float:
    """What a gap's upper bound must stay within: the tolerance, a fresh seed's draw neither
    credited nor charged (the user's own run is one seed too); where a seed alone moves the
    loss past what the tolerance can tell apart (a CPU's tiny model: 4-5%), what fp32 against
    itself at another seed reaches, ``UPPER`` spreads (less for the mean of several seeds)."""
    return max(parity_tolerance, UPPER * seed_noise / math.sqrt(seeds))


def parity_terms(parity_tolerance: float, seed_noise: float, seeds: int = 1) -> str:
    """The bar in words, for a verdict or a config's note."""
    bar = parity_bar(parity_tolerance, seed_noise, seeds)
    over = f" over {seeds} seeds" if seeds > 1 else ""
    if bar <= parity_tolerance:
        return f"tolerance {parity_tolerance:.0%}; a seed alone moves this loss by {seed_noise:.1%}"
    return (
        f"tolerance {parity_tolerance:.0%}, widened to {bar:.1%}{over}: a seed alone moves this "
        f"loss by {seed_noise:.1%}, more than the tolerance can tell apart"
    )


def judge(
    name: str,
    rerun: Rerun,
    *,
    min_speedup: float,
    parity_tolerance: float,
    seed_noise: float,
) -> Rejection | None:
    """A complete rerun's verdict: rejected for parity (its gap's upper bound, :func:`gap_bound`,
    past the tolerance unless its gap projected to the real run's end is within it,
    :func:`projected_within`; or below it and still growing by its growth,
    :func:`~autotune.measure.parity.parity_growth`'s figures), then for speed; None: accepted."""
    paired, gap, grew = rerun.paired, rerun.gap, rerun.growth
    assert paired is not None
    bar = parity_bar(parity_tolerance, seed_noise, rerun.seeds)
    bound = gap_bound(rerun, charged(parity_tolerance, seed_noise)) if gap is not None else None
    # Off the bar where the curves end, within it at the real run's end: an early lag fading.
    fading = (
        bound is not None and bound > bar and projected_within(rerun, parity_tolerance, seed_noise)
    )
    if gap is None or bound is None or (bound > bar and not fading):
        shown = "not comparable"
        if gap is not None:
            seen = samples_seen(rerun.gap_samples, rerun.run_samples)
            shown = f"{gap[0]:+.1%} (upper bound {bound:+.1%}){seen}"
        return _rejection(
            name,
            "parity",
            f"loss parity {shown} vs the fp32 reference "
            f"({parity_terms(parity_tolerance, seed_noise, rerun.seeds)})",
        )
    if not fading and grew is not None and grew[0] > _GROWING * grew[1] and gap[0] + grew[0] > bar:
        # Still growing where the curves end: one more such stretch would cross the bound.
        return _rejection(
            name,
            "parity",
            f"loss parity {gap[0]:+.1%} vs the fp32 reference and still growing "
            f"({grew[0]:+.1%} over the pair's second half): a lasting gap that has not shown "
            f"all of itself would pass the bar ({bar:.1%}); give the search more time for a "
            "longer pair",
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


def for_choice(rerun: Rerun, among: int) -> Rerun:
    """``rerun`` with its speedup's interval at the confidence that holds for ``among``
    intervals at once (each at ``1 - 5%/among``; itself where one, or where its pairs are
    too few for that confidence)."""
    paired = rerun.paired
    if among <= 1 or paired is None or paired.speedup_low is None:
        return rerun
    confidence = 1 - (1 - CONFIDENCE) / among
    ratios = paired_ratios(paired.candidate.rates(), paired.reference.rates())
    if len(ratios) < min_values(confidence):
        return rerun
    est = claimed(serial_interval(ratios, confidence))
    wide = {"speedup_low": min(est.low, paired.speedup_low),
            "speedup_high": max(est.high, paired.speedup_high or 0.0)}  # fmt: skip
    return replace(rerun, paired=paired.model_copy(update=wide))


def _winner(accepted: list[Rerun], steadiest: Rerun) -> Rerun:
    """``steadiest`` (the best lower bound), unless another's lower bound lies within what a
    figure moves from one run to the next (:data:`~autotune.measure.stats.CLAIM_FLOOR`) of it
    and its figure is more than that above: lower bounds that close say nothing about which
    is faster. A candidate paired for less time has the wider interval:
    an fp16 batch whose run alone to its overflow horizon took most of its share measured
    2.31x (2.15-2.51) over 11 pairs, and the lower bound alone took the smaller batch's 2.23x
    (2.16-2.30), truly 2.33x against 2.23x. Figures within the floor are one figure, and the
    better measured one, its parity read over more samples too, stays (a 1.57x read over 33
    steps, its lasting gap not shown yet, against a 1.54x)."""
    tied = [r for r in accepted if _speedup_low(r) >= _speedup_low(steadiest) * (1 - CLAIM_FLOOR)]
    fastest = max(tied, key=speedup_of)
    return fastest if speedup_of(fastest) > speedup_of(steadiest) * (1 + CLAIM_FLOOR) else steadiest


def speedup_of(rerun: Rerun) -> float:
    """An accepted rerun's paired speedup."""
    assert rerun.paired is not None and rerun.paired.speedup is not None
    return rerun.paired.speedup


def _speedup_low(rerun: Rerun) -> float:
    # Only a paired rerun whose lower bound cleared min_speedup is accepted.
    assert rerun.paired is not None and rerun.paired.speedup_low is not None
    return rerun.paired.speedup_low


def with_gap(rerun: Rerun, reference: ReferenceRecord | None = None, run_samples: int = 0) -> Rerun:
    """The rerun with its parity gap at equal samples seen, and how the gap grew over the
    second half of those samples: against its own reference arm, or against the reference's
    first curve (``reference``'s) where that one overlaps the candidate's for longer (a fast
    candidate's arm cut by its pair's time sees fewer samples than the search's probes did,
    and a lasting gap that has not shown yet reads as parity). A batch larger than the
    reference's whose gap still fades as an early lag does has it projected to the real
    run's ``run_samples`` (0: none named)."""
    paired = rerun.paired
    if paired is not None and paired.ok:
        c, r = paired.candidate, paired.reference
        ref_losses, ref_batch = list(r.losses), r.batch_size
        first = reference.finite_losses if reference is not None else []
        if reference is not None and len(first) * reference.batch_size > len(r.losses) * ref_batch:
            ref_losses, ref_batch = first, reference.batch_size
        rerun.gap = parity_gap(c.losses, c.batch_size, ref_losses, ref_batch)
        rerun.gap_samples = min(len(c.losses) * c.batch_size, len(ref_losses) * ref_batch)
        rerun.gap_error = parity_gap_error(c.losses, c.batch_size, ref_losses, ref_batch)
        rerun.growth = parity_growth(c.losses, c.batch_size, ref_losses, ref_batch)
        rerun.run_samples = run_samples
        if 0 < run_samples < rerun.gap_samples:
            _at_run_end(rerun, (c.losses, c.batch_size), (ref_losses, ref_batch))
        elif run_samples and c.batch_size > ref_batch:
            rerun.projected = projected_gap(
                c.losses, c.batch_size, ref_losses, ref_batch, run_samples, z=UPPER
            )
    return rerun


def _at_run_end(
    rerun: Rerun, cand: tuple[Sequence[float], int], ref: tuple[Sequence[float], int]
) -> None:
    """A real run shorter than the curves: its gap read where the run ends, with that horizon,
    where it is clearly the worse (``UPPER`` standard errors of the two readings above the
    whole curves' gap: a larger batch's early lag that the run ends inside). Short of that the
    whole curves' reading stands: the run's fewer steps would only widen the bound with noise
    (the mypkg MLP's bf16 at 4x the batch read +0.1%, bound +8.3%, over one epoch's 32 steps,
    and kept parity in full)."""
    samples = rerun.run_samples
    mine = cand[0][: samples // cand[1]]
    theirs = ref[0][: samples // ref[1]]
    short = parity_gap(mine, cand[1], theirs, ref[1])
    if short is None or rerun.gap is None:
        return
    error = parity_gap_error(mine, cand[1], theirs, ref[1])
    if short[0] - rerun.gap[0] > UPPER * math.hypot(error, rerun.gap_error):
        rerun.gap, rerun.gap_error = short, error
        rerun.gap_samples = min(len(mine) * cand[1], len(theirs) * ref[1])


def validation_reserve(
    ctx: SearchContext, store: StudyStore, reference: ReferenceRecord | None = None
) -> float:
    """Seconds validation will need: a paired rerun of each shortlisted candidate and of the
    safe standby (or of one, before any), from the search's own probe times, fp16's run past
    its overflow horizon and a compiled candidate's compiling included, with room to spare."""
    leaders, standby = candidates(ctx, store, reference)
    picked = leaders + ([standby] if standby is not None else [])
    if not ctx.typical_probe(default=0.0):
        return VALIDATION_SHARE * ctx.budget.total
    horizon = partial(verdict_horizon, ctx, store.trials())
    # Nothing worth validating yet: keep room for the least pair a late winner needs (two
    # arms' set-up and six short pairs), and give the rest to the search: without a trial,
    # validation has nothing to measure.
    need = sum(rerun_need(ctx, t, horizon(t)) for t in picked) if picked else least_pair(ctx)
    # An fp16 leader's run to its overflow horizon comes on top of validation's share (its
    # own share at most): pairs alone, without it, would prove nothing.
    proof = max(
        (
            min(endurance_seconds(ctx, t, horizon(t)), proof_seconds(ctx, t, horizon(t)))
            for t in leaders
        ),
        default=0.0,
    )
    return min(VALIDATION_SHARE * ctx.budget.total + proof, need + 1.0)


# The seed-to-seed band a parity decision rests on is measured from at least this many repeats.
SPREAD_REPEATS = 3


def measure_spread(
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord,
    remeasure: Callable[[], object],
    end_at: float,
) -> None:
    """Before validation picks by parity: when a trial failed only parity, by less than the
    band could ever allow (the tolerance again), the band rests on :data:`SPREAD_REPEATS`
    repeats of the reference (each a fresh seed), time allowing. Fewer leave it to chance: one
    repeat that happened to land close gives a band of a few tenths of a percent."""
    tol = ctx.spec.parity_tolerance
    trials = store.trials((TrialState.COMPLETE,))
    val = ctx.spec.validation
    if not any(
        not is_feasible(t) and eligible(t, 2 * tol) and (record(t).speedup or 0) >= val.min_speedup
        for t in trials
    ):
        return
    for _ in range(SPREAD_REPEATS):
        gaps = [m for m in reference.measurements if m.seed_gap is not None]
        left = end_at - ctx.budget.elapsed() - validation_reserve(ctx, store, reference)
        if len(gaps) >= SPREAD_REPEATS or left < ctx.typical_probe():
            return
        remeasure()
