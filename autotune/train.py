"""Training runs under a tuned config, measured the way people compare AMP.

A run:
1. opens an :class:`~autotune.session.AmpSession` (backend flags restored afterwards) and forks
   the RNG, so the caller's random state is untouched and every run starts from the same seed;
2. builds the model, the optimizer at the run's learning rate and the batches at its size;
3. trains; the first ``warmup_steps`` are real steps but untimed (kernel selection, building the
   data pool), and the losses are read back every ``check_every`` steps (one host sync each);
4. measures peak memory, the final loss (mean over the last tenth of the steps) and, when the
   workload has an accuracy function, accuracy on held-out batches.

:func:`compare` runs the tuned config and a baseline (IEEE fp32, or the plain AMP recipe: fp16
with a default GradScaler) at the workload's base batch size and lr. Both see the same number of
samples, so losses and accuracies compare sample for sample: a larger tuned batch does not look
better, or worse, only by seeing more data.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from loguru import logger
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    model_validator,
)

from autotune.config import TunedConfig, one_line, warn_if_environment_differs
from autotune.precision import resolve_device
from autotune.probe import _check_loss, _CpuMemory
from autotune.session import AmpSession, check_supported
from autotune.spec import Candidate, PrecisionName
from autotune.workloads import Batch, Workload

__all__ = [
    "BASELINES",
    "Comparison",
    "Progress",
    "TrainResult",
    "TrainSettings",
    "baseline_candidate",
    "compare",
    "held_out_batches",
    "parse_train_settings",
    "train",
]

BASELINES: tuple[str, ...] = ("fp32", "amp")

# (run label, steps done, steps planned, latest loss or None between loss reads)
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
    # completed, or stopped early: diverged (a loss that poisons the weights, a dead scaler), oom
    outcome: Literal["completed", "diverged", "oom"] = "completed"
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
        return self.outcome == "completed"

    @property
    def epochs(self) -> float:
        """Samples seen, in epochs."""
        return self.samples / self.samples_per_epoch if self.samples_per_epoch else 0.0

    @property
    def run_seconds(self) -> float | None:
        """Steady-state time for all the run's samples."""
        return self.samples / self.throughput if self.throughput else None

    def settings(self) -> str:
        """``bf16 bs=256 lr=0.4`` (and init_scale for fp16)."""
        text = f"{self.precision} bs={self.batch_size} lr={self.learning_rate:.3g}"
        if self.init_scale is not None:
            text += f" init_scale={self.init_scale:g}"
        return text


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return a / b if a is not None and b else None


class Comparison(BaseModel):
    """The tuned run and, optionally, a baseline run on the same samples, with the ratios."""

    model_config = ConfigDict(extra="forbid")

    tuned: TrainResult
    baseline: TrainResult | None = None
    against: Literal["fp32", "amp"] | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def speedup(self) -> float | None:
        """Baseline time per epoch over the tuned one (2.0: the tuned config is twice as fast)."""
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
    from autotune.errors import SpecError, format_validation_error

    try:
        return TrainSettings(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise SpecError(one_line(format_validation_error(exc, "train options"))) from None


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
    from autotune.errors import SpecError

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


def _as_candidate(setup: TunedConfig | Candidate, workload: Workload) -> Candidate:
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
    cand = _as_candidate(setup, workload)
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
    _release_memory()
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
    cpu_mem = _CpuMemory()
    start_allocated = 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        start_allocated = torch.cuda.memory_allocated(dev)
    else:
        cpu_mem.start()
    state: dict[str, Any] = {}
    oom: str | None = None
    try:
        _loop(workload, amp, settings, total, result, on_progress, state)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0][:200] if str(exc) else "out of memory"
    # Recover outside the except block: its traceback would keep the tensors alive.
    if oom is not None:
        state.clear()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        result.outcome = "oom"
        result.reason = (
            f"out of memory at batch_size={result.batch_size}, step {result.steps}: {oom}"
        )
        return
    if dev.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(dev) - start_allocated
        result.memory_source = "cuda_allocated"
    else:
        result.peak_memory_bytes = cpu_mem.peak_growth()
        result.memory_source = "cpu_rss" if result.peak_memory_bytes is not None else "unavailable"
    if result.ok and workload.accuracy is not None and settings.eval_samples:
        if held_out is None:
            held_out = held_out_batches(workload, dev, settings)
        result.accuracy = _accuracy(workload.accuracy, amp, state["model"], held_out)


def _loop(
    workload: Workload,
    amp: AmpSession,
    settings: TrainSettings,
    total: int,
    result: TrainResult,
    on_progress: Progress | None,
    state: dict[str, Any],
) -> None:
    dev = amp.device
    model = amp.prepare(workload.build_model())
    model.train()
    opt = workload.build_optimizer(model.parameters(), amp.learning_rate)
    state.update(model=model, opt=opt)
    applied = [0]
    # GradScaler.step skips optimizer.step when the gradients are not finite: count real steps.
    hook = opt.register_step_post_hook(lambda *_: applied.__setitem__(0, applied[0] + 1))
    batches = workload.make_batches(
        amp.batch_size, dev, torch.Generator().manual_seed(settings.seed)
    )
    state["batches"] = batches
    warmup = result.warmup_steps
    pending: list[torch.Tensor] = []
    losses = result.losses
    started = time.perf_counter()
    t_start = started
    done = 0

    def read_losses(step: int) -> str | None:
        """Read the pending losses back (one sync); return why training must stop, or None."""
        values = torch.stack(pending).float().tolist()
        pending.clear()
        first = len(losses)
        losses.extend(values)
        if not amp.mode.scales_loss:
            # Without a scaler a non-finite loss reaches the weights: the run is lost.
            for offset, value in enumerate(values):
                if not math.isfinite(value):
                    return f"loss={value} at step {first + offset}"
            return None
        # With one, a non-finite loss only skips its step; a scale below 1 means it skips all.
        scale = amp.scaler.get_scale()
        if scale < 1:
            return f"GradScaler scale fell to {scale:g} at step {step}: every step is skipped"
        return None

    try:
        for i in range(total):
            if i == warmup:
                _sync(dev)
                t_start = time.perf_counter()
            batch = amp.prepare_batch(next(batches))
            opt.zero_grad(set_to_none=True)
            with amp.autocast():
                loss = workload.loss(model, batch)
            if i == 0:
                _check_loss(loss, workload)
            amp.backward(loss)
            amp.step(opt)
            pending.append(loss.detach())
            done = i + 1
            latest = None
            if done % settings.check_every == 0 or done == total:
                reason = read_losses(i)
                latest = losses[-1]
                if reason:
                    result.outcome, result.reason = "diverged", reason
                    break
            if on_progress is not None:
                on_progress(result.label, done, total, latest)
        _sync(dev)
        t_end = time.perf_counter()
    finally:
        hook.remove()
        result.steps = done
        result.samples = done * amp.batch_size
        result.skipped_steps = done - applied[0]
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


def _release_memory() -> None:
    """Free what earlier runs left, so this run's peak memory is its own.

    On a CPU, glibc keeps freed memory for reuse; a second run in the same process would then
    grow its resident memory by almost nothing. ``malloc_trim(0)`` hands the free pages back.
    """
    gc.collect()
    # Not glibc (macOS, musl): no trim, and a second run's growth may be understated.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        >>> cmp = compare(load_workload(cfg.workload), cfg, "cuda", against="fp32")  # doctest: +SKIP
        >>> cmp.speedup  # doctest: +SKIP
        2.3
    """
    settings = settings or TrainSettings()
    tuned_cand = _as_candidate(setup, workload)
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
