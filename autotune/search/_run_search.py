"""The search's entry: the study and its budget window opened, the worker started, the phases
run (:mod:`autotune.search._phases`), the config written up."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger
from optuna.trial import TrialState

from autotune.errors import DeviceError, StorageError
from autotune.execution.facts import WorkerFacts
from autotune.execution.probe_worker import ProbeWorker, Runner
from autotune.execution.runner import StartTooSlow
from autotune.infra import clock
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Phase, Role
from autotune.schema.spec import StudySpec
from autotune.search._artifact import baseline
from autotune.search._budget import (
    OPENING_PLAN,
    Budget,
    BudgetTooShort,
    SearchInterrupted,
    SearchStopped,
    open_window,
)
from autotune.search._context import Gate, SearchContext
from autotune.search._events import EventSink
from autotune.search._phases import PhasesDone, run_phases, space_for
from autotune.search._validate import Selection
from autotune.study.claims import mark_done
from autotune.study.crown import store_config
from autotune.study.leftovers import fail_orphans, fail_ownerless, fail_waiting
from autotune.study.reference import ReferenceRecord
from autotune.study.storage import Storage, open_study
from autotune.study.store import StudyStore
from autotune.study.trials import (
    Rejection,
    role_trials,
)
from autotune.workloads import normalize_reference

__all__ = ["SearchResult", "run_search"]


@dataclass
class SearchResult:
    """What a search produced: the config, where it was written and the study behind it."""

    config: TunedConfig | None
    path: Path | None
    store: StudyStore
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


class _Starting(threading.Thread):
    """The runner's worker, started beside the study's opening, within what the budget leaves
    (a second kept to stop it); a failure shows again, with its reason, on first use, except a
    start the budget ran out in (``too_slow``)."""

    def __init__(self, runner: Runner, within: float | None) -> None:
        super().__init__(daemon=True)
        self.runner, self.within = runner, within
        self.too_slow: StartTooSlow | None = None

    def run(self) -> None:
        try:
            self.runner.start(self.within)
        except StartTooSlow as exc:
            self.too_slow = exc
        except Exception as exc:  # noqa: BLE001 - re-raised by the first real request
            logger.debug("worker start failed ({}); retried on first use", exc)


def _resolve_runner(spec: StudySpec, runner: Runner | None) -> tuple[Runner, bool]:
    if runner is not None:
        return runner, False
    return ProbeWorker(spec.device), True


def run_search(  # noqa: PLR0913 - public API: the search's options, keyword-only
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

    Args:
        spec: the study spec (budget, space, probe lengths, storage...).
        out_dir: where ``best.json`` goes; ``studies/<name>/`` by default.
        runner: runs probes; a :class:`~autotune.execution.probe_worker.ProbeWorker` on the spec's
            device by default (the workload is imported only there, never in this process).
        budget: the clock to count against; starts now by default (the CLI starts it earlier).
        on_event: called with each :data:`Event` as phases, trials and results happen.
        gate: called before each probe with its candidate; may block while the device is busy
            (that time does not count against the budget).
        should_stop: polled before each trial; True stops the search with SearchStopped.
        join: join a study another process started (``autotune worker``): use its budget
            window instead of opening a new one.
        handle_sigint: make Ctrl-C stop cleanly: the probe in flight is stopped, the trial is
            recorded as interrupted (and retried on resume), then SearchInterrupted is raised.
            A second Ctrl-C interrupts at once.
        storage: an opened Optuna storage to use instead of ``spec.storage`` (a simulation
            keeps its study in memory).

    Returns:
        The SearchResult with the TunedConfig and the path it was written to. When another
        worker of the same study validates, ``config`` is what it stored so far (maybe None).

    Raises:
        SpecError, WorkloadError, DeviceError, StorageError: the user's mistake, named.
        SearchInterrupted: Ctrl-C; the trials so far are saved, the same command resumes.
        SearchStopped: ``should_stop`` said so; the interrupted trial is retried on resume.

    Example:
        >>> result = run_search(load_spec("studies/tiny.yaml"), out_dir="out")  # doctest: +SKIP
        >>> result.config.precision, result.config.evidence.speedup  # doctest: +SKIP
        ('bf16', 1.62)
    """
    t0 = clock.now()
    runner, own_runner = _resolve_runner(spec, runner)
    # (A study joined shares its running window, read once the study is open.)
    budget = budget if budget is not None or join else Budget(spec.budget)
    within = budget.left() - 1.0 if budget is not None else None
    store, starting = _open(
        spec, storage, join=join, runner=runner, own_runner=own_runner, within=within
    )
    budget = _window(store, spec, budget, join=join)
    out = Path(out_dir) if out_dir is not None else Path("studies") / spec.name
    interrupted = threading.Event()

    def stop_requested() -> bool:
        return interrupted.is_set() or (should_stop is not None and should_stop())

    try:
        with _sigint_stops(runner, interrupted, enabled=handle_sigint):
            try:
                starting.join()
                if starting.too_slow is not None:
                    raise _start_too_slow(spec, budget, starting.too_slow)
                facts = runner.facts(normalize_reference(spec.workload))
                started_in = clock.now() - t0
                rule = _check_facts(spec, store, budget, facts)
                ctx = SearchContext(
                    spec=spec,
                    runner=runner,
                    budget=budget,
                    facts=facts,
                    space=space_for(spec, list(spec.space.precisions), facts, rule),
                    emit=on_event or (lambda event: None),
                    gate=gate,
                    should_stop=stop_requested,
                )
                ctx.found.spent[Phase.START] = started_in
                outcome = run_phases(ctx, store, rule)
            except (KeyboardInterrupt, SearchStopped) as exc:
                if isinstance(exc, SearchStopped) and not interrupted.is_set():
                    raise
                raise _interrupted(store, spec) from None
    finally:
        if own_runner:
            runner.close()
    return _write_up(store, outcome, out, budget)


def _open(  # noqa: PLR0913 - the opening's inputs, keyword-only
    spec: StudySpec,
    storage: Storage | None,
    *,
    join: bool,
    runner: Runner,
    own_runner: bool,
    within: float | None,
) -> tuple[StudyStore, _Starting]:
    """Open (or join) the study while the runner's worker starts beside it, in ``within``
    seconds at most."""
    # The worker imports torch while the storage opens: the first trial starts sooner.
    starting = _Starting(runner, within)
    starting.start()
    try:
        return StudyStore(open_study(spec, storage, create=not join)), starting
    except BaseException:
        starting.join()
        if own_runner:
            runner.close()
        raise


def _start_too_slow(spec: StudySpec, budget: Budget, exc: StartTooSlow) -> BudgetTooShort:
    """The budget ran out while the worker started: where it went, and the fix."""
    return BudgetTooShort(
        f"study {spec.name!r}: the {budget.total:.0f}s budget ran out while the probe worker "
        f"started (not ready after {exc.seconds:.1f}s; it was stopped): nothing was measured, so "
        f"no config was written; --budget {math.ceil(budget.total + OPENING_PLAN)}s or more "
        "leaves room for the start, a trial and its validation",
        elapsed=budget.elapsed(),
    )


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


def _write_up(store: StudyStore, outcome: PhasesDone, out: Path, budget: Budget) -> SearchResult:
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
        store=store,
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
