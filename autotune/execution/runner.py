"""Who runs probes: the Runner interface, and :class:`InProcessRunner`, which probes in this
process (no isolation, no hard limit, no start-up cost: tests, notebooks)."""

from __future__ import annotations

import json
from typing import Any

from autotune.errors import AutotuneError
from autotune.execution.facts import WorkerFacts
from autotune.execution.messages import CompareRequest, DiagnoseRequest, ProbeRequest
from autotune.measure.knobs import poisons_context
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings

__all__ = [
    "RESTARTED",
    "InProcessRunner",
    "Runner",
    "StartTooSlow",
    "crashed_pair",
    "crashed_result",
    "poisons_context",
]


class StartTooSlow(RuntimeError):
    """The worker was not ready within the seconds its start was given (it was stopped)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the probe worker was not ready within {seconds:.1f}s")
        self.seconds = seconds


# Appended to the reason of a probe that ended so.
RESTARTED = "the CUDA context cannot be used after this error: the probe worker was restarted"


class Runner:
    """Runs the search's probes, paired runs and diagnoses, and finds the facts they need.

    This class says what each call means, once; an implementation decides only where and how
    isolated the work runs: :class:`~autotune.execution.probe_worker.ProbeWorker` in a worker
    process, :class:`InProcessRunner` in this one, the simulated device (:mod:`autotune.sim`) on a
    virtual clock. Callers call :meth:`run`, :meth:`compare` and :meth:`diagnose`; each puts its
    arguments into one request, the message a worker is sent
    (:mod:`autotune.execution.messages`), and an implementation answers it in
    :meth:`answer_probe`, :meth:`answer_compare` and :meth:`answer_diagnose`.

    Example:
        >>> from autotune.schema.spec import Candidate, ProbeSettings
        >>> cand = Candidate(precision="fp32", batch_size=32, learning_rate=0.05)
        >>> settings = ProbeSettings(warmup_steps=1, steps=4, min_time=0.2)
        >>> with InProcessRunner("cpu") as runner:
        ...     print(runner.run("autotune.workloads:tiny_mlp", cand, settings).outcome)
        completed
    """

    # The device the probes run on, as the caller names it (``cpu``, ``cuda:1``).
    device: str = "cpu"

    def run(
        self,
        workload: str,
        candidate: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
        early_stop: EarlyStop | None = None,
    ) -> ProbeResult:
        """Run one probe: ``candidate``'s warm-up and timed steps
        (:func:`autotune.measure.probe.run_probe`).

        Args:
            workload: the workload reference, e.g. ``autotune.workloads:tiny_mlp``.
            candidate: what to train with.
            settings: the probe's settings; ``time_limit`` is its soft limit.
            timeout: the hard limit in seconds, where the runner keeps one (a worker's default:
                ``time_limit`` plus a grace period).
            early_stop: when the probe may stop before its timed phase is done.

        Returns:
            The probe's result; ``crashed``, with the reason, when it produced none (it raised,
            or its worker died or hung).

        Raises:
            WorkloadError, SpecError, DeviceError: the user's mistake.
        """
        request = ProbeRequest(
            workload=workload, candidate=candidate, settings=settings, early_stop=early_stop
        )
        return self.answer_probe(request, timeout)

    def compare(
        self,
        workload: str,
        candidate: Candidate,
        reference: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
    ) -> PairedResult:
        """Measure ``candidate`` paired with ``reference``: their timed blocks interleaved in
        one process (:func:`autotune.measure.paired.run_paired`).

        Args:
            workload, candidate, settings, timeout: as :meth:`run`'s.
            reference: the arm ``candidate`` is measured against (the fp32 reference).

        Returns:
            Both arms' results and the speedup; both arms ``crashed``, with the reason, when the
            run produced none.

        Raises:
            WorkloadError, SpecError, DeviceError: the user's mistake.
        """
        request = CompareRequest(
            workload=workload, candidate=candidate, reference=reference, settings=settings
        )
        return self.answer_compare(request, timeout)

    def facts(self, workload: str) -> WorkerFacts:
        """The workload's facts and the device's, found where the probes run (importing the
        workload runs user code; touching a GPU opens a CUDA context).

        Raises:
            WorkloadError: the reference cannot be loaded.
            DeviceError: the device does not exist.
        """
        raise NotImplementedError  # pragma: no cover - interface

    def diagnose(
        self,
        workload: str,
        candidate: Candidate,
        *,
        steps: int = 3,
        seed: int = 0,
        timeout: float = 60.0,
    ) -> dict | None:
        """A per-layer numerics diagnosis of ``candidate`` over ``steps`` steps
        (:func:`autotune.diagnose.diagnose`), as JSON; None when it could not run, within
        ``timeout`` seconds or at all (the diagnosis is evidence, never a reason to fail a
        search)."""
        request = DiagnoseRequest(workload=workload, candidate=candidate, steps=steps, seed=seed)
        return self.answer_diagnose(request, timeout)

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        """:meth:`run`, its arguments in one request."""
        raise NotImplementedError  # pragma: no cover - interface

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        """:meth:`compare`, its arguments in one request."""
        raise NotImplementedError  # pragma: no cover - interface

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        """:meth:`diagnose`, its arguments in one request; None by default (a runner that
        cannot diagnose)."""
        return None

    def start(self, within: float | None = None) -> None:
        """Pay the start-up cost now (a worker process importing torch), not in the first probe.

        Raises:
            StartTooSlow: not ready ``within`` seconds (None: the runner's own limit); the
                worker is stopped.
        """

    def interrupt(self) -> None:
        """Stop the probe in flight at once (Ctrl-C); its ``run`` returns a crashed result."""

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


def crashed_pair(
    request: CompareRequest, device: str, reason: str, *, timed_out: bool = False
) -> PairedResult:
    """A paired run that produced nothing: both arms :func:`crashed_result`, for one reason."""
    candidate, reference = (
        crashed_result(request.workload, arm, device, request.settings, reason, timed_out=timed_out)
        for arm in (request.candidate, request.reference)
    )
    return PairedResult(candidate=candidate, reference=reference)


class InProcessRunner(Runner):
    """Runs probes in this process: no isolation and no hard limit (``timeout`` is not kept),
    but no start-up cost."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._cache: dict[str, Any] = {}

    def _loaded(self, workload: str) -> Any:
        """The workload, loaded on its first request and kept."""
        from autotune.workloads import load_workload

        if workload not in self._cache:
            self._cache[workload] = load_workload(workload)
        return self._cache[workload]

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        from autotune.measure.probe import run_probe

        workload = self._loaded(request.workload)
        try:
            return run_probe(
                workload,
                request.candidate,
                self.device,
                request.settings,
                early_stop=request.early_stop,
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
            return crashed_result(
                request.workload, request.candidate, self.device, request.settings, reason
            )

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        from autotune.measure.paired import run_paired

        workload = self._loaded(request.workload)
        try:
            return run_paired(
                workload, request.candidate, request.reference, self.device, request.settings
            )
        except AutotuneError:
            raise
        except Exception as exc:
            return crashed_pair(request, self.device, f"{type(exc).__name__}: {exc}")

    def facts(self, workload: str) -> WorkerFacts:
        from autotune.execution.collect import collect_facts

        return collect_facts(workload, self.device)

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        from autotune.diagnose import diagnose
        from autotune.workloads import load_workload

        try:
            found = diagnose(
                load_workload(request.workload),
                request.candidate,
                self.device,
                steps=request.steps,
                seed=request.seed,
            )
        except AutotuneError:
            return None
        return json.loads(found.model_dump_json())
