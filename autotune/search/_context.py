"""What every phase of a search shares: a frozen context (the spec, the runner, the clock, the
device's facts, the space) and one mutable record of what the phases found (cuts, ceilings, probe
times)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from autotune.execution.contention import CpuContention
from autotune.execution.facts import WorkerFacts
from autotune.execution.probe_worker import Runner
from autotune.infra import clock
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.spec import DEFAULT_MIN_TIME, Candidate, EarlyStop, ProbeSettings, StudySpec
from autotune.search._budget import HARD_GRACE, WRITE_RESERVE, Budget, SearchStopped
from autotune.search._events import Event, EventSink
from autotune.search._space import Space

__all__ = ["Findings", "Gate", "SearchContext"]

# Called before each probe with its candidate; may block until the device has room.
Gate = Callable[[Candidate], None]
# Seconds a first compilation may take, before any was measured (a CPU compiles a small model
# in seconds from a warm cache and in tens of seconds from a cold one; a GPU model takes longer).
_FIRST_COMPILE = {"cuda": 180.0, "cpu": 60.0}
# Seconds a probe stopped at its hard limit takes to end (its worker killed, the result back).
_KILL_SECONDS = 1.0
# How many times a default compilation each compile mode's may take: reduce-overhead also
# captures CUDA graphs, max-autotune times several kernels for every matmul and convolution.
_MODE_FACTOR = {
    "default": 1.0,
    "reduce-overhead": 1.5,
    "max-autotune": 5.0,
    "max-autotune-no-cudagraphs": 5.0,
}


def _no_events(event: Event) -> None:
    return None


@dataclass
class Findings:
    """What a search's phases find as they go, shared by every context of one search: the one
    mutable record beside the frozen :class:`SearchContext`."""

    # Modes cut on this device, and batches above a mode's ceiling left unmeasured: the reason.
    cut: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, int] = field(default_factory=dict)
    # The modes the second wave of first trials has still to offer, fastest first (None until
    # it starts): one mode at a time, so a ceiling its trials raise is tried before the next.
    wave_two: list[str] | None = None
    # Wall seconds of every probe, and of the search trials' probes only (compiling left out),
    # and what each compiled probe spent compiling, by compile mode.
    probe_seconds: list[float] = field(default_factory=list)
    trial_seconds: list[float] = field(default_factory=list)
    # Seconds each probe that timed steps after the spec's warm-up spent before them (a build,
    # the warm-up, first-use costs; compiling apart): what a probe pays before it measures.
    setup_seconds: list[float] = field(default_factory=list)
    compile_seconds: dict[str, list[float]] = field(default_factory=dict)
    # Where the job's time went, by phase (seconds); see :meth:`SearchContext.clock`.
    spent: dict[str, float] = field(default_factory=dict)
    # A short budget's opening pairs (bf16 at the next batch up beside the reference, then the
    # safe rule's pick where that one stopped early): each candidate's first trial and first
    # validation pair, until they take it.
    openings: list[PairedResult] = field(default_factory=list)
    # What other processes take of this machine's CPU while the search runs.
    contention: CpuContention = field(default_factory=CpuContention, repr=False)
    _clocks: list[list] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class SearchContext:
    """What a search's phases share: fixed for the search, but the space, which a phase that
    changes it replaces (``dataclasses.replace(ctx, space=...)``); what they find goes to
    ``found``.

    Args:
        spec: the study spec.
        runner: runs probes (a worker process per device, or in-process).
        budget: the whole job's clock.
        facts: the workload's and the device's facts, from the runner.
        space: what the sampler may choose.
        emit: where events go.
        gate: called before each probe; may block (off the budget) while the device is busy.
        should_stop: polled before each probe and trial; True stops with SearchStopped.
        found: what the phases found so far (shared by the contexts a replace makes).
    """

    spec: StudySpec
    runner: Runner
    budget: Budget
    facts: WorkerFacts
    space: Space
    emit: EventSink = _no_events
    gate: Gate | None = None
    should_stop: Callable[[], bool] = lambda: False
    found: Findings = field(default_factory=Findings)

    @contextmanager
    def clock(self, phase: str) -> Iterator[None]:
        """Count the block's wall time to ``phase``; a clock started inside another pauses it,
        so the figures add up to the whole."""
        clocks, spent = self.found._clocks, self.found.spent
        now = clock.now()
        if clocks:
            outer = clocks[-1]
            spent[outer[0]] = spent.get(outer[0], 0.0) + now - outer[1]
        clocks.append([phase, now])
        try:
            yield
        finally:
            name, since = clocks.pop()
            now = clock.now()
            spent[name] = spent.get(name, 0.0) + now - since
            if clocks:
                clocks[-1][1] = now

    @property
    def workload(self) -> str:
        return self.facts.workload

    @property
    def device(self) -> str:
        return self.facts.device

    @property
    def default_min_time(self) -> float:
        """The timed phase's length when the spec leaves it to the device."""
        return DEFAULT_MIN_TIME["cuda" if self.device.startswith("cuda") else "cpu"]

    @property
    def maximize(self) -> bool:
        return self.spec.objective == "throughput"

    def stop_if_asked(self) -> None:
        """Raise SearchStopped when the caller asked the search to stop."""
        if self.should_stop():
            raise SearchStopped(f"study {self.spec.name!r} was asked to stop")

    def hard_grace(self) -> float:
        """Seconds a probe may run past its soft limit before the worker is stopped: 15, or a
        tenth of a short budget (at least 3): a step or a build that hangs must not overrun a
        10-second budget by 15 seconds."""
        return min(HARD_GRACE, max(3.0, 0.1 * self.budget.total))

    def compile_allowance(self, candidate: Candidate) -> float:
        """Seconds a compiled candidate may take beyond an uncompiled probe's hard limit: twice
        the longest compilation seen in its compile mode; in a mode not seen yet, a first guess
        for the device and mode, or more where the other modes' compilations, scaled, say so."""
        mode, compiled = candidate.compile_mode, self.found.compile_seconds
        if compiled.get(mode):
            return 2 * max(compiled[mode]) + 5.0
        factor = _MODE_FACTOR.get(mode, max(_MODE_FACTOR.values()))
        guess = factor * _FIRST_COMPILE["cuda" if self.device.startswith("cuda") else "cpu"]
        for other, seconds in compiled.items():
            scaled = max(seconds, default=0.0) * factor / _MODE_FACTOR.get(other, 1.0)
            guess = max(guess, 2 * scaled + 5.0)
        return guess

    def _spent(self, candidate: Candidate, started: float, compiled: float | None) -> None:
        """Count a finished probe: its wall time without compiling, and the compiling."""
        seconds = clock.now() - started
        if candidate.compile and compiled is not None:
            self.found.compile_seconds.setdefault(candidate.compile_mode, []).append(compiled)
            seconds = max(0.0, seconds - compiled)
        self.found.probe_seconds.append(seconds)

    def typical_probe(self, default: float = 0.0) -> float:
        """The median wall time of the last probes (``default`` before any)."""
        recent = self.found.probe_seconds[-10:]
        return statistics.median(recent) if recent else default

    def _margined(self, settings: ProbeSettings) -> ProbeSettings:
        """Every probe keeps the spec's memory margin free while it runs (on a GPU)."""
        if settings.memory_margin is not None:
            return settings
        return settings.model_copy(update={"memory_margin": self.spec.memory_margin})

    def run_probe(
        self,
        candidate: Candidate,
        settings: ProbeSettings,
        *,
        floor: bool = False,
        early_stop: EarlyStop | None = None,
        within: float | None = None,
    ) -> ProbeResult:
        """Run one probe in the runner: gated, counted against the budget, hard-limited.

        The hard limit is the soft limit plus a grace (plus a compile allowance for a compiled
        candidate, whose compiling the soft limit leaves out), cut to what the budget has left
        unless ``floor`` (a probe the search cannot do without, like the reference's). The
        compile allowance stays ``within`` the seconds the caller's phase has left.
        """
        self.stop_if_asked()
        settings = self._margined(settings)
        if self.gate is not None:
            with self.budget.paused():
                self.gate(candidate)
        left = self.budget.left()
        hard = settings.time_limit + self.hard_grace()
        if candidate.compile:
            allowance = self.compile_allowance(candidate)
            if within is not None:
                allowance = min(allowance, max(0.0, within - hard))
            hard += allowance
        if not floor:
            # A probe stopped at its hard limit ends a second or so later (the worker is
            # killed, the result written): the limit keeps that and the config's writing
            # inside the budget (a CPU search killed a trial at the budget's end, 166.1 s of
            # 165).
            room = left - WRITE_RESERVE - _KILL_SECONDS
            hard = min(hard, max(settings.time_limit + 1.0, room))
        t0 = clock.now()
        result = self.runner.run(
            self.workload, candidate, settings, timeout=hard, early_stop=early_stop
        )
        self._spent(candidate, t0, result.compile_seconds)
        # A ceiling's try (one warm-up step) pays less before its steps than a probe does.
        full = settings.warmup_steps >= self.spec.probe.warmup_steps
        if full and result.timed_steps and result.timed_seconds:
            before = result.wall_seconds - result.timed_seconds - (result.compile_seconds or 0.0)
            self.found.setup_seconds.append(max(0.0, before))
        return result

    def least_probe(self) -> float:
        """Seconds the shortest probe worth starting takes: a typical set-up, then half the
        device's timed phase (a probe cut before it has timed anything measures nothing)."""
        recent = self.found.setup_seconds[-10:]
        setup = statistics.median(recent) if recent else 0.0
        return setup + 0.5 * self.default_min_time

    def run_compare(
        self,
        candidate: Candidate,
        reference: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float,
    ) -> PairedResult:
        """Measure a candidate paired with the reference in the runner: gated, counted (a
        compiled candidate's ``timeout`` grows by the compile allowance)."""
        self.stop_if_asked()
        settings = self._margined(settings)
        if self.gate is not None:
            with self.budget.paused():
                self.gate(candidate)
        if candidate.compile:
            timeout += self.compile_allowance(candidate)
        t0 = clock.now()
        result = self.runner.compare(self.workload, candidate, reference, settings, timeout=timeout)
        self._spent(candidate, t0, result.candidate.compile_seconds)
        return result
