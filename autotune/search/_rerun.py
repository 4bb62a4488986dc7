"""One shortlisted candidate measured again: paired with the fp32 reference in its share of
validation's time, and fp16 run alone to its overflow horizon where its pair would pass."""

from __future__ import annotations

from loguru import logger
from optuna.trial import FrozenTrial

from autotune.measure.parity import parity_gap
from autotune.measure.result import PairedResult, ProbeResult
from autotune.measure.stats import MIN_VALUES
from autotune.schema.enums import Outcome
from autotune.search._context import SearchContext
from autotune.search._risk import steps_run
from autotune.search._validate import UPPER, Rerun, covered, judge, with_gap
from autotune.search._validation_time import (
    ENDURANCE_SHARE,
    alone_seconds,
    compiling,
    endurance_seconds,
    in_pair_seconds,
    opening_of,
    setup_seconds,
    six_pairs,
)
from autotune.study.reference import ReferenceRecord
from autotune.study.trials import candidate, record

__all__ = [
    "gapped",
    "least_seconds",
    "paired_rerun",
    "reference_arm",
    "run_alone",
    "run_pair",
    "run_samples",
    "shared_samples",
    "would_pass",
]

# Seed gaps a band must rest on before it may widen validation's bar.
_BAND_DRAWS = 2
# Each arm of a validation pair measures for about this share of the pair's slice ...
_PAIR_SHARE = 0.3
# ... and at most this share of what is left of it after both arms' set-up.
_AFTER_SETUPS = 0.4


def least_seconds(ctx: SearchContext, trial: FrozenTrial) -> float:
    """The least time that gives ``trial`` an interval: its set-up, six pairs, compiling."""
    return six_pairs(ctx, trial) + compiling(trial) + 1.0


def run_samples(ctx: SearchContext, reference: ReferenceRecord) -> int:
    """The samples the real run sees, where the spec names its length (0: it does not)."""
    return ctx.spec.run.samples_at(reference.batch_size) if ctx.spec.run is not None else 0


def gapped(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun) -> Rerun:
    """:func:`~autotune.search._validate.with_gap` for the spec's real run."""
    return with_gap(rerun, reference, run_samples(ctx, reference))


def reference_arm(
    reruns: list[Rerun], reference: ReferenceRecord, tol: float
) -> tuple[PairedResult | None, float]:
    """The first reference arm measured, and the seed noise it and the search's repeats give
    together (one root mean square of every seed gap they saw; from a single gap, at most a
    quarter of the tolerance)."""
    arms = [
        r.paired
        for r in reruns
        if r.paired is not None and r.paired.reference.ok and r.paired.reference.throughput > 0
    ]
    # One at a seed of its own first (the opening pair's arm is the reference's first run).
    ref_run = next((p for p in arms if p.reference.seed != reference.seed), None)
    ref_run = ref_run or next(iter(arms), None)
    also = _seed_gaps(ref_run, reference)
    noise = reference.seed_noise(tol, also=also)
    drawn = len(also) + sum(m.seed_gap is not None for m in reference.measurements)
    if drawn < _BAND_DRAWS:
        # One draw is no band: past a quarter of the tolerance a band widens the bar or takes
        # the seed's draw off a gap's bound (charged), and one repeat's 2.5%, where two seeds
        # lie 1.1% apart, took it off a bf16 batch whose lasting 5.04% measured 3.3% (+3.9%).
        noise = min(noise, tol / (2 * UPPER))
    return ref_run, noise


def _seed_gaps(ref_run: PairedResult | None, reference: ReferenceRecord) -> list[float]:
    """How far a fresh seed moved the reference's loss curve by itself: its validation arm's
    gap to its first run (none where there is no arm to compare)."""
    if ref_run is None or not reference.finite_losses or ref_run.reference.seed == reference.seed:
        # (The opening pair's arm is the reference's own run: no second seed.)
        return []
    r = ref_run.reference
    seed_gap = parity_gap(r.losses, r.batch_size, reference.finite_losses, reference.batch_size)
    return [seed_gap[0]] if seed_gap else []


def shared_samples(paired: PairedResult | None) -> int:
    """The samples both arms of a pair saw: the horizon its parity gap is taken at."""
    if paired is None:
        return 0
    c, r = paired.candidate, paired.reference
    return min(len(c.losses) * c.batch_size, len(r.losses) * r.batch_size)


def run_alone(
    ctx: SearchContext, trial: FrozenTrial, horizon: int, share: float, *, ran: int = 0
) -> ProbeResult | None:
    """An fp16 candidate run alone to ``horizon`` steps (or as far as its time reaches: at
    most ``share``, its set-up and warm-up paid out of it): does its loss stay in range?
    None when it ran that far in the search already, when its time reaches no further than
    the search's run or its pair (``ran`` steps) did, or when the run ended for another
    reason than a divergence (a run stopped at its limit proves nothing either way)."""
    seconds = endurance_seconds(ctx, trial, horizon)
    rec = record(trial)
    if not seconds or not rec.throughput:
        return None
    probe = ctx.spec.probe
    step = trial.params.get("batch_size", 1) / rec.throughput
    # Its time limit counts from its start: set-up and warm-up come out of it.
    limit = min(share, seconds)
    timed = limit - (probe.warmup_steps + 2) * step - setup_seconds(trial)
    if timed < (max(ran, steps_run(trial)) - probe.warmup_steps + 1) * step:
        return None
    settings = probe.model_copy(
        update={
            "steps": max(1, horizon - probe.warmup_steps),
            "min_time": 0.0,
            "time_limit": max(1.0, limit),
            "seed": probe.seed + 1,
            "early_stop": False,
        }
    )
    result = ctx.run_probe(candidate(trial), settings, within=share)
    logger.info("validation of {}: alone for {} steps: {}", trial.number, horizon, result.summary())
    return result if result.ok or result.outcome == Outcome.DIVERGED else None


def paired_rerun(
    ctx: SearchContext,
    trial: FrozenTrial,
    reference: ReferenceRecord,
    *,
    share: float,
    horizon: int = 0,
    ran: int = 0,
) -> Rerun:
    """One candidate measured again, paired with the reference, inside ``share`` seconds (a
    compiled one only where its share covers compiling again and six pairs after it); an
    fp16 one's candidate runs on alone after its pairs to ``horizon`` steps (where it has not
    run ``ran`` steps already), and one still short of it whose pair would be accepted then
    runs alone to it in what is left of its share."""
    if (opening := opening_of(ctx, trial)) is not None:
        # Its pair was one of the search's opening pairs: measured before any trial, so not
        # chosen for its figures; the first rerun of its candidate is that pair, paid already
        # (``share`` is for fp16's run alone, where the pair fell short of its horizon).
        ctx.found.openings.remove(opening)
        wall = opening.candidate.wall_seconds
        rerun = gapped(ctx, reference, Rerun(trial, opening, share=wall, horizon=horizon))
        return _endure(ctx, reference, rerun, trial, share=share)
    started = ctx.budget.elapsed()
    seconds = compiling(trial)
    least = seconds + six_pairs(ctx, trial)
    kept = endurance_seconds(ctx, trial, horizon, capped=False, ran=ran) if horizon else 0.0
    along = in_pair_seconds(ctx, trial, horizon) if kept else 0.0
    steps, alone = 0, 0.0
    if along and along <= kept and least + along <= share:
        # Cheaper than a run alone (its build and first step): the pair's arms run to the
        # horizon, and fp16's verdict comes from the pair itself.
        kept, steps = 0.0, horizon
    most = ENDURANCE_SHARE * ctx.budget.total
    cap = min(most, share - least)
    if kept > cap:
        # No room for a run alone beside the pair: the pair's candidate runs on alone after
        # its pairs instead (no build of its own), paid whether or not the pair passes.
        kept, alone = 0.0, alone_seconds(ctx, trial, horizon, ran)
    if alone and alone > cap and share >= least:
        # fp16 cannot be run to its horizon beside its pair in this share: a verdict short of
        # it would be refused, so the time goes to the next candidate (for good, where the
        # budget's cap, not this share, is what it is past).
        beyond_budget = most < share - least
        limit = (
            f"the {most:.0f}s ({ENDURANCE_SHARE:.0%} of the budget) an fp16 run alone may take"
            if beyond_budget
            else f"its {share:.0f}s share leaves beside its pairs"
        )
        why = (
            f"not validated: running fp16 to {horizon} steps takes about {alone:.0f}s, more "
            f"than {limit}; give the search more time"
        )
        return Rerun(
            trial,
            None,
            share=share,
            skipped=why,
            horizon=horizon,
            beyond_budget=beyond_budget,
        )
    pair_share = share - kept
    if pair_share - alone < least:
        # Too short for the pairs an interval needs: measuring would only overrun the budget.
        again = f"compiling it again ({seconds:.0f}s), " if seconds else ""
        why = (
            f"not validated: {max(0.0, share):.0f}s left for it, too short for {again}its "
            f"set-up and the {MIN_VALUES} pairs an interval needs; give the search more time"
        )
        return Rerun(trial, None, share=share, skipped=why, horizon=horizon)
    pace = (horizon if alone else 0, alone)
    paired = run_pair(ctx, trial, reference, pair_share, seconds, steps=steps, alone=pace)
    rerun = gapped(ctx, reference, Rerun(trial, paired, share=share, horizon=horizon))
    return _endure(ctx, reference, rerun, trial, share=share - (ctx.budget.elapsed() - started))


def _endure(
    ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun, trial: FrozenTrial, *,
    share: float,
) -> Rerun:  # fmt: skip
    """An fp16 rerun whose pair would pass but fell short of its horizon runs alone to it, in
    the ``share`` seconds left of its time."""
    paired = rerun.paired
    if (
        paired is not None
        and rerun.horizon
        and covered(rerun) < rerun.horizon
        and would_pass(ctx, reference, rerun)
    ):
        ran = len(paired.candidate.losses)
        rerun.endurance = run_alone(ctx, trial, rerun.horizon, share, ran=ran)
    return rerun


def would_pass(ctx: SearchContext, reference: ReferenceRecord, rerun: Rerun) -> bool:
    """Would this pair be accepted on its figures (speed and parity, as :func:`select` judges
    them, with the seed noise its own reference arm gives)?"""
    paired, tol = rerun.paired, ctx.spec.parity_tolerance
    if paired is None or not paired.ok or paired.pairs < MIN_VALUES:
        return False
    noise = reference_arm([rerun], reference, tol)[1]
    verdict = judge(
        "", rerun, min_speedup=ctx.spec.validation.min_speedup, parity_tolerance=tol,
        seed_noise=noise,
    )  # fmt: skip
    return verdict is None


def run_pair(  # noqa: PLR0913 - one pair's settings, from validation alone
    ctx: SearchContext, trial: FrozenTrial, reference: ReferenceRecord, share: float,
    seconds: float, seed: int = 1, steps: int = 0, alone: tuple[int, float] = (0, 0.0),
) -> PairedResult:  # fmt: skip
    """The paired run itself, in ``share`` seconds, ``seconds`` of them compiling, at the
    probe's seed plus ``seed``, its arms running ``steps`` steps at least; ``alone``: the
    steps its candidate takes at least, the last ones alone after the pairs where its time
    is short, and the seconds kept for them."""
    probe = ctx.spec.probe
    settings = probe.model_copy(
        update={
            "steps": max(ctx.spec.validation.steps, steps),
            "seed": probe.seed + seed,
            "alone_steps": alone[0],
        }
    )
    # The pair measures for most of its share (each arm about a third of it; warm-ups and
    # the reference's catch-up to the horizon fit in the rest): the budget kept for
    # validation buys a tighter interval instead of going unused. Compiling counts apart.
    # Blocks are sized by this time, so it is at most 40% of what both arms' set-ups leave:
    # where they take most of a short share, six pairs still fit after them (sized by the
    # whole share, four did, and a better candidate was refused for it); elsewhere the pair
    # is as long as before, and its parity horizon with it.
    timed = share - seconds
    measured = timed - alone[1] - 2 * setup_seconds(trial)
    min_time = max(ctx.default_min_time if settings.min_time is None else settings.min_time,
                   min(_PAIR_SHARE * (timed - alone[1]), _AFTER_SETUPS * measured))  # fmt: skip
    paired = ctx.run_compare(
        candidate(trial),
        reference.candidate(),
        settings.model_copy(
            update={"time_limit": max(1.0, timed - 1.0), "min_time": min_time, "precision": 0.005}
        ),
        # Stopped at the budget's end at the latest: two set-ups that outlast a short share
        # must not take the run past its budget.
        timeout=min(share + ctx.hard_grace(), max(1.0, ctx.budget.left())),
    )
    logger.info("validation of {}: {}", trial.number, paired.summary())
    return paired
