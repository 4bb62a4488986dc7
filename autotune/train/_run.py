"""One training run under a config: a measurement policy over the step engine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from loguru import logger

from autotune.apply import AmpSession
from autotune.config import TunedConfig, warn_if_environment_differs
from autotune.memory import PeakMemory, release_memory
from autotune.precision import resolve_device
from autotune.spec import Candidate
from autotune.step import StepEngine
from autotune.train._models import Progress, TrainResult, TrainSettings
from autotune.workloads import Batch, Workload

__all__ = ["as_candidate", "held_out_batches", "train"]


def as_candidate(setup: TunedConfig | Candidate, workload: Workload) -> Candidate:
    """The candidate a config (or a candidate) runs, with channels_last resolved."""
    cand = setup.candidate() if isinstance(setup, TunedConfig) else setup
    if cand.channels_last is None:
        cand = cand.model_copy(update={"channels_last": workload.channels_last})
    return cand


def train(
    workload: Workload,
    setup: TunedConfig | Candidate,
    device: str | torch.device = "auto",
    settings: TrainSettings | None = None,
    *,
    label: str = "tuned",
    on_progress: Progress | None = None,
    held_out: list[Batch] | None = None,
) -> TrainResult:
    """Train ``workload`` under a config (or a candidate) and measure it.

    Args:
        workload: the workload to train.
        setup: a TunedConfig (its environment is checked, once) or a Candidate.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        settings: length (steps, epochs or samples), warmup, seed; one epoch by default.
        label: names the run in results and progress.
        on_progress: called after every step with ``(label, done, total, loss or None)``.
        held_out: batches to score accuracy on; :func:`held_out_batches` when None
            (:func:`compare` makes them once for every run).

    Returns:
        The TrainResult. Divergence and OOM end the run early as outcomes, not exceptions.

    Raises:
        DeviceError: the device does not exist or cannot run the precision.
        WorkloadError: the workload breaks its contract (e.g. a loss that is not a scalar).

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> cand = Candidate(precision="bf16", batch_size=64, learning_rate=0.05)
        >>> train(tiny_mlp(), cand, "cpu", TrainSettings(steps=5)).steps
        5
    """
    settings = settings or TrainSettings()
    cand = as_candidate(setup, workload)
    dev = resolve_device(device)
    total = settings.steps_for(cand.batch_size)
    result = TrainResult(
        label=label,
        workload=workload.reference or workload.name,
        device=str(dev),
        precision=cand.precision,
        batch_size=cand.batch_size,
        learning_rate=cand.learning_rate,
        init_scale=cand.init_scale if cand.precision == "fp16" else None,
        channels_last=bool(cand.channels_last),
        planned_steps=total,
        samples_per_epoch=settings.samples_per_epoch,
        warmup_steps=min(settings.warmup_steps, total - 1),
    )
    # What earlier runs left is freed first, so this run's peak memory is its own.
    release_memory(dev)
    session = AmpSession(cand, dev)
    if isinstance(setup, TunedConfig):
        warn_if_environment_differs(setup, session.device, stacklevel=2)
    fork = [dev.index or 0] if dev.type == "cuda" else []
    with session as amp, torch.random.fork_rng(devices=fork), torch.enable_grad():
        torch.manual_seed(settings.seed)
        _run(workload, amp, settings, total, result, on_progress, held_out)
    logger.debug(
        "train {}: {} → {} {:.1f} samples/s",
        label,
        result.settings(),
        result.outcome,
        result.throughput,
    )
    return result


def _run(
    workload: Workload,
    amp: AmpSession,
    settings: TrainSettings,
    total: int,
    result: TrainResult,
    on_progress: Progress | None,
    held_out: list[Batch] | None,
) -> None:
    """The loop, then the memory and accuracy figures; writes them into ``result``."""
    dev = amp.device
    peak = PeakMemory(dev)
    peak.start()
    engine = StepEngine(workload, amp.candidate, dev, seed=settings.seed, scaler=amp.scaler)
    with engine:
        oom = engine.run(lambda e: _loop(e, amp, settings, total, result, on_progress))
        result.steps = engine.steps
        result.samples = engine.steps * amp.batch_size
        result.skipped_steps = engine.skipped
        result.losses = engine.losses
        if oom is not None:
            result.outcome = "oom"
            result.reason = (
                f"out of memory at batch_size={result.batch_size}, step {result.steps}: {oom}"
            )
            return
        result.peak_memory_bytes = peak.growth()
        result.memory_source = (
            peak.source if result.peak_memory_bytes is not None else "unavailable"
        )
        if result.ok and workload.accuracy is not None and settings.eval_samples:
            if held_out is None:
                held_out = held_out_batches(workload, dev, settings)
            assert engine.model is not None
            result.accuracy = _accuracy(workload.accuracy, amp, engine.model, held_out)


def _loop(
    engine: StepEngine,
    amp: AmpSession,
    settings: TrainSettings,
    total: int,
    result: TrainResult,
    on_progress: Progress | None,
) -> None:
    """The training run's policy over the engine: every step, a loss read every
    ``check_every`` steps; the timing and loss figures into ``result``."""
    engine.build()
    # The session sets its backend flags again: the workload's model code may have changed them.
    amp.prepare(engine.model)
    warmup = result.warmup_steps
    losses = engine.losses
    started = time.perf_counter()
    t_start = started

    def read_losses(step: int) -> str | None:
        """Read the pending losses back (one sync); return why training must stop, or None."""
        first = len(losses)
        values = engine.read_losses()
        if not amp.mode.scales_loss:
            # Without a scaler a non-finite loss reaches the weights: the run is lost.
            for offset, value in enumerate(values):
                if not math.isfinite(value):
                    return f"loss={value} at step {first + offset}"
            return None
        # With one, a non-finite loss only skips its step; a scale below 1 means it skips all.
        scale = engine.scale()
        if scale < 1:
            return f"GradScaler scale fell to {scale:g} at step {step}: every step is skipped"
        return None

    for i in range(total):
        if i == warmup:
            engine.sync()
            t_start = time.perf_counter()
        engine.step()
        done = engine.steps
        latest = None
        if done % settings.check_every == 0 or done == total:
            reason = read_losses(i)
            latest = losses[-1]
            if reason:
                result.outcome, result.reason = "diverged", reason
                break
        if on_progress is not None:
            on_progress(result.label, done, total, latest)
    engine.sync()
    t_end = time.perf_counter()
    done = engine.steps
    result.wall_seconds = t_end - started
    timed = done - warmup if done > warmup else done
    result.timed_steps = timed
    result.timed_seconds = t_end - (t_start if done > warmup else started)
    if timed and result.timed_seconds > 0:
        result.throughput = timed * amp.batch_size / result.timed_seconds
        result.seconds_per_epoch = settings.samples_per_epoch / result.throughput
    finite = [v for v in losses if math.isfinite(v)]
    if finite:
        result.first_loss = finite[0]
        tail = losses[-max(1, math.ceil(len(losses) / 10)) :]
        tail_finite = [v for v in tail if math.isfinite(v)]
        result.final_loss = sum(tail_finite) / len(tail_finite) if tail_finite else None


def held_out_batches(
    workload: Workload, device: str | torch.device, settings: TrainSettings
) -> list[Batch]:
    """Batches no run trains on, the same for every run: a generator seed the runs never use,
    ``eval_samples`` samples at the workload's base batch size.

    Args:
        workload: the workload.
        device: where the batches go.
        settings: ``eval_samples`` and ``seed``.

    Returns:
        The batches (an empty list when ``eval_samples`` is 0).

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> len(held_out_batches(tiny_mlp(), "cpu", TrainSettings(eval_samples=128)))
        2
    """
    if not settings.eval_samples:
        return []
    size = workload.base_batch_size
    gen = torch.Generator().manual_seed(settings.seed + 1)
    batches = workload.make_batches(size, resolve_device(device), gen)
    return [next(batches) for _ in range(max(1, math.ceil(settings.eval_samples / size)))]


def _accuracy(
    accuracy: Callable[[torch.nn.Module, Batch], float],
    amp: AmpSession,
    model: torch.nn.Module,
    batches: list[Batch],
) -> float | None:
    if not batches:
        return None
    model.eval()
    with torch.no_grad(), amp.autocast():
        scores = [float(accuracy(model, amp.prepare_batch(b))) for b in batches]
    model.train()
    return sum(scores) / len(scores)
