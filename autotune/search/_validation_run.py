"""Validation's measurements, round by round, until a candidate is accepted or time runs out."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from loguru import logger
from optuna.trial import FrozenTrial

from autotune.measure.parity import clearly_off
from autotune.measure.result import PairedResult, pooled
from autotune.measure.stats import MIN_VALUES, claimable
from autotune.schema.enums import Outcome
from autotune.search._budget import WRITE_RESERVE
from autotune.search._context import SearchContext
from autotune.search._rerun import (
    gapped,
    least_seconds,
    paired_rerun,
    reference_arm,
    run_alone,
    run_pair,
    shared_samples,
    would_pass,
)
from autotune.search._risk import RuledOut, settings_key, verdict_horizon
from autotune.search._shortlist import candidates
from autotune.search._validate import (
    UPPER,
    Rerun,
    Selection,
    charged,
    covered,
    gap_bound,
    judge,
    parity_bar,
    pooled_gap,
    projected_within,
    select,
)
from autotune.search._validation_order import least_needed, likelier_first
from autotune.search._validation_time import (
    LONGER,
    compiling,
    opened,
    rerun_need,
)
from autotune.study.reference import ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.trials import is_feasible, record

__all__ = ["validate"]


def validate(
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord,
    end_at: float,
    *,
    hard_end: float | None = None,
) -> tuple[Selection | None, PairedResult | None, float]:
    """Phase 4: paired reruns of the shortlist, round by round, then the selection.

    Args:
        end_at: when the first round must be done (the budget's reserve for validation).
        hard_end: when later rounds must be done (the budget's end); ``end_at`` by default.

    Returns:
        ``(selection, reference_run, seed_noise)``; selection None when nothing was worth
        validating.
    """
    tol, min_speedup = ctx.spec.parity_tolerance, ctx.spec.validation.min_speedup
    ruled, reruns = RuledOut(), list[Rerun]()
    selection: Selection | None = None
    # The seed's band as every verdict below counts it (one draw is no band: reference_arm).
    (ref_run, noise), end = reference_arm([], reference, tol), end_at
    close = False
    while True:
        leaders, standby = candidates(ctx, store, reference, ruled, close=close)
        if not leaders and not close and (hard_end or end_at) - ctx.budget.elapsed() >= 1.0:
            # Nothing clearly faster left, and time: the close runners, to the budget's end.
            close, end = True, max(end, hard_end or end_at)
            leaders, standby = candidates(ctx, store, reference, ruled, close=True)
            if leaders:
                logger.info(
                    "validation: nothing the search measured clearly faster is left; measuring "
                    "what it measured at least as fast as the reference, {:.0f}s left",
                    end - ctx.budget.elapsed(),
                )
        if not leaders:
            break
        horizon_of = partial(verdict_horizon, ctx, store.trials())
        leaders = likelier_first(ctx, leaders, end - ctx.budget.elapsed(), horizon_of)
        fresh = _round(ctx, store, reference, (leaders, standby), end, reruns, noise, ruled)
        reruns += fresh
        ref_run, noise = reference_arm(reruns, reference, tol)
        reruns = _lengthen(ctx, reference, reruns, fresh, noise)
        trials = [r.trial for r in fresh]
        reruns = [_more_pairs(ctx, reference, r, noise) if r.trial in trials else r for r in reruns]
        reruns = _reseed_all(ctx, reference, reruns, trials, noise)
        selection = select(reruns, min_speedup=min_speedup, parity_tolerance=tol, seed_noise=noise)
        measured = [r for r in fresh if r.paired is not None or r.endurance is not None]
        # One whose verdict no share of this budget holds is passed over for good: the next
        # round measures the candidates after it (a standby fp16 cannot be, for its late
        # overflow risk: with both leaders past the cap, nothing was measured and 24 s of 45 s
        # went unspent).
        beyond = [r for r in fresh if r.beyond_budget]
        for r in beyond:
            ruled.settings.add(settings_key(r.trial))
        if selection.winner is not None or not (measured or beyond):
            break
        end = max(end, hard_end or end_at)
        if end - ctx.budget.elapsed() < 1.0:
            break
        logger.info("validation: nothing accepted yet; measuring the next candidates")
    if selection is None:
        return None, None, 0.0
    for rejection in selection.rejected:
        logger.info("rejected in validation: {}", rejection)
    if selection.winner is not None and selection.winner.paired is not None:
        ref_run = selection.winner.paired
    return selection, ref_run, noise


def _round(  # noqa: PLR0913 - one round's inputs, from validate alone
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord,
    queue: tuple[list[FrozenTrial], FrozenTrial | None],
    end: float,
    before: list[Rerun],
    noise: float,
    ruled: RuledOut,
) -> list[Rerun]:
    """One round: each leader of ``queue`` measured in its share of what is left (one judged
    off parity at the probe's horizon, more shares, but none of what the feasible ones after it
    need); then the standby, its share kept for it, only while nothing measured so far was
    accepted. What each refusal rules out (into ``ruled``) is skipped in the rest of the round
    too."""
    tol, min_speedup = ctx.spec.parity_tolerance, ctx.spec.validation.min_speedup
    horizon_of = partial(verdict_horizon, ctx, store.trials())
    leaders, standby = queue
    order = leaders + ([standby] if standby is not None else [])
    out: list[Rerun] = []
    for i, trial in enumerate(order):
        so_far = select(before + out, min_speedup=min_speedup, parity_tolerance=tol,
                        seed_noise=noise)  # fmt: skip
        accepted = so_far.winner is not None
        if trial is standby and accepted:
            break
        if trial in ruled:
            out.append(Rerun(trial, None, skipped="ruled out by a refusal before it"))
            continue
        left = end - ctx.budget.elapsed()
        if left < 1.0 and not opened(ctx, trial):  # (the opening pair costs nothing now)
            out.append(Rerun(trial, None))
            continue
        # Each its share of what is left by what it needs, and the best first what it needs
        # (a shorter pair sees fewer samples: a lasting gap it would not see) as far as the
        # standby (or the next one) keeps the least that gives it an interval; the standby's
        # share is kept only while nothing is accepted. A pair cut short by its share is
        # still compared, on what both arms saw.
        rest = [trial] + [
            t for t in order[i + 1 :] if t not in ruled and not (accepted and t is standby)
        ]
        needs = [rerun_need(ctx, t, horizon_of(t)) for t in rest]
        keep = _kept_after(ctx, trial, rest[1:], horizon_of)
        # At least what it needs to be measured at all, where that is left: a share short of
        # it skips it for certain, and a better candidate goes unmeasured for a worse one.
        horizon = horizon_of(trial)
        least = least_needed(ctx, trial, horizon)
        floor = left
        # One the search found off parity takes its least only from what the feasible ones
        # after it do not need: it is the likelier to be refused.
        within = [t for t in rest[1:] if is_feasible(t)]
        off_parity = not accepted and not is_feasible(trial) and bool(within)
        if off_parity:
            floor -= sum(least_needed(ctx, t, horizon_of(t), spare=1.5) for t in within)
        room = max(left - keep, min(floor, least))
        # At most twice its need: what it leaves goes to the next round, should it fail.
        share = min(max(left * needs[0] / max(sum(needs), 1e-9), needs[0]), room, 2 * needs[0])
        if accepted and share < least:
            # One is accepted already: a pair too short for an interval would change nothing,
            # and its set-up could only run past the budget.
            out.append(Rerun(trial, None, share=share))
            continue
        rerun = paired_rerun(ctx, trial, reference, share=share, horizon=horizon)
        skipped = rerun.paired is None and rerun.endurance is None and not rerun.beyond_budget
        if off_parity and room < least and skipped:
            # Its share went to those after it: its note says so, not "0s left for it".
            rerun = replace(rerun, skipped=_behind(trial, left))
        out.append(rerun)
        if rerun.paired is not None or rerun.endurance is not None:
            _rule_out(ruled, rerun)
    return out


def _kept_after(
    ctx: SearchContext,
    trial: FrozenTrial,
    later: list[FrozenTrial],
    horizon_of: Callable[[FrozenTrial], int],
) -> float:
    """What the ones after ``trial`` in its round keep from its share: each its least, fp16's
    horizon included (an opening pair's pick only the latter: its pair is paid); none for those
    the search found off parity after one it found within (the likelier refused: fp16 at 8x the
    batch kept 27 s for its 500 steps, and the 2.5x leader before it got 5 pairs)."""
    return sum(
        least_needed(ctx, t, horizon_of(t), spare=1.5)
        for t in later
        if is_feasible(t) or not is_feasible(trial)
    )


def _behind(trial: FrozenTrial, left: float) -> str:
    """Why a candidate the search found off parity was not measured: the time left went to
    those it found within parity, the likelier to be accepted."""
    gap = record(trial).parity_gap
    read = f" ({gap:+.1%} at the probe's horizon)" if gap is not None else ""
    return (
        f"not validated: the search found it off parity{read}, and the {left:.0f}s left went "
        "to the candidates it found within parity; give the search more time"
    )


def _rule_out(ruled: RuledOut, rerun: Rerun) -> None:
    """What a refused rerun rules out (see :class:`RuledOut`)."""
    result = rerun.endurance if rerun.endurance is not None and not rerun.endurance.ok else None
    if result is None and rerun.paired is not None and not rerun.paired.candidate.ok:
        result = rerun.paired.candidate
    outcome = result.outcome if result is not None else Outcome.COMPLETED
    overflowed = result is not None and any(not math.isfinite(v) for v in result.losses)
    ruled.add(rerun.trial, outcome, overflowed)


# A parity horizon shorter than this share of the candidate's own curve is short.
_SHORT = 4


def _lengthen(
    ctx: SearchContext,
    reference: ReferenceRecord,
    reruns: list[Rerun],
    fresh: list[Rerun],
    noise: float,
) -> list[Rerun]:
    """:func:`_recheck` for this round's reruns, the largest batch first; before each, what a
    larger batch of its mode showed over a longer horizon: a candidate whose gap, grown as
    that one's grew between its two horizons, passes the tolerance is not validated (a
    lasting gap that shows late at one batch shows late at the next: from 30,000 samples on,
    bs=1024 went from +3.0% to +11.2%, and bs=256, passed at +2.5% read over fewer samples,
    had a true gap of 8%)."""
    out = list(reruns)
    for i in sorted(range(len(out)), key=lambda i: -out[i].trial.params.get("batch_size", 0)):
        grown = _grown_gap(ctx, out[i], out, noise)
        if grown is not None:
            r = out[i]
            why = (
                f"not validated: its parity gap, {r.gap[0] if r.gap else 0.0:+.1%} over "
                f"{shared_samples(r.paired):,} samples, grows to about {grown:+.1%} as a larger "
                "batch's did over a longer horizon"
            )
            out[i] = Rerun(r.trial, None, share=r.share, skipped=why, horizon=r.horizon)
        elif out[i] in fresh:
            out[i] = _recheck(ctx, reference, out[i], noise)
    return out


def _grown_gap(ctx: SearchContext, rerun: Rerun, reruns: list[Rerun], noise: float) -> float | None:
    """``rerun``'s gap grown by the most a larger batch of its mode's grew between its two
    horizons (where that one was refused after its longer look), when that passes the
    tolerance and ``rerun`` was read over fewer samples; None otherwise."""
    tol, mode = ctx.spec.parity_tolerance, rerun.trial.params.get("precision")
    batch = rerun.trial.params.get("batch_size", 0)
    if rerun.first_gap is not None or rerun.gap is None or rerun.gap[0] > tol + noise:
        return None
    seen = shared_samples(rerun.paired)
    growth = [
        q.gap[0] / max(q.first_gap, tol / 10)
        for q in reruns
        if q.first_gap is not None
        and q.gap is not None
        and q.gap[0] > tol + noise
        and q.trial.params.get("precision") == mode
        and q.trial.params.get("batch_size", 0) > batch
        and shared_samples(q.paired) > seen
    ]
    grown = max(growth, default=0.0) * rerun.gap[0]
    return grown if grown > tol + noise else None


def _recheck(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun, noise: float) -> Rerun:
    """A larger batch off parity at validation's horizon by no more than its early lag can
    explain, or a candidate within parity whose gap still grows where its curves end, is
    measured once more over a horizon ``LONGER`` times as long, time allowing (up to the
    budget's end: a search that measured its space through leaves time unspent)."""
    tol, gap, grew = ctx.spec.parity_tolerance, rerun.gap, rerun.growth
    ratio = rerun.trial.params.get("batch_size", 0) / reference.batch_size
    if gap is None:
        return rerun
    lagging = ratio > 1 and tol + noise < gap[0] <= clearly_off(tol, ratio) + noise
    # (Not where its gap projected to the real run's end passes: that verdict stands.)
    lagging = lagging and not projected_within(rerun, tol, noise)
    # Within the bound but growing where the curves end (clearly, or at all where the horizon
    # is a small part of what the candidate ran): a lasting gap may still be showing.
    paired = rerun.paired
    short = paired is not None and len(paired.candidate.losses) * paired.candidate.batch_size > (
        _SHORT * shared_samples(paired)
    )
    growing = (
        grew is not None
        and gap[0] <= tol + noise
        and (grew[0] > grew[1] or (short and grew[0] > 0))
    )
    if not (lagging or growing):
        return rerun
    share = min(LONGER * rerun.share, ctx.budget.total - WRITE_RESERVE - ctx.budget.elapsed())
    if share < 2 * rerun.share:
        return rerun
    logger.info(
        "validation of {}: {:+.1%} off parity at {:,} samples, {}: measuring it over a longer "
        "horizon",
        rerun.trial.number,
        gap[0],
        shared_samples(rerun.paired),
        "within a larger batch's early lag" if lagging else "and still growing",
    )
    ran = covered(rerun)
    again = paired_rerun(ctx, rerun.trial, reference, share=share, horizon=rerun.horizon, ran=ran)
    # fp16's verdict to its horizon stands from the first look (its run alone, or its pair's
    # candidate run on alone) where this one did not go that far.
    first = rerun.paired.candidate if rerun.paired is not None else None
    if first is not None and first.ok and len(first.losses) == ran and covered(again) < ran:
        again.endurance = again.endurance or first
    again.endurance = again.endurance or rerun.endurance
    again.first_gap = gap[0]
    return again


def _reseed(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun, noise: float) -> Rerun:
    """A fast enough candidate whose parity verdict one seed's draw could turn (its gap's bound
    within a seed's spread of the bar, either side) is paired once more at another seed, time
    allowing (up to the budget's end): its gap is then two seeds' gaps pooled, each its own
    draw of the seed's offset (:func:`~autotune.search._validate.pooled_gap`). One refused on
    an unlucky draw may pass; one a lucky draw carried under the bar is caught by the second."""
    paired, tol = rerun.paired, ctx.spec.parity_tolerance
    if paired is None or not paired.ok or rerun.gap is None or rerun.seeds > 1:
        return rerun
    fast = paired.speedup_low is not None and paired.speedup_low >= ctx.spec.validation.min_speedup
    # The seed's spread its bound carries (as far past the bar as its bound's multiple of it:
    # the mean of two draws takes most of that back).
    spread = charged(tol, noise)
    off = gap_bound(rerun, spread) - parity_bar(tol, noise)
    # A passing verdict is paired again only where its bound carries the seed's draw: where
    # the bar has widened for it instead, a second seed narrows the bar more than the bound.
    if (
        not fast
        or paired.pairs < MIN_VALUES
        or abs(off) > noise + UPPER * spread
        or (off <= 0 and not spread)
    ):
        return rerun
    trial, seconds, share = rerun.trial, compiling(rerun.trial), _again_share(ctx, rerun)
    if share is None:
        return rerun
    logger.info(
        "validation of {}: loss parity {:+.1%} (upper bound {:+.1%}, bar {:.1%}), a verdict one "
        "seed's spread could turn: pairing it again at another seed",
        trial.number,
        rerun.gap[0],
        gap_bound(rerun, spread),
        parity_bar(tol, noise),
    )
    other = gapped(
        ctx, reference, Rerun(trial, run_pair(ctx, trial, reference, share, seconds, seed=2))
    )
    if other.gap is None:
        return rerun
    mean, error = pooled_gap(rerun, other, spread)
    gap = (mean, rerun.gap[1], rerun.gap[2])
    # The projection stands where both seeds' gaps fade so: the worse of the two.
    projected = None
    if rerun.projected is not None and other.projected is not None:
        projected = max(rerun.projected, other.projected, key=lambda p: p[1])
    merged = replace(rerun, gap=gap, gap_error=error, seeds=2, projected=projected)
    if (
        merged.horizon
        and covered(merged) < merged.horizon
        and merged.endurance is None
        and would_pass(ctx, reference, merged)
    ):
        # fp16's run alone was kept for a pair that would pass: this one now would.
        left = ctx.budget.total - WRITE_RESERVE - ctx.budget.elapsed()
        ran = len(paired.candidate.losses)
        merged.endurance = run_alone(ctx, trial, merged.horizon, left, ran=ran)
    return merged


def _reseed_all(
    ctx: SearchContext,
    reference: ReferenceRecord,
    reruns: list[Rerun],
    fresh: list[FrozenTrial],
    noise: float,
) -> list[Rerun]:
    """:func:`_reseed` for this round's reruns, those the bar passes first: a verdict that
    would ship is confirmed before time goes to turning a refusal."""
    tol = ctx.spec.parity_tolerance
    bar = parity_bar(tol, noise)

    def passing(r: Rerun) -> bool:
        return r.gap is not None and (
            gap_bound(r, charged(tol, noise)) <= bar or projected_within(r, tol, noise)
        )

    out = list(reruns)
    order = sorted(
        (i for i, r in enumerate(reruns) if r.trial in fresh), key=lambda i: not passing(reruns[i])
    )
    for i in order:
        out[i] = _reseed(ctx, reference, reruns[i], noise)
    return out


def _more_pairs(
    ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun, noise: float
) -> Rerun:
    """A candidate whose figure clears ``min_speedup`` by more than a claim's floor is measured
    again, time allowing (up to the budget's end), where its first pair left it unjudged:

    - refused for its speed alone (its interval, not its figure, short of the bar: a few slow
      pairs, 1.31x (1.04-1.35) over 12, with 83 s of the budget unspent): paired again at the
      same seed and judged on both runs' pairs together;
    - cut short of the pairs an interval needs by its share (fp16 at 2x the base batch, 2.21x
      over 5 pairs and 11,000 samples, refused while the AMP recipe's 1.44x was accepted and
      20 s went unspent): measured afresh over the longer look what is left allows, which
      stands for it (the first said nothing: neither an interval nor a parity read past its
      few samples)."""
    paired, spec = rerun.paired, ctx.spec
    min_speedup = spec.validation.min_speedup
    if (
        paired is None
        or not paired.ok
        or paired.speedup is None
        or rerun.runs > 1
        or paired.speedup < claimable(min_speedup)
    ):
        return rerun
    if paired.pairs < MIN_VALUES:
        return _look_again(ctx, reference, rerun)
    verdict = judge("", rerun, min_speedup=min_speedup, parity_tolerance=spec.parity_tolerance,
                    seed_noise=noise)  # fmt: skip
    if verdict is None or verdict.kind != "speed":
        return rerun
    trial, seconds, share = rerun.trial, compiling(rerun.trial), _again_share(ctx, rerun)
    if share is None:
        return rerun
    logger.info(
        "validation of {}: {:.2f}x ({:.2f}-{:.2f}) over {} pairs, its interval short of {:.2f}x: "
        "pairing it again for more pairs",
        trial.number,
        paired.speedup,
        paired.speedup_low,
        paired.speedup_high,
        paired.pairs,
        min_speedup,
    )
    again = run_pair(ctx, trial, reference, share, seconds)
    if not again.ok or again.pairs == 0:
        return rerun
    return replace(rerun, paired=pooled(paired, again), runs=2)


def _look_again(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun) -> Rerun:
    """:func:`_more_pairs` for a rerun cut short of the pairs an interval needs: measured
    afresh over up to ``LONGER`` times its share (to the budget's end), where that is more
    than its first share and covers its least; the new look stands for it."""
    trial, paired = rerun.trial, rerun.paired
    assert paired is not None
    share = min(LONGER * rerun.share, _to_end(ctx))
    if share <= rerun.share or share < least_needed(ctx, trial, rerun.horizon):
        return rerun
    logger.info(
        "validation of {}: {:.2f}x over {} pairs, fewer than the {} an interval needs: "
        "measuring it again over a longer look",
        trial.number,
        paired.speedup,
        paired.pairs,
        MIN_VALUES,
    )
    again = paired_rerun(ctx, trial, reference, share=share, horizon=rerun.horizon,
                         ran=covered(rerun))  # fmt: skip
    return again if again.paired is not None else rerun


def _to_end(ctx: SearchContext) -> float:
    return ctx.budget.total - WRITE_RESERVE - ctx.budget.elapsed()


def _again_share(ctx: SearchContext, rerun: Rerun) -> float | None:
    """The seconds a second pair of ``rerun``'s candidate gets: its first pair's share, up to
    the budget's end; None where that cannot give it an interval."""
    share = min(rerun.share, _to_end(ctx))
    return share if share >= least_seconds(ctx, rerun.trial) else None
