"""A landscape: what one device does with one workload, as data.

A landscape says, per precision mode, how fast a step is at each batch size, how much memory it
needs, how its loss curve compares with the fp32 reference's, when fp16 diverges, what the
knobs bring, and what starting, warming up and compiling cost — with a noise model for the
timings. It is either **recorded** on a real device (``benchmarks/record_landscape.py``) or
**modelled** from published figures, each cited in its ``sources`` and marked as modelled.

The simulated device (:class:`~autotune.sim.SimulatedRunner`) answers probes from it; the
*truth* (:meth:`Landscape.truth`) is what an exhaustive, noise-free grid would find, so a
search's result can be scored against it.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autotune.errors import SpecError
from autotune.spec import Candidate, PrecisionName

__all__ = [
    "LANDSCAPE_DIR",
    "Landscape",
    "load_landscape",
    "shipped_landscapes",
]

LANDSCAPE_DIR = Path(__file__).parent / "landscapes"
SCHEMA_VERSION: Final = 1


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Source(_M):
    """Where a figure comes from: a citation a reader can follow."""

    id: str
    cite: str
    used_for: str = ""


class ModeModel(_M):
    """One precision mode on this device."""

    # Samples/s at batch sizes: log-log interpolated between, flat past the ends.
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

    # Block to block: log-normal with this sigma (0.02: ~2%).
    block_cv: float = Field(default=0.02, ge=0)
    # Slow drift shared by everything running at that time: 1 + amplitude * sin(2π t / period).
    drift_amplitude: float = Field(default=0.0, ge=0, lt=1)
    drift_period_s: float = Field(default=600.0, gt=0)
    # A neighbour's burst: with this probability a block runs this many times slower.
    burst_probability: float = Field(default=0.0, ge=0, le=1)
    burst_slowdown: float = Field(default=2.0, ge=1)


class LossModel(_M):
    """The fp32 reference's loss by samples seen: final + (initial - final) * exp(-s / scale)."""

    initial: float = Field(default=2.3, gt=0)
    final: float = Field(default=0.5, gt=0)
    samples_scale: float = Field(default=20000.0, gt=0)
    # Step to step noise of a loss (relative).
    step_noise: float = Field(default=0.02, ge=0)
    # Seed to seed spread of a whole curve's level (relative): what a parity check sees move.
    seed_spread: float = Field(default=0.01, ge=0)


class ParityModel(_M):
    """How far a candidate's curve lies above the reference's, beyond its mode's own gap."""

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
    # An lr multiplier above this blows the loss up (None: never).
    diverge_lr_multiplier: float | None = None


class Fp16Model(_M):
    """What fp16's GradScaler sees."""

    # Gradients overflow above this scale: a larger init_scale skips steps while it backs off.
    safe_init_scale: float = Field(default=65536.0, gt=0)
    # Activations overflow fp16's range somewhere: the loss turns inf at this step ...
    diverges_at_step: int | None = None
    # ... unless these modules run in fp32 (fp32 islands).
    islands: list[str] = Field(default_factory=list)


class Knobs(_M):
    """What the knobs bring, as throughput factors."""

    compile_speedup: float = Field(default=1.0, gt=0)
    compile_seconds: float = Field(default=30.0, ge=0)
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


class Truth(_M):
    """A candidate's noise-free figures."""

    candidate: Candidate
    speedup: float
    parity_gap: float
    fits: bool
    diverges: bool

    @property
    def feasible(self) -> bool:
        return self.fits and not self.diverges


class Landscape(_M):
    """One device and one workload, as data (see the module's docstring)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    kind: Literal["recorded", "modelled"]
    description: str = ""
    device: str
    device_type: Literal["cuda", "cpu"]
    capability: list[int] | None = None
    memory_total_bytes: int = Field(gt=0)
    workload: str
    facts: Facts
    modes: dict[PrecisionName, ModeModel]
    unsupported: dict[PrecisionName, str] = Field(default_factory=dict)
    noise: Noise = Field(default_factory=Noise)
    loss: LossModel = Field(default_factory=LossModel)
    parity: ParityModel = Field(default_factory=ParityModel)
    fp16: Fp16Model = Field(default_factory=Fp16Model)
    knobs: Knobs = Field(default_factory=Knobs)
    timing: Timing = Field(default_factory=Timing)
    sources: list[Source] = Field(default_factory=list)

    @model_validator(mode="after")
    def _reference(self) -> Landscape:
        if "fp32" not in self.modes:
            raise ValueError("modes must include fp32: the search measures against it")
        if self.kind == "modelled" and not self.sources:
            raise ValueError("a modelled landscape cites its sources (sources: [...])")
        return self

    # ---- the figures --------------------------------------------------------------------------

    def throughput(self, cand: Candidate) -> float:
        """Noise-free samples/s of a candidate (its knobs included)."""
        table = self.modes[cand.precision].throughput
        sizes = sorted(table)
        bs = cand.batch_size
        if bs <= sizes[0]:
            # Below the table: a step costs at least the smallest batch's step.
            rate = table[sizes[0]] * bs / sizes[0]
        elif bs >= sizes[-1]:
            rate = table[sizes[-1]]
        else:
            i = bisect.bisect_left(sizes, bs)
            lo, hi = sizes[i - 1], sizes[i]
            w = math.log(bs / lo) / math.log(hi / lo)
            rate = math.exp((1 - w) * math.log(table[lo]) + w * math.log(table[hi]))
        if cand.compile:
            rate *= self.knobs.compile_speedup
        if cand.channels_last is not None and cand.channels_last != self.facts.channels_last:
            k = self.knobs.channels_last_speedup
            rate *= k if cand.channels_last else 1 / k
        if cand.precision == "fp16" and cand.fp32_modules:
            rate *= (1 - self.knobs.fp32_module_cost) ** len(cand.fp32_modules)
        return rate

    def peak_bytes(self, cand: Candidate) -> int:
        m = self.modes[cand.precision]
        return m.memory_fixed_bytes + m.memory_per_sample_bytes * cand.batch_size

    def lr_multiplier(self, cand: Candidate) -> float:
        """The candidate's lr over what the workload's rule gives at its batch size."""
        f = self.facts
        ratio = cand.batch_size / f.base_batch_size
        rule = ratio if f.lr_scaling == "linear" else math.sqrt(ratio)
        return cand.learning_rate / (f.base_lr * rule)

    def parity_gap(self, cand: Candidate) -> float:
        """Noise-free relative gap of the candidate's loss to fp32's at the base batch."""
        ratio = max(1.0, cand.batch_size / self.facts.base_batch_size)
        lr_off = abs(math.log2(self.lr_multiplier(cand)))
        return (
            self.modes[cand.precision].parity_gap
            + self.parity.gap_per_batch_doubling * math.log2(ratio)
            + self.parity.gap_per_batch_ratio * (ratio - 1)
            + self.parity.gap_per_lr_log2 * lr_off
        )

    def early_lag(self, cand: Candidate) -> float:
        """The candidate's early lag at its peak (see :class:`ParityModel`); 0 at the base."""
        ratio = max(1.0, cand.batch_size / self.facts.base_batch_size)
        return self.parity.lag_per_batch_ratio * (ratio - 1)

    def diverges(self, cand: Candidate) -> bool:
        limit = self.parity.diverge_lr_multiplier
        if limit is not None and self.lr_multiplier(cand) > limit * 1.0001:
            return True
        return (
            cand.precision == "fp16"
            and self.fp16.diverges_at_step is not None
            and not set(self.fp16.islands) <= set(cand.fp32_modules)
        )

    def truth(self, cand: Candidate, *, margin: float = 0.1) -> Truth:
        """The candidate's noise-free speedup over fp32 at the base batch, its gap, and whether
        it fits with ``margin`` of the memory free and keeps from diverging."""
        base = Candidate(precision="fp32", batch_size=self.facts.base_batch_size, learning_rate=1.0)
        fits = (
            cand.precision not in self.unsupported
            and cand.precision in self.modes
            and self.peak_bytes(cand) <= (1 - margin) * self.memory_total_bytes
        )
        return Truth(
            candidate=cand,
            speedup=self.throughput(cand) / self.throughput(base) if fits else 0.0,
            parity_gap=self.parity_gap(cand) if fits else math.inf,
            fits=fits,
            diverges=self.diverges(cand) if fits else False,
        )


def shipped_landscapes() -> dict[str, Path]:
    """The landscapes autotune ships, by name.

    Example:
        >>> "a100-resnet18" in shipped_landscapes()
        True
    """
    return {p.stem: p for p in sorted(LANDSCAPE_DIR.glob("*.yaml"))}


def load_landscape(ref: str | Path) -> Landscape:
    """A landscape by shipped name (``a100-resnet18``) or from a YAML/JSON file.

    Raises:
        SpecError: no such file or name, or the file is not a valid landscape (naming the
            field and the fix).
    """
    shipped = shipped_landscapes()
    path = shipped.get(str(ref)) or Path(ref)
    if not path.is_file():
        names = ", ".join(shipped) or "none"
        raise SpecError(
            f"landscape {str(ref)!r} is neither a file nor a shipped landscape; shipped: {names}"
        )
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"landscape {str(path)!r} cannot be read: {exc}") from None
    if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise SpecError(
            f"landscape {str(path)!r} has schema_version={data.get('schema_version')!r}; this "
            f"autotune reads version {SCHEMA_VERSION}: record it again or upgrade autotune"
        )
    try:
        return Landscape.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise SpecError(
            f"landscape {str(path)!r}: {where}: {first['msg']} ({exc.error_count()} errors in "
            "all); see autotune/sim/landscapes/ for the format"
        ) from None
