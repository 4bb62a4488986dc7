"""The sections of a landscape file: each precision mode, the noise, the loss curve, parity,
fp16's numerics, the knobs, the timing outside the steps and the workload's facts."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autotune.schema.spec import CompileMode

__all__ = [
    "CompileFigures",
    "Facts",
    "Fp16Model",
    "Knobs",
    "LossModel",
    "ModeModel",
    "Noise",
    "ParityModel",
    "Source",
    "Timing",
]


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Fields only a schema_version 2 file may set.
    V2: ClassVar[frozenset[str]] = frozenset()


class Source(_M):
    """Where a figure comes from: a citation a reader can follow."""

    id: str
    cite: str
    used_for: str = ""


class ModeModel(_M):
    """One precision mode on this device."""

    # Samples/s at batch sizes: log-log interpolated between, flat past the ends. A rate may
    # fall again past a middle batch (activations that no longer fit the caches, another
    # kernel chosen for the larger shape): the interpolation follows the table down.
    throughput: dict[int, float] = Field(min_length=1)
    # Peak bytes of a probe: fixed (weights, optimizer state, workspace) + per sample.
    memory_fixed_bytes: int = Field(ge=0)
    memory_per_sample_bytes: int = Field(ge=0)
    # The loss curve's relative gap to fp32's at the base batch and lr (0.01: 1% higher).
    parity_gap: float = 0.0

    @model_validator(mode="after")
    def _positive(self) -> ModeModel:
        bad = {bs: v for bs, v in self.throughput.items() if bs <= 0 or not v > 0}
        if bad:
            raise ValueError(f"throughput needs positive batch sizes and rates, got {bad}")
        return self


class Noise(_M):
    """How a timed block's time varies around the median."""

    V2 = frozenset({"burst_blocks"})

    # Block to block: log-normal with this sigma (0.02: ~2%).
    block_cv: float = Field(default=0.02, ge=0)
    # Slow drift shared by everything running at that time: 1 + amplitude * sin(2π t / period).
    drift_amplitude: float = Field(default=0.0, ge=0, lt=1)
    drift_period_s: float = Field(default=600.0, gt=0)
    # A neighbour's burst: with this probability a block starts one, and runs this many times
    # slower ...
    burst_probability: float = Field(default=0.0, ge=0, le=1)
    burst_slowdown: float = Field(default=2.0, ge=1)
    # ... as do the blocks after it, this many in all: a neighbour's job runs for a while, not
    # for one block, and hits whatever runs meanwhile (both arms of a paired run alike).
    burst_blocks: int = Field(default=1, ge=1)


class LossModel(_M):
    """The fp32 reference's loss by samples seen: final + (initial - final) * exp(-s / scale)."""

    initial: float = Field(default=2.3, gt=0)
    final: float = Field(default=0.5, gt=0)
    samples_scale: float = Field(default=20000.0, gt=0)
    # Step to step noise of a loss (relative, log-normal): the floor's; the curve's falling part
    # moves by at most 5% (a fresh model's loss is near log(classes) on every batch).
    step_noise: float = Field(default=0.02, ge=0)
    # Seed to seed spread of a whole curve's level (relative): what a parity check sees move.
    seed_spread: float = Field(default=0.01, ge=0)


class ParityModel(_M):
    """How far a candidate's curve lies above the reference's, beyond its mode's own gap."""

    V2 = frozenset({"gap_onset_samples", "diverge_lr_above", "lag_fade"})

    # Per doubling of the batch above the workload's base (at the lr its rule gives) ...
    gap_per_batch_doubling: float = 0.0
    # ... and per unit of (batch / base - 1) above the base: the large-batch gap grows with
    # the batch itself, so a ladder's steps cross the tolerance cleanly.
    gap_per_batch_ratio: float = 0.0
    # Per unit of |log2(lr multiplier)|: an lr off the rule learns worse.
    gap_per_lr_log2: float = 0.05
    # A larger batch's early lag, per unit of (batch / base - 1) above the base: at equal
    # samples it has taken fewer steps, and until training settles (the lr rule holds only
    # then) its loss lags by up to this much more: the lag grows over its first samples
    # (e-fold ``lag_ramp_samples``) and fades linearly to nothing after ``lag_steps`` of its
    # steps (so a larger batch lags for more samples). A full run erases it, so the truth
    # leaves it out: only a short horizon sees it.
    lag_per_batch_ratio: float = Field(default=0.0, ge=0)
    lag_ramp_samples: float = Field(default=4000.0, gt=0)
    lag_steps: float = Field(default=200.0, gt=0)
    # How the lag fades: linearly to nothing at ``lag_steps``, or halving every ``lag_steps``
    # of its steps (a relaxation: a CPU's tiny convnet at 8x the batch lagged 70%, 27% and
    # about 0 after 31, 125 and 312 of its steps).
    lag_fade: Literal["linear", "exponential"] = "linear"
    # The lasting gap shows in full only from this many samples on, and ramps in smoothly
    # before (0: from the start). A lower precision's rounding swallows updates only once they
    # are small against the weights, late in training: a short run's curves agree, and a
    # parity read over fewer samples sees a fraction of the gap (a quarter of the way: ~16%).
    gap_onset_samples: float = Field(default=0.0, ge=0)
    # An lr multiplier above this blows the loss up (None: never).
    diverge_lr_multiplier: float | None = None
    # An lr above this many times the workload's base lr blows the loss up at any batch (None:
    # never): without a warm-up the first updates at that lr leave the stable region however
    # large the batch, so the linear rule's lr diverges from some batch up while the base lr
    # trains there (an H200's and a CPU's recorded resnet18: lr 0.2 at bs=256 diverged).
    diverge_lr_above: float | None = Field(default=None, gt=0)


class Fp16Model(_M):
    """What fp16's GradScaler sees."""

    V2 = frozenset(
        {"diverge_batch_exponent", "diverge_lr_exponent", "diverge_min_batch", "skip_rate"}
    )

    # Gradients overflow above this scale: a larger init_scale skips steps while it backs off
    # (one step per halving; a scale far above it skips a probe's whole timed window).
    safe_init_scale: float = Field(default=65536.0, gt=0)
    # Activations overflow fp16's range somewhere: the loss turns inf at this step (at the
    # base batch and the rule's lr) ...
    diverges_at_step: int | None = None
    # ... at step ``diverges_at_step * (batch / base) ** diverge_batch_exponent *
    # lr_multiplier ** diverge_lr_exponent``: the weights, and the activations they make, grow
    # with the updates taken, so a larger lr (and a larger batch at the rule's larger lr)
    # reaches fp16's limit in fewer steps (negative exponents); 0: the same step for all ...
    diverge_batch_exponent: float = 0.0
    diverge_lr_exponent: float = 0.0
    # ... and only from this batch up (None: every batch): a summed loss, or a larger batch's
    # larger lr, takes the activations past the limit only there.
    diverge_min_batch: int | None = Field(default=None, gt=0)
    # ... unless these modules run in fp32 (fp32 islands). In a version 2 file, an overflow
    # with no islands named is in functional code between modules (an op outside any
    # submodule, or the loss): no module list fixes it. (Version 1 read an empty list as
    # already fixed: its overflow never happened.)
    islands: list[str] = Field(default_factory=list)
    # After the back-off, this share of steps still overflows at any scale (a rare batch's
    # gradient spike): each skip halves the scale, and GradScaler doubles it only after
    # ``growth_interval`` clean steps, so past about 0.57 / growth_interval the scale falls
    # for good, below 1: diverged. Skipping more than the probes' max_skip_rate is diverged
    # too.
    skip_rate: float = Field(default=0.0, ge=0, le=1)


class CompileFigures(_M):
    """What one torch.compile mode brings and costs."""

    speedup: float = Field(gt=0)
    # Paid in the first step of every run that compiles.
    seconds: float = Field(ge=0)


class Knobs(_M):
    """What the knobs bring, as throughput factors."""

    V2 = frozenset({"compile_modes"})

    # torch.compile's default mode (and any mode not in compile_modes).
    compile_speedup: float = Field(default=1.0, gt=0)
    compile_seconds: float = Field(default=30.0, ge=0)
    # Per mode: reduce-overhead's CUDA graphs cut the launch floor (most at small batches),
    # max-autotune benchmarks kernel choices for its shapes (several times longer to compile).
    compile_modes: dict[CompileMode, CompileFigures] = Field(default_factory=dict)
    # channels_last on, against off (for 4-d inputs); 1.0 where it does not matter.
    channels_last_speedup: float = Field(default=1.0, gt=0)
    # Each module kept in fp32 inside fp16 costs this share of the speed.
    fp32_module_cost: float = Field(default=0.05, ge=0, lt=1)


class Timing(_M):
    """What is paid outside the timed steps."""

    worker_start_seconds: float = Field(default=3.0, ge=0)
    # The tuner's own decision per trial (the sampler's ask, the storage's writes).
    trial_overhead_seconds: float = Field(default=0.1, ge=0)
    # Building the model, optimizer and batches, per probe.
    build_seconds: float = Field(default=0.3, ge=0)
    # The first step's extra cost (kernels for a new shape, cuDNN autotune, allocator growth).
    first_step_seconds: float = Field(default=0.2, ge=0)
    # Warm-up: step i costs (1 + extra * exp(-i / steps)) times the steady step.
    warmup_extra: float = Field(default=0.5, ge=0)
    warmup_steps: float = Field(default=3.0, gt=0)


class Facts(_M):
    """The workload's facts, as the worker would report them."""

    base_lr: float = Field(gt=0)
    base_batch_size: int = Field(gt=0)
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    channels_last: bool = False
    optimizer: str = "SGD"
