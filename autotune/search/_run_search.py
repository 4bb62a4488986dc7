"""The search, phase by phase, inside one wall-clock budget (the face is :func:`run_search`)."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune.errors import AutotuneError, DeviceError, StorageError, StorageIOError
from autotune.execution.facts import WorkerFacts
from autotune.execution.probe_worker import ProbeWorker, Runner
from autotune.infra import clock
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Outcome, Phase, Role
from autotune.schema.spec import StudySpec
from autotune.search._artifact import baseline, build_config
from autotune.search._budget import (
    OPENING_LEAST,
    OPENING_PLAN,
    SAFE_PLAN,
    WRITE_RESERVE,
    Budget,
    SearchInterrupted,
    SearchStopped,
    finishing_seconds,
    open_window,
    window_id,
)
from autotune.search._context import Gate, SearchContext
from autotune.search._coordination import (
    SETTLE_WAIT,
    await_validation,
    settle,
    validation_job,
)
from autotune.search._events import EventSink, PhaseStarted
from autotune.search._first_trials import (
    enqueue_base_trials,
    enqueue_between,
    enqueue_larger_batches,
    safe_pick,
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
from autotune.study.claims import LEASE, holding, mark_done
from autotune.study.crown import store_config
from autotune.study.leftovers import fail_orphans, fail_ownerless, fail_waiting, requeue_not_run
from autotune.study.reference import ReferenceRecord
from autotune.study.storage import Storage, fail_stale, heartbeat, open_study
from autotune.study.store import StudyStore
from autotune.study.trials import (
    Rejection,
    TrialRecord,
    role_trials,
)
from autotune.workloads import normalize_reference

__all__ = ["SearchResult", "run_search"]


@dataclass
class SearchResult:
    """What a search produced: the config, where it was written and the study behind it."""

    config: TunedConfig | None
    path: Path | None
    study: optuna.Study
    reference: ReferenceRecord | None
    baselines: dict[str, dict[str, Any]]
    rejected: list[Rejection]
    cut: dict[str, str]
    ceilings: dict[str, int]
    elapsed: float
    # Who validated: this process, or another worker of the same study.
    validated_by: str = ""
    selection: Selection | None = field(default=None, repr=False)
    # Where the job's time went, by phase: start (worker and facts), ceilings, reference,
    # trials, diagnosis, validation, writing.
    spent: dict[str, float] = field(default_factory=dict)
    # Cores other processes kept busy on average while it ran (None: not measured).
    others_cores: float | None = None


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


def _start_quietly(runner: Runner) -> None:
    """Start the runner's worker; a failure here shows again, with its reason, on first use."""
    try:
        runner.start()
    except Exception as exc:  # noqa: BLE001 - re-raised by the first real request
        logger.debug("worker start failed ({}); retried on first use", exc)


def _resolve_runner(spec: StudySpec, runner: Runner | None) -> tuple[Runner, bool]:
    if runner is not None:
        return runner, False
    return ProbeWorker(spec.device), True


@dataclass
class _Outcome:
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


def run_search(  # noqa: PLR0913 - the face's keyword options (autotune.search.run_search)
    spec: StudySpec,
    *,
    out_dir: str | Path | None = None,
    runner: Runner | None = None,
    budget: Budget | None = None,
    on_event: EventSink | None = None,
    gate: Gate | None = None,
    should_stop: Callable[[], bool] | None = None,
    join: bool = False,
    handle_sigint: bool = False,
    storage: Storage | None = None,
) -> SearchResult:
    """Search a spec's space within its budget and write the validated config.

    See :func:`autotune.search.run_search` for the arguments.
    """
    t0 = clock.now()
    runner, own_runner = _resolve_runner(spec, runner)
    store, starting = _open(spec, storage, join=join, runner=runner, own_runner=own_runner)
    budget = _window(store, spec, budget, join=join)
    out = Path(out_dir) if out_dir is not None else Path("studies") / spec.name
    interrupted = threading.Event()

    def stop_requested() -> bool:
        return interrupted.is_set() or (should_stop is not None and should_stop())

    try:
        with _sigint_stops(runner, interrupted, enabled=handle_sigint):
            try:
                starting.join()
                facts = runner.facts(normalize_reference(spec.workload))
                started_in = clock.now() - t0
                rule = _check_facts(spec, store, budget, facts)
                ctx = SearchContext(
                    spec=spec,
                    runner=runner,
                    budget=budget,
                    facts=facts,
                    space=_space(spec, list(spec.space.precisions), facts, rule),
                    emit=on_event or (lambda event: None),
                    gate=gate,
                    should_stop=stop_requested,
                )
                ctx.found.spent[Phase.START] = started_in
                outcome = _run_phases(ctx, store, rule)
            except (KeyboardInterrupt, SearchStopped) as exc:
                if isinstance(exc, SearchStopped) and not interrupted.is_set():
                    raise
                raise _interrupted(store, spec) from None
    finally:
        if own_runner:
            runner.close()
    return _write_up(store, outcome, out, budget)


def _open(
    spec: StudySpec,
    storage: Storage | None,
    *,
    join: bool,
    runner: Runner,
    own_runner: bool,
) -> tuple[StudyStore, threading.Thread]:
    """Open (or join) the study while the runner's worker starts beside it."""
    # The worker imports torch while the storage opens: the first trial starts sooner.
    starting = threading.Thread(target=_start_quietly, args=(runner,), daemon=True)
    starting.start()
    try:
        return StudyStore(open_study(spec, storage, create=not join)), starting
    except BaseException:
        starting.join()
        if own_runner:
            runner.close()
        raise


def _window(store: StudyStore, spec: StudySpec, budget: Budget | None, *, join: bool) -> Budget:
    """The budget window: the running search's when joining, else a new one, opened now."""
    if not join:
        budget = budget or Budget(spec.budget)
        open_window(store, budget)
        return budget
    shared = Budget.shared(store)
    if shared is None:
        raise StorageError(
            f"study {spec.name!r} has no running search to join; start one with "
            f"`autotune search ... --storage <url>` first"
        )
    return shared


@contextlib.contextmanager
def _sigint_stops(runner: Runner, interrupted: threading.Event, *, enabled: bool) -> Iterator[None]:
    """While inside, a first Ctrl-C stops the probe in flight and asks the search to stop; a
    second one interrupts at once. Only the main thread can take signals."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        runner.interrupt()

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_handler)


def _interrupted(store: StudyStore, spec: StudySpec) -> SearchInterrupted:
    done = len(store.trials((TrialState.COMPLETE, TrialState.PRUNED)))
    return SearchInterrupted(
        f"interrupted: {done} finished trials of study {spec.name!r} are saved in its storage; "
        "run the same command again to resume"
    )


def _check_facts(spec: StudySpec, store: StudyStore, budget: Budget, facts: WorkerFacts) -> str:
    """Log what the search starts with; refuse a device that cannot run the fp32 reference.

    Returns:
        The lr scaling rule: the spec's, or the workload's own where the spec says ``auto``.
    """
    logger.info(
        "study {!r}: workload {} on {}, budget {:.0f}s ({:.0f}s left), {} trials stored",
        spec.name,
        facts.workload,
        facts.device,
        budget.total,
        budget.left(),
        len(store.trials()),
    )
    if "fp32" in facts.unsupported:
        raise DeviceError(
            f"device {facts.device} cannot run the fp32 reference: {facts.unsupported['fp32']}"
        )
    return facts.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling


def _space(spec: StudySpec, modes: list[str], facts: WorkerFacts, rule: str) -> Space:
    return Space.of(
        spec,
        modes,
        rule=rule,
        base_lr=facts.base_lr,
        base_batch=facts.base_batch_size,
        channels_last=facts.channels_last,
    )


def _run_phases(ctx: SearchContext, store: StudyStore, rule: str) -> _Outcome:
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
    ctx = replace(ctx, space=_space(ctx.spec, choices, ctx.facts, rule))
    refs = ReferenceKeeper(ctx, store)
    opening = safe_pick(ctx, [m for m in choices if m in modes]) if short else None
    reference = establish(ctx, refs, opening)
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
) -> _Outcome:
    """Validation and the config, by this worker if it is the first of its window to get here."""
    # Validation runs once per budget window, by whichever worker gets there first; the
    # window is read now, from the study: workers that started together may each have
    # opened one, and the last one written is the one they all share.
    window = window_id(store)
    won, validated_by, lost_by = await_validation(
        store, window, wait=max(0.0, ctx.budget.left()), stop=ctx.should_stop
    )
    outcome = _Outcome(ctx=ctx, reference=reference, validated_by=validated_by)
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
    outcome.rejected = rejection_summary(trials) + (selection.rejected if selection else [])
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


def _write_up(store: StudyStore, outcome: _Outcome, out: Path, budget: Budget) -> SearchResult:
    """Write the config this worker validated (or read the one stored), tidy the study, and
    say where the time went."""
    written_from = outcome.validated_at if outcome.config is not None else clock.now()
    path, config = None, outcome.config
    if config is not None:
        path = config.save(out / "best.json")
        store.set_best_config_path(path)
        store_config(store.study, config)
        if outcome.job:
            mark_done(store.study, outcome.job)
        logger.info(
            "wrote {} after {:.1f}s of a {:.0f}s budget", path, budget.elapsed(), budget.total
        )
    else:
        config = store.config()
    # Nothing of this search runs any more: what it left RUNNING (a refused write), and what
    # nobody owns (a start cut off by a full disk), is failed with its reason and retried.
    fail_waiting(store)  # what it queued and never ran: nothing stays WAITING either
    for number in fail_orphans(store) + fail_ownerless(store):
        logger.warning("trial {} was left running: failed, and retried", number)
    ctx = outcome.ctx
    spent = {**ctx.found.spent, Phase.WRITING: clock.now() - written_from}
    logger.info("time spent: {}", ", ".join(f"{k} {v:.1f}s" for k, v in spent.items()))
    roles = role_trials(store.trials())
    return SearchResult(
        config=config,
        path=path,
        study=store.study,
        reference=outcome.reference,
        baselines={Role.AMP_RECIPE: baseline(roles.get(Role.AMP_RECIPE))},
        rejected=outcome.rejected,
        cut=ctx.found.cut,
        ceilings=ctx.found.ceilings,
        elapsed=budget.elapsed(),
        validated_by=outcome.validated_by,
        selection=outcome.selection,
        spent=spent,
        others_cores=ctx.found.contention.report(),
    )
