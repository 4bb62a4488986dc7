"""The scheduler: one thread per device, each running one queued study at a time."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from autotune.errors import AutotuneError, StorageIOError
from autotune.execution.probe_worker import ProbeWorker
from autotune.infra import clock
from autotune.infra.logs import log_to_file
from autotune.schema.enums import Phase, StudyState
from autotune.schema.spec import Candidate, parse_spec
from autotune.search import (
    Budget,
    CeilingFound,
    Event,
    PhaseStarted,
    SearchStopped,
    TrialFinished,
    TrialStarted,
    run_search,
    settle,
)
from autotune.service._device_monitor import DeviceMonitor
from autotune.service._queue import QueueRow, StudyQueue
from autotune.service._study_run import DeviceRunner, StudyRun, accepts, preemptor
from autotune.study.storage import GRACE_PERIOD, HEARTBEAT_INTERVAL, Storage, stored_study
from autotune.study.store import StudyStore

__all__ = ["DRAIN_GRACE", "Scheduler"]

_POLL = 0.5  # seconds between looks at a busy device or an empty queue
# On SIGTERM the probe in flight gets this long to finish before it is stopped.
DRAIN_GRACE = 10.0
# How long a resumed study waits for its crashed run's trials to go stale (then they are failed
# and re-enqueued): the heartbeat grace period plus one missed beat.
_STALE_WAIT = GRACE_PERIOD + HEARTBEAT_INTERVAL + 1.0
# A ceiling try is never stopped (a stopped try would be stored as a wrong ceiling); it ends by
# its hard limit at the latest: the default probe time limit (120 s) plus the worker's grace.
_DRAIN_JOIN = 150.0
# NVML's utilisation is sampled over up to a second: right after our own probe it is still ours.
_UTIL_WINDOW = 1.5
# Seconds between write attempts while the storage refuses writes (a full disk).
_STORAGE_RETRY = 3.0
# Seconds a "should a queued study of higher priority take this device?" answer is reused.
_PREEMPT_CHECK = 1.0


class Scheduler:
    """Runs queued studies on devices, one thread and one persistent worker per device.

    Args:
        queue: the durable queue.
        monitor: reads the devices.
        storage_url: the study storage every study is stored in.
        out_dir: each study writes ``<out_dir>/<name>/best.json`` and ``service.log``.
        storage: the opened storage (for the stale-trial check of resumed studies).
        workers, poll, observer: see :class:`~autotune.service.SimulatedHardware`; by default
            a warm :class:`~autotune.execution.probe_worker.ProbeWorker` per device, 0.5 s polls, no
            observer.
    """

    def __init__(  # noqa: PLR0913 - its collaborators and knobs, keyword-only, built in one place (TuningService)
        self,
        queue: StudyQueue,
        monitor: DeviceMonitor,
        *,
        storage_url: str,
        out_dir: Path,
        storage: Storage,
        workers: dict[str, Any] | None = None,
        poll: float = _POLL,
        observer: Callable[[str, Event], None] | None = None,
    ) -> None:
        self.queue = queue
        self.monitor = monitor
        self.storage_url = storage_url
        self.out_dir = out_dir
        self.storage = storage
        # Warm: each starts with the service, and loads all a first probe would before any study.
        self.workers = workers or {d: ProbeWorker(d, warm=True) for d in monitor.devices}
        self.poll = poll
        self.observer = observer
        # device → the study running there
        self.runs: dict[str, StudyRun] = {}
        # Cancels of studies taken from the queue but not started yet; guarded by _runs_lock.
        self._cancel_on_start: set[str] = set()
        self._runs_lock = threading.Lock()
        self._draining = threading.Event()
        self._drain_lock = threading.Lock()
        self._drained = False
        self._wake = threading.Condition()
        self._threads: list[threading.Thread] = []
        # device → when our last probe there ended (monotonic seconds)
        self._probe_ended: dict[str, float] = {}

    # ---- control ---------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def start(self) -> None:
        """Start one thread per device."""
        for device in self.monitor.devices:
            self._threads.append(clock.start_thread(self._loop, device, name=f"device-{device}"))

    def wake(self) -> None:
        """Something changed (a submit, a cancel): idle device threads look at the queue now."""
        clock.notify(self._wake)

    def run_of(self, name: str) -> StudyRun | None:
        return next((r for r in list(self.runs.values()) if r.name == name), None)

    def cancel(self, name: str, *, starting: bool = False) -> bool:
        """Stop a running study; False when it is not running here.

        A probe in flight is stopped at once (its trial is recorded as interrupted), except a
        ceiling try: those are short, and stopping one would record a wrong ceiling. With
        ``starting``, a study a device thread has just taken from the queue (and not yet
        started) is cancelled as it starts.
        """
        with self._runs_lock:
            run = self.run_of(name)
            if run is None:
                if starting:
                    self._cancel_on_start.add(name)
                    self.wake()
                return starting
        run.cancel.set()
        if run.probing and run.phase != Phase.CEILINGS:
            self.workers[run.device].interrupt()
        self.wake()
        return True

    def drain(self, grace: float = DRAIN_GRACE) -> None:
        """No new probes; give the ones in flight ``grace`` seconds, stop the rest; join.

        Studies that were running go back to the queue, each with the budget it has left.
        """
        with self._drain_lock:
            if self._drained:
                return
            logger.info("draining: no new trials; the probes in flight finish or are stopped")
            self._drain(grace)
            self._drained = True
            logger.info("drained; the queue and every recorded trial are in the storage")

    def _drain(self, grace: float) -> None:
        self._draining.set()
        self.wake()
        deadline = clock.now() + grace
        for thread in self._threads:
            thread.join(max(0.0, deadline - clock.now()))
        for device, run in list(self.runs.items()):
            if run.phase != Phase.CEILINGS:
                logger.info("draining: stopping the probe of study {!r} on {}", run.name, device)
                self.workers[device].interrupt()
        for thread in self._threads:
            thread.join(_DRAIN_JOIN)
            if thread.is_alive():
                logger.warning("{} did not stop in time; exiting anyway", thread.name)
        for worker in self.workers.values():
            worker.close()

    def own_pids(self) -> set[int]:
        return {os.getpid()} | {w.pid for w in self.workers.values() if w.pid is not None}

    def probing(self, device: str) -> bool:
        """Whether the device's utilisation may be our own: a probe runs, or just ended."""
        run = self.runs.get(device)
        if run is not None and run.probing:
            return True
        return clock.now() - self._probe_ended.get(device, -math.inf) < _UTIL_WINDOW

    # ---- the device loop -------------------------------------------------------------------

    def _idle(self, seconds: float | None = None) -> None:
        clock.wait(self._wake, self.poll if seconds is None else seconds)

    def _loop(self, device: str) -> None:
        try:
            # Pay the worker's start-up (importing torch) now, not in the first study's budget.
            self.workers[device].start()
        except Exception as exc:  # it restarts on the first probe; say why it did not start
            logger.error("the probe worker for {} did not start: {}", device, exc)
        shown_error = ""
        while not self._draining.is_set():
            try:
                if self.monitor.read(device).busy:
                    self._idle()
                    continue
                row = self.queue.take_next(device, lambda r: accepts(device, r.requested_device))
                if row is None:
                    self.queue.adopt_orphans()  # a dead service's studies: taken at the next look
                    self._idle()
                    continue
                self._run(row, device)
            except StorageIOError as exc:  # a full disk: nothing can start until it has room
                if str(exc) != shown_error:
                    logger.warning("device {}: {}; retrying every 5 s", device, exc)
                    shown_error = str(exc)
                self._idle(5.0)
            except Exception:  # a bug or a lost database: log it, keep the device thread alive
                logger.exception("device {}: scheduler error; retrying in 5 s", device)
                self._idle(5.0)

    # ---- one study -------------------------------------------------------------------------

    def _run(self, row: QueueRow, device: str) -> None:
        name = row.name
        try:
            spec = parse_spec(
                {**row.spec, "storage": self.storage_url, "device": device},
                source=f"queued spec of study {name!r}",
            )
        except AutotuneError as exc:
            with self._runs_lock:
                self._cancel_on_start.discard(name)
            error = str(exc)
            self._until_written(lambda: self.queue.finish(name, StudyState.FAILED, error=error))
            return
        # Queue time is not budget: the clock starts now, minus what earlier runs spent.
        budget = Budget(spec.budget, started=clock.now() - row.probe_seconds)
        run = StudyRun(name=name, device=device, spec=spec, budget=budget, priority=row.priority)
        with self._runs_lock:
            self.runs[device] = run
            if name in self._cancel_on_start:
                self._cancel_on_start.discard(name)
                run.cancel.set()
        out = self.out_dir / name
        sink = self._log_sink(out, name)
        try:
            with logger.contextualize(study=name):
                logger.info(
                    "study {!r} starts on {} (run {}, {:.1f}s of its {:.0f}s budget spent)",
                    name,
                    device,
                    row.runs,
                    row.probe_seconds,
                    spec.budget,
                )
                if row.runs > 1:
                    self._settle_stale(run)
                    budget.started = clock.now() - row.probe_seconds
                self._search(run, out)
        finally:
            self.runs.pop(device, None)
            if sink is not None:
                logger.remove(sink)
            self.wake()

    def _search(self, run: StudyRun, out: Path) -> None:
        """Run the study's search; while the storage refuses writes, hold it and resume."""
        while True:
            try:
                self._search_once(run, out)
                return
            except StorageIOError as exc:
                if not self._hold(run, str(exc)):
                    return
                self._settle_stale(run)

    def _search_once(self, run: StudyRun, out: Path) -> None:
        name = run.name
        runner = DeviceRunner(self.workers[run.device], run, self._probe_ended)
        try:
            if run.cancel.is_set() or self._draining.is_set():
                raise SearchStopped(f"study {name!r} was asked to stop before it started")
            result = run_search(
                run.spec,
                out_dir=out,
                runner=runner,
                budget=run.budget,
                on_event=lambda event: self._on_event(run, event),
                gate=lambda cand: self._gate(run, cand),
                should_stop=lambda: self._should_stop(run),
            )
        except SearchStopped:
            self._stopped(run)
            return
        except StorageIOError:
            raise
        except AutotuneError as exc:
            if run.cancel.is_set() or self._draining.is_set() or run.preempted_by is not None:
                # The stop killed the worker under a phase that reports a crash as the
                # workload's fault (the reference): the operator did it, the study goes on.
                logger.info("study {!r} stopped while {}: {}", name, run.phase, exc)
                self._stopped(run)
                return
            logger.error("study {!r} failed: {}", name, exc)
            self.queue.record_progress(name, run.budget.elapsed())
            self.queue.finish(name, StudyState.FAILED, error=str(exc))
            return
        except Exception as exc:  # a bug in autotune: the study fails, the service stays up
            logger.exception("study {!r}: internal error", name)
            self.queue.record_progress(name, run.budget.elapsed())
            error = f"internal error: {type(exc).__name__}: {exc}; see the log"
            self.queue.finish(name, StudyState.FAILED, error=error)
            return
        self.queue.record_progress(name, run.budget.elapsed())
        if result.config is None and result.store.config() is None:
            error = f"validation was claimed by {result.validated_by} and wrote no config"
            self.queue.finish(name, StudyState.FAILED, error=error)
            return
        logger.info("study {!r} done in {:.1f}s of budget", name, run.budget.elapsed())
        self.queue.finish(name, StudyState.DONE)

    def _stopped(self, run: StudyRun) -> None:
        """The search stopped on request: cancelled, or back in the queue (drain, preemption)
        with the budget it has left."""
        name = run.name
        self.queue.record_progress(name, run.budget.elapsed())
        if run.cancel.is_set():
            logger.info("study {!r} cancelled", name)
            self.queue.finish(name, StudyState.CANCELLED)
            return
        why = "the service is draining" if self._draining.is_set() else "preempted"
        if run.preempted_by is not None and not self._draining.is_set():
            why = f"{run.preempted_by!r} (higher priority) takes {run.device}"
        spent = run.budget.elapsed()
        logger.info("study {!r} back in the queue: {} ({:.1f}s spent, kept)", name, why, spent)
        self.queue.requeue(name)

    def _hold(self, run: StudyRun, reason: str) -> bool:
        """The storage refused a write: pause the study, off its budget, until a write succeeds.

        Returns:
            True to resume the search; False when it ended meanwhile (cancelled, or the service
            drains: back in the queue, or left ``running`` for the next start to recover when
            even that write fails).
        """
        logger.warning("study {!r} paused: {}", run.name, reason)
        run.paused, run.phase = reason, "paused"
        run.used_before_wait = run.budget.elapsed()
        try:
            with run.budget.paused():
                while True:
                    what = "cancelling" if run.cancel.is_set() else "paused"
                    run.detail = (
                        f"{what}: {reason}; it goes on by itself once the storage can be written "
                        f"again (tried every {_STORAGE_RETRY:g}s)"
                    )
                    self._idle(_STORAGE_RETRY)
                    try:
                        if self._draining.is_set() and not run.cancel.is_set():
                            with contextlib.suppress(StorageIOError):
                                self.queue.requeue(run.name)
                            return False
                        if run.cancel.is_set():
                            self.queue.finish(run.name, StudyState.CANCELLED)
                            logger.info("study {!r} cancelled while paused", run.name)
                            return False
                        self.queue.record_progress(run.name, run.budget.elapsed())
                    except StorageIOError as exc:
                        reason = str(exc)
                        if self._draining.is_set():
                            return False
                        continue
                    logger.info("study {!r}: the storage takes writes again; resuming", run.name)
                    return True
        finally:
            run.paused = None
            run.used_before_wait = None

    def _until_written(self, write: Callable[[], None]) -> None:
        """Retry a queue write the storage refuses until it succeeds (or the service drains:
        the next start recovers the row)."""
        while True:
            try:
                write()
                return
            except StorageIOError as exc:
                logger.warning("{}; retrying in {:g}s", exc, _STORAGE_RETRY)
                if self._draining.is_set():
                    return
                self._idle(_STORAGE_RETRY)

    def _should_stop(self, run: StudyRun) -> bool:
        """Polled before each trial and probe: a cancel, a drain, or a preemption."""
        return run.cancel.is_set() or self._draining.is_set() or self._preempted(run)

    def _preempted(self, run: StudyRun) -> bool:
        """Whether a queued study of higher priority takes this device now, asked of the queue at
        most once a second (see :func:`~autotune.service._study_run.preemptor`)."""
        if run.phase != Phase.SEARCH:
            return False
        now = clock.now()
        if now - run.preempt_checked >= _PREEMPT_CHECK:
            run.preempt_checked = now
            with contextlib.suppress(StorageIOError):
                run.preempted_by = preemptor(
                    run,
                    self.queue.rows(),
                    self.monitor.devices,
                    lambda d: (
                        d not in self.runs and not self.monitor.read(d, max_age=_PREEMPT_CHECK).busy
                    ),
                )
        return run.preempted_by is not None

    def _log_sink(self, out: Path, name: str) -> int | None:
        """Every log line of this study, also in ``<out>/service.log``."""
        try:
            return log_to_file(
                out / "service.log", filter=lambda r: r["extra"].get("study") == name
            )
        except OSError as exc:
            logger.warning("study {!r}: no log file in {}: {}", name, out, exc)
            return None

    def _settle_stale(self, run: StudyRun) -> None:
        """Before resuming after a crash: wait until the crashed run's trials are stale, then
        fail them (each is re-enqueued once), so none stays RUNNING."""

        def waiting(count: int) -> None:
            run.detail = (
                f"resuming: waiting up to {GRACE_PERIOD}s for {count} trial(s) of the "
                "interrupted run to go stale, to fail and retry them"
            )

        try:
            study = stored_study(self.storage, run.name)
            if study is None:  # never started a search: nothing in flight
                return
            running = settle(
                StudyStore(study),
                wait=_STALE_WAIT,
                stop=lambda: run.cancel.is_set() or self._draining.is_set(),
                on_wait=waiting,
                poll=self.poll,
            )
        except Exception as exc:  # the search's own stale check runs before each trial anyway
            logger.warning("study {!r}: stale-trial check failed: {}", run.name, exc)
            return
        if running:
            logger.warning(
                "study {!r}: trials {} still RUNNING (another worker may hold them)",
                run.name,
                running,
            )

    # ---- hooks into the search -------------------------------------------------------------

    def _on_event(self, run: StudyRun, event: Event) -> None:
        if self.observer is not None:
            self.observer(run.name, event)
        if isinstance(event, PhaseStarted):
            run.phase = event.phase
            mode = f" ({event.mode})" if event.mode else ""
            run.detail = f"running on {run.device}: {run.phase} phase{mode}"
        elif isinstance(event, CeilingFound):
            for t in event.ceiling.tries:
                if t.peak_memory:
                    run.peaks.append((event.mode, t.batch_size, t.peak_memory))
        elif isinstance(event, TrialStarted):
            cand = event.candidate
            run.detail = (
                f"running on {run.device}: {run.phase} phase, trial {event.number} "
                f"({cand.precision} bs={cand.batch_size})"
            )
        elif isinstance(event, TrialFinished):
            self.queue.record_progress(run.name, run.budget.elapsed())

    def _gate(self, run: StudyRun, cand: Candidate) -> None:
        """Called before every probe: wait (off the budget) until the device has room."""
        self.queue.record_progress(run.name, run.budget.elapsed())
        need = run.memory_need(cand, self.storage)
        shown, before = "", run.detail
        # The search pauses its clock around this call; the status shows the budget standing still.
        run.used_before_wait = run.budget.elapsed()
        try:
            while True:
                if self._should_stop(run):
                    raise SearchStopped(f"study {run.name!r} was asked to stop")
                why = self.monitor.room_for(run.device, need, run.spec.memory_margin)
                if not why:
                    if shown:
                        logger.info("study {!r}: {} has room again", run.name, run.device)
                        run.detail = before
                    return
                if why != shown:
                    logger.info("study {!r} waits: {}", run.name, why)
                    shown = why
                run.detail = f"waiting: {why}"
                self._idle()
        finally:
            run.used_before_wait = None
