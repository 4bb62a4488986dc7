"""A timed run: the measurement policy a probe (and each arm of a paired run) applies to one
:class:`~autotune.measure.step.StepEngine`, its windows sized by time, not by count."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from loguru import logger

from autotune.measure.memory import memory_cap, restart_peak
from autotune.measure.parity import parity_gap, parity_gap_error
from autotune.measure.precision import PrecisionMode
from autotune.measure.stats import HOPELESS, median_interval, spread
from autotune.measure.step import Block
from autotune.schema.enums import Outcome
from autotune.schema.spec import (
    DEFAULT_MIN_TIME,
    Candidate,
    EarlyStop,
    ProbeSettings,
    format_duration,
)

__all__ = ["Engine", "TimedRun", "min_time_for"]

# A timed phase needs this many blocks for its interval to mean anything ...
_MIN_BLOCKS = 5
# ... and a block lasts about this share of min_time, so there are about ten.
_BLOCK_SHARE = 0.1
# When the interval never tightens (a noisy neighbour), stop at this many times min_time.
_MAX_TIME_FACTOR = 4.0
# Warm-up goes on while a block's steps run faster than this share of the last ones' time ...
_STEADY = 0.8
# ... for at most this share of min_time.
_SETTLE_SHARE = 0.5
# Warm steps longer than this share of the time limit run one at a time (one whose rate is
# under the best's divided by stats.HOPELESS stops the run as slower).
_SLOW_STEP_SHARE = 0.05
# An early "slower" verdict waits for this share of min_time of timed blocks.
_DECIDE_SHARE = 0.5
# A loss gap stops a probe early only this many standard errors (the two curves' own
# step-to-step noise) past the rule's level: it is checked at every block from half the
# horizon on, and a noisy curve would otherwise cross the level by chance alone.
_PARITY_STOP_Z = 2.0


def min_time_for(settings: ProbeSettings, device: torch.device) -> float:
    """The timed phase's minimum length on a device: the setting, or the device's default."""
    if settings.min_time is not None:
        return settings.min_time
    return DEFAULT_MIN_TIME.get(device.type, DEFAULT_MIN_TIME["cpu"])


class Engine(Protocol):
    """What a :class:`TimedRun` drives: a :class:`~autotune.measure.step.StepEngine`, or a simulated
    device's engine."""

    @property
    def candidate(self) -> Candidate: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def mode(self) -> PrecisionMode: ...
    @property
    def steps(self) -> int: ...
    @property
    def losses(self) -> list[float]: ...
    @property
    def skipped(self) -> int: ...

    def build(self) -> None: ...
    def run_steps(self, n: int) -> Block: ...
    def read_losses(self) -> list[float]: ...
    def scale(self) -> float: ...


class TimedRun:
    """A probe's policy over one :class:`~autotune.measure.step.StepEngine`: warm up, then time
    blocks.

    1. Warm-up: ``warmup_steps`` untimed steps (the first one timed apart, to size blocks and
       to score a run its time limit stops inside warm-up), then more untimed blocks while the
       steps still get faster (first-use costs outlast a fixed count); losses checked after.
       A compiled model compiles in its first step (always untimed, even with no warm-up
       steps); the time limit counts from after it, and what the warm-up took beyond its
       steps at the steady rate is the run's ``compile_seconds``. The CUDA peak memory counts
       from after the first step: its one-off allocations (cuDNN's algorithm search, the
       compiler's autotuning) are no part of what the run needs.
    2. Blocks: ``k`` steps between two syncs, ``k`` sized so a block lasts about a tenth of
       ``min_time`` (at most ``check_every`` steps); after each block the losses (and the fp16
       scale) are read back, one host sync, and checked for divergence.
    3. Enough: ``min_time`` and ``steps`` reached, at least five blocks, and the median block
       rate's 95% interval within ``precision`` of it; or 4x ``min_time``; or ``time_limit``.

    :meth:`measure` runs the three under the spec's memory margin when the settings carry one
    (``memory_margin``): on CUDA the process's allocator runs out of memory at the margin.
    :meth:`warm_up` and :meth:`block` are public so a paired run can interleave two of these.

    Args:
        engine: the run's engine (built by :meth:`warm_up`); settings: lengths, thresholds, time
            limit; started: ``timer()`` at the probe's start (the time limit counts from it);
            timer: the clock the time limit reads (a simulated device passes its virtual one).
    """

    def __init__(
        self,
        engine: Engine,
        settings: ProbeSettings,
        started: float,
        early_stop: EarlyStop | None = None,
        *,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.engine = engine
        # Looked up at each call, not bound now: a test may swap time.perf_counter.
        self.timer = timer or (lambda: time.perf_counter())
        self.settings = settings
        self.started = started
        self.early_stop = early_stop
        self.parity_samples: int | None = None
        self.min_time = min_time_for(settings, engine.device)
        self.blocks: list[Block] = []
        # The first ``_counted`` blocks' steps and rates (blocks are only appended: read after
        # every block, each is counted once), and the blocks' seconds summed.
        self._counted, self._steps, self._seconds_sum = 0, 0, 0.0
        self._rates: list[float] = []
        self.scales: list[tuple[int, float]] = []
        self.first_step: float | None = None
        self.warm_seconds = 0.0
        # The whole warm-up's wall time and steps; the first step's time if it compiled.
        self.warm_wall, self.warm_steps, self.compile_shift = 0.0, 0, 0.0
        self.block_steps, self.skipped_at_start = 1, 0
        # The share of device memory kept free while the run runs (memory_cap); None: no cap.
        self.memory_margin: float | None = getattr(settings, "memory_margin", None)
        self.outcome, self.reason = Outcome.COMPLETED, ""
        self.truncated, self.check_seconds = False, 0.0

    # ---- what the policy checks -------------------------------------------------------------

    def _check(self, step: int, timed: bool) -> str | None:
        """Read pending losses (one sync) and the scale; return a divergence reason or None.

        The scale is recorded at every check, a diverging probe's too: the report's GradScaler
        plot shows where it ended."""
        engine, settings = self.engine, self.settings
        blowup = self._blowup(engine.read_losses())
        if not engine.mode.scales_loss:
            return blowup
        scale = engine.scale()
        self.scales.append((step, scale))
        if blowup:
            return blowup
        if scale < 1:
            return f"GradScaler scale fell to {scale:g} at step {step}"
        steps = self.timed_steps
        if timed and steps >= settings.check_every:
            skipped = engine.skipped - self.skipped_at_start
            if skipped / steps > settings.max_skip_rate:
                return (
                    f"GradScaler skipped {skipped} of {steps} steps after warmup "
                    f"(limit {settings.max_skip_rate:.0%}) at step {step}, scale={scale:g}"
                )
        return None

    def _blowup(self, values: list[float]) -> str | None:
        """Why the losses just read show a diverging run (non-finite, or far above the first
        loss), or None."""
        losses, factor = self.engine.losses, self.settings.loss_blowup_factor
        # Most reads: all finite (a finite sum says so), none above the limit.
        if (
            values
            and math.isfinite(sum(values))
            and (not losses[0] > 0 or max(values) <= factor * losses[0])
        ):
            return None
        first = len(losses) - len(values)
        for at, value in enumerate(values, start=first):
            if not math.isfinite(value):
                return f"loss={value} at step {at}"
            if losses[0] > 0 and value > factor * losses[0]:
                return f"loss={value:.4g} at step {at} is above {factor:g}x the initial {losses[0]:.4g}"
        return None

    def _diverged(self, reason: str | None) -> bool:
        if reason:
            self.outcome, self.reason = Outcome.DIVERGED, reason
        return reason is not None

    def over_time(self) -> bool:
        return self.timer() - self.started > self.settings.time_limit

    # ---- the phases ----------------------------------------------------------------------------

    def warm_up(self) -> bool:
        """Build and run the warm-up steps; False when the run already ended (diverged, or out
        of time inside warm-up)."""
        engine, settings = self.engine, self.settings
        engine.build()
        compiles = engine.candidate.compile
        # A compiled model compiles in its first step: never inside a timed block.
        warmup = max(settings.warmup_steps, 1 if compiles else 0)
        if warmup:
            # The first step apart: it carries first-use costs, and scores a run that its
            # time limit stops inside warm-up.
            self.first_step = engine.run_steps(1).seconds
            self.warm_wall += self.first_step
            restart_peak(engine.device)
            if compiles:
                # Compiling is charged to the budget, not to the measurement's time limit.
                self.compile_shift = self.first_step
                self.started += self.first_step
            elif self._hopeless(self.first_step, first=True):
                return False
            left = warmup - 1
            while True:
                if (engine.steps % settings.check_every == 0 or not left) and self._diverged(
                    self._check(engine.steps - 1, timed=False)
                ):
                    return False
                if not left:
                    break
                if self.over_time():
                    self.truncated = True
                    return False
                chunk = self._warm_chunk(left)
                if not chunk:
                    self.outcome = Outcome.TOO_SLOW
                    self.reason = (
                        f"a step takes {self.warm_seconds:.1f}s: one more would end past its "
                        "time limit of "
                        f"{format_duration(settings.time_limit)}"
                    )
                    self.truncated = True
                    return False
                block = engine.run_steps(chunk)
                self.warm_wall += block.seconds
                self.warm_seconds = block.step_time
                left -= chunk
                if self._hopeless(block.step_time):
                    return False
            if self.over_time():
                self.truncated = True
                return False
        if not self._back_off() or (self.min_time > 0 and not self._settle()):
            return False
        self.warm_steps = engine.steps
        self.skipped_at_start = engine.skipped
        self.block_steps = self._block_size(self.warm_seconds or self.first_step or 0.0)
        return True

    def _back_off(self) -> bool:
        """GradScaler's back-off from its init_scale, warm-up while every step so far skipped (not
        a skip rate). False when the run ended: scale below 1, or no time for a step."""
        engine = self.engine
        while engine.mode.scales_loss and engine.steps and engine.skipped == engine.steps:
            if self._diverged(self._check(engine.steps - 1, timed=False)):
                return False
            if self.over_time() or not self._warm_chunk(1):  # a slow step that would not fit
                self.truncated = True
                return False
            self.warm_wall += engine.run_steps(1).seconds
        return True

    def _warm_chunk(self, left: int) -> int:
        """Warm-up steps to run next, of the ``left`` still to run: up to the next check, no
        more than the time limit holds by the last step's time (four 13 s steps in one chunk ran
        50 s past it), one at a time where a step is slow (each checked against the best), and,
        for a search's trial, 0 where not one more slow step fits (past the hard limit the
        worker is killed)."""
        settings = self.settings
        chunk = min(left, settings.check_every - self.engine.steps % settings.check_every)
        slow = _SLOW_STEP_SHARE * settings.time_limit
        warm = self.warm_seconds
        if warm <= 0:
            # Only the first step is timed, its first-use costs in it (on a GPU, a second of
            # them before millisecond steps): one more step times a warm one.
            return 1 if (self.first_step or 0.0) > slow else chunk
        room = settings.time_limit - (self.timer() - self.started)
        if warm > slow:
            # A search's trial stops here; a run the search cannot do without (the reference)
            # goes on to its limit, whose cut it survives.
            return 0 if warm > room and self.early_stop is not None else 1
        return max(1, min(chunk, int(room / warm)))

    def _hopeless(self, step_time: float, *, first: bool = False) -> bool:
        """A slow step whose rate is under ``1 / HOPELESS`` of the best's, which no burst explains
        (a CPU's fp16 ResNet-18: 10 samples/s beside bf16's 637): a warm one, or the ``first``
        less the first-use costs its rule allows. Not for a compiled model (it may recompile)."""
        rule = self.early_stop
        if rule is None or rule.below is None or self.engine.candidate.compile:
            return False
        allowed = rule.first_use
        if first:  # (none allowed: not judged)
            step_time -= allowed if allowed is not None else math.inf
        if step_time <= _SLOW_STEP_SHARE * self.settings.time_limit:
            return False  # quick steps: the timed blocks' early stop decides at little cost
        rate = self.engine.candidate.batch_size / step_time
        if rate * HOPELESS >= rule.below:
            return False
        self.outcome = Outcome.SLOWER
        head = "a warm step ran at"
        if first:
            head = f"its first step took {self.first_step:.1f}s: less {allowed:.1f}s for first-use "
            head += "costs, a step runs at most at"
        self.reason = (
            f"{head} {rate:,.1f} samples/s, under 1/{HOPELESS:g} of the best's lower bound, "
            f"{rule.below:,.0f} samples/s"
        )
        return True

    def _settle(self) -> bool:
        """Keep warming up while the steps still get faster: first-use costs (kernels for a new
        shape, allocator growth) can outlast a fixed count of warm-up steps, and a timed block
        that holds them makes a candidate look slower than it is. At most half of min_time.

        Returns:
            False when the run ended meanwhile (diverged, or out of time).
        """
        engine = self.engine
        step_time = self.warm_seconds or self.first_step or 0.0
        spent = 0.0
        while step_time > 0 and spent < _SETTLE_SHARE * self.min_time:
            block = engine.run_steps(self._block_size(step_time))
            spent += block.seconds
            self.warm_wall += block.seconds
            if self._diverged(self._check(engine.steps - 1, timed=False)):
                return False
            if self.over_time():
                self.truncated = True
                return False
            steady = block.step_time > _STEADY * step_time
            step_time = self.warm_seconds = block.step_time
            if steady:
                break
        return True

    def _block_size(self, step_time: float) -> int:
        """Steps per block: about a tenth of min_time, at most ``check_every``."""
        settings = self.settings
        if step_time > 0 and self.min_time > 0:
            wanted = math.ceil(_BLOCK_SHARE * self.min_time / step_time)
            return max(1, min(settings.check_every, wanted))
        return max(1, min(settings.check_every, settings.steps))

    def block(self, steps: int | None = None) -> bool:
        """One timed block; False when the run ended (diverged, or its time limit)."""
        k = steps or self.block_steps
        block = self.engine.run_steps(k)
        self.blocks.append(block)
        if len(self.blocks) <= 2 and block.step_time > 0:
            # The warm-up's step time includes first-use costs: size blocks by the timed ones.
            self.block_steps = self._block_size(block.step_time)
        c0 = self.timer()
        reason = self._check(self.engine.steps - 1, timed=True)
        self.check_seconds += self.timer() - c0
        if self._diverged(reason):
            return False
        if self.early_stop is not None and self._stopped_early(self.early_stop):
            return False
        if self.over_time():
            if not self.enough():
                self.truncated = True
                logger.info(
                    "probe stopped at its time limit of {} after {} steps",
                    format_duration(self.settings.time_limit),
                    self.engine.steps,
                )
            return False
        return True

    def _stopped_early(self, rule: EarlyStop) -> bool:
        """Whether the run has answered its question already: clearly slower than the best,
        or clearly off the reference's loss curve (see :class:`~autotune.schema.spec.EarlyStop`)."""
        engine = self.engine
        # Half of min_time at least: a neighbour's burst can stall a few blocks, and a burst
        # must not read as a slow candidate.
        settled = self.timed_seconds >= _DECIDE_SHARE * self.min_time
        if rule.below is not None and len(self.blocks) >= rule.after_blocks and settled:
            est = median_interval(self.rates())
            if est.high < rule.below:
                self.outcome = Outcome.SLOWER
                self.reason = (
                    f"upper bound {est.high:,.0f} < best {rule.below:,.0f} samples/s "
                    f"after {len(self.blocks)} blocks"
                )
                return True
        samples = engine.steps * engine.candidate.batch_size
        if rule.parity_gap is not None and rule.reference_losses and samples >= rule.parity_samples:
            curves = (
                engine.losses,
                engine.candidate.batch_size,
                rule.reference_losses,
                rule.reference_batch_size,
            )
            found = parity_gap(*curves)
            if found is None or found[0] <= rule.parity_gap:
                return False  # most blocks: the noise allowance is not even read
            noise = _PARITY_STOP_Z * parity_gap_error(*curves)
            if found[0] - noise > rule.parity_gap:
                self.outcome = Outcome.OFF_PARITY
                self.parity_samples = samples
                self.reason = (
                    f"loss {found[0]:+.1%} vs the fp32 reference's at {samples:,} "
                    f"samples seen (stops above {rule.parity_gap:+.0%}"
                    + (f" + {noise:.0%} for the curves' step noise)" if noise >= 0.005 else ")")
                )
                return True
        return False

    def _count(self) -> None:
        """Count the blocks appended since the last call: their steps and rates; the seconds
        summed again over all of them, in order (a running float total would round apart)."""
        if self._counted == len(self.blocks):
            return
        bs = self.engine.candidate.batch_size
        for b in self.blocks[self._counted :]:
            self._steps += b.steps
            if b.seconds > 0:
                self._rates.append(b.steps * bs / b.seconds)
        self._counted = len(self.blocks)
        self._seconds_sum = sum(b.seconds for b in self.blocks)

    @property
    def timed_steps(self) -> int:
        self._count()
        return self._steps

    @property
    def timed_seconds(self) -> float:
        self._count()
        return self._seconds_sum

    def rates(self) -> list[float]:
        """Each block's throughput, samples/s."""
        self._count()
        return list(self._rates)

    def enough(self) -> bool:
        """Whether the timed phase has measured what it must (see the class docstring)."""
        if self.timed_steps < self.settings.steps:
            return False
        if self.min_time <= 0:
            return True
        if self.timed_seconds < self.min_time or len(self.blocks) < _MIN_BLOCKS:
            return False
        if self.timed_seconds >= _MAX_TIME_FACTOR * self.min_time:
            return True
        return median_interval(self.rates()).half_width <= self.settings.precision

    def measure(self) -> None:
        """Warm up, then time blocks until enough (the probe's whole policy), inside the
        memory margin."""
        with memory_cap(self.engine.device, self.memory_margin):
            if not self.warm_up():
                return
            while self.block() and not self.enough():
                pass

    # ---- the figures -------------------------------------------------------------------------

    def compile_seconds(self, step_time: float | None) -> float:
        """What compiling added to the warm-up: its wall time beyond its steps at the steady
        step time (the warm-up's own, when no block was timed)."""
        steady = step_time or self.warm_seconds
        if not steady:
            return self.warm_wall
        steps = self.warm_steps or self.engine.steps
        return max(0.0, self.warm_wall - steps * steady)

    def fields(self) -> dict[str, Any]:
        """The ProbeResult fields this run measured."""
        engine, settings = self.engine, self.settings
        out: dict[str, Any] = {
            "outcome": self.outcome,
            "reason": self.reason,
            "losses": list(engine.losses),
            "scales": list(self.scales),
            # Also on divergence: the skips are part of the evidence the reason refers to.
            "skipped_steps": engine.skipped,
            "check_seconds": self.check_seconds,
            "truncated": self.truncated,
        }
        if self.parity_samples is not None:
            out["parity_samples"] = self.parity_samples
        timed_steps, seconds = self.timed_steps, self.timed_seconds
        rates = self.rates()
        if not rates and engine.steps > 1 and self.warm_seconds:
            # Stopped inside warmup: score the steps after the first one (scored, and flagged).
            timed_steps = engine.steps - 1
            seconds = self.warm_seconds * timed_steps
            rates = [engine.candidate.batch_size / self.warm_seconds]
        elif not rates and self.first_step:
            timed_steps, seconds = engine.steps, self.first_step
            rates = [engine.candidate.batch_size / self.first_step]
        out["warmup_steps"] = engine.steps - timed_steps
        out["timed_steps"] = timed_steps
        out["timed_seconds"] = seconds
        out["blocks"] = [(b.steps, b.seconds) for b in self.blocks]
        if rates and self.outcome in (Outcome.COMPLETED, Outcome.SLOWER, Outcome.OFF_PARITY):
            est = median_interval(rates)
            out["throughput"] = est.value
            out["throughput_low"] = est.low
            out["throughput_high"] = est.high
            out["step_time"] = engine.candidate.batch_size / est.value
            out["spread"] = spread(rates)
        if engine.candidate.compile:
            out["compile_seconds"] = self.compile_seconds(out.get("step_time"))
        if timed_steps < settings.steps:
            out["truncated"] = True
            if not out["reason"]:
                out["reason"] = (
                    f"time limit {format_duration(settings.time_limit)} reached: scored on "
                    f"{timed_steps} of {settings.steps} timed steps"
                )
        return out
