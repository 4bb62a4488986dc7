"""A simulated step engine: the probe's real policy runs over it, and it answers each step from a
landscape on a virtual clock."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from autotune.infra.clock import VirtualClock
from autotune.measure.memory import is_oom, oom_message
from autotune.measure.precision import get_mode
from autotune.measure.step import Block
from autotune.schema.spec import Candidate
from autotune.sim._landscape import Landscape

# The relative step noise of a loss curve's falling part, at most (see SimEngine._loss).
EARLY_NOISE = 0.05

__all__ = ["Bursts", "HardTimeout", "Killed", "SimEngine", "SimOOM"]


class SimOOM(RuntimeError):
    """The candidate's peak memory is past the device's."""


class HardTimeout(Exception):
    """The probe ran past its hard limit (the worker would have been killed)."""


class Killed(Exception):
    """The worker was killed mid-probe (a cancel, a drain, or a crash)."""


def curve_rng(landscape: Landscape, cand: Candidate, seed: int, world: int = 0) -> random.Random:
    """The randomness of a loss curve: fixed by the seed and the candidate, as a real run's is
    by its seed (the same probe twice gives the same curve). ``world`` is the simulated
    device's own seed: another world, other curves for the same probe seed."""
    return random.Random(f"{landscape.name}|{world}|{seed}|{cand.model_dump_json()}")


class Bursts:
    """A neighbour's bursts, shared by the runs a probe makes: one that starts in a block lasts
    ``noise.burst_blocks`` blocks, whichever run each of them belongs to (the neighbour does
    not know which arm of a paired run is on the device)."""

    def __init__(self) -> None:
        self.left = 0

    def hit(self, rng: random.Random, probability: float, blocks: int) -> bool:
        """Whether this block runs in a burst (``rng`` draws whether one starts)."""
        if self.left:
            self.left -= 1
            return True
        if rng.random() < probability:
            self.left = blocks - 1
            return True
        return False


class SimEngine:
    """One simulated training run of ``cand`` on the landscape's device.

    Args:
        landscape: the device and workload.
        cand: what the run trains with.
        clock: the virtual clock its steps advance.
        seed: the probe's seed (fixes the loss curve, as a real seed does).
        noise: the randomness of the timings (each run's own).
        deadline: a clock reading past which the run is killed (HardTimeout); None: never.
        world: the simulated device's own seed (see :func:`curve_rng`).
        killed: asked after every block: True when the worker was killed meanwhile (Killed).
        slowdown: every step of this run takes this many times longer (a neighbour's job that
            held the device for the whole run, or a warm-up that this run alone suffers).
        bursts: the neighbour's bursts this run shares with the others of its probe; its own
            by default.
    """

    def __init__(  # noqa: PLR0913 - a simulated run's settings, keyword-only, built in one place (the runner)
        self,
        landscape: Landscape,
        cand: Candidate,
        clock: VirtualClock,
        *,
        seed: int,
        noise: random.Random,
        deadline: float | None = None,
        world: int = 0,
        killed: Callable[[], bool] | None = None,
        slowdown: float = 1.0,
        bursts: Bursts | None = None,
    ) -> None:
        self.landscape, self.candidate, self.clock = landscape, cand, clock
        self.killed = killed or (lambda: False)
        self.device = torch.device("cuda:0" if landscape.device_type == "cuda" else "cpu")
        self.mode = get_mode(cand.precision)
        self.noise = noise
        self.deadline = deadline
        self.slowdown = slowdown
        self.bursts = bursts or Bursts()
        self.steps = 0
        self.applied = 0
        self.losses: list[float] = []
        self.pending: list[float] = []
        self.step_seconds = cand.batch_size / landscape.throughput(cand)
        self.curve = curve_rng(landscape, cand, seed, world)
        loss = landscape.loss
        # This run's curve: the candidate's lasting gap plus the seed's own offset.
        self.lasting = landscape.parity_gap(cand)
        self.offset = self.curve.gauss(0.0, loss.seed_spread)
        self.gap = self.lasting + self.offset
        self.lag = landscape.early_lag(cand)
        self.diverge_step = landscape.diverge_step(cand)
        # fp16's GradScaler: its scale now, and the clean steps since it last changed. Above
        # the safe scale a step skips and halves it (the back-off from a large init_scale).
        self.scale_now = cand.init_scale
        self.clean = 0
        # Version 2 also regrows it (x2 after growth_interval clean steps, as GradScaler does);
        # version 1 files were written and scored without, their runs far shorter than that.
        self.regrows = landscape.schema_version >= 2
        # A lasting skip rate draws its gradient spikes apart from the curve and the timings.
        self.spikes = None
        if landscape.fp16.skip_rate:
            key = f"spikes|{landscape.name}|{world}|{seed}|{cand.model_dump_json()}"
            self.spikes = random.Random(key)

    # ---- what the policy drives -------------------------------------------------------------

    def _spend(self, seconds: float) -> None:
        """Advance the clock by ``seconds``, or to the deadline and stop (the worker is killed
        there, however long the step would have taken)."""
        if self.deadline is not None and self.clock.monotonic() + seconds > self.deadline:
            self.clock.advance(max(0.0, self.deadline - self.clock.monotonic()))
            raise HardTimeout
        self.clock.advance(seconds)
        if self.killed():
            raise Killed

    def build(self) -> None:
        self._spend(self.landscape.timing.build_seconds)
        if self.landscape.peak_bytes(self.candidate) > self.landscape.memory_total_bytes:
            raise SimOOM(
                f"out of memory (simulated): batch_size={self.candidate.batch_size} needs "
                f"{self.landscape.peak_bytes(self.candidate) / 2**30:.1f} GiB of "
                f"{self.landscape.memory_total_bytes / 2**30:.1f} GiB"
            )

    def _block_time(self, first: int, n: int) -> float:
        """Steps ``first .. first + n - 1``'s noise-free time, summed in step order: the steady
        step's with the warm-up's extra, the first step's costs (and compiling) on step 0."""
        t = self.landscape.timing
        step_seconds, extra, warmup_steps = self.step_seconds, t.warmup_extra, t.warmup_steps
        exp = math.exp
        block = 0.0
        for step in range(first, first + n):
            seconds = step_seconds * (1 + extra * exp(-step / warmup_steps))
            if step == 0:
                seconds += t.first_step_seconds
                seconds += self.landscape.compile_seconds(self.candidate)
            block += seconds
        return block

    def _losses(self, first: int, n: int) -> list[float]:
        """The losses of steps ``first .. first + n - 1``: one draw of the curve's step noise
        each (none once diverged, whose loss is inf).

        Log-normal step noise: a loss stays positive however noisy the curve. The measured
        noise is the floor's (a recorded curve near its floor moves by tens of percent from
        step to step: most of a recording's steps are there); the falling part moves by at
        most EARLY_NOISE (a fresh model's cross-entropy is near log(classes) on every batch:
        an H200's recorded resnet18 starts at 2.5 on both seeds, its floor's noise 0.73)."""
        m, p, bs = self.landscape.loss, self.landscape.parity, self.candidate.batch_size
        gauss, exp, step_noise, final = self.curve.gauss, math.exp, m.step_noise, m.final
        early = min(1.0, EARLY_NOISE / step_noise) if step_noise else 0.0
        span, scale, quarter = m.initial - m.final, m.samples_scale, 0.25 * m.samples_scale
        lag0, lag_ramp, lag_steps = self.lag, p.lag_ramp_samples, p.lag_steps
        halving = p.lag_fade == "exponential"
        lasting, offset, onset = self.lasting, self.offset, p.gap_onset_samples
        gap, diverge = self.gap, self.diverge_step
        out = []
        for step in range(first, first + n):
            if diverge is not None and step >= diverge:
                out.append(math.inf)
                continue
            samples = (step + 1) * bs
            floor_noise = gauss(0.0, step_noise)
            early_noise = floor_noise * early if step_noise else 0.0
            decay = span * exp(-samples / scale)
            level = final * exp(floor_noise) + decay * exp(early_noise)
            ramp = 1 - exp(-samples / quarter)
            # No lag at all (the base batch), or faded out: a term of 0 (the same sum).
            lag = 0.0
            if lag0 and (halving or step + 1 < lag_steps):
                lag = lag0 * (1 - exp(-samples / lag_ramp))
                if halving:
                    lag *= 0.5 ** ((step + 1) / lag_steps)
                else:
                    lag *= max(0.0, 1 - (step + 1) / lag_steps)
            if onset:
                # Landscape.gap_shown(samples), inlined (a call per step cost a third of it).
                x = samples / onset
                if not x < 1.0:
                    x = 1.0
                gap = lasting * (x * x * (3 - 2 * x)) + offset
            out.append(level * (1 + gap * ramp + lag))
        return out

    def _skips(self, n: int) -> int:
        """``n`` GradScaler updates (see :meth:`_applied`): how many of them skipped."""
        if not self.mode.scales_loss:
            self.applied += n
            return 0
        skipped = 0
        for _ in range(n):
            if self._applied():
                self.applied += 1
            else:
                skipped += 1
        return skipped

    def _applied(self) -> bool:
        """One GradScaler update: whether this step's gradients were finite and applied."""
        if not self.mode.scales_loss:
            return True
        fp16 = self.landscape.fp16
        spike = self.spikes is not None and self.spikes.random() < fp16.skip_rate
        if spike or self.scale_now > fp16.safe_init_scale:
            self.scale_now /= 2
            self.clean = 0
            return False
        self.clean += 1
        if self.regrows and self.clean >= self.candidate.growth_interval:
            self.scale_now *= 2
            self.clean = 0
        return True

    def run_steps(self, n: int) -> Block:
        """``n`` steps: their time (with the block's noise) advances the clock."""
        noise = self.landscape.noise
        first = self.steps
        block = self._block_time(first, n)
        self.pending += self._losses(first, n)
        skipped = self._skips(n)
        self.steps += n
        factor = self.slowdown * math.exp(self.noise.gauss(0.0, noise.block_cv))
        if noise.drift_amplitude:
            phase = 2 * math.pi * self.clock.monotonic() / noise.drift_period_s
            factor *= 1 + noise.drift_amplitude * math.sin(phase)
        p = noise.burst_probability
        if p and self.bursts.hit(self.noise, p, noise.burst_blocks):
            factor *= noise.burst_slowdown
        seconds = block * factor
        self._spend(seconds)
        return Block(first, n, seconds, skipped)

    def read_losses(self) -> list[float]:
        values, self.pending = self.pending, []
        self.losses.extend(values)
        return values

    def scale(self) -> float:
        return self.scale_now if self.mode.scales_loss else 1.0

    @property
    def skipped(self) -> int:
        return self.steps - self.applied

    def run(self, policy: Callable[[SimEngine], Any]) -> str | None:
        """Run ``policy(self)``; a simulated OOM comes back as its message, as a real one does."""
        try:
            policy(self)
        except Exception as exc:
            # Its own, or one the real measurement's code raised (a margin others hold).
            if not isinstance(exc, SimOOM) and not is_oom(exc):
                raise
            self.close()
            return oom_message(exc) if not isinstance(exc, SimOOM) else str(exc)
        return None

    def close(self) -> None:
        self.pending = []
