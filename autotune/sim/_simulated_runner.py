"""The simulated device behind the Runner interface."""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Mapping
from typing import Any

import torch

import autotune
from autotune.errors import DeviceError
from autotune.execution.facts import WorkerFacts
from autotune.execution.messages import CompareRequest, DiagnoseRequest, ProbeRequest
from autotune.execution.runner import Runner, StartTooSlow, crashed_result
from autotune.infra.clock import VirtualClock
from autotune.measure.paired import interleave
from autotune.measure.result import PairedResult, ProbeResult
from autotune.measure.timed import TimedRun
from autotune.schema.config import Environment
from autotune.schema.enums import Outcome
from autotune.schema.spec import PRECISIONS, Candidate, ProbeSettings
from autotune.sim._diagnosis import DIAGNOSIS_SLOWDOWN, simulated_diagnosis
from autotune.sim._engine import Bursts, HardTimeout, Killed, SimEngine
from autotune.sim._landscape import Landscape

__all__ = ["SimulatedRunner"]


class SimulatedRunner(Runner):
    """Answers probes from a landscape on a virtual clock.

    Args:
        landscape: the device and workload to simulate.
        seed: seeds the timing noise (loss curves follow each probe's own seed, as real runs'
            do); the same seed gives the same search.
        clock: the virtual clock to advance; a new one by default. Make it the current clock
            (``autotune.infra.clock.use(runner.clock)``) for the search to read it.
        device: the device's name (a simulated box has several); ``cuda:0`` or ``cpu`` by
            default, from the landscape.
        crash_at: numbers of probes (1 = the first) during which the worker dies, as a real
            one killed by the kernel does: the probe is ``crashed`` and the worker restarts.
        slow_at: numbers of probes (1 = the first) that run this many times slower throughout,
            as one run during a neighbour's burst, or in a warm-up it alone suffers: a one-off
            mis-measurement (``{5: 20.0}``: the fifth probe at a twentieth of its speed).

    Example:
        >>> from autotune.sim import load_landscape
        >>> runner = SimulatedRunner(load_landscape("a100-resnet18"))
        >>> runner.facts("autotune.workloads:resnet18").environment.device
        'NVIDIA A100-SXM4-80GB'
    """

    def __init__(
        self,
        landscape: Landscape,
        *,
        seed: int = 0,
        clock: VirtualClock | None = None,
        device: str | None = None,
        crash_at: frozenset[int] = frozenset(),
        slow_at: Mapping[int, float] | None = None,
    ) -> None:
        self.landscape = landscape
        self.clock = clock or VirtualClock()
        self.device = device or ("cuda:0" if landscape.device_type == "cuda" else "cpu")
        self.seed = seed
        self.started = False
        self.probes = 0
        self.crash_at = crash_at
        self.slow_at = dict(slow_at or {})
        # Crashes injected so far (a kill by interrupt() is not one).
        self.crashes = 0
        self._killed = threading.Event()
        # What a real worker reports of its process and memory (a simulated one has neither).
        self.pid: int | None = None
        self.memory = None

    # ---- the interface ------------------------------------------------------------------------

    def start(self, within: float | None = None) -> None:
        if not self.started:
            takes = self.landscape.timing.worker_start_seconds
            if within is not None and takes > within:
                self.clock.advance(max(0.0, within))
                raise StartTooSlow(max(0.0, within))
            self.started = True
            self.clock.advance(takes)

    def interrupt(self) -> None:
        """Kill the probe in flight: it ends after its current block, ``crashed``."""
        self._killed.set()

    def facts(self, workload: str) -> WorkerFacts:
        self._check_workload(workload)
        self.start()
        land = self.landscape
        free = int(land.memory_total_bytes * 0.98)  # the CUDA context's own share
        return WorkerFacts(
            workload=land.workload,
            name=land.workload.rsplit(":", 1)[-1],
            base_lr=land.facts.base_lr,
            base_batch_size=land.facts.base_batch_size,
            lr_scaling=land.facts.lr_scaling,
            channels_last=land.facts.channels_last,
            optimizer=land.facts.optimizer,
            device=self.device,
            unsupported=self.unsupported(),
            memory_free=free,
            memory_total=land.memory_total_bytes,
            environment=Environment(
                device=land.device,
                capability=land.capability,
                torch=torch.__version__.split("+")[0],
                cuda="13.0" if land.device_type == "cuda" else None,
                autotune=autotune.__version__,
                python="simulated",
            ),
        )

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        self._check_workload(request.workload)
        self.start()
        candidate, settings = request.candidate, request.settings
        base = self._base(candidate, settings)
        why = self.unsupported().get(candidate.precision)
        if why is not None:
            return ProbeResult(**base, outcome=Outcome.UNSUPPORTED, reason=why)
        started = self.clock.monotonic()
        engine = self._engine(candidate, settings, started, timeout)
        run = TimedRun(engine, settings, started, request.early_stop, timer=self.clock.monotonic)
        try:
            oom = engine.run(lambda e: run.measure())
        except HardTimeout:
            return self._timed_out(candidate, settings, timeout)
        except Killed:
            return self._died(candidate, settings, "the probe")
        fields = run.fields()
        fields["wall_seconds"] = self.clock.monotonic() - started
        if oom is not None:
            reason = (
                f"out of memory at batch_size={candidate.batch_size}, step {engine.steps}: {oom}"
            )
            return ProbeResult(
                **base, **{**fields, "outcome": Outcome.OOM, "throughput": 0.0, "reason": reason}
            )
        peak = self.landscape.peak_bytes(candidate)
        return ProbeResult(
            **base,
            **fields,
            peak_memory_allocated=int(peak * 0.9),
            peak_memory_reserved=peak,
            autocast_dtype=_dtype(candidate),
        )

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        self._check_workload(request.workload)
        self.start()
        candidate, reference, settings = request.candidate, request.reference, request.settings
        bases = {
            "candidate": self._base(candidate, settings),
            "reference": self._base(reference, settings),
        }
        for cand in (candidate, reference):
            why = self.unsupported().get(cand.precision)
            if why is not None:
                return PairedResult(
                    candidate=ProbeResult(
                        **bases["candidate"], outcome=Outcome.UNSUPPORTED, reason=why
                    ),
                    reference=ProbeResult(
                        **bases["reference"], outcome=Outcome.UNSUPPORTED, reason=why
                    ),
                )
        started = self.clock.monotonic()
        # One neighbour: a burst that starts in one arm's block goes on in the other's.
        bursts = Bursts()
        engines = {
            "candidate": self._engine(candidate, settings, started, timeout, bursts),
            "reference": self._engine(reference, settings, started, timeout, bursts),
        }
        try:
            result = interleave(
                engines,
                settings,
                started,
                bases,
                set_flags=lambda mode: None,
                seed=lambda seed: None,
                timer=self.clock.monotonic,
            )
        except HardTimeout:
            return PairedResult(
                candidate=self._timed_out(candidate, settings, timeout),
                reference=self._timed_out(reference, settings, timeout),
            )
        except Killed:
            return PairedResult(
                candidate=self._died(candidate, settings, "the paired run"),
                reference=self._died(reference, settings, "the paired run"),
            )
        wall = self.clock.monotonic() - started
        for arm, cand in ((result.candidate, candidate), (result.reference, reference)):
            arm.wall_seconds = wall
            if arm.outcome == Outcome.COMPLETED:
                arm.peak_memory_reserved = self.landscape.peak_bytes(cand)
                arm.autocast_dtype = _dtype(cand)
        return result

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        """From the landscape: its fp16 islands, an overflow between modules, an lr past the
        stable one, a wasteful init_scale. The steps run on the virtual clock, uncompiled; the
        worker restarts after a diagnosis it killed."""
        self._check_workload(request.workload)
        self.start()
        eager = request.candidate.model_copy(update={"compile": False})
        why = self.unsupported().get(eager.precision)
        losses: list[float] = []
        scales: list[float] = []
        skipped = 0
        if why is None:
            self._killed.clear()
            engine = SimEngine(
                self.landscape,
                eager,
                self.clock,
                seed=request.seed,
                noise=random.Random(f"{self.seed}|diagnosis|{self.clock.monotonic()}"),
                deadline=self.clock.monotonic() + timeout,
                world=self.seed,
                killed=self._killed.is_set,
                slowdown=DIAGNOSIS_SLOWDOWN,
            )
            try:
                why = engine.run(lambda e: _diagnosed_steps(e, request.steps, scales))
            except (HardTimeout, Killed):
                self.clock.advance(self.landscape.timing.worker_start_seconds)
                return None
            losses, skipped = engine.losses, engine.skipped
        found = simulated_diagnosis(
            self.landscape,
            eager,
            device=self.device,
            losses=losses,
            scales=scales,
            skipped=skipped,
            failure=why,
        )
        return json.loads(found.model_dump_json())

    def unsupported(self) -> dict[str, str]:
        """Modes the device cannot run, with the reason: the landscape's, and those it has no
        figures for."""
        land = self.landscape
        reasons: dict[str, str] = {
            m: f"the simulated device {land.name!r} has no figures for {m}"
            for m in PRECISIONS
            if m not in land.modes
        }
        reasons.update(land.unsupported.items())
        return reasons

    # ---- helpers ------------------------------------------------------------------------------

    def _check_workload(self, workload: str) -> None:
        if workload != self.landscape.workload:
            raise DeviceError(
                f"the simulated device {self.landscape.name!r} knows workload "
                f"{self.landscape.workload!r}, not {workload!r}; use that workload in the spec "
                "or another landscape"
            )

    def _engine(
        self,
        cand: Candidate,
        settings: ProbeSettings,
        started: float,
        timeout: float | None,
        bursts: Bursts | None = None,
    ) -> SimEngine:
        self.probes += 1
        self._killed.clear()
        noise = random.Random(f"{self.seed}|{self.probes}")
        deadline = None if timeout is None else started + timeout
        crash = self.probes in self.crash_at
        if crash:
            self.crashes += 1
        return SimEngine(
            self.landscape,
            cand,
            self.clock,
            seed=settings.seed,
            noise=noise,
            deadline=deadline,
            world=self.seed,
            killed=lambda: crash or self._killed.is_set(),
            slowdown=self.slow_at.get(self.probes, 1.0),
            bursts=bursts,
        )

    def _base(self, cand: Candidate, settings: ProbeSettings) -> dict[str, Any]:
        return {
            "candidate": cand,
            "workload": self.landscape.workload,
            "device": self.device,
            "seed": settings.seed,
            "planned_steps": settings.steps,
            "batch_size": cand.batch_size,
        }

    def _died(self, cand: Candidate, settings: ProbeSettings, what: str) -> ProbeResult:
        """The worker died mid-probe (killed, or a crash injected by ``crash_at``): a fresh one
        starts, its start-up paid now."""
        self.clock.advance(self.landscape.timing.worker_start_seconds)
        return crashed_result(
            self.landscape.workload,
            cand,
            self.device,
            settings,
            f"worker process died (killed by SIGKILL) during {what}",
        )

    def _timed_out(
        self, cand: Candidate, settings: ProbeSettings, timeout: float | None
    ) -> ProbeResult:
        return crashed_result(
            self.landscape.workload,
            cand,
            self.device,
            settings,
            f"no result within its hard limit of {timeout or 0:.0f}s: the worker was stopped",
            timed_out=True,
        )


def _diagnosed_steps(engine: SimEngine, steps: int, scales: list[float]) -> None:
    """The diagnosis' steps: one at a time, each scale read before it; a run without a scaler
    stops at its first non-finite loss (what follows is NaN noise), as the real one does."""
    engine.build()
    for _ in range(steps):
        scales.append(engine.scale())
        engine.run_steps(1)
        (loss,) = engine.read_losses()
        if not engine.mode.scales_loss and not math.isfinite(loss):
            break


def _dtype(cand: Candidate) -> str | None:
    return {"fp16": "float16", "bf16": "bfloat16"}.get(cand.precision)
