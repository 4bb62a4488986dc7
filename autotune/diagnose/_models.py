"""What a diagnosis reports: per-layer figures, recommendations, a verdict."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autotune.schema.spec import Candidate

__all__ = [
    "DEFAULT_STEPS",
    "NEAR_LIMIT",
    "UNDERFLOW_SHARE",
    "Diagnosis",
    "Kind",
    "LayerStats",
    "Pass",
    "Recommendation",
    "Verdict",
]

# Enough for an overflow at initialization to show and the GradScaler to back off a few times;
# every step is two passes, so a diagnosis costs about ten probe steps.
DEFAULT_STEPS = 5
# An activation within 10x of the limit in the first steps has little room: they grow in training.
NEAR_LIMIT = 0.1
# Past this share of a layer's nonzero gradient values lost to underflow, its updates are wrong.
UNDERFLOW_SHARE = 0.01

Verdict = Literal["safe", "at_risk", "fails", "inconclusive"]
Pass = Literal["forward", "loss", "backward"]
Kind = Literal[
    "keep_fp32",
    "find_op",
    "lower_lr",
    "use_bf16",
    "raise_init_scale",
    "lower_init_scale",
    "safe",
    "retry",
]


class LayerStats(BaseModel):
    """What one leaf module did over the diagnosed steps.

    Magnitudes are of finite values only; non-finite ones are counted instead. Where a shadow
    fp32 pass ran, ``act_max`` and ``grad_max`` are its true sizes, which may exceed the limit.
    """

    model_config = ConfigDict(extra="forbid")

    name: str  # as in model.named_modules(); "" is the model itself
    type: str
    order: int  # execution order of its first forward call
    dtype: str  # dtype of its output in the real pass
    act_max: float  # largest |output|
    act_limit_ratio: float  # act_max / the dtype's largest finite value
    act_nonfinite: int  # non-finite output values in the real pass, all steps
    # Its output was non-finite while its inputs were finite: it made them, not passed them on.
    made_nonfinite: bool = False
    fp32_nonfinite: int = 0  # non-finite outputs in the fp32 shadow pass: not a precision problem
    grad_max: float | None = None  # largest |d loss / d output|, unscaled; None: none reached it
    grad_nonfinite: int = 0  # non-finite values in the real (scaled) backward pass
    # Share of its nonzero fp32 gradient values (output and own parameters) the dtype flushes to
    # zero at the GradScaler's scale. 0 for layers that compute in fp32 under autocast; None
    # without a shadow pass (fp32, tf32).
    grad_underflow: float | None = None
    first_nonfinite_step: int | None = None

    @property
    def label(self) -> str:
        """The name as a person reads it: ``(model)`` for the root module."""
        return self.name or "(model)"


class Recommendation(BaseModel):
    """One thing to do, with the numbers that call for it."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    evidence: str
    action: str
    layers: list[str] = Field(default_factory=list)
    # For raise_init_scale / lower_init_scale: the GradScaler init_scale to use.
    init_scale: float | None = None

    def __str__(self) -> str:
        return f"{self.evidence}: {self.action}"


class Diagnosis(BaseModel):
    """The per-layer numerics of a few training steps, a verdict and what to do.

    ``verdict``: ``fails`` (non-finite values that loss scaling cannot explain), ``at_risk``
    (activations near the limit, or gradients lost to underflow), ``safe``, or ``inconclusive``
    (the run could not be made: unsupported mode, out of memory, the workload raised).
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    workload: str
    candidate: Candidate
    device: str
    dtype: str
    limit: float  # the dtype's largest finite value
    smallest_subnormal: float
    steps: int  # steps run
    losses: list[float] = Field(default_factory=list)
    scales: list[float] = Field(default_factory=list)  # GradScaler scale at each step
    skipped_steps: int = 0
    layers: list[LayerStats] = Field(default_factory=list)  # in execution order
    first_nonfinite: str | None = None
    first_nonfinite_step: int | None = None
    first_nonfinite_pass: Pass | None = None
    verdict: Verdict
    reason: str
    recommendations: list[Recommendation] = Field(default_factory=list)
    wall_seconds: float = 0.0

    def worst(self, n: int = 10) -> list[LayerStats]:
        """The ``n`` layers nearest to failing: those that made non-finite values, those that
        passed them on, those near the limit, the most underflowing, then by size."""

        def badness(s: LayerStats) -> tuple[bool, bool, bool, float, float]:
            under = s.grad_underflow or 0.0
            return (
                s.made_nonfinite,
                s.act_nonfinite > 0,
                s.act_limit_ratio >= NEAR_LIMIT,
                under if under >= UNDERFLOW_SHARE else 0.0,
                s.act_limit_ratio,
            )

        return sorted(self.layers, key=badness, reverse=True)[:n]
