"""What a training run is told and what it reports: its settings, its result, a comparison."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    model_validator,
)

from autotune.errors import SpecError, format_validation_error
from autotune.schema.config import one_line
from autotune.schema.enums import Outcome
from autotune.schema.spec import PrecisionName

__all__ = [
    "BASELINES",
    "Comparison",
    "Progress",
    "TrainResult",
    "TrainSettings",
    "parse_train_settings",
]

BASELINES: tuple[str, ...] = ("fp32", "amp")

# (run label, steps done, steps planned, latest loss): after the warm-up and every block
Progress = Callable[[str, int, int, float | None], None]


class TrainSettings(BaseModel):
    """How long a training run lasts and how it is measured.

    Give at most one of ``steps``, ``epochs`` and ``samples``; none means one epoch.

    Example:
        >>> TrainSettings(epochs=2).steps_for(256)
        64
    """

    model_config = ConfigDict(extra="forbid")

    steps: int | None = Field(default=None, gt=0)
    epochs: int | None = Field(default=None, gt=0)
    samples: int | None = Field(default=None, gt=0)
    # The built-in synthetic pools hold 8192 distinct samples: an epoch sees each once.
    samples_per_epoch: int = Field(default=8192, gt=0)
    # Real training steps left out of the clock: first-use kernel costs, building the data pool.
    warmup_steps: int = Field(default=2, ge=0)
    # One host read of the losses every k steps keeps syncs out of the step time.
    check_every: int = Field(default=25, gt=0)
    # Accuracy is measured on this many held-out samples, the same for every run; 0: not at all.
    eval_samples: int = Field(default=1024, ge=0)
    seed: int = 0
    # The share of a CUDA device kept free for other processes, as the search keeps it (the
    # spec's default): a run that needs more runs out of memory instead. None: no cap.
    memory_margin: float | None = Field(default=0.10, ge=0, lt=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_length(self) -> TrainSettings:
        given = {
            k: v
            for k, v in (("steps", self.steps), ("epochs", self.epochs), ("samples", self.samples))
            if v
        }
        if len(given) > 1:
            shown = ", ".join(f"{k}={v}" for k, v in given.items())
            raise ValueError(f"give one of steps, epochs or samples, got {shown}; e.g. --steps 100")
        return self

    def steps_for(self, batch_size: int) -> int:
        """Steps a run at ``batch_size`` takes: ``steps``, or the samples in whole batches."""
        if self.steps is not None:
            return self.steps
        total = self.samples or (self.epochs or 1) * self.samples_per_epoch
        return max(1, math.ceil(total / batch_size))


class TrainResult(BaseModel):
    """What one training run measured. Times are steady state: after the warmup steps."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    label: str
    workload: str
    device: str
    precision: PrecisionName
    batch_size: int
    learning_rate: float
    init_scale: float | None = None
    channels_last: bool = False
    # torch.compile's mode when the run compiled its model (None: eager), and what compiling
    # took in the untimed warm-up; the modules kept in fp32.
    compile_mode: str | None = None
    compile_seconds: float | None = None
    fp32_modules: list[str] = Field(default_factory=list)
    # completed, or stopped early: diverged (a loss that poisons the weights, a dead scaler), oom,
    # compile_failed (torch.compile could not compile the model)
    outcome: Literal[Outcome.COMPLETED, Outcome.DIVERGED, Outcome.OOM, Outcome.COMPILE_FAILED] = (
        Outcome.COMPLETED
    )
    reason: str = ""
    steps: int = 0
    planned_steps: int = 0
    samples: int = 0
    samples_per_epoch: int = 0
    warmup_steps: int = 0
    timed_steps: int = 0
    timed_seconds: float = 0.0
    # the whole loop, warmup included
    wall_seconds: float = 0.0
    throughput: float = 0.0
    seconds_per_epoch: float | None = None
    # the run's own peak: CUDA max_memory_allocated above what was allocated before it, or the
    # growth of the process's peak resident memory on a CPU (Linux)
    peak_memory_bytes: int | None = None
    memory_source: Literal["cuda_allocated", "cpu_rss", "unavailable"] = "unavailable"
    first_loss: float | None = None
    final_loss: float | None = None
    accuracy: float | None = None
    skipped_steps: int = 0
    losses: list[float] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.COMPLETED

    @property
    def epochs(self) -> float:
        """Samples seen, in epochs."""
        return self.samples / self.samples_per_epoch if self.samples_per_epoch else 0.0

    @property
    def run_seconds(self) -> float | None:
        """Steady-state time for all the run's samples."""
        return self.samples / self.throughput if self.throughput else None

    def settings(self) -> str:
        """``bf16 bs=256 lr=0.4`` (and init_scale for fp16, compile, fp32 modules)."""
        text = f"{self.precision} bs={self.batch_size} lr={self.learning_rate:.3g}"
        if self.init_scale is not None:
            text += f" init_scale={self.init_scale:g}"
        if self.compile_mode is not None:
            text += (
                " compile" if self.compile_mode == "default" else f" compile={self.compile_mode}"
            )
        if self.fp32_modules:
            text += f" fp32[{','.join(self.fp32_modules)}]"
        return text


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return a / b if a is not None and b else None


class Comparison(BaseModel):
    """The tuned run and, optionally, a baseline run on the same samples, with the ratios."""

    model_config = ConfigDict(extra="forbid")

    tuned: TrainResult
    baseline: TrainResult | None = None
    against: Literal["fp32", "amp"] | None = None
    # Paired runs: the median of the per-pair block-rate ratios, its 95% interval, the pairs.
    paired_speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    pairs: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def speedup(self) -> float | None:
        """How much faster the tuned run trains (2.0: twice as fast): the paired estimate when
        the runs were interleaved, else the baseline's time per epoch over the tuned one."""
        if self.paired_speedup is not None:
            return self.paired_speedup
        b = self.baseline
        return _ratio(self.tuned.throughput, b.throughput) if b and self.tuned.ok else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def memory_ratio(self) -> float | None:
        """Tuned peak memory over the baseline's."""
        b = self.baseline
        return _ratio(self.tuned.peak_memory_bytes, b.peak_memory_bytes) if b else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def loss_ratio(self) -> float | None:
        """Tuned final loss over the baseline's (below 1: the tuned run ended lower)."""
        b = self.baseline
        return _ratio(self.tuned.final_loss, b.final_loss) if b else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def accuracy_delta(self) -> float | None:
        """Tuned accuracy minus the baseline's, as a share (0.01 = one point)."""
        b = self.baseline
        if b is None or self.tuned.accuracy is None or b.accuracy is None:
            return None
        return self.tuned.accuracy - b.accuracy


def parse_train_settings(**fields: Any) -> TrainSettings:
    """Validate train options into TrainSettings.

    Args:
        **fields: TrainSettings fields, e.g. ``steps=100``; None values are dropped.

    Returns:
        The TrainSettings.

    Raises:
        SpecError: naming each bad option, its value and what would work.

    Example:
        >>> parse_train_settings(steps=100, epochs=None).steps
        100
    """
    try:
        return TrainSettings(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise SpecError(one_line(format_validation_error(exc, "train options"))) from None
