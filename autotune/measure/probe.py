"""One short, honestly timed training run of a workload under one candidate, ending in a
ProbeResult: a measurement policy over the step engine that leaves no trace behind."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import torch
from loguru import logger

from autotune.measure.knobs import compile_failure
from autotune.measure.memory import PeakMemory, release_memory
from autotune.measure.precision import (
    PrecisionMode,
    apply_backend_flags,
    check_autocast,
    float32_matmul_precision,
    get_mode,
    resolve_device,
    restore_backend_flags,
    snapshot_backend_flags,
    unsupported_modes,
)
from autotune.measure.result import ProbeResult
from autotune.measure.step import StepEngine
from autotune.measure.timed import TimedRun
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings
from autotune.workloads import Workload

__all__ = ["global_state", "leave_no_trace", "run_probe", "unsupported_reason"]


_UNSUPPORTED_CACHE: dict[str, dict[str, str]] = {}


def _unsupported(device: torch.device) -> dict[str, str]:
    key = str(device)
    if key not in _UNSUPPORTED_CACHE:
        _UNSUPPORTED_CACHE[key] = unsupported_modes(device)
    return _UNSUPPORTED_CACHE[key]


def unsupported_reason(candidate: Candidate, device: torch.device) -> str | None:
    """Why this device cannot really run the candidate's mode, or None when it can (the
    hardware check, then autocast's real output dtype)."""
    mode = get_mode(candidate.precision)
    why = _unsupported(device).get(mode.name)
    if why is not None:
        return why
    found = _check_autocast(mode, device)
    return None if found is None else found["reason"]


def global_state() -> dict[str, Any]:
    """The global torch settings a probe could change, in comparable form (tests use it)."""
    state: dict[str, Any] = {
        "flags": snapshot_backend_flags(),
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": float32_matmul_precision(),
        "cpu_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


@contextlib.contextmanager
def leave_no_trace() -> Iterator[None]:
    """Save the global torch state, run the block, put the state back — also on error."""
    saved = global_state()
    try:
        yield
    finally:
        restore_backend_flags(saved["flags"])
        torch.set_grad_enabled(saved["grad_enabled"])
        torch.set_default_dtype(saved["default_dtype"])
        torch.use_deterministic_algorithms(saved["deterministic"])
        torch.set_float32_matmul_precision(saved["float32_matmul_precision"])
        # Setting matmul precision above may touch the TF32 flag; put the flags back last.
        restore_backend_flags(saved["flags"])
        torch.set_rng_state(saved["cpu_rng"])
        random.setstate(saved["python_rng"])
        if "cuda_rng" in saved:
            torch.cuda.set_rng_state_all(saved["cuda_rng"])


def run_probe(
    workload: Workload,
    candidate: Candidate,
    device: str | torch.device = "cpu",
    settings: ProbeSettings | None = None,
    *,
    early_stop: EarlyStop | None = None,
) -> ProbeResult:
    """Train ``workload`` for ``warmup_steps + steps`` under ``candidate`` and measure it.

    Args:
        workload: the workload to train.
        candidate: precision, batch size, learning rate and GradScaler settings.
        device: ``cpu``, ``cuda:N`` or ``auto``.
        settings: probe lengths, check interval, divergence thresholds, time limit and seed.
        early_stop: when to stop before the timed phase is done (``slower``, ``off_parity``).

    Returns:
        A ProbeResult. Divergence, OOM, unsupported modes and early stops are outcomes, not
        exceptions.

    Raises:
        WorkloadError: the workload breaks its contract (e.g. its loss is not a scalar tensor).
        DeviceError: the device does not exist.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> r = run_probe(tiny_mlp(), Candidate(precision="fp32", batch_size=32, learning_rate=0.05),
        ...               settings=ProbeSettings(warmup_steps=1, steps=4, min_time=0.2))
        >>> print(r.outcome)
        completed
    """
    settings = settings or ProbeSettings()
    dev = resolve_device(device)
    mode = get_mode(candidate.precision)
    started = time.perf_counter()
    base = {
        "candidate": candidate,
        "workload": workload.reference or workload.name,
        "device": str(dev),
        "seed": settings.seed,
        "planned_steps": settings.steps,
        "batch_size": candidate.batch_size,
    }
    reason = _unsupported(dev).get(mode.name)
    if reason is not None:
        return ProbeResult(**base, outcome=Outcome.UNSUPPORTED, reason=reason)
    with leave_no_trace():
        # A caller inside torch.no_grad() still gets a training run; the mode is restored.
        torch.set_grad_enabled(True)
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        apply_backend_flags(mode)
        fields = _train(workload, candidate, dev, mode, settings, started, early_stop)
    fields["wall_seconds"] = time.perf_counter() - started
    result = ProbeResult(**base, **fields)
    logger.debug("probe {}", result.summary())
    return result


def _check_autocast(mode: PrecisionMode, dev: torch.device) -> dict[str, Any] | None:
    """None when autocast really runs the mode's dtype here, else the unsupported fields."""
    if mode.autocast_dtype is None:
        return None
    got = check_autocast(dev, mode.autocast_dtype)
    if got == mode.autocast_dtype:
        return None
    return {
        "autocast_dtype": str(got).replace("torch.", ""),
        "outcome": Outcome.UNSUPPORTED,
        "reason": f"autocast fell back to {got} instead of {mode.autocast_dtype}",
    }


def _train(  # noqa: PLR0913 - run_probe's resolved inputs, passed on once
    workload: Workload,
    candidate: Candidate,
    dev: torch.device,
    mode: PrecisionMode,
    settings: ProbeSettings,
    started: float,
    early_stop: EarlyStop | None = None,
) -> dict[str, Any]:
    unsupported = _check_autocast(mode, dev)
    if unsupported is not None:
        return unsupported
    dtype = None if mode.autocast_dtype is None else str(mode.autocast_dtype).replace("torch.", "")
    # Cleared cache, reset peaks: this probe's peak memory is its own, not an earlier one's.
    peak = PeakMemory(dev)
    peak.start()
    failed: str | None = None
    with StepEngine(workload, candidate, dev, seed=settings.seed) as engine:
        run = TimedRun(engine, settings, started, early_stop)
        try:
            oom = engine.run(lambda e: run.measure())
        except Exception as exc:
            failed = compile_failure(candidate, exc)
            if failed is None:
                raise
            oom = None
        out = run.fields()
    if failed is not None:
        # Outside the except block: its traceback would keep the half-built graphs alive.
        release_memory(dev)
        out.update(
            outcome=Outcome.COMPILE_FAILED,
            reason=failed,
            throughput=0.0,
            autocast_dtype=dtype,
            compile_seconds=None,
        )
        return out
    if oom is not None:
        return {
            **out,
            "autocast_dtype": dtype,
            "outcome": Outcome.OOM,
            "throughput": 0.0,
            "reason": f"out of memory at batch_size={candidate.batch_size}, step {engine.steps}: {oom}",
        }
    if (
        out.get("outcome") == Outcome.DIVERGED
        and engine.defect is not None
        and out.get("skipped_steps")
    ):
        out["reason"] = f"{out['reason']}; {engine.defect}"
    out["peak_memory_allocated"] = peak.allocated()
    out["peak_memory_reserved"] = peak.reserved()
    out["autocast_dtype"] = dtype
    return out
