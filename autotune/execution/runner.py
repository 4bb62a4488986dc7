"""Who runs probes: the Runner interface, and a runner that probes in this process.

:class:`~autotune.execution.worker.ProbeWorker` runs them in an isolated worker process (the default
for searches and the service); :class:`InProcessRunner` runs them here, with no isolation and no
hard limit, but no start-up cost (tests, notebooks).
"""

from __future__ import annotations

import json
from typing import Any

from autotune.enums import Outcome
from autotune.errors import AutotuneError
from autotune.execution.facts import WorkerFacts
from autotune.measure.knobs import poisons_context
from autotune.measure.result import PairedResult, ProbeResult
from autotune.spec import Candidate, EarlyStop, ProbeSettings

__all__ = ["RESTARTED", "InProcessRunner", "Runner", "crashed_result", "poisons_context"]


# Appended to the reason of a probe that ended so.
RESTARTED = "the CUDA context cannot be used after this error: the probe worker was restarted"


class Runner:
    """Runs probes. ``ProbeWorker`` isolates them; ``InProcessRunner`` does not."""

    device: str = "cpu"

    def run(
        self,
        workload: str,
        candidate: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
        early_stop: EarlyStop | None = None,
    ) -> ProbeResult:  # pragma: no cover - interface
        raise NotImplementedError

    def compare(
        self,
        workload: str,
        candidate: Candidate,
        reference: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
    ) -> PairedResult:  # pragma: no cover - interface
        """Measure ``candidate`` paired with ``reference``: their timed blocks interleaved in
        one process (see :func:`autotune.measure.paired.run_paired`)."""
        raise NotImplementedError

    def facts(self, workload: str) -> WorkerFacts:  # pragma: no cover - interface
        """The workload's facts and the device's, found where the probes run (importing the
        workload runs user code; touching a GPU opens a CUDA context).

        Raises:
            WorkloadError: the reference cannot be loaded.
            DeviceError: the device does not exist.
        """
        raise NotImplementedError

    def start(self) -> None:
        """Pay the start-up cost now (a worker process importing torch), not in the first probe."""

    def interrupt(self) -> None:
        """Stop the probe in flight at once (Ctrl-C); its ``run`` returns a crashed result."""

    def diagnose(
        self,
        workload: str,
        candidate: Candidate,
        *,
        steps: int = 3,
        seed: int = 0,
        timeout: float = 60.0,
    ) -> dict | None:
        """A per-layer numerics diagnosis of a candidate, as JSON; None when it could not run
        (a runner that cannot diagnose returns None: the diagnosis is evidence, never needed)."""
        return None

    def close(self) -> None:
        """Release what the runner holds."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def crashed_result(
    workload: str,
    candidate: Candidate,
    device: str,
    settings: ProbeSettings,
    reason: str,
    *,
    timed_out: bool = False,
) -> ProbeResult:
    """A ``crashed`` result for a probe that produced none (the worker hung or died)."""
    return ProbeResult(
        timed_out=timed_out,
        candidate=candidate,
        workload=workload,
        device=device,
        outcome=Outcome.CRASHED,
        reason=reason,
        seed=settings.seed,
        planned_steps=settings.steps,
        batch_size=candidate.batch_size,
    )


class InProcessRunner(Runner):
    """Runs probes in this process: no isolation and no hard limit, but no start-up cost."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._cache: dict[str, Any] = {}

    def run(
        self,
        workload: str,
        candidate: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
        early_stop: EarlyStop | None = None,
    ) -> ProbeResult:
        from autotune.measure.probe import run_probe
        from autotune.workloads import load_workload

        if workload not in self._cache:
            self._cache[workload] = load_workload(workload)
        try:
            return run_probe(
                self._cache[workload], candidate, self.device, settings, early_stop=early_stop
            )
        except AutotuneError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if poisons_context(exc):
                # No process to replace here: say so, so nobody trusts the probes after it.
                reason += (
                    "; the CUDA context of this process cannot be used after this error, so "
                    "later probes in it fail too (the probe worker would restart)"
                )
            return crashed_result(workload, candidate, self.device, settings, reason)

    def compare(
        self,
        workload: str,
        candidate: Candidate,
        reference: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
    ) -> PairedResult:
        from autotune.measure.paired import run_paired
        from autotune.workloads import load_workload

        if workload not in self._cache:
            self._cache[workload] = load_workload(workload)
        try:
            return run_paired(self._cache[workload], candidate, reference, self.device, settings)
        except AutotuneError:
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            return PairedResult(
                candidate=crashed_result(workload, candidate, self.device, settings, why),
                reference=crashed_result(workload, reference, self.device, settings, why),
            )

    def facts(self, workload: str) -> WorkerFacts:
        from autotune.execution.collect import collect_facts

        return collect_facts(workload, self.device)

    def diagnose(
        self,
        workload: str,
        candidate: Candidate,
        *,
        steps: int = 3,
        seed: int = 0,
        timeout: float = 60.0,
    ) -> dict | None:
        """The diagnosis in this process (no isolation, like the probes here)."""
        from autotune.diagnose import diagnose
        from autotune.workloads import load_workload

        try:
            found = diagnose(
                load_workload(workload), candidate, self.device, steps=steps, seed=seed
            )
        except AutotuneError:
            return None
        return json.loads(found.model_dump_json())
