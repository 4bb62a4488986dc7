"""One training run under a config: a measurement policy over the step engine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from loguru import logger

from autotune.amp_session import AmpSession
from autotune.measure.knobs import compile_failure
from autotune.measure.memory import PeakMemory, memory_cap, release_memory, restart_peak
from autotune.measure.precision import apply_backend_flags, resolve_device
from autotune.measure.step import StepEngine
from autotune.schema.config import TunedConfig, warn_if_environment_differs
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate
from autotune.train._models import Progress, TrainResult, TrainSettings
from autotune.workloads import Batch, Workload

__all__ = ["RandomStreams", "TrainRun", "as_candidate", "held_out_batches", "train"]

# Blocks per run, about: each ends with a device sync and one read of its losses.
_BLOCKS = 40


def as_candidate(setup: TunedConfig | Candidate, workload: Workload) -> Candidate:
    """The candidate a config (or a candidate) runs, with channels_last resolved."""
    cand = setup.candidate() if isinstance(setup, TunedConfig) else setup
    if cand.channels_last is None:
        cand = cand.model_copy(update={"channels_last": workload.channels_last})
    return cand


def train(  # noqa: PLR0913 - public API: what to train, then keyword-only options
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
        on_progress: called after the warm-up and every block of ``check_every`` steps with
            ``(label, done, total, latest loss)``.
        held_out: batches to score accuracy on; :func:`held_out_batches` when None
            (:func:`compare` makes them once for every run).

    A compiled setup compiles in the untimed warm-up, afresh (torch's in-process compile caches
    are dropped first): its ``compile_seconds`` are what a new training process pays.

    Returns:
        The TrainResult. Divergence, OOM and a failed compile end the run early as outcomes,
        not exceptions.

    Raises:
        DeviceError: the device does not exist or cannot run the precision.
        WorkloadError: the workload breaks its contract (e.g. a loss that is not a scalar).

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> cand = Candidate(precision="bf16", batch_size=64, learning_rate=0.05)
        >>> train(tiny_mlp(), cand, "cpu", TrainSettings(steps=5)).steps
        5
    """
    with TrainRun(workload, setup, device, settings, label=label, on_progress=on_progress) as run:
        while run.advance():
            pass
        return run.finish(held_out)


class TrainRun:
    """One training run, advanced a block of steps at a time (about forty blocks a run, at most
    ``check_every`` steps each).

    :func:`train` advances one run to its end; :func:`~autotune.train.compare` advances two in
    turn, so their timed blocks interleave (tuned, baseline, tuned, …) and a neighbour's load
    hits both. Each block runs under the run's own session (its backend flags are set again
    before the block), between two device syncs, and ends with one read of its losses.

    Args:
        workload: the workload to train.
        setup: a TunedConfig (its environment is checked, once) or a Candidate.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        settings: length, warmup, seed.
        label: names the run in results and progress.
        on_progress: called after every block with ``(label, done, total, latest loss)``.
        measure_memory: measure this run's peak memory (not when another run is alive beside
            it: the peak would be both runs').
    """

    def __init__(  # noqa: PLR0913 - train()'s arguments: a TrainRun is train() one block at a time
        self,
        workload: Workload,
        setup: TunedConfig | Candidate,
        device: str | torch.device = "auto",
        settings: TrainSettings | None = None,
        *,
        label: str = "tuned",
        on_progress: Progress | None = None,
        measure_memory: bool = True,
    ) -> None:
        self.workload = workload
        self.settings = settings = settings or TrainSettings()
        cand = as_candidate(setup, workload)
        dev = resolve_device(device)
        self.total = settings.steps_for(cand.batch_size)
        self.on_progress = on_progress
        self.result = TrainResult(
            label=label,
            workload=workload.reference or workload.name,
            device=str(dev),
            precision=cand.precision,
            batch_size=cand.batch_size,
            learning_rate=cand.learning_rate,
            init_scale=cand.init_scale if cand.precision == "fp16" else None,
            channels_last=bool(cand.channels_last),
            planned_steps=self.total,
            samples_per_epoch=settings.samples_per_epoch,
            # A compiled run compiles in its first step: never a timed one.
            warmup_steps=min(max(settings.warmup_steps, int(cand.compile)), self.total - 1),
            compile_mode=cand.compile_mode if cand.compile else None,
            fp32_modules=list(cand.fp32_modules),
        )
        # What earlier runs left is freed first, so this run's peak memory is its own.
        release_memory(dev)
        # Compiling afresh: a compiled run pays what a new training process pays, in its warm-up.
        self.amp = AmpSession(cand, dev, fresh_compile=True)
        if isinstance(setup, TunedConfig):
            warn_if_environment_differs(setup, self.amp.device, stacklevel=3)
        self.peak = PeakMemory(dev) if measure_memory else None
        # The session prepares the model, as in a training script: fp32 modules, channels_last,
        # torch.compile, and its backend flags again (the model code may have changed them).
        self.engine = StepEngine(
            workload,
            self.amp.candidate,
            dev,
            seed=settings.seed,
            scaler=self.amp.scaler,
            prepare=self.amp.prepare,
        )
        # This run's own random streams, the CPU's and its device's: interleaved runs must not
        # draw from each other's, and each block continues where the run's last one stopped.
        self.streams = RandomStreams(settings.seed, [torch.device("cpu"), self.amp.device])
        self.blocks: list[tuple[int, float]] = []
        # About forty blocks a run (at most check_every steps each): enough pairs for an
        # interval when two runs interleave, one loss read per block.
        self.block_steps = max(1, min(settings.check_every, math.ceil(self.total / _BLOCKS)))
        self.done = False
        self._started = 0.0

    def __enter__(self) -> TrainRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.close()
        self.amp.close()

    def _in_own_state(self, action: Callable[[], None]) -> bool:
        """Run ``action`` under this run's flags, random state and grad mode; an OOM or a failed
        compile ends the run (False)."""
        with self.streams.own(), torch.enable_grad():
            # Two runs interleave: each block runs under its own run's backend flags.
            apply_backend_flags(self.amp.mode)
            failed: str | None = None
            try:
                oom = self.engine.run(lambda e: self._within_margin(action))
            except Exception as exc:
                failed = compile_failure(self.amp.candidate, exc)
                if failed is None:
                    raise
                oom = None
        if failed is not None:
            self.result.outcome, self.result.reason = Outcome.COMPILE_FAILED, failed
            self.done = True
            return False
        if oom is not None:
            r = self.result
            r.outcome = Outcome.OOM
            r.reason = (
                f"out of memory at batch_size={r.batch_size}, step {self.engine.steps}: {oom}"
            )
            self.done = True
            return False
        return True

    def _within_margin(self, action: Callable[[], None]) -> None:
        """``action`` with the settings' memory margin kept free (an OOM past it, as in a
        probe; the process's own limit is put back after)."""
        with memory_cap(self.amp.device, self.settings.memory_margin):
            action()

    def _start(self) -> None:
        torch.manual_seed(self.settings.seed)
        if self.peak is not None:
            self.peak.start()
        self.engine.build()
        self._started = time.perf_counter()
        warmup = self.result.warmup_steps
        if warmup:
            first = self.engine.run_steps(1)
            if self.peak is not None:
                # The first step's one-off allocations (cuDNN's algorithm search, the compiler's
                # autotuning) are no part of what the run needs, as in a probe.
                restart_peak(self.amp.device)
            rest = self.engine.run_steps(warmup - 1) if warmup > 1 else None
            if self.amp.candidate.compile:
                # Compiling happens in the first step: what it took beyond a warm step.
                steady = rest.step_time if rest is not None else 0.0
                self.result.compile_seconds = max(0.0, first.seconds - steady)
            self._check()

    def advance(self) -> bool:
        """One timed block (``check_every`` steps, fewer at the end); False once the run has
        ended (all its steps, a divergence, or an OOM)."""
        if self.done:
            return False
        if self.engine.model is None and not self._in_own_state(self._start):
            return False
        if self.done:
            return False

        def block() -> None:
            n = min(self.block_steps, self.total - self.engine.steps)
            if n <= 0:
                self.done = True
                return
            b = self.engine.run_steps(n)
            self.blocks.append((b.steps, b.seconds))
            self._check()

        if not self._in_own_state(block):
            return False
        if self.engine.steps >= self.total:
            self.done = True
        return not self.done

    def _check(self) -> None:
        """Read the block's losses back; stop a run that cannot recover."""
        engine, amp, r = self.engine, self.amp, self.result
        first = len(engine.losses)
        values = engine.read_losses()
        if on := self.on_progress:
            on(r.label, engine.steps, self.total, engine.losses[-1] if engine.losses else None)
        if not amp.mode.scales_loss:
            # Without a scaler a non-finite loss reaches the weights: the run is lost.
            bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:
                r.outcome, r.reason = Outcome.DIVERGED, f"loss={values[bad]} at step {first + bad}"
                self.done = True
            return
        # With one, a non-finite loss only skips its step; a scale below 1 means it skips all.
        scale = engine.scale()
        if scale < 1:
            r.outcome = Outcome.DIVERGED
            r.reason = (
                f"GradScaler scale fell to {scale:g} at step {engine.steps - 1}: every step is "
                "skipped"
            )
            self.done = True

    def rates(self) -> list[float]:
        """Each timed block's throughput, samples/s."""
        bs = self.result.batch_size
        return [n * bs / s for n, s in self.blocks if s > 0]

    def finish(self, held_out: list[Batch] | None = None) -> TrainResult:
        """The run's figures: throughput over its timed blocks, losses, memory, accuracy."""
        r, engine = self.result, self.engine
        r.steps = engine.steps
        r.samples = engine.steps * self.amp.batch_size
        r.skipped_steps = engine.skipped
        r.losses = list(engine.losses)
        r.wall_seconds = (time.perf_counter() - self._started) if self._started else 0.0
        r.timed_steps = sum(n for n, _ in self.blocks)
        r.timed_seconds = sum(s for _, s in self.blocks)
        if r.timed_steps and r.timed_seconds > 0:
            r.throughput = r.timed_steps * r.batch_size / r.timed_seconds
            r.seconds_per_epoch = self.settings.samples_per_epoch / r.throughput
        finite = [v for v in engine.losses if math.isfinite(v)]
        if finite:
            r.first_loss = finite[0]
            tail = engine.losses[-max(1, math.ceil(len(engine.losses) / 10)) :]
            tail_finite = [v for v in tail if math.isfinite(v)]
            r.final_loss = sum(tail_finite) / len(tail_finite) if tail_finite else None
        if r.outcome == Outcome.OOM:
            return r
        if self.peak is not None:
            r.peak_memory_bytes = self.peak.growth()
            r.memory_source = self.peak.source if r.peak_memory_bytes is not None else "unavailable"
        wl, settings = self.workload, self.settings
        if r.ok and wl.accuracy is not None and settings.eval_samples and engine.model is not None:
            if held_out is None:
                held_out = held_out_batches(wl, self.amp.device, settings)
            r.accuracy = _accuracy(wl.accuracy, self.amp, engine.model, held_out)
        logger.debug(
            "train {}: {} → {} {:.1f} samples/s", r.label, r.settings(), r.outcome, r.throughput
        )
        return r


class RandomStreams:
    """A run's own random streams, carried from block to block as in one uninterrupted run.

    One stream per device in ``devices`` (its global generator: the CPU's, a CUDA device's; a
    device named twice counts once). Inside :meth:`own` each generator holds the run's state,
    seeded with ``seed`` the first time; on the way out the run's state is kept for its next
    block and the caller's is restored. So consecutive blocks draw new numbers (new dropout
    masks), never the same ones again, and two runs whose blocks interleave each draw their own
    sequence.

    Example:
        >>> streams = RandomStreams(0, [torch.device("cpu")])
        >>> with streams.own():
        ...     first = torch.rand(1)
        >>> with streams.own():
        ...     second = torch.rand(1)
        >>> bool(first != second)
        True
    """

    def __init__(self, seed: int, devices: Sequence[torch.device]) -> None:
        self.seed = seed
        self.devices = list(dict.fromkeys(_with_index(torch.device(d)) for d in devices))
        self._states: list[torch.Tensor] | None = None

    @contextmanager
    def own(self) -> Iterator[None]:
        """Run the block under the run's random state; the caller's is back afterwards."""
        generators = [_default_generator(d) for d in self.devices]
        outside = [g.get_state() for g in generators]
        for i, g in enumerate(generators):
            if self._states is None:
                g.manual_seed(self.seed)
            else:
                g.set_state(self._states[i])
        try:
            yield
        finally:
            self._states = [g.get_state() for g in generators]
            for g, state in zip(generators, outside, strict=True):
                g.set_state(state)


def _with_index(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _default_generator(device: torch.device) -> torch.Generator:
    """The global generator that random ops on ``device`` draw from."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        torch.cuda.init()  # the per-device generators exist once CUDA is initialised
        return torch.cuda.default_generators[device.index]
    raise ValueError(f"no random stream for device {device}")


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
