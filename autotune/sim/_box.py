"""A simulated box: the tuning service's real queue and scheduler over several simulated devices,
on one event clock."""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from optuna.trial import TrialState

from autotune.infra import clock
from autotune.schema.enums import StudyState
from autotune.search import Event, TrialStarted
from autotune.service import DeviceReading, SimulatedHardware, TuningService
from autotune.sim._landscape import Landscape, load_landscape
from autotune.sim._simulated_runner import SimulatedRunner
from autotune.study.storage import stored_study

__all__ = ["Arrival", "BoxReport", "StudyOutcome", "run_box"]

# Seconds between the driver's looks at whether every study has ended.
_LOOK = 30.0


@dataclass(frozen=True)
class Arrival:
    """A study submitted to the box.

    Attributes:
        at: seconds after the box starts.
        user: who submits it.
        name: the study's name.
        budget: its budget in seconds.
        priority: its queue priority (higher pre-empts lower at the next trial).
        cancel_after: seconds after ``at`` when its owner cancels it; None: never.
    """

    at: float
    user: str
    name: str
    budget: float
    priority: int = 0
    cancel_after: float | None = None


@dataclass
class StudyOutcome:
    """What became of one study."""

    name: str
    user: str
    state: str
    submitted: float
    # Simulated seconds from its submission to its first start; None: it never ran.
    waited: float | None
    runs: int
    trials: int
    # Simulated seconds from the box's start to its end; None: it never ended.
    finished: float | None = None
    # The budget it spent (the time it waited for a busy device is not charged).
    budget_used: float = 0.0
    # Trials whose searches started them but the storage does not hold finished.
    lost: list[str] = field(default_factory=list)
    speedup: float | None = None


@dataclass
class BoxReport:
    """What a simulated box did."""

    seconds: float
    # device → share of the simulated span a study held it (its search ran there)
    held: dict[str, float]
    # device → share of the simulated span it spent running probes
    utilisation: dict[str, float]
    studies: list[StudyOutcome]
    crashes: int

    def lost(self) -> list[str]:
        """Every trial a study lost (none, when the service keeps its promise)."""
        return [f"{s.name}: {why}" for s in self.studies for why in s.lost]

    def waits_by_user(self) -> dict[str, tuple[float, float]]:
        """user → (median, longest) simulated seconds from submission to a study's first start."""
        waits: dict[str, list[float]] = defaultdict(list)
        for s in self.studies:
            if s.waited is not None:
                waits[s.user].append(s.waited)
        return {u: (statistics.median(w), max(w)) for u, w in sorted(waits.items())}

    def to_json(self) -> dict:
        return {
            "seconds": self.seconds,
            "held": self.held,
            "utilisation": self.utilisation,
            "crashes": self.crashes,
            "states": dict(Counter(s.state for s in self.studies)),
            "waits_by_user": {
                u: {"median_s": m, "max_s": x} for u, (m, x) in self.waits_by_user().items()
            },
            "lost": self.lost(),
            "studies": [s.__dict__ for s in self.studies],
        }


class _Device(SimulatedRunner):
    """One GPU of the box: a simulated runner that counts the simulated time it probes."""

    busy_seconds = 0.0

    def _timed(self, call, *args, **kwargs):  # noqa: ANN001, ANN202 - a pass-through
        started = self.clock.monotonic()
        try:
            return call(*args, **kwargs)
        finally:
            self.busy_seconds += self.clock.monotonic() - started

    def answer_probe(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self._timed(super().answer_probe, *args, **kwargs)

    def answer_compare(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self._timed(super().answer_compare, *args, **kwargs)

    def answer_diagnose(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self._timed(super().answer_diagnose, *args, **kwargs)


class _Monitor:
    """The box's devices, as the scheduler reads them; a colleague's job holds a device during
    its busy windows."""

    def __init__(
        self, devices: list[str], land: Landscape, busy: dict[int, list[tuple[float, float]]]
    ) -> None:
        self.devices, self.land = devices, land
        self.busy = {devices[i]: windows for i, windows in busy.items()}

    def read(self, device: str, *, max_age: float = 0.0) -> DeviceReading:
        total = self.land.memory_total_bytes
        now = clock.now()
        taken = any(start <= now < end for start, end in self.busy.get(device, []))
        return DeviceReading(
            name=device, kind="cuda", description=self.land.device, total_bytes=total,
            free_bytes=total,
            busy_reason=f"{device} is used by another process (a colleague's job)" if taken else "",
        )  # fmt: skip

    def room_for(self, device: str, need_bytes: int, margin: float) -> str:
        return self.read(device).busy_reason  # nobody else holds memory there


class _Journal:
    """The trials each study's search started, from its events."""

    def __init__(self, land: Landscape) -> None:
        self.land = land
        self.started: dict[str, set[int]] = defaultdict(set)
        # study → the simulated wall time of its search's first event (its first start)
        self.first_event: dict[str, float] = {}

    def __call__(self, name: str, event: Event) -> None:
        self.first_event.setdefault(name, clock.wall())
        if isinstance(event, TrialStarted):
            self.started[name].add(event.number)
            # The tuner's own work between probes (ask, tell, writes) takes time too.
            clock.sleep(self.land.timing.trial_overhead_seconds)


def run_box(  # noqa: PLR0913 - public API: the simulated box's knobs, keyword-only
    arrivals: Sequence[Arrival],
    landscape: Landscape | str | Path,
    *,
    devices: int = 8,
    seed: int = 0,
    crashes: dict[int, frozenset[int]] | None = None,
    busy: dict[int, list[tuple[float, float]]] | None = None,
    workdir: str | Path | None = None,
) -> BoxReport:
    """Run the service's scheduler over ``devices`` simulated GPUs as ``arrivals`` come.

    Args:
        arrivals: the studies submitted, each with its time, user and budget.
        landscape: every device's landscape (a shipped name, a file or a Landscape); every
            study tunes its workload.
        devices: how many GPUs the box has (``cuda:0`` ...).
        seed: seeds the devices' timing noise and the studies' samplers.
        crashes: device index → numbers of the probes on it during which its worker dies.
        busy: device index → (start, end) windows, in seconds after the box starts, during
            which another process uses the device (the service leaves it alone then).
        workdir: where the study database and each study's output go; a temporary folder by
            default.

    Returns:
        The report, once every study has ended (done, failed or cancelled).

    Example:
        >>> arrivals = [Arrival(0, "ada", "a", 120), Arrival(30, "bo", "b", 120)]
        >>> report = run_box(arrivals, "t4-resnet18")
        >>> [(s.name, s.state) for s in report.studies], report.lost()
        ([('a', 'done'), ('b', 'done')], [])
    """
    land = landscape if isinstance(landscape, Landscape) else load_landscape(landscape)
    # The study database takes a write per trial attribute: in memory-backed files where the
    # system has them (a simulated run needs no durability).
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        return _Box(land, devices, seed, crashes or {}, busy or {}, root).run(arrivals)


class _Box:
    def __init__(
        self,
        land: Landscape,
        count: int,
        seed: int,
        crashes: dict[int, frozenset[int]],
        busy: dict[int, list[tuple[float, float]]],
        root: Path,
    ) -> None:
        self.land, self.seed, self.root = land, seed, root
        self.clock = clock.EventClock()
        names = [f"cuda:{i}" for i in range(count)]
        self.devices = {
            d: _Device(
                land,
                seed=seed * 1000 + i,
                clock=self.clock,
                device=d,
                crash_at=crashes.get(i, frozenset()),
            )  # fmt: skip
            for i, d in enumerate(names)
        }
        self.journal = _Journal(land)
        # device → simulated seconds a study held it (sampled at each of the driver's looks)
        self.held: dict[str, float] = dict.fromkeys(names, 0.0)
        self.url = f"sqlite:///{root / 'box.db'}"
        self.service = TuningService(
            self.url,
            names,
            out_dir=root / "out",
            box=SimulatedHardware(
                _Monitor(names, land, busy), dict(self.devices), 5.0, self.journal
            ),
        )

    def run(self, arrivals: Sequence[Arrival]) -> BoxReport:
        events = sorted(
            [(a.at, 0, a) for a in arrivals]
            + [(a.at + a.cancel_after, 1, a) for a in arrivals if a.cancel_after is not None],
            key=lambda e: (e[0], e[1]),
        )
        with clock.use(self.clock):
            with self.clock.taking_part():
                t0 = self.clock.monotonic()
                self.service.start()
                for at, kind, arrival in events:
                    self._until(t0 + at)
                    if kind == 0:
                        self._submit(arrival)
                    else:
                        self._cancel(arrival.name)
                while any(
                    r.state in (StudyState.QUEUED, StudyState.RUNNING)
                    for r in self.service.queue.rows()
                ):
                    self._until(self.clock.monotonic() + _LOOK)
                span = self.clock.monotonic() - t0
            self.service.stop()
        return self._report(arrivals, span)

    def _until(self, when: float) -> None:
        """Wait until ``when``, counting each look's devices that hold a study."""
        while (now := self.clock.monotonic()) < when:
            step = min(_LOOK, when - now)
            for device in self.service.scheduler.runs:
                self.held[device] += step
            self.clock.sleep(step)

    def _submit(self, a: Arrival) -> None:
        spec = {
            "name": a.name,
            "workload": self.land.workload,
            "budget": f"{a.budget:g}s",
            "device": "cuda",
            "seed": self.seed,
        }
        self.service.submit(json.dumps(spec).encode(), "application/json", priority=a.priority)

    def _cancel(self, name: str) -> None:
        row = self.service.queue.get(name)
        if row is not None and row.state in (StudyState.QUEUED, StudyState.RUNNING):
            self.service.cancel(name)

    def _report(self, arrivals: Sequence[Arrival], span: float) -> BoxReport:
        rows = {r.name: r for r in self.service.queue.rows()}
        start = self.clock.time() - self.clock.monotonic()
        outcomes = []
        for a in arrivals:
            row = rows[a.name]
            stored = self._trials(a.name)
            started = self.journal.started[a.name]
            lost = [f"trial {n} left {stored[n].name}" for n in sorted(started) if n in stored
                    and stored[n] in (TrialState.RUNNING, TrialState.WAITING)]  # fmt: skip
            lost += [f"trial {n} started but not stored" for n in sorted(started - set(stored))]
            first = self.journal.first_event.get(a.name)
            outcomes.append(
                StudyOutcome(
                    name=a.name,
                    user=a.user,
                    state=row.state,
                    submitted=a.at,
                    waited=None if first is None else max(0.0, first - start - a.at),
                    runs=row.runs,
                    trials=len(stored),
                    finished=None if row.finished_at is None else row.finished_at - start,
                    budget_used=row.probe_seconds,
                    lost=lost,
                    speedup=self._speedup(a.name),
                )
            )

        def share(seconds: float) -> float:
            return min(1.0, seconds / span) if span else 0.0

        return BoxReport(
            seconds=span,
            held={d: share(s) for d, s in self.held.items()},
            utilisation={d: share(dev.busy_seconds) for d, dev in self.devices.items()},
            studies=outcomes,
            crashes=sum(dev.crashes for dev in self.devices.values()),
        )

    def _trials(self, name: str) -> dict[int, TrialState]:
        study = stored_study(self.service.storage, name)
        if study is None:
            return {}
        return {t.number: t.state for t in study.get_trials(deepcopy=False)}

    def _speedup(self, name: str) -> float | None:
        path = self.root / "out" / name / "best.json"
        if not path.exists():
            return None
        return json.loads(path.read_text()).get("evidence", {}).get("speedup")
