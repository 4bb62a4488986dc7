"""A landscape: what one device does with one workload, as data, recorded on a real device or
modelled from published figures."""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autotune.errors import SpecError
from autotune.schema.spec import Candidate, PrecisionName, ProbeSettings
from autotune.sim._sections import (
    Facts,
    Fp16Model,
    Knobs,
    LossModel,
    ModeModel,
    Noise,
    ParityModel,
    Source,
    Timing,
)

__all__ = [
    "LANDSCAPE_DIR",
    "Landscape",
    "Truth",
    "load_landscape",
    "shipped_landscapes",
]

LANDSCAPE_DIR = Path(__file__).parent / "landscapes"
# The versions this autotune reads; a file that does not say is version 1.
SCHEMA_VERSIONS: Final = (1, 2)
# The step at which an lr past the stable one has blown the loss up.
LR_BLOWUP_STEP: Final = 3
# A probe that skips more of its steps than this is diverged; a long run by the same rule.
MAX_SKIP_RATE: Final[float] = ProbeSettings.model_fields["max_skip_rate"].default


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Truth(_M):
    """A candidate's noise-free figures."""

    candidate: Candidate
    speedup: float
    parity_gap: float
    fits: bool
    diverges: bool
    # Paid in the first step of every run of it (0 uncompiled): a scorer charges it to the run.
    compile_seconds: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.fits and not self.diverges


class Landscape(_M):
    """One device and one workload, as data (see the module's docstring)."""

    schema_version: Literal[1, 2] = 1
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
        if self.schema_version == 1:
            sections = (self.noise, self.parity, self.fp16, self.knobs)
            newer = [
                f"{name}.{field}"
                for name, section in zip(
                    ("noise", "parity", "fp16", "knobs"), sections, strict=True
                )
                for field in sorted(section.V2)
                # A dump of a version 1 file holds them at their defaults: it still loads.
                if getattr(section, field)
                != type(section).model_fields[field].get_default(call_default_factory=True)
            ]
            if newer:
                raise ValueError(
                    f"{', '.join(newer)} need schema_version: 2 (this file says 1); "
                    "put schema_version: 2 at its top"
                )
        return self

    # ---- speed and memory ---------------------------------------------------------------------

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
            rate *= self.compile_speedup(cand)
        if cand.channels_last is not None and cand.channels_last != self.facts.channels_last:
            k = self.knobs.channels_last_speedup
            rate *= k if cand.channels_last else 1 / k
        if cand.precision == "fp16" and cand.fp32_modules:
            rate *= (1 - self.knobs.fp32_module_cost) ** len(cand.fp32_modules)
        return rate

    def compile_speedup(self, cand: Candidate) -> float:
        """What compiling brings the candidate's steps (1.0 uncompiled)."""
        if not cand.compile:
            return 1.0
        mode = self.knobs.compile_modes.get(cand.compile_mode)
        return self.knobs.compile_speedup if mode is None else mode.speedup

    def compile_seconds(self, cand: Candidate) -> float:
        """What compiling costs the candidate's first step (0 uncompiled)."""
        if not cand.compile:
            return 0.0
        mode = self.knobs.compile_modes.get(cand.compile_mode)
        return self.knobs.compile_seconds if mode is None else mode.seconds

    def peak_bytes(self, cand: Candidate) -> int:
        m = self.modes[cand.precision]
        return m.memory_fixed_bytes + m.memory_per_sample_bytes * cand.batch_size

    # ---- the loss -----------------------------------------------------------------------------

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

    def gap_shown(self, samples: float) -> float:
        """The share of the lasting gap a curve shows after ``samples`` (see
        :class:`ParityModel`'s ``gap_onset_samples``): a smooth step from 0 to 1."""
        onset = self.parity.gap_onset_samples
        if onset <= 0:
            return 1.0
        x = min(1.0, samples / onset)
        return x * x * (3 - 2 * x)

    def early_lag(self, cand: Candidate) -> float:
        """The candidate's early lag at its peak (see :class:`ParityModel`); 0 at the base."""
        ratio = max(1.0, cand.batch_size / self.facts.base_batch_size)
        return self.parity.lag_per_batch_ratio * (ratio - 1)

    # ---- divergence ---------------------------------------------------------------------------

    def overflow_step(self, cand: Candidate) -> int | None:
        """The step at which fp16's activations overflow and the loss turns inf (see
        :class:`Fp16Model`); None where they never do (another mode, islands that fix it, a
        batch below ``diverge_min_batch``)."""
        f = self.fp16
        if cand.precision != "fp16" or f.diverges_at_step is None:
            return None
        fixed = set(f.islands) <= set(cand.fp32_modules)
        if fixed and (f.islands or self.schema_version == 1):
            return None
        if f.diverge_min_batch is not None and cand.batch_size < f.diverge_min_batch:
            return None
        if not (f.diverge_batch_exponent or f.diverge_lr_exponent):
            return f.diverges_at_step
        ratio = cand.batch_size / self.facts.base_batch_size
        at = f.diverges_at_step * ratio**f.diverge_batch_exponent
        return max(1, round(at * self.lr_multiplier(cand) ** f.diverge_lr_exponent))

    def lr_blows_up(self, cand: Candidate) -> bool:
        """Whether the candidate's lr is past the stable one: its multiplier over the rule's
        (``parity.diverge_lr_multiplier``), or the lr itself over the base lr at any batch
        (``parity.diverge_lr_above``)."""
        limit, above = self.parity.diverge_lr_multiplier, self.parity.diverge_lr_above
        if limit is not None and self.lr_multiplier(cand) > limit * 1.0001:
            return True
        return above is not None and cand.learning_rate > above * self.facts.base_lr * 1.0001

    def diverge_step(self, cand: Candidate) -> int | None:
        """The step at which the candidate's loss turns inf, however long it runs; None: never."""
        overflow, blows_up = self.overflow_step(cand), self.lr_blows_up(cand)
        if self.schema_version == 1 and (blows_up or overflow is not None):
            # Version 1 ends every diverging run at fp16's overflow step where one is stated.
            at = self.fp16.diverges_at_step
            return LR_BLOWUP_STEP if at is None else at
        steps = [s for s in (overflow, LR_BLOWUP_STEP if blows_up else None) if s is not None]
        return min(steps, default=None)

    def scale_collapses(self, cand: Candidate) -> bool:
        """Whether fp16's lasting skips (``fp16.skip_rate``) outrun GradScaler's regrowth, or
        skip more steps than a probe allows: a long run diverges either way."""
        rate = self.fp16.skip_rate
        if cand.precision != "fp16" or rate <= 0:
            return False
        # Per growth_interval steps: rate * G halvings against one doubling, which needs G
        # clean steps in a row (a chance of about exp(-rate * G)).
        halvings = rate * cand.growth_interval
        return halvings > math.exp(-halvings) or rate > MAX_SKIP_RATE

    def diverges(self, cand: Candidate) -> bool:
        """Whether a long real run of the candidate diverges (what the simulated engine does
        over an unbounded run)."""
        return self.diverge_step(cand) is not None or self.scale_collapses(cand)

    def truth(self, cand: Candidate, *, margin: float = 0.1) -> Truth:
        """The candidate's noise-free speedup over fp32 at the base batch, its lasting gap, and
        whether it fits with ``margin`` of the memory free and keeps from diverging in a long
        run."""
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
            compile_seconds=self.compile_seconds(cand),
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
    if isinstance(data, dict) and data.get("schema_version", 1) not in SCHEMA_VERSIONS:
        readable = " and ".join(str(v) for v in SCHEMA_VERSIONS)
        raise SpecError(
            f"landscape {str(path)!r} has schema_version={data.get('schema_version')!r}; this "
            f"autotune reads versions {readable}: record it again or upgrade autotune"
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
