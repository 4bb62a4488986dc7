"""The phases of one search, in order: the hardware and its ceilings, the reference, the
trials, then validation (the config is written up by :func:`run_search`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import cast

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune.errors import AutotuneError, StorageIOError
from autotune.execution.facts import WorkerFacts
from autotune.infra import clock
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Outcome, Phase, Role
from autotune.schema.spec import StudySpec
from autotune.search._artifact import build_config
from autotune.search._budget import (
    OPENING_LEAST,
    OPENING_PLAN,
    SAFE_PLAN,
    WRITE_RESERVE,
    SearchStopped,
    finishing_seconds,
    window_id,
)
from autotune.search._ceiling_moves import ceiling_from_opening
from autotune.search._context import SearchContext
from autotune.search._coordination import (
    SETTLE_WAIT,
    await_validation,
    settle,
    validation_job,
)
from autotune.search._events import PhaseStarted
from autotune.search._first_trials import (
    enqueue_base_trials,
    enqueue_between,
    enqueue_larger_batches,
    opening_picks,
)
from autotune.search._hardware import check_hardware, find_ceilings
from autotune.search._knob_trials import (
    after_trial,
    diagnose_failures,
    enqueue_diagnosed_islands,
)
from autotune.search._reference_keeper import ReferenceKeeper, establish
from autotune.search._rejections import rejection_summary
from autotune.search._space import Space
from autotune.search._trial import TrialStep
from autotune.search._validate import Selection, measure_spread, validation_reserve
from autotune.search._validation_run import validate
from autotune.study.claims import LEASE, holding
from autotune.study.leftovers import requeue_not_run
from autotune.study.reference import ReferenceRecord
from autotune.study.storage import fail_stale, heartbeat
from autotune.study.store import StudyStore
from autotune.study.trials import (
    Rejection,
    TrialRecord,
    role_trials,
)

__all__ = ["EXHAUSTED", "PhasesDone", "run_phases", "space_for"]


def _fix_choices(store: StudyStore, spec: StudySpec, runnable: list[str]) -> list[str]:
    """The precision choices the sampler offers: the spec's modes the study's first device
    runs, stored with the study so every worker and every resumed run offers the same ones."""
    stored = store.precision_choices()
    if stored is not None:
        return stored
    choices = [m for m in spec.space.precisions if m in runnable] or list(spec.space.precisions)
    store.set_precision_choices(choices)
    return cast(list[str], choices)  # precision names, read as plain strings


# Candidates in a row the sampler proposes that were all measured already: the space is
# exhausted (TPE keeps proposing near the best; a few repeats alone are normal).
EXHAUSTED = 12


def _search(
    ctx: SearchContext, store: StudyStore, step: TrialStep, modes: list[str], end_at: float
) -> bool:
    """Phase 3: ask, probe, tell, until the search's share of the budget is spent.

    Returns:
        True when it ended because the space was measured through (exhausted).
    """
    ctx.emit(PhaseStarted(phase=Phase.SEARCH))
    wave_two = False
    while True:
        enqueue_between(ctx, store)  # before the next mode's batches: the leader's first
        if not wave_two:
            wave_two = enqueue_larger_batches(ctx, store, modes, step.refs.record)
        # From what the search measured so far: a new leader's pair may need more.
        reserve = validation_reserve(ctx, store, step.refs.record)
        left = end_at - reserve - ctx.budget.elapsed()
        if (
            left < max(1.0, 0.25 * ctx.typical_probe(), ctx.least_probe())
            and not step.opening_waits
        ):
            logger.info("search phase over: {:.0f}s left for it", max(0.0, left))
            return False
        if step.twins_in_row >= EXHAUSTED:
            # A small space is measured through: asking on only copies measurements (a one-point
            # space would write hundreds of copies a minute until the budget ends).
            logger.info(
                "search phase over: the last {} candidates proposed were all measured already "
                "(the space is exhausted); {:.0f}s of the budget left unspent",
                step.twins_in_row,
                max(0.0, left),
            )
            return True
        ctx.stop_if_asked()
        # Trials whose worker died (no heartbeat) are failed here and retried once.
        fail_stale(store.study)
        trial = store.ask()
        try:
            with heartbeat(store.study, trial):
                step.run(trial, modes, left)
            # A divergence diagnosed now leaves time for the fp32 islands it suggests.
            after_trial(ctx, store, trial, spare=end_at - reserve - ctx.budget.elapsed())
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker failed this trial as stale while it ran (its heartbeats came late
            # on a busy machine) and queued its retry: the retry measures it; this one goes on.
            logger.warning(
                "trial {} was failed as stale by another worker while it ran", trial.number
            )
            continue
        except (KeyboardInterrupt, SearchStopped) as exc:
            TrialRecord(
                outcome=Outcome.INTERRUPTED, reason="stopped before the trial finished"
            ).write(trial)
            store.tell(trial, state=TrialState.FAIL)
            if isinstance(exc, SearchStopped):
                step.retry(trial)
            raise
        except AutotuneError:
            # A storage that refuses writes refuses this one too: the original error is the
            # one to report, and the trial left RUNNING is failed as stale on resume.
            with contextlib.suppress(StorageIOError):
                store.tell(trial, state=TrialState.FAIL)
            raise


@dataclass
class PhasesDone:
    """What the phases leave for writing up: the context and the reference they ran with, and,
    where this worker validated, the config and the selection behind it."""

    ctx: SearchContext
    reference: ReferenceRecord
    validated_by: str = ""
    config: TunedConfig | None = None
    selection: Selection | None = None
    rejected: list[Rejection] = field(default_factory=list)
    # When validation ended: writing the config is counted from here.
    validated_at: float = 0.0
    # The claimed job this worker did (its validation), marked done once the config is stored.
    job: str = ""


def space_for(spec: StudySpec, modes: list[str], facts: WorkerFacts, rule: str) -> Space:
    """The sampler's space over ``modes``, with the workload's base settings and lr rule."""
    return Space.of(
        spec,
        modes,
        rule=rule,
        base_lr=facts.base_lr,
        base_batch=facts.base_batch_size,
        channels_last=facts.channels_last,
    )


def run_phases(ctx: SearchContext, store: StudyStore, rule: str) -> PhasesDone:
    """The phases in order: the hardware and its ceilings, the reference, the trials, then
    validation and the config."""
    # A resumed study first fails what its dead workers left RUNNING (labelled, retried once),
    # even when no time is left for a trial: nothing stays RUNNING after a run.
    fail_stale(store.study)
    requeue_not_run(store)  # what the last run queued and never ran
    modes = check_hardware(ctx, list(ctx.spec.space.precisions))
    # Too short a budget for a reference, a trial and a pair: no ceilings, and the safe pick's
    # pair opens the search (see OPENING_PLAN).
    short = OPENING_LEAST <= ctx.budget.left() < OPENING_PLAN
    with ctx.clock(Phase.CEILINGS):
        find_ceilings(ctx, store, modes, keep=math.inf if short else SAFE_PLAN)
    modes = [m for m in modes if ctx.found.ceilings.get(m, 0) > 0]
    runnable: list[str] = [m for m in ctx.spec.space.precisions if m not in ctx.facts.unsupported]
    choices = _fix_choices(store, ctx.spec, runnable)
    # The sampler's space from here on: the choices fixed with the study, a new context for it.
    ctx = replace(ctx, space=space_for(ctx.spec, choices, ctx.facts, rule))
    refs = ReferenceKeeper(ctx, store)
    opening = opening_picks(ctx, [m for m in choices if m in modes]) if short else []
    reference = establish(ctx, refs, opening)
    for pair in ctx.found.openings:
        ceiling_from_opening(ctx, store, pair.candidate)
    enqueue_base_trials(ctx, store, [m for m in choices if m in modes])
    enqueue_diagnosed_islands(ctx, store, modes)
    end_at = hard_end = ctx.budget.total - WRITE_RESERVE
    with ctx.clock(Phase.SEARCH):
        if _search(ctx, store, TrialStep(ctx, store, refs), modes, end_at):
            # Measured through: validation takes what it needs, and the search ends with
            # its result instead of spending the rest of the budget on tighter intervals
            # (a second round, after every first choice was refused, may use the rest).
            end_at = min(end_at, ctx.budget.elapsed() + validation_reserve(ctx, store, reference))
        measure_spread(ctx, store, reference, refs.measure, end_at)
    return _validate_once(ctx, store, reference, end_at, hard_end)


def _validate_once(
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord,
    end_at: float,
    hard_end: float,
) -> PhasesDone:
    """Validation and the config, by this worker if it is the first of its window to get here."""
    # Validation runs once per budget window, by whichever worker gets there first; the
    # window is read now, from the study: workers that started together may each have
    # opened one, and the last one written is the one they all share.
    window = window_id(store)
    won, validated_by, lost_by = await_validation(
        store, window, wait=max(0.0, ctx.budget.left()), stop=ctx.should_stop
    )
    outcome = PhasesDone(ctx=ctx, reference=reference, validated_by=validated_by)
    if not won:
        logger.info("validation of study {!r} is done by {}", ctx.spec.name, validated_by)
        return outcome
    if lost_by:
        end_at, hard_end = _take_over(ctx, lost_by)
    outcome.job = validation_job(window)
    with holding(store.study, outcome.job):
        wait = min(SETTLE_WAIT, max(0.0, ctx.budget.left() - 1.0))
        settle(store, wait=wait, stop=ctx.should_stop)
        ctx.emit(PhaseStarted(phase=Phase.VALIDATION))
        with ctx.clock(Phase.VALIDATION):
            selection, ref_run, noise = validate(ctx, store, reference, end_at, hard_end=hard_end)
        # The config's word on why fp16 diverged, with what validation left over (before it,
        # the diagnosis took the time validation's pairs were kept for).
        diagnose_failures(ctx, store)
    outcome.validated_at = clock.now()
    trials = store.trials()
    outcome.selection = selection
    # Validation's refusals first: the last word on the candidates the search liked best (cut
    # off behind six groups of the search's, a fallback's summary hid why it fell back).
    outcome.rejected = (selection.rejected if selection else []) + rejection_summary(trials)
    outcome.config = build_config(
        ctx,
        selection=selection,
        reference=reference,
        reference_run=ref_run,
        amp_recipe=role_trials(trials).get(Role.AMP_RECIPE),
        trials=trials,
        rejected=outcome.rejected,
        seed_noise=noise,
        fp16_diagnosis=store.diagnosis(),
    )
    return outcome


def _take_over(ctx: SearchContext, lost_by: str) -> tuple[float, float]:
    """This worker validates in place of one that died holding the claim: with what is left of
    the budget, or a finishing share of it where less is left (the study's measurements are
    not lost to one crash). Returns the new ``(end_at, hard_end)``."""
    ctx.budget.total = max(
        ctx.budget.total, ctx.budget.elapsed() + finishing_seconds(ctx.budget.total)
    )
    logger.warning(
        "validation of study {!r}: {} held it and is gone (or silent past its {:.0f}s lease): this "
        "worker validates, with {:.0f}s",
        ctx.spec.name,
        lost_by,
        LEASE,
        ctx.budget.left(),
    )
    end = ctx.budget.total - WRITE_RESERVE
    return end, end
