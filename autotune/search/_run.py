"""The search, phase by phase, inside one wall-clock budget (the face is :func:`run_search`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune import clock
from autotune.config import TunedConfig
from autotune.crown import store_config, stored_config
from autotune.errors import AutotuneError, DeviceError, StorageError, StorageIOError
from autotune.parity import parity_gap
from autotune.reference import ReferenceRecord
from autotune.result import PairedResult
from autotune.search._artifact import baseline, build_config
from autotune.search._budget import (
    WRITE_RESERVE,
    Budget,
    SearchInterrupted,
    SearchStopped,
    open_window,
    window_id,
)
from autotune.search._context import Gate, SearchContext
from autotune.search._coordination import (
    SETTLE_WAIT,
    claim_validation,
    fail_orphans,
    fail_ownerless,
    fail_waiting,
    requeue_not_run,
    settle,
)
from autotune.search._events import EventSink, PhaseStarted
from autotune.search._hardware import check_hardware, find_ceilings
from autotune.search._knobs import (
    DIAGNOSIS_KEY,
    after_trial,
    diagnose_failures,
    enqueue_diagnosed_islands,
)
from autotune.search._reference import ReferenceKeeper, ReferenceUnavailable
from autotune.search._space import Space
from autotune.search._trial import TrialStep
from autotune.search._validate import (
    Rerun,
    Selection,
    rejection_summary,
    select,
    shortlist,
    validation_reserve,
    with_gap,
)
from autotune.spec import StudySpec
from autotune.storage import fail_stale, heartbeat, open_study
from autotune.trials import (
    ROLE_AMP,
    Rejection,
    TrialRecord,
    at_base_role,
    candidate,
    role_trials,
)
from autotune.worker import ProbeWorker, Runner
from autotune.workloads import normalize_reference

__all__ = ["SearchResult", "run_search"]

_CHOICES = "precision_choices"
# Each arm of a validation pair measures for about this share of the pair's slice.
_PAIR_SHARE = 0.3


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


def _fix_choices(study: optuna.Study, spec: StudySpec, runnable: list[str]) -> list[str]:
    """The precision choices the sampler offers: the spec's modes the study's first device
    runs, stored with the study so every worker and every resumed run offers the same ones."""
    stored = study.user_attrs.get(_CHOICES)
    if isinstance(stored, list) and stored:
        return [str(m) for m in stored]
    choices = [m for m in spec.space.precisions if m in runnable] or list(spec.space.precisions)
    study.set_user_attr(_CHOICES, choices)
    return cast(list[str], choices)  # precision names, read as plain strings


def _enqueue_first_trials(ctx: SearchContext, study: optuna.Study, modes: list[str]) -> None:
    """Informed first trials, before the sampler's own:

    1. each searched mode at the reference's own settings (the plain AMP recipe for fp16:
       GradScaler's defaults): the same curve, only faster or not;
    2. each mode at the next batch of the ladder above the base, lr by the rule: the nearest
       larger batch, whose loss curve stays closest to the reference's — on a small model, or
       on a CPU, where the speed usually is, while larger batches fail the parity check;
    3. each mode at the largest batch of the ladder that fits (its ceiling), lr by the rule:
       on most GPUs the fastest point of a mode, and what its ceiling tries already hint.
    """
    base = ctx.space.base_batch
    for mode in modes:
        if mode != "fp32":  # fp32 at base is the reference itself: measured, never twice
            role = ROLE_AMP if mode == "fp16" else at_base_role(mode)
            study.enqueue_trial(
                ctx.space.params(mode, base),
                user_attrs=TrialRecord(role=role).to_attrs(),
                skip_if_exists=True,
            )
    fitting = {m: [b for b in ctx.space.ladder if b <= ctx.ceilings.get(m, 0)] for m in modes}
    near = {m: next((b for b in fitting[m] if b > base), None) for m in modes}
    ceiling = {m: max(fitting[m]) if fitting[m] else None for m in modes}
    for batches in (near, ceiling):
        for mode in modes:
            batch = batches[mode]
            if batch is not None and batch != base:
                study.enqueue_trial(ctx.space.params(mode, batch), skip_if_exists=True)


# Candidates in a row the sampler proposes that were all measured already: the space is
# exhausted (TPE keeps proposing near the best; a few repeats alone are normal).
EXHAUSTED = 12


def _search(
    ctx: SearchContext, study: optuna.Study, step: TrialStep, modes: list[str], end_at: float
) -> bool:
    """Phase 3: ask, probe, tell, until the search's share of the budget is spent.

    Returns:
        True when it ended because the space was measured through (exhausted).
    """
    ctx.emit(PhaseStarted(phase="search"))
    reserve, reserved_at = validation_reserve(ctx, study), 0
    while True:
        if len(ctx.trial_seconds) - reserved_at >= 5:
            # Reading the whole study costs: the reserve is recomputed every few trials.
            reserve, reserved_at = validation_reserve(ctx, study), len(ctx.trial_seconds)
        left = end_at - reserve - ctx.budget.elapsed()
        if left < max(1.0, 0.25 * ctx.typical_probe()):
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
        fail_stale(study)
        trial = study.ask()
        try:
            with heartbeat(study, trial):
                step.run(trial, modes, left)
            # A divergence diagnosed now leaves time for the fp32 islands it suggests.
            after_trial(ctx, study, trial, spare=end_at - reserve - ctx.budget.elapsed())
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker failed this trial as stale while it ran (its heartbeats came late
            # on a busy machine) and queued its retry: the retry measures it; this one goes on.
            logger.warning(
                "trial {} was failed as stale by another worker while it ran", trial.number
            )
            continue
        except (KeyboardInterrupt, SearchStopped) as exc:
            TrialRecord(outcome="interrupted", reason="stopped before the trial finished").write(
                trial
            )
            study.tell(trial, state=TrialState.FAIL)
            if isinstance(exc, SearchStopped):
                step.retry(trial)
            raise
        except AutotuneError:
            # A storage that refuses writes refuses this one too: the original error is the
            # one to report, and the trial left RUNNING is failed as stale on resume.
            with contextlib.suppress(StorageIOError):
                study.tell(trial, state=TrialState.FAIL)
            raise


def _validate(
    ctx: SearchContext, study: optuna.Study, reference: ReferenceRecord, end_at: float
) -> tuple[Selection | None, PairedResult | None, float]:
    """Phase 4: paired reruns of the shortlist, then the selection.

    Returns:
        ``(selection, reference_run, seed_noise)``; selection None when nothing was worth
        validating.
    """
    spec, val = ctx.spec, ctx.spec.validation
    picked = shortlist(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
        top_k=val.top_k,
        min_speedup=val.min_speedup,
        parity_tolerance=spec.parity_tolerance,
        maximize=ctx.maximize,
    )
    if not picked:
        return None, None, 0.0
    settings = spec.probe.model_copy(update={"steps": val.steps, "seed": spec.probe.seed + 1})
    reruns: list[Rerun] = []
    for i, trial in enumerate(picked):
        left = end_at - ctx.budget.elapsed()
        if left < 1.0:
            reruns.append(Rerun(trial, None))
            continue
        # Each candidate gets an equal share of what is left; a pair cut short by its share is
        # still compared, on the blocks and samples both arms saw.
        share = left / (len(picked) - i)
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
        reruns.append(with_gap(Rerun(trial, paired)))
    ref_run = next(
        (
            r.paired
            for r in reruns
            if r.paired is not None and r.paired.reference.ok and r.paired.reference.throughput > 0
        ),
        None,
    )
    # A fresh seed moves a loss curve by itself: the reference's two curves (search and
    # validation seeds) measure by how much, and a candidate is allowed that much on top.
    noise = 0.0
    if ref_run is not None and reference.finite_losses:
        r = ref_run.reference
        seed_gap = parity_gap(r.losses, r.batch_size, reference.finite_losses, reference.batch_size)
        noise = min(abs(seed_gap[0]), spec.parity_tolerance) if seed_gap else 0.0
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


def run_search(
    spec: StudySpec,
    *,
    out_dir: str | Path | None = None,
    runner: Runner | None = None,
    budget: Budget | None = None,
    on_event: EventSink | None = None,
    gate: Gate | None = None,
    should_stop: Any = None,
    join: bool = False,
    handle_sigint: bool = False,
    storage: optuna.storages.BaseStorage | None = None,
) -> SearchResult:
    """Search a spec's space within its budget and write the validated config.

    See :func:`autotune.search.run_search` for the arguments.
    """
    t0 = clock.now()
    runner, own_runner = _resolve_runner(spec, runner)
    # The worker imports torch while the storage opens: the first trial starts sooner.
    starting = threading.Thread(target=_start_quietly, args=(runner,), daemon=True)
    starting.start()
    try:
        study = open_study(spec, storage, create=not join)
    except BaseException:
        starting.join()
        if own_runner:
            runner.close()
        raise
    if join:
        budget = Budget.shared(study)
        if budget is None:
            raise StorageError(
                f"study {spec.name!r} has no running search to join; start one with "
                f"`autotune search ... --storage <url>` first"
            )
    else:
        budget = budget or Budget(spec.budget)
        open_window(study, budget)
    out = Path(out_dir) if out_dir is not None else Path("studies") / spec.name
    interrupted = threading.Event()

    def stop_requested() -> bool:
        return interrupted.is_set() or (should_stop is not None and should_stop())

    previous_handler = None
    if handle_sigint and threading.current_thread() is threading.main_thread():

        def on_sigint(signum: int, frame: Any) -> None:
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()
            runner.interrupt()

        previous_handler = signal.signal(signal.SIGINT, on_sigint)
    ctx: SearchContext | None = None
    validated_by, config, selection, reference = "", None, None, None
    w0 = clock.now()
    rejected: list[Rejection] = []
    try:
        starting.join()
        facts = runner.facts(normalize_reference(spec.workload))
        started_in = clock.now() - t0
        rule = facts.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
        logger.info(
            "study {!r}: workload {} on {}, budget {:.0f}s ({:.0f}s left), {} trials stored",
            spec.name,
            facts.workload,
            facts.device,
            budget.total,
            budget.left(),
            len(study.trials),
        )
        runnable: list[str] = [m for m in spec.space.precisions if m not in facts.unsupported]
        if "fp32" in facts.unsupported:
            raise DeviceError(
                f"device {facts.device} cannot run the fp32 reference: {facts.unsupported['fp32']}"
            )
        ctx = SearchContext(
            spec=spec,
            runner=runner,
            budget=budget,
            facts=facts,
            space=Space.of(
                spec,
                list(spec.space.precisions),
                rule=rule,
                base_lr=facts.base_lr,
                base_batch=facts.base_batch_size,
                channels_last=facts.channels_last,
            ),
            emit=on_event or (lambda event: None),
            gate=gate,
            should_stop=stop_requested,
        )
        ctx.spent["start"] = started_in
        # A resumed study first fails what its dead workers left RUNNING (labelled, retried once),
        # even when no time is left for a trial: nothing stays RUNNING after a run.
        fail_stale(study)
        requeue_not_run(study)  # what the last run queued and never ran
        modes = check_hardware(ctx, list(spec.space.precisions))
        with ctx.clock("ceilings"):
            find_ceilings(ctx, study, modes)
        modes = [m for m in modes if ctx.ceilings.get(m, 0) > 0]
        choices = _fix_choices(study, spec, runnable)
        ctx.space = Space.of(
            spec,
            choices,
            rule=rule,
            base_lr=facts.base_lr,
            base_batch=facts.base_batch_size,
            channels_last=facts.channels_last,
        )
        refs = ReferenceKeeper(ctx, study)
        try:
            with ctx.clock("reference"):
                reference = refs.establish()
        except ReferenceUnavailable as exc:
            # A drain, a cancel or a preemption stops the worker under the reference: that is
            # the operator's doing, not the workload's.
            ctx.stop_if_asked()
            raise DeviceError(
                f"study {spec.name!r}: {exc} at batch_size={ctx.space.base_batch}; the search "
                "needs it as the baseline — check the workload runs in fp32 on "
                f"{facts.device} (autotune probe --workload {facts.workload} --device "
                f"{facts.device})"
            ) from None
        _enqueue_first_trials(ctx, study, [m for m in choices if m in modes])
        enqueue_diagnosed_islands(ctx, study, modes)
        end_at = budget.total - WRITE_RESERVE
        with ctx.clock("trials"):
            if _search(ctx, study, TrialStep(ctx, study, refs), modes, end_at):
                # Measured through: validation takes what it needs, and the search ends with
                # its result instead of spending the rest of the budget on tighter intervals.
                end_at = min(end_at, budget.elapsed() + validation_reserve(ctx, study))
        # Validation runs once per budget window, by whichever worker gets there first; the
        # window is read now, from the study: workers that started together may each have
        # opened one, and the last one written is the one they all share.
        won, validated_by = claim_validation(study, window_id(study))
        if won:
            settle(study, wait=min(SETTLE_WAIT, max(0.0, budget.left() - 1.0)), stop=stop_requested)
            ctx.emit(PhaseStarted(phase="validation"))
            diagnose_failures(ctx, study)
            with ctx.clock("validation"):
                selection, ref_run, noise = _validate(ctx, study, reference, end_at)
            w0 = clock.now()
            trials = study.get_trials(deepcopy=False)
            rejected = rejection_summary(trials) + (selection.rejected if selection else [])
            config = build_config(
                spec,
                facts,
                rule=rule,
                selection=selection,
                reference=reference,
                reference_run=ref_run,
                amp_recipe=role_trials(trials).get(ROLE_AMP),
                trials=trials,
                rejected=rejected,
                cut=ctx.cut,
                ceilings=ctx.ceilings,
                seed_noise=noise,
                fp16_diagnosis=study.user_attrs.get(DIAGNOSIS_KEY),
            )
        else:
            logger.info("validation of study {!r} is done by {}", spec.name, validated_by)
    except (KeyboardInterrupt, SearchStopped) as exc:
        if isinstance(exc, SearchStopped) and not interrupted.is_set():
            raise
        done = len(
            study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        )
        raise SearchInterrupted(
            f"interrupted: {done} finished trials of study {spec.name!r} are saved in its storage; "
            "run the same command again to resume"
        ) from None
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
        if own_runner:
            runner.close()
    path = None
    if config is None:
        w0 = clock.now()
    if config is not None:
        path = config.save(out / "best.json")
        study.set_user_attr("best_config", str(path))
        store_config(study, config)
        logger.info(
            "wrote {} after {:.1f}s of a {:.0f}s budget", path, budget.elapsed(), budget.total
        )
    else:
        config = stored_config(study)
    # Nothing of this search runs any more: what it left RUNNING (a refused write), and what
    # nobody owns (a start cut off by a full disk), is failed with its reason and retried.
    fail_waiting(study)  # what it queued and never ran: nothing stays WAITING either
    for number in fail_orphans(study) + fail_ownerless(study):
        logger.warning("trial {} was left running: failed, and retried", number)
    spent = dict(ctx.spent) if ctx is not None else {}
    spent["writing"] = clock.now() - w0
    if ctx is not None:
        study.set_user_attr("time_spent", {k: round(v, 3) for k, v in spent.items()})
        logger.info(
            "time spent: {}",
            ", ".join(f"{k} {v:.1f}s" for k, v in spent.items()),
        )
    trials = study.get_trials(deepcopy=False)
    roles = role_trials(trials)
    return SearchResult(
        config=config,
        path=path,
        study=study,
        reference=reference,
        baselines={"amp_recipe": baseline(roles.get(ROLE_AMP))},
        rejected=rejected,
        cut=ctx.cut if ctx else {},
        ceilings=ctx.ceilings if ctx else {},
        elapsed=budget.elapsed(),
        validated_by=validated_by,
        selection=selection,
        spent=spent,
    )
