"""The search: an Optuna study over precision, batch size, learning rate, init_scale and the
knobs a spec turns on, a private module per phase behind one face, :func:`run_search`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.execution.probe_worker import Runner
from autotune.schema.spec import StudySpec
from autotune.search._budget import Budget, SearchInterrupted, SearchStopped, finishing_seconds
from autotune.search._context import Gate
from autotune.search._coordination import settle
from autotune.search._events import (
    CeilingFound,
    Event,
    EventSink,
    HardwareChecked,
    PhaseStarted,
    Standing,
    TrialFinished,
    TrialStarted,
)
from autotune.search._run_search import SearchResult
from autotune.search._run_search import run_search as _run_search
from autotune.search._space import batch_ladder, lr_for, reference_factor
from autotune.study.storage import Storage

__all__ = [
    "Budget",
    "CeilingFound",
    "Event",
    "EventSink",
    "Gate",
    "HardwareChecked",
    "PhaseStarted",
    "SearchInterrupted",
    "SearchResult",
    "SearchStopped",
    "Standing",
    "TrialFinished",
    "TrialStarted",
    "batch_ladder",
    "finishing_seconds",
    "lr_for",
    "reference_factor",
    "run_search",
    "settle",
]


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
    return _run_search(
        spec,
        out_dir=out_dir,
        runner=runner,
        budget=budget,
        on_event=on_event,
        gate=gate,
        should_stop=should_stop,
        join=join,
        handle_sigint=handle_sigint,
        storage=storage,
    )
