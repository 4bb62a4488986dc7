"""Pydantic models for what goes in: the study spec, a candidate and probe settings; every
default lives here (the run's length in :mod:`autotune.schema.run_length`) with its reason."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from autotune.errors import SpecError, format_validation_error, short_repr
from autotune.infra.inputs import check_shape, file_problem, load_text, read_text
from autotune.schema.bounds import bounded, check_bound
from autotune.schema.durations import Duration, duration_text, format_duration, parse_duration
from autotune.schema.run_length import RunLength
from autotune.schema.workload_spec import workload_reference

__all__ = [
    "COMPILE_MODES",
    "MAX_SEED",
    "MIN_BUDGET",
    "PRECISIONS",
    "DEFAULT_MIN_TIME",
    "MAX_BUDGET",
    "Candidate",
    "CompileMode",
    "EarlyStop",
    "Duration",
    "PrecisionName",
    "ProbeSettings",
    "Range",
    "SearchSpace",
    "StudySpec",
    "ValidationSettings",
    "format_duration",
    "load_spec",
    "parse_duration",
]

PrecisionName = Literal["fp32", "tf32", "fp16", "bf16"]
# The sampler's random generator takes seeds in [0, 2**32); probes use the same range.
MAX_SEED = 2**32 - 1
# Below this a search cannot run the fp32 reference, one candidate and validation, each at
# least a one-second probe, plus their start-up: it would write a config that measured nothing.
MIN_BUDGET = 4.0
# A search answers in minutes to hours; a week is already generous. A budget past it is a typo
# (--budget 1e9 is 31 years) that would hold a device until someone notices.
MAX_BUDGET = 7 * 24 * 3600.0
PRECISIONS: tuple[PrecisionName, ...] = ("fp32", "tf32", "fp16", "bf16")
# torch.compile's modes; the cudagraph ones ("reduce-overhead", "max-autotune") need CUDA.
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[CompileMode, ...] = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
# The modes whose compiled graphs replay as CUDA graphs: their outputs live in the graph's
# memory pool, which the next replay overwrites.
CUDA_GRAPH_MODES: frozenset[str] = frozenset({"reduce-overhead", "max-autotune"})


def _seed(value: int, info: Any) -> int:
    if not 0 <= value <= MAX_SEED:
        field = info.field_name or "seed"
        raise ValueError(
            f"{field} must be between 0 and {MAX_SEED} (2**32 - 1), got {field}={short_repr(value)}; "
            "e.g. --seed 0"
        )
    return value


# A seed the sampler and the probes accept: an integer in [0, 2**32).
Seed = Annotated[int, AfterValidator(_seed)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Candidate(_Model):
    """One point of the search space: what a probe trains with."""

    precision: PrecisionName
    batch_size: Annotated[int, bounded("candidate.batch_size")]
    learning_rate: float = Field(gt=0, allow_inf_nan=False)
    # GradScaler's own defaults; only fp16 uses them.
    init_scale: Annotated[float, Field(allow_inf_nan=False), bounded("candidate.init_scale")] = (
        2.0**16
    )
    growth_interval: Annotated[int, bounded("candidate.growth_interval")] = 2000
    # None: follow the workload's preference.
    channels_last: bool | None = None
    # torch.compile the model (its batch dimension marked dynamic), in this mode.
    compile: bool = False
    compile_mode: CompileMode = "default"
    # Modules (names as in model.named_modules()) run in fp32 inside the autocast region.
    fp32_modules: list[str] = Field(default_factory=list)


def _seconds_or_zero(value: Any, info: Any) -> float | None:
    """A duration that may also be 0 (off) or None (the device's default)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    if isinstance(value, str) and value.strip() in ("0", "0s"):
        return 0.0
    return parse_duration(value, info.field_name or "duration")


OptionalDuration = Annotated[
    float | None,
    BeforeValidator(_seconds_or_zero),
    PlainSerializer(lambda v: None if v is None else duration_text(v) if v else 0.0),
]

# The timed phase lasts at least this long by default: a GPU step is short and steady, a CPU's
# shares its cores with whatever else runs there.
DEFAULT_MIN_TIME = {"cuda": 1.0, "cpu": 2.0}


class ProbeSettings(_Model):
    """How long one probe runs and what it calls divergence: its timed phase (blocks of steps
    between two device syncs) lasts until it has run ``min_time`` *and* ``steps`` steps *and*
    the throughput's 95% interval is within ``precision`` of its median (or 4x ``min_time``,
    or ``time_limit``), the way ``timeit`` sizes its runs by time, not by count."""

    # Untimed steps first: cudnn autotune, allocator growth and scaler calibration happen here.
    warmup_steps: Annotated[int, bounded("probe.warmup_steps")] = 3
    # Timed steps at least: the parity check needs that much of the loss curve.
    steps: Annotated[int, bounded("probe.steps")] = 20
    # The most steps between two loss reads (one host sync each); a timed block is at most
    # this long, and shorter when its steps would take more than a tenth of min_time.
    check_every: Annotated[int, bounded("probe.check_every")] = 10
    # Seconds the timed phase lasts at least; None: 1s on a GPU, 2s on a CPU; 0: count steps.
    min_time: Annotated[OptionalDuration, bounded("probe.min_time")] = None
    # Target relative half-width of the throughput's 95% interval (0.03: ±3%).
    precision: Annotated[float, Field(allow_inf_nan=False), bounded("probe.precision")] = 0.03
    # Let the search stop a probe early once it is clearly slower than the best candidate or
    # clearly off parity (multi-fidelity); false measures every probe to its end.
    early_stop: bool = True
    # A loss this many times above its first value is a blow-up, not noise.
    loss_blowup_factor: Annotated[
        float, Field(allow_inf_nan=False), bounded("probe.loss_blowup_factor")
    ] = 10.0
    # Past warmup, GradScaler should rarely skip; more than this share of skips is divergence.
    max_skip_rate: Annotated[float, Field(allow_inf_nan=False), bounded("probe.max_skip_rate")] = (
        0.25
    )
    # Soft limit: the probe stops and is scored on the steps it finished.
    time_limit: Annotated[Duration, bounded("probe.time_limit")] = 120.0
    seed: Seed = 0
    # Set by the search from the spec's memory_margin: a GPU's share kept free. None: no cap.
    memory_margin: float | None = Field(default=None, ge=0, lt=1, allow_inf_nan=False)
    # Set by the search for fp16: a pair's candidate runs on alone after its pairs to this step.
    alone_steps: int = Field(default=0, ge=0)


# Set per run by the search (how long a probe measures), they do not shape its space.
_PER_RUN = {"time_limit", "min_time", "precision", "early_stop", "memory_margin", "alone_steps"}


class EarlyStop(_Model):
    """When a probe may stop before its timed phase is done: set by the search, per trial.

    A probe clearly slower than the best candidate, or clearly off the fp32 reference's loss,
    has answered its question: its time is better spent on another candidate.

    Example:
        >>> EarlyStop(below=1240.0).after_blocks
        5
    """

    # Stop once the throughput interval's upper bound is below this many samples/s ...
    below: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # ... judged after at least this many timed blocks (and half of min_time); the first step
    # judged too, less these seconds for its first-use costs (None: not the first step).
    after_blocks: int = Field(default=5, ge=1)
    first_use: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Stop once the loss is more than this far above the reference's (relative gap), by twice
    # the gap's standard error from both curves' step-to-step noise (measure/timed.py) ...
    parity_gap: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # ... at equal samples seen, from this many samples on (where a short curve says enough).
    parity_samples: int = Field(default=0, ge=0)
    # The reference's loss curve and batch size.
    reference_losses: list[float] = Field(default_factory=list)
    reference_batch_size: int = Field(default=1, gt=0)


class Range(_Model):
    """A closed interval ``[min, max]``."""

    # Bounded where it is used (SearchSpace): a learning-rate multiplier is not a scale.
    min: float = Field(allow_inf_nan=False)
    max: float = Field(allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min > self.max:
            raise ValueError(
                f"min must not be above max, got min={self.min:g}, max={self.max:g}; "
                "swap them or widen the range"
            )
        return self


class IntRange(_Model):
    """A closed integer interval ``[min, max]``."""

    # Bounded where it is used (SearchSpace).
    min: int
    max: int

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.min > self.max:
            raise ValueError(
                f"min must not be above max, got min={self.min}, max={self.max}; "
                "swap them or raise max"
            )
        return self


class SearchSpace(_Model):
    """What the search may choose from. The device and the batch ceilings cut it further."""

    precisions: list[PrecisionName] = Field(default_factory=lambda: list(PRECISIONS), min_length=1)
    # Batch sizes are tried on a ladder of powers of two (and the workload's base size) inside this.
    batch_size: IntRange = Field(default_factory=lambda: IntRange(min=16, max=1024))
    # Explicit batch sizes instead of the ladder (still cut by the ceilings).
    batch_sizes: list[Annotated[int, bounded("space.batch_sizes[]")]] | None = Field(
        default=None, min_length=1
    )
    # Multiplier on the learning rate after the batch-size scaling rule; 1.0 is the rule itself,
    # and the default: a learning rate off the rule changes the final loss of a long run without
    # showing in the loss curve of a short one (benchmarks/parity_horizon.py), so the parity
    # check cannot vouch for it. Widen it (e.g. {min: 0.5, max: 2.0}) to tune the lr too.
    lr_multiplier: Range = Field(default_factory=lambda: Range(min=1.0, max=1.0))
    # Explicit multipliers instead of the continuous range.
    lr_multipliers: (
        list[Annotated[float, Field(allow_inf_nan=False), bounded("space.lr_multipliers[]")]] | None
    ) = Field(default=None, min_length=1)
    # linear for SGD-like optimizers, sqrt for Adam-like; auto asks the workload.
    lr_scaling: Literal["auto", "linear", "sqrt", "none"] = "auto"
    # Powers of two in this range are tried for fp16's GradScaler; 2^16 is torch's default.
    # Down to 1: a model with large gradients fits only a small scale (2^7 is not rare), and a
    # divergence that names such a scale leads to a trial at it.
    init_scale: Range = Field(default_factory=lambda: Range(min=1.0, max=2.0**20))
    # torch.compile off, on, or both searched ([false, true]); compiling happens in the warm-up,
    # outside the timed window, and its wall time is charged to the budget.
    compile: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    # The compile modes searched when compiling (max-autotune compiles for far longer).
    compile_modes: list[CompileMode] = Field(
        default_factory=lambda: list[CompileMode](["default"]), min_length=1
    )
    # channels_last for 4-d inputs, searched ([false, true]) or fixed; None: the workload's own
    # preference (a convnet's channels_last=True), not searched.
    channels_last: list[bool] | None = Field(default=None, min_length=1)
    # After an fp16 trial diverges and its diagnosis names the modules that leave fp16's range,
    # try fp16 with those modules kept in fp32 (a candidate of its own, measured like any).
    fp32_islands: bool = True

    # Knobs added after studies were first stored: left out of the space fingerprint at these
    # defaults, so a study stored before them still resumes.
    KNOB_DEFAULTS: ClassVar[dict[str, Any]] = {
        "compile": [False],
        "compile_modes": ["default"],
        "channels_last": None,
        "fp32_islands": True,
    }

    @field_validator("precisions", "compile", "compile_modes", "channels_last")
    @classmethod
    def _unique(cls, value: list | None) -> list | None:
        return None if value is None else list(dict.fromkeys(value))

    @field_validator("batch_size", "lr_multiplier", "init_scale")
    @classmethod
    def _in_bounds(cls, value: Range | IntRange, info: Any) -> Range | IntRange:
        for end in ("min", "max"):
            check_bound(f"space.{info.field_name}.{end}", getattr(value, end))
        return value


class ValidationSettings(_Model):
    """How the best candidates are checked again before they become the config."""

    # The best few feasible candidates get a longer, fresh-seed rerun.
    top_k: Annotated[int, bounded("validation.top_k")] = 2
    # Longer than the search probes so the parity check sees more of the curve.
    steps: Annotated[int, bounded("validation.steps")] = 40
    # A winner's validated speedup must have its *lower bound* at least this high: a few
    # percent is measurement noise, and then the reference itself is the config.
    min_speedup: Annotated[float, Field(allow_inf_nan=False), bounded("validation.min_speedup")] = (
        1.05
    )
    # An fp16 candidate is validated over a run of at least this many steps (twice the
    # earliest overflow the study saw, where that is more): fp16's range often runs out only
    # after hundreds of steps, as activations grow, far past a probe's few dozen.
    fp16_steps: Annotated[int, bounded("validation.fp16_steps")] = 500


class StudySpec(_Model):
    """A whole study: what to tune, within which bounds, for how long, stored where.

    Example:
        >>> spec = StudySpec(name="tiny", workload="autotune.workloads:tiny_convnet", budget="90s")
        >>> spec.budget
        90.0
    """

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # A reference (package.module:function, a built-in name) or the user's own classes
    # ({lightning: ...}, {huggingface: ...}, {loop: ...}), held as one reference string.
    workload: Annotated[str, BeforeValidator(workload_reference), Field(min_length=1)]
    device: str = "auto"
    budget: Duration = 1800.0
    space: SearchSpace = Field(default_factory=SearchSpace)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    # Relative: the candidate's smoothed loss may be at most 5% above the fp32 reference's.
    parity_tolerance: Annotated[float, Field(allow_inf_nan=False), bounded("parity_tolerance")] = (
        0.05
    )
    # Share of device memory a chosen batch must leave free: the box is shared.
    memory_margin: Annotated[float, Field(allow_inf_nan=False), bounded("memory_margin")] = 0.10
    # Default objective; time_to_loss estimates the wall time to reach the reference's loss.
    objective: Literal["throughput", "time_to_loss"] = "throughput"
    # SQLite beside the specs: embedded, no set-up. Use PostgreSQL for many workers.
    storage: str = "sqlite:///studies/autotune.db"
    # Seeds the sampler; probes derive theirs from it.
    seed: Seed = 0
    # How long the real run trains: parity is read at its end where it is shorter than
    # validation's curves, and projected to it where an early lag still fades. None: at their end.
    run: RunLength | None = None

    @field_validator("budget")
    @classmethod
    def _measurable(cls, value: float) -> float:
        if value < MIN_BUDGET:
            raise ValueError(
                f"budget must be at least {MIN_BUDGET:g}s, enough to measure the fp32 reference, "
                f"one candidate and validation; got budget={format_duration(value)!r}; "
                "try --budget 30m"
            )
        if value > MAX_BUDGET:
            raise ValueError(
                f"budget must be at most {format_duration(MAX_BUDGET)} (7 days), got "
                f"budget={format_duration(value)!r}; a search answers in minutes to hours: "
                "try --budget 30m"
            )
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        value = value.strip().lower()
        if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
            return value
        raise ValueError(
            f"device must be auto, cpu, cuda or cuda:N, got device={short_repr(value)}"
        )

    def space_fingerprint(self) -> str:
        """A short hash of everything that shapes the search space, for resume checks."""
        space = self.space.model_dump(mode="json")
        for key, default in SearchSpace.KNOB_DEFAULTS.items():
            if space.get(key) == default:
                del space[key]
        shape = {
            "workload": self.workload,
            "space": space,
            # How long a probe measures does not change the space; its step counts do.
            "probe": self.probe.model_dump(mode="json", exclude=_PER_RUN),
            "objective": self.objective,
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def with_overrides(self, overrides: dict[str, Any]) -> StudySpec:
        """Return a copy with dotted-path overrides applied, e.g. ``{"probe.steps": 10}``.

        Raises:
            SpecError: naming the field when a path or a value is invalid.
        """
        data = self.model_dump(mode="json")
        for path, value in overrides.items():
            if value is None:
                continue
            node = data
            parts = path.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    raise SpecError(
                        f"unknown spec field {path!r}; see the fields in studies/*.yaml"
                    )
                node = node[part]
            if parts[-1] not in node:
                raise SpecError(f"unknown spec field {path!r}; see the fields in studies/*.yaml")
            node[parts[-1]] = value
        return parse_spec(data, source="study spec (after command-line overrides)")


def parse_spec(data: Any, source: str = "study spec") -> StudySpec:
    """Validate a mapping into a StudySpec, raising SpecError with one line per bad field.

    Data too deep or too large to be a spec is refused before validation walks it
    (:func:`autotune.infra.inputs.check_shape`).
    """
    if not isinstance(data, dict):
        raise SpecError(
            f"invalid {source}: expected a mapping of fields, got {type(data).__name__}"
        )
    check_shape(data, source)
    try:
        return StudySpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, source)) from None


def load_spec(path: str | Path) -> StudySpec:
    """Read a study spec from a YAML (or JSON) file.

    Args:
        path: the file, e.g. ``studies/resnet18.yaml``.

    Returns:
        The validated StudySpec.

    Raises:
        SpecError: the file is missing, is not YAML, is too large, nests too deep, expands its
            aliases too far, or has invalid fields.
    """
    path = Path(path)
    problem = file_problem(path)
    if problem is not None:
        raise SpecError(f"study spec {str(path)!r} {problem}; pass a file like studies/tiny.yaml")
    source = f"study spec {str(path)!r}"
    data = load_text(read_text(path, source), "yaml", source)
    return parse_spec(data, source=source)
