"""The tuning service: the queue, the devices and the scheduler behind the HTTP API, one public
method per API operation."""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import autotune
from autotune.errors import AutotuneError, SpecError, WorkloadError
from autotune.infra.inputs import Format, load_text
from autotune.report import config_notes, ratio_text
from autotune.schema.bounds import check_plain_text
from autotune.schema.config import TunedConfig
from autotune.schema.enums import StudyState
from autotune.schema.spec import StudySpec, format_duration, parse_duration, parse_spec
from autotune.service._access import WorkloadPolicy, WorkloadRefused
from autotune.service._device_monitor import DeviceMonitor, SimulatedHardware
from autotune.service._models import (
    CancelReply,
    DeviceInfo,
    DeviceProcess,
    Health,
    StudyDetail,
    StudyProgress,
    StudyStatus,
    SubmitReply,
)
from autotune.service._queue import FINISHED, QueueRow, StudyQueue, service_owner
from autotune.service._scheduler import Scheduler
from autotune.service._standing import StandingCache, StudyStanding
from autotune.service._study_run import accepts
from autotune.study.storage import mask_url, open_storage, owner_alive, stored_study
from autotune.study.store import StudyStore

__all__ = ["MAX_BUDGET", "RequestError", "TuningService"]

# Seconds a device reading may be reused by status answers (many clients poll).
_READING_AGE = 0.5
# The longest budget a study may ask for by default: a day of a shared device.
MAX_BUDGET = 24 * 3600.0


def _done_detail(cfg: TunedConfig) -> str:
    """A finished study in one line: its config and figure with its interval, then why it fell
    back, the timing noise and others' load, as best.json, the report and the page say them."""
    ev = cfg.evidence
    head = (
        f"done: {cfg.precision} bs={cfg.batch_size} lr={cfg.learning_rate:.3g}, "
        f"{ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high)} the fp32 reference "
        f"({'validated' if ev.validated else 'fp32 fallback'})"
    )
    return "; ".join([head, *config_notes(cfg)])


class RequestError(AutotuneError):
    """A refused request: ``status`` is the HTTP status (404, 409, 413, 422...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _when(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=timezone.utc)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class TuningService:
    """Everything ``autotune serve`` runs, without the HTTP layer.

    Args:
        storage: the study storage URL; the queue table lives in the same database.
        devices: device names (``cpu``, ``cuda:0`` ...).
        out_dir: where each study writes ``<name>/best.json`` and ``<name>/service.log``.
        workload_dirs: folders whose packages may be used as workloads.
        token: the bearer token changing requests need; None for none.
        max_budget: the longest budget (seconds) a submitted study may ask for.
        box: simulated devices to schedule on instead of this machine's (see
            :mod:`autotune.sim`); ``devices`` must name the same devices.

    Raises:
        StorageError: the storage cannot be opened.
        DeviceError: a device does not exist here.

    Example:
        >>> service = TuningService("sqlite:///studies/autotune.db", ["cpu"])  # doctest: +SKIP
        >>> service.start(); service.submit(b"name: t\\nworkload: tiny_mlp\\n")  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 - the service's configuration, keyword-only: `autotune serve`'s options
        self,
        storage: str,
        devices: list[str],
        *,
        out_dir: Path = Path("studies"),
        workload_dirs: list[Path] | None = None,
        token: str | None = None,
        max_budget: float = MAX_BUDGET,
        box: SimulatedHardware | None = None,
    ) -> None:
        self.storage_url = storage
        self.token = token
        self.max_budget = max_budget
        self.policy = WorkloadPolicy(workload_dirs or [])
        self.storage = open_storage(storage)
        self.queue = StudyQueue(storage)
        self.scheduler: Scheduler
        if box is None:
            self.monitor = DeviceMonitor(
                devices,
                own_pids=lambda: self.scheduler.own_pids(),
                probing=lambda device: self.scheduler.probing(device),
                worker_memory=lambda device: self.scheduler.workers[device].memory,
            )
            self.monitor.check()
        else:
            self.monitor = box.monitor
        self.scheduler = Scheduler(
            self.queue,
            self.monitor,
            storage_url=storage,
            out_dir=out_dir,
            storage=self.storage,
            **box.scheduling() if box else {},
        )
        self.standings = StandingCache(self.storage)
        self._recovered = False
        self._beats = threading.Event()  # set: the queue's beats stop

    # ---- life ------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Put studies a dead service left running back in the queue (before :meth:`start`);
        a live one sharing the queue keeps its own, and its studies are adopted should it die."""
        self._recovered = True
        return self.queue.recover()

    def start(self) -> None:
        """Start the device threads (recovering the queue first, if not done yet)."""
        if not self._recovered:
            self.recover()
        self.queue.start_beating(self._beats)  # the lease on the studies it runs
        self.scheduler.start()

    def stop(self) -> None:
        """Drain: no new probes, the ones in flight finish or are stopped, then return.

        Safe to call again (and from two threads): later calls wait for the first drain.
        """
        self.scheduler.drain()
        self._beats.set()

    # ---- submit ----------------------------------------------------------------------------

    def parse(self, body: bytes, content_type: str | None) -> StudySpec:
        """A request body (YAML or JSON) as a spec stored in this service's storage.

        Raises:
            RequestError: 422 naming the bad field, 403 for a workload it will not import.
        """
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(422, f"the body is not UTF-8 text (byte {exc.start})") from None
        if not text.strip():
            raise RequestError(
                422, "the body is empty; send a study spec as YAML or JSON, e.g. studies/tiny.yaml"
            )
        fmt: Format = "json" if "json" in (content_type or "") else "yaml"
        try:
            data = load_text(text, fmt, "the body")
        except SpecError as exc:
            raise RequestError(422, str(exc)) from None
        if not isinstance(data, dict):
            raise RequestError(
                422, f"the body must be a mapping of spec fields, got a {type(data).__name__}"
            )
        # The service's storage replaces whatever the spec says: the queue and the trials must
        # live where the service looks for them.
        data = {**data, "storage": self.storage_url}
        try:
            spec = parse_spec(data, source="study spec")
            spec = spec.model_copy(update={"workload": self.policy.check(spec.workload)})
        except WorkloadRefused as exc:
            raise RequestError(403, str(exc)) from None
        except (SpecError, WorkloadError) as exc:
            raise RequestError(422, str(exc)) from None
        if spec.budget > self.max_budget:
            raise RequestError(
                422,
                f"budget must be at most {format_duration(self.max_budget)} on this service (its "
                f"--max-budget), got budget={format_duration(spec.budget)!r}; ask for less, or "
                "ask whoever runs the service",
            )
        if not any(accepts(d, spec.device) for d in self.monitor.devices):
            raise RequestError(
                422,
                f"device: this service runs on {', '.join(self.monitor.devices)}, got "
                f"device={spec.device!r}; use device: auto",
            )
        return spec

    def submit(
        self,
        body: bytes,
        content_type: str | None = None,
        priority: int = 0,
        owner: str | None = None,
    ) -> SubmitReply:
        """Queue a study spec; ``owner`` is who submits it, as their client says (shown, not
        checked).

        Raises:
            RequestError: 422/403 for a bad spec, 409 when the name is taken, 503 while the
                service drains.
            StorageIOError: the storage cannot be written (the API answers 503).
        """
        if self.scheduler.draining:
            raise RequestError(
                503,
                "the service is draining (it is stopping); nothing was queued: submit again "
                "once it has restarted",
            )
        try:
            check_plain_text(owner or "", "owner")
        except SpecError as exc:  # U+202E would show another name than the one sent
            raise RequestError(422, str(exc)) from None
        spec = self.parse(body, content_type)
        resumes = self._check_stored(spec)
        existing = self.queue.get(spec.name)
        if existing is not None and existing.state not in (StudyState.FAILED, StudyState.CANCELLED):
            raise self._taken(existing)
        stored = spec.model_dump(mode="json", exclude={"storage"})
        try:
            row = self.queue.submit(spec.name, stored, priority, submitted_by=owner or None)
        except ValueError:  # taken between the check and the insert
            current = self.queue.get(spec.name)
            assert current is not None
            raise self._taken(current) from None
        position = self._position(row)
        self.scheduler.wake()
        message = f"queued {_ordinal(position)} in line" if position else "queued"
        if resumes:
            message += f"; resumes the {resumes} trials stored for this study"
        return SubmitReply(
            name=row.name,
            state=StudyState.QUEUED,
            priority=row.priority,
            position=position,
            message=message,
        )

    def _taken(self, row: QueueRow) -> RequestError:
        if row.state == StudyState.DONE:
            return RequestError(
                409,
                f"study {row.name!r} is already done; get its config with `autotune result "
                f"{row.name}` (GET /studies/{row.name}/config), or submit under a new name",
            )
        return RequestError(
            409,
            f"study {row.name!r} is already {row.state}; cancel it first "
            f"(POST /studies/{row.name}/cancel) or submit under a new name",
        )

    def _check_stored(self, spec: StudySpec) -> int:
        """Trials a stored study of this name holds (it resumes); 409 if its space differs."""
        study = stored_study(self.storage, spec.name)
        if study is None:
            return 0
        store = StudyStore(study)
        if store.space_fingerprint() != spec.space_fingerprint():
            raise RequestError(
                409,
                f"study {spec.name!r} already exists in the service's storage with a different "
                f"space (workload {store.workload() or '?'!r}); its trials are "
                f"kept. Submit under a new name, e.g. name: {spec.name}-2",
            )
        return len(study.trials)

    # ---- reading ---------------------------------------------------------------------------

    def _row(self, name: str) -> QueueRow:
        row = self.queue.get(name)
        if row is None:
            known = ", ".join(r.name for r in self.queue.rows()[:20]) or "none"
            raise RequestError(
                404, f"study {name!r} is not in this service's queue (studies: {known})"
            )
        return row

    def _position(self, row: QueueRow) -> int:
        queued = [r for r in self.queue.rows() if r.state == StudyState.QUEUED]
        return next((i for i, r in enumerate(queued, 1) if r.name == row.name), 0)

    def _detail(self, row: QueueRow, standing: StudyStanding | None, position: int) -> str:
        run = self.scheduler.run_of(row.name)
        if row.state == StudyState.RUNNING:
            if run is not None:
                return run.detail
            if owner_alive(row.owner) is False:
                return (
                    f"left running by a service that stopped ({row.owner}); the next start puts "
                    "it back in the queue, or cancel it"
                )
            return "starting" if row.owner == service_owner() else f"running in {row.owner}"
        if row.state == StudyState.QUEUED:
            blocked = [
                self.monitor.read(d, max_age=_READING_AGE).busy_reason
                for d in self.monitor.devices
                if accepts(d, row.requested_device)
            ]
            spent = (
                f" (resumes with {row.probe_seconds:.1f}s of its budget spent)" if row.runs else ""
            )
            if not blocked:  # queued before a restart with other --devices
                return (
                    f"queued, but no device here can run it: it asks for "
                    f"device={row.requested_device!r} and this service runs "
                    f"{', '.join(self.monitor.devices)}; cancel it, or restart with --devices"
                )
            if all(blocked):
                return f"queued: waiting for a device: {'; '.join(blocked)}{spent}"
            return f"queued: {_ordinal(position)} in line{spent}"
        if row.state == StudyState.DONE and standing is not None and standing.tuned_config:
            return _done_detail(TunedConfig.model_validate(standing.tuned_config))
        if row.state == StudyState.FAILED:
            return f"failed: {row.error}"
        return row.state

    def _status(
        self, row: QueueRow, position: int = 0, *, detail: bool = False
    ) -> StudyStatus | StudyDetail:
        standing = self.standings.get(
            row.name, (row.state, row.finished_at), final=row.state in FINISHED
        )
        run = self.scheduler.run_of(row.name)
        used = run.budget_used() if run is not None else row.probe_seconds
        state = StudyState.PAUSED if run is not None and run.paused else row.state
        spec: dict[str, Any] = row.spec
        progress = StudyProgress(
            phase=run.phase if run is not None else None,
            trials=dict(standing.trials) if standing else {},
            budget_seconds=parse_duration(spec.get("budget", 1800.0)),
            budget_used_seconds=round(max(0.0, used), 2),
            best_throughput=standing.best.throughput if standing and standing.best else None,
            reference_throughput=standing.reference_throughput if standing else None,
        )
        fields: dict[str, Any] = {
            "name": row.name,
            "state": state,
            "detail": self._detail(row, standing, position),
            "priority": row.priority,
            "owner": row.submitted_by,
            "workload": str(spec.get("workload", "")),
            "device": row.device if row.state != StudyState.QUEUED else None,
            "submitted_at": _when(row.submitted_at),
            "started_at": _when(row.started_at),
            "finished_at": _when(row.finished_at),
            "error": run.paused if run is not None and run.paused else row.error,
            "progress": progress,
        }
        if not detail:
            return StudyStatus(**fields)
        return StudyDetail(
            **fields,
            by_outcome=dict(standing.by_outcome) if standing else {},
            best=standing.best if standing else None,
            trials=list(standing.latest) if standing else [],
            spec={**spec, "storage": mask_url(self.storage_url)},
        )

    def studies(self) -> list[StudyStatus]:
        """Every study in queue order, with state and progress."""
        out = []
        position = 0
        for row in self.queue.rows():
            if row.state == StudyState.QUEUED:
                position += 1
            out.append(self._status(row, position))
        return out

    def study(self, name: str) -> StudyDetail:
        """One study with its trials. Raises RequestError 404 for an unknown name."""
        row = self._row(name)
        result = self._status(row, self._position(row), detail=True)
        assert isinstance(result, StudyDetail)
        return result

    def config(self, name: str) -> dict[str, Any]:
        """The TunedConfig of a finished study (as JSON data).

        Raises:
            RequestError: 404 unknown study, 409 not done (yet).
        """
        row = self._row(name)
        if row.state != StudyState.DONE:
            status = self._status(row, self._position(row))
            raise RequestError(
                409,
                f"study {name!r} is {row.state}, so it has no config"
                + (" yet" if row.state in (StudyState.QUEUED, StudyState.RUNNING) else "")
                + f" ({status.detail})",
            )
        standing = self.standings.get(name, (row.state, row.finished_at), final=True)
        if standing is None or standing.tuned_config is None:
            raise RequestError(409, f"study {name!r} is done but its storage holds no config")
        return standing.tuned_config

    # ---- changing --------------------------------------------------------------------------

    def cancel(self, name: str) -> CancelReply:
        """Cancel a queued or running study.

        Raises:
            RequestError: 404 unknown study, 409 already finished.
        """
        row = self._row(name)
        if row.state == StudyState.QUEUED:
            if self.queue.cancel_queued(name):
                return CancelReply(
                    name=name, state=StudyState.CANCELLED, message="removed from the queue"
                )
            row = self._row(name)  # a device took it a moment ago
        # A running row this service owns but runs nowhere yet has just been taken from the
        # queue: it is cancelled as it starts.
        starting = row.state == StudyState.RUNNING and row.owner == service_owner()
        if self.scheduler.cancel(name, starting=starting):
            return CancelReply(
                name=name,
                state="cancelling",
                message="stopping: the probe in flight is stopped and recorded, then the study "
                "is cancelled; its trials stay in the storage",
            )
        row = self._row(name)
        if row.state in FINISHED:
            raise RequestError(409, f"study {name!r} is already {row.state}; nothing to cancel")
        if row.state == StudyState.RUNNING and owner_alive(row.owner) is False:
            # Left running by a service that is gone: nobody else will ever finish it.
            self.queue.finish(name, StudyState.CANCELLED)
            return CancelReply(
                name=name,
                state=StudyState.CANCELLED,
                message=f"cancelled (it was left running by a stopped service, {row.owner}); "
                "its trials stay in the storage",
            )
        raise RequestError(409, f"study {name!r} is {row.state} elsewhere; try again shortly")

    # ---- devices and health ----------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        out = []
        for device in self.monitor.devices:
            r = self.monitor.read(device, max_age=_READING_AGE)
            run = self.scheduler.runs.get(device)
            out.append(
                DeviceInfo(
                    name=device,
                    description=r.description,
                    total_bytes=r.total_bytes,
                    free_bytes=r.free_bytes,
                    utilization=r.utilization,
                    busy=r.busy,
                    busy_reason=r.busy_reason,
                    study=run.name if run is not None else None,
                    worker_pid=self.scheduler.workers[device].pid,
                    others_bytes=r.others_bytes,
                    other_processes=[
                        DeviceProcess(pid=p.pid, used_bytes=p.used_bytes) for p in r.others
                    ],
                )
            )
        return out

    def health(self) -> Health:
        """Up or draining, with queue counts: from memory only (no database, no thread), so
        the API answers it on its event loop however busy the rest is."""
        counts = self.queue.counts()
        problem = self.queue.problem
        status = "draining" if self.scheduler.draining else "storage_error" if problem else "ok"
        return Health(
            status=status,
            storage_error=problem,
            version=autotune.__version__,
            devices=list(self.monitor.devices),
            queued=counts.get(StudyState.QUEUED, 0),
            running=counts.get(StudyState.RUNNING, 0),
            storage=mask_url(self.storage_url),
            token_required=self.token is not None,
        )
