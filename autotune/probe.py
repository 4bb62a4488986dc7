"""One short, honestly timed training run of a workload under one candidate.

A probe is a measurement policy over :class:`~autotune.step.StepEngine`, which owns the AMP
step, the loss read-back and the OOM recovery. A probe:
1. checks the device really supports the precision mode (autocast output dtype included);
2. clears the device cache and resets the peak memory statistics, so its peak is its own;
   builds the model, optimizer and GradScaler from a fixed seed;
3. runs untimed warmup steps, then timed steps between two device synchronizations;
4. reads the loss (and the fp16 scale) back every ``check_every`` steps to catch divergence,
   so the host syncs only once per check;
5. reports throughput, peak memory, the loss and scale traces and an outcome.

It leaves no trace: RNG states, backend flags and grad mode are restored afterwards, and an
out-of-memory error is cleaned up so the same process can run the next probe.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import torch
from loguru import logger

from autotune.memory import PeakMemory
from autotune.precision import (
    PrecisionMode,
    apply_backend_flags,
    check_autocast,
    get_mode,
    resolve_device,
    restore_backend_flags,
    snapshot_backend_flags,
    unsupported_modes,
)
from autotune.result import ProbeResult
from autotune.spec import Candidate, ProbeSettings, format_duration
from autotune.step import StepEngine
from autotune.workloads import Workload

__all__ = ["global_state", "leave_no_trace", "run_probe"]

_UNSUPPORTED_CACHE: dict[str, dict[str, str]] = {}


def _unsupported(device: torch.device) -> dict[str, str]:
    key = str(device)
    if key not in _UNSUPPORTED_CACHE:
        _UNSUPPORTED_CACHE[key] = unsupported_modes(device)
    return _UNSUPPORTED_CACHE[key]


def global_state() -> dict[str, Any]:
    """The global torch settings a probe could change, in comparable form (tests use it)."""
    state: dict[str, Any] = {
        "flags": snapshot_backend_flags(),
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
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
) -> ProbeResult:
    """Train ``workload`` for ``warmup_steps + steps`` under ``candidate`` and measure it.

    Args:
        workload: the workload to train.
        candidate: precision, batch size, learning rate and GradScaler settings.
        device: ``cpu``, ``cuda:N`` or ``auto``.
        settings: probe lengths, check interval, divergence thresholds, time limit and seed.

    Returns:
        A ProbeResult. Divergence, OOM and unsupported modes are outcomes, not exceptions.

    Raises:
        WorkloadError: the workload breaks its contract (e.g. its loss is not a scalar tensor).
        DeviceError: the device does not exist.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> r = run_probe(tiny_mlp(), Candidate(precision="fp32", batch_size=32, learning_rate=0.05),
        ...               settings=ProbeSettings(warmup_steps=1, steps=4))
        >>> r.outcome
        'completed'
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
        return ProbeResult(**base, outcome="unsupported", reason=reason)
    with leave_no_trace():
        # A caller inside torch.no_grad() still gets a training run; the mode is restored.
        torch.set_grad_enabled(True)
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        apply_backend_flags(mode)
        fields = _train(workload, candidate, dev, mode, settings, started)
    fields["wall_seconds"] = time.perf_counter() - started
    result = ProbeResult(**base, **fields)
    logger.debug("probe {}", result.summary())
    return result


def _train(
    workload: Workload,
    candidate: Candidate,
    dev: torch.device,
    mode: PrecisionMode,
    settings: ProbeSettings,
    started: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {"outcome": "completed", "warmup_steps": 0}
    if mode.autocast_dtype is not None:
        got = check_autocast(dev, mode.autocast_dtype)
        out["autocast_dtype"] = str(got).replace("torch.", "")
        if got != mode.autocast_dtype:
            return {
                **out,
                "outcome": "unsupported",
                "reason": f"autocast fell back to {got} instead of {mode.autocast_dtype}",
            }
    # Cleared cache, reset peaks: this probe's peak memory is its own, not an earlier one's.
    peak = PeakMemory(dev)
    peak.start()
    with StepEngine(workload, candidate, dev, seed=settings.seed) as engine:
        oom = engine.run(lambda e: _loop(e, settings, started, out))
        # Also on divergence: the skips are part of the evidence the reason refers to.
        out["skipped_steps"] = engine.skipped
    if oom is not None:
        return {
            **out,
            "outcome": "oom",
            "throughput": 0.0,
            "reason": f"out of memory at batch_size={candidate.batch_size}, step {engine.steps}: {oom}",
        }
    out["peak_memory_allocated"] = peak.allocated()
    out["peak_memory_reserved"] = peak.reserved()
    return out


def _loop(engine: StepEngine, settings: ProbeSettings, started: float, out: dict[str, Any]) -> None:
    """The probe's policy over the engine: warmup, timed steps, checks; figures into ``out``."""
    engine.build()
    warmup, total = settings.warmup_steps, settings.warmup_steps + settings.steps
    losses = engine.losses
    scales: list[tuple[int, float]] = []
    out.update(losses=losses, scales=scales)
    t_start: float | None = None
    t_first: float | None = None
    applied_at_start = 0
    check_seconds = 0.0

    def check(step: int) -> str | None:
        """Read pending losses (one sync) and the scale; return a divergence reason or None."""
        first = len(losses)
        for offset, value in enumerate(engine.read_losses()):
            at = first + offset
            if not math.isfinite(value):
                return f"loss={value} at step {at}"
            if losses[0] > 0 and value > settings.loss_blowup_factor * losses[0]:
                return (
                    f"loss={value:.4g} at step {at} is above {settings.loss_blowup_factor:g}x "
                    f"the initial {losses[0]:.4g}"
                )
        if engine.mode.scales_loss:
            scale = engine.scale()
            scales.append((step, scale))
            if scale < 1:
                return f"GradScaler scale fell to {scale:g} at step {step}"
            if t_start is not None:
                timed = step + 1 - warmup
                skipped = timed - (engine.applied - applied_at_start)
                if timed >= settings.check_every and skipped / timed > settings.max_skip_rate:
                    return (
                        f"GradScaler skipped {skipped} of {timed} steps after warmup "
                        f"(limit {settings.max_skip_rate:.0%}) at step {step}, scale={scale:g}"
                    )
        return None

    for i in range(total):
        if i == warmup:
            if engine.pending:
                reason = check(i - 1)
                if reason:
                    out.update(outcome="diverged", reason=reason)
                    return
            engine.sync()
            t_start = time.perf_counter()
            applied_at_start = engine.applied
        engine.step()
        if i == 0 and warmup > 0:
            # Marks the end of the first (costliest) step, for a probe its time limit stops
            # inside warmup; without warmup this step is timed and must not sync.
            engine.sync()
            t_first = time.perf_counter()
        last = i == total - 1
        over_time = time.perf_counter() - started > settings.time_limit
        if (i + 1) % settings.check_every == 0 or last or over_time:
            c0 = time.perf_counter()
            reason = check(i)
            if t_start is not None:
                check_seconds += time.perf_counter() - c0
            if reason:
                out.update(outcome="diverged", reason=reason)
                return
        if over_time and not last:
            out["truncated"] = True
            logger.info(
                "probe stopped at its time limit of {} after {} steps",
                format_duration(settings.time_limit),
                engine.steps,
            )
            break
    done = engine.steps
    if engine.pending:
        reason = check(done - 1)
        if reason:
            out.update(outcome="diverged", reason=reason)
            return
    engine.sync()
    t_end = time.perf_counter()
    if t_start is not None and done > warmup:
        timed_steps, seconds = done - warmup, t_end - t_start
    elif done > 1 and t_first is not None:
        # Stopped inside warmup: score the steps after the first one (scored, and flagged).
        timed_steps, seconds = done - 1, t_end - t_first
    else:
        timed_steps, seconds = done, t_end - started
    # Stopped inside warmup: the steps scored as timed are no longer warmup.
    out["warmup_steps"] = done - timed_steps
    out["timed_steps"] = timed_steps
    out["timed_seconds"] = seconds
    out["check_seconds"] = check_seconds
    if timed_steps and seconds > 0:
        out["throughput"] = timed_steps * engine.candidate.batch_size / seconds
        out["step_time"] = seconds / timed_steps
    if timed_steps < settings.steps:
        out["truncated"] = True
        if not out.get("reason"):
            out["reason"] = (
                f"time limit {format_duration(settings.time_limit)} reached: scored on "
                f"{timed_steps} of {settings.steps} timed steps"
            )
