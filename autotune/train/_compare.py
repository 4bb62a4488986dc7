"""The tuned run against a baseline, on the same samples."""

from __future__ import annotations

import torch

from autotune.apply import check_supported
from autotune.config import TunedConfig
from autotune.errors import SpecError
from autotune.spec import Candidate
from autotune.train._models import BASELINES, Comparison, Progress, TrainSettings
from autotune.train._run import as_candidate, held_out_batches, train
from autotune.workloads import Workload

__all__ = ["baseline_candidate", "compare"]


def baseline_candidate(workload: Workload, against: str) -> Candidate:
    """The baseline a tuned config is compared with, at the workload's base batch size and lr.

    Args:
        workload: the workload.
        against: ``fp32`` (IEEE fp32, TF32 off) or ``amp`` (fp16 autocast with torch's default
            GradScaler: what the usual AMP tutorial does).

    Returns:
        The baseline's Candidate.

    Raises:
        SpecError: an unknown baseline.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> baseline_candidate(tiny_mlp(), "amp").precision
        'fp16'
    """
    if against not in BASELINES:
        raise SpecError(
            f"unknown baseline compare={against!r}; use fp32 or amp, e.g. --compare fp32"
        )
    return Candidate(
        precision="fp32" if against == "fp32" else "fp16",
        batch_size=workload.base_batch_size,
        learning_rate=workload.base_lr,
        channels_last=workload.channels_last,
    )


def compare(
    workload: Workload,
    setup: TunedConfig | Candidate,
    device: str | torch.device = "auto",
    settings: TrainSettings | None = None,
    *,
    against: str | None = None,
    on_progress: Progress | None = None,
) -> Comparison:
    """Train the tuned setup and, with ``against``, a baseline on the same samples.

    With ``steps``, the tuned run takes that many steps and the baseline as many as it needs to
    see the same samples at its own batch size; with ``epochs`` or ``samples`` both see those.

    Args:
        workload: the workload to train.
        setup: the TunedConfig (or a Candidate).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        settings: length, warmup, seed.
        against: ``fp32``, ``amp`` or None (the tuned run only).
        on_progress: called after every step of either run.

    Returns:
        The Comparison with both results and the ratios.

    Raises:
        SpecError: an unknown baseline.
        DeviceError: the device cannot run the tuned precision or the baseline's; checked
            before either run starts.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> tuned = Candidate(precision="bf16", batch_size=128, learning_rate=0.1)
        >>> cmp = compare(tiny_mlp(), tuned, "cpu", TrainSettings(steps=2, eval_samples=0),
        ...               against="fp32")
        >>> cmp.baseline.batch_size, cmp.baseline.samples == cmp.tuned.samples
        (64, True)
    """
    settings = settings or TrainSettings()
    tuned_cand = as_candidate(setup, workload)
    base_cand = baseline_candidate(workload, against) if against is not None else None
    # Both modes are checked before anything trains: no half-finished comparison.
    dev = check_supported(tuned_cand.precision, device)
    if base_cand is not None:
        check_supported(base_cand.precision, dev)
    # A few unmeasured steps of each run first: the process's one-time costs (allocator and
    # library set-up, first-use kernels) would otherwise land in whichever run goes first.
    prime = settings.model_copy(
        update={"steps": 2, "epochs": None, "samples": None, "eval_samples": 0}
    )
    for cand in filter(None, (tuned_cand, base_cand)):
        train(workload, cand, dev, prime, label="prime")
    held_out = held_out_batches(workload, dev, settings) if workload.accuracy else []
    tuned = train(
        workload, setup, dev, settings, label="tuned", on_progress=on_progress, held_out=held_out
    )
    if base_cand is None:
        return Comparison(tuned=tuned)
    base_settings = settings
    if settings.steps is not None:
        base_settings = settings.model_copy(
            update={"steps": None, "samples": settings.steps * tuned_cand.batch_size}
        )
    baseline = train(
        workload,
        base_cand,
        dev,
        base_settings,
        label=str(against),
        on_progress=on_progress,
        held_out=held_out,
    )
    return Comparison(tuned=tuned, baseline=baseline, against=against)  # type: ignore[arg-type]
