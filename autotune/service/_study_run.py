"""A study running on a device: its state as the API sees it, and the device's worker as one
study sees it."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from optuna.trial import TrialState

from autotune.execution.facts import WorkerFacts
from autotune.execution.messages import CompareRequest, DiagnoseRequest, ProbeRequest
from autotune.execution.runner import Runner
from autotune.infra import clock
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.enums import StudyState
from autotune.schema.spec import Candidate, StudySpec
from autotune.search import Budget
from autotune.service._queue import QueueRow
from autotune.study.storage import Storage, stored_study
from autotune.study.store import StudyStore
from autotune.study.trials import record

__all__ = ["DeviceRunner", "StudyRun", "accepts", "preemptor"]


def accepts(device: str, requested: str) -> bool:
    """Whether a study asking for device ``requested`` may run on ``device``.

    Example:
        >>> accepts("cuda:1", "cuda"), accepts("cpu", "cuda:0"), accepts("cpu", "auto")
        (True, False, True)
    """
    if requested == "auto":
        return True
    if requested == "cuda":
        return device.startswith("cuda")
    return requested == device


def preemptor(
    run: StudyRun, rows: list[QueueRow], devices: list[str], is_free: Callable[[str], bool]
) -> str | None:
    """The queued study that should take ``run``'s device, if any.

    The first queued study (in queue order) of higher priority that may run there, unless
    another device that may run it is free: then it goes there, and nobody is stopped.
    """
    waiting = [
        r
        for r in rows
        if r.state == StudyState.QUEUED
        and r.priority > run.priority
        and accepts(run.device, r.requested_device)
    ]
    if not waiting:
        return None
    first = waiting[0]
    if any(d != run.device and accepts(d, first.requested_device) and is_free(d) for d in devices):
        return None
    return first.name


@dataclass
class StudyRun:
    """A study running on a device, as the API sees it."""

    name: str
    device: str
    spec: StudySpec
    budget: Budget
    priority: int = 0
    phase: str = "starting"
    detail: str = "starting"
    probing: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    # (precision, batch size, peak bytes) measured by ceiling tries: the memory a probe needs.
    peaks: list[tuple[str, int, int]] = field(default_factory=list)
    store: StudyStore | None = None
    # Budget spent when the current wait for the device began; None when not waiting.
    used_before_wait: float | None = None
    # Why the study is paused (the storage failed a write); None while it runs.
    paused: str | None = None
    # The queued study of higher priority this one gives the device to; None when none.
    preempted_by: str | None = None
    preempt_checked: float = -math.inf

    def budget_used(self) -> float:
        """Budget spent so far; it stands still while the study waits for its device."""
        if self.used_before_wait is not None:
            return self.used_before_wait
        return self.budget.elapsed()

    def memory_need(self, cand: Candidate, storage: Storage) -> int:
        """Bytes a candidate is expected to need, from what this study measured so far.

        The nearest measured batch size of the same precision (any precision if none): its
        peak when the candidate's batch is smaller, scaled up in proportion when larger. Both
        are upper bounds (peak memory grows at most linearly with the batch). 0 when nothing
        was measured yet: the margin alone protects the first probes.
        """
        measured = list(self.peaks)
        try:
            if self.store is None and (study := stored_study(storage, self.name)) is not None:
                self.store = StudyStore(study)
            store = self.store  # None: no study yet (the first ceiling try)
            complete = (TrialState.COMPLETE,)
            for t in store.trials(complete) if store else []:
                peak = record(t).peak_memory_bytes
                if peak and peak > 0 and "batch_size" in t.params:
                    measured.append(
                        (str(t.params["precision"]), int(t.params["batch_size"]), int(peak))
                    )
        except Exception:  # best effort: no study yet (first ceiling try), or a busy database
            pass
        same = [m for m in measured if m[0] == cand.precision] or measured
        if not same:
            return 0
        _, bs, peak = min(same, key=lambda m: (abs(math.log(m[1] / cand.batch_size)), -m[2]))
        return peak if cand.batch_size <= bs else math.ceil(peak * cand.batch_size / bs)


class DeviceRunner(Runner):
    """The device's persistent worker, seen by one study: marks when a probe is in flight."""

    def __init__(
        self,
        worker: Runner,
        run: StudyRun,
        ended: dict[str, float],
    ) -> None:
        self.worker = worker
        self.device = worker.device
        self.run_state = run
        self.ended = ended

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Mark the device busy with our own probe: its utilisation is ours, not a colleague's."""
        self.run_state.probing = True
        try:
            yield
        finally:
            self.run_state.probing = False
            self.ended[self.run_state.device] = clock.now()

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        with self._in_flight():
            return self.worker.answer_probe(request, timeout)

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        with self._in_flight():
            return self.worker.answer_compare(request, timeout)

    def facts(self, workload: str) -> WorkerFacts:
        # Asked of the worker: the service never imports a workload or touches a device itself.
        return self.worker.facts(workload)

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        # In the worker too, never a workload in the service process. The search has already
        # waited at its gate for room on the device.
        with self._in_flight():
            return self.worker.answer_diagnose(request, timeout)

    def start(self, within: float | None = None) -> None:
        self.worker.start(within)

    def interrupt(self) -> None:
        self.worker.interrupt()

    def close(self) -> None:
        """The worker outlives the study: it serves the next one on this device."""
