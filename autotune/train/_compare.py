"""The tuned run against a baseline, on the same samples."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from loguru import logger

from autotune.amp_session import check_supported
from autotune.errors import SpecError
from autotune.measure.stats import MIN_VALUES, claimed, ratio_estimate
from autotune.schema.config import TunedConfig
from autotune.schema.spec import Candidate
from autotune.train._models import BASELINES, Comparison, Progress, TrainResult, TrainSettings
from autotune.train._training_run import TrainRun, as_candidate, held_out_batches, train
from autotune.workloads import Batch, Workload

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


def compare(  # noqa: PLR0913 - public API: train()'s arguments, plus the baseline's options
    workload: Workload,
    setup: TunedConfig | Candidate,
    device: str | torch.device = "auto",
    settings: TrainSettings | None = None,
    *,
    against: str | None = None,
    on_progress: Progress | None = None,
    paired: bool = True,
) -> Comparison:
    """Train the tuned setup and, with ``against``, a baseline on the same samples.

    With ``steps``, the tuned run takes that many steps and the baseline as many as it needs to
    see the same samples at its own batch size; with ``epochs`` or ``samples`` both see those.

    The two runs are *paired*: both are alive at once and advance a block of ``check_every``
    steps in turn (tuned, baseline, tuned, …), so drift and a neighbour's load hit both; the
    speedup is the median of the per-pair block-rate ratios, with its 95% interval: from six
    pairs on; with fewer the interval is left out (None), and a warning says to run longer.
    Each run's peak memory is measured on its own first, in a short run of a few steps.

    Args:
        workload: the workload to train.
        setup: the TunedConfig (or a Candidate).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        settings: length, warmup, seed.
        against: ``fp32``, ``amp`` or None (the tuned run only).
        on_progress: called after every block of either run.
        paired: False runs the two one after the other (what an unpaired timing says).

    Returns:
        The Comparison with both results and the ratios.

    Raises:
        SpecError: an unknown baseline.
        DeviceError: the device cannot run the tuned precision or the baseline's; checked
            before either run starts.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> tuned = Candidate(precision="bf16", batch_size=128, learning_rate=0.1)
        >>> cmp = compare(tiny_mlp(), tuned, "cpu", TrainSettings(steps=8, check_every=2,
        ...               eval_samples=0), against="fp32")
        >>> cmp.baseline.batch_size, cmp.baseline.samples == cmp.tuned.samples, cmp.pairs > 0
        (64, True, True)
    """
    settings = settings or TrainSettings()
    tuned_cand = as_candidate(setup, workload)
    base_cand = baseline_candidate(workload, against) if against is not None else None
    # Both modes are checked before anything trains: no half-finished comparison.
    dev = check_supported(tuned_cand.precision, device)
    if base_cand is not None:
        check_supported(base_cand.precision, dev)
    peaks = _prime(workload, dev, settings, {"tuned": tuned_cand, "baseline": base_cand})
    held_out = held_out_batches(workload, dev, settings) if workload.accuracy else []
    runs = _Runs(workload, dev, held_out, on_progress)
    if base_cand is None:
        return Comparison(tuned=runs.alone(setup, settings, "tuned"))
    base_settings = settings
    if settings.steps is not None:
        # The baseline sees the tuned run's samples at its own batch size.
        base_settings = settings.model_copy(
            update={"steps": None, "samples": settings.steps * tuned_cand.batch_size}
        )
    if not paired:
        tuned = runs.alone(setup, settings, "tuned")
        baseline = runs.alone(base_cand, base_settings, str(against))
        return Comparison(tuned=tuned, baseline=baseline, against=against)
    tuned, baseline, rates = runs.in_turn(
        (setup, settings, "tuned"), (base_cand, base_settings, str(against))
    )
    for result, name in ((tuned, "tuned"), (baseline, "baseline")):
        result.peak_memory_bytes = peaks[name].peak_memory_bytes
        result.memory_source = peaks[name].memory_source
    return _paired_comparison(tuned, baseline, rates, against=against)


def _prime(
    workload: Workload,
    dev: torch.device,
    settings: TrainSettings,
    cands: dict[str, Candidate | None],
) -> dict[str, TrainResult]:
    """A few steps of each run first, one at a time: the process's one-time costs (allocator
    and library set-up, thread pools, first-use kernels) are paid first by a run no figure
    comes from (the uncompiled one, where there is one: it compiles nothing), so they are not
    charged to whichever run primed first, and each run's peak memory is its own."""
    prime = settings.model_copy(
        update={"steps": 3, "epochs": None, "samples": None, "eval_samples": 0, "warmup_steps": 1}
    )
    runs = {name: cand for name, cand in cands.items() if cand is not None}
    warm = min(runs, key=lambda name: runs[name].compile)
    train(workload, runs[warm], dev, prime, label="prime")
    return {name: train(workload, cand, dev, prime, label="prime") for name, cand in runs.items()}


# A run's setup, its settings and its label.
_Arm = tuple[TunedConfig | Candidate, TrainSettings, str]


@dataclass
class _Runs:
    """What both runs share: the workload, the device, the held-out batches, the watcher."""

    workload: Workload
    dev: torch.device
    held_out: list[Batch]
    on_progress: Progress | None

    def alone(
        self, what: TunedConfig | Candidate, settings: TrainSettings, label: str
    ) -> TrainResult:
        return train(
            self.workload,
            what,
            self.dev,
            settings,
            label=label,
            on_progress=self.on_progress,
            held_out=self.held_out,
        )

    def in_turn(
        self, tuned: _Arm, baseline: _Arm
    ) -> tuple[TrainResult, TrainResult, list[list[float]]]:
        """Both runs alive at once, a block each in turn while both run; then whichever is
        left finishes alone.

        Returns:
            Both results, and each run's block rates.
        """
        with contextlib.ExitStack() as stack:
            runs = [
                stack.enter_context(
                    TrainRun(
                        self.workload,
                        run_setup,
                        self.dev,
                        run_settings,
                        label=label,
                        on_progress=self.on_progress,
                        measure_memory=False,
                    )
                )
                for run_setup, run_settings, label in (tuned, baseline)
            ]
            while any([run.advance() for run in runs]):
                pass
            first, second = (run.finish(self.held_out) for run in runs)
            return first, second, [run.rates() for run in runs]


def _paired_comparison(
    tuned: TrainResult, baseline: TrainResult, rates: list[list[float]], *, against: str | None
) -> Comparison:
    """The speedup of paired runs: the median of the per-pair block-rate ratios, with its
    interval from six pairs on."""
    pairs = min(len(rates[0]), len(rates[1]))
    est = ratio_estimate(rates[0][:pairs], rates[1][:pairs]) if tuned.ok else None
    est = claimed(est) if est is not None else None
    # Fewer pairs give only the ratios' range, not a 95% interval: the point stays, the
    # interval is not claimed.
    interval = est if est is not None and not est.too_few else None
    if est is not None and est.too_few:
        logger.warning(
            "{} of blocks: too few for a 95% interval on the speedup ({} are needed), so none "
            "is given; run longer (more steps or epochs) for one",
            _pairs(est.n),
            MIN_VALUES,
        )
    return Comparison(
        tuned=tuned,
        baseline=baseline,
        against=against,
        paired_speedup=est.value if est else None,
        speedup_low=interval.low if interval is not None else None,
        speedup_high=interval.high if interval is not None else None,
        pairs=est.n if est else 0,
    )


def _pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"
