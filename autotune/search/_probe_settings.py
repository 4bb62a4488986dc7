"""How long a trial's probe runs: the spec's settings, cut to the budget, long enough for fp16."""

from __future__ import annotations

import math
import statistics

from optuna.trial import FrozenTrial, TrialState

from autotune.schema.enums import Role
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.search._budget import TRIAL_SHARE, VALIDATION_SHARE
from autotune.search._context import SearchContext
from autotune.search._risk import fp16_horizon, overflow_step

__all__ = ["trial_settings"]


def trial_settings(
    ctx: SearchContext,
    trials: list[FrozenTrial],
    left: float,
    cand: Candidate,
    role: str | None = None,
    reference_step: float = 0.0,
) -> ProbeSettings:
    """Probe settings for a trial: the spec's, with a time limit that fits the budget; an fp16
    candidate runs past the step where fp16 has been seen to overflow (a shorter run would call
    it safe before it could know), and the AMP recipe to the steps its validation must cover
    (then its pair alone validates it, without a second build for a run alone) where it runs
    those steps at most twice as slow as the fp32 reference's ``reference_step`` seconds."""
    probe = ctx.spec.probe
    overflow = overflow_step([t for t in trials if t.state == TrialState.PRUNED])
    most = TRIAL_SHARE * ctx.budget.total
    if cand.precision == "fp16" and overflow is not None:
        need = math.ceil(1.25 * overflow) + 1 - probe.warmup_steps
        probe = probe.model_copy(update={"steps": max(probe.steps, need)})
    if role == Role.AMP_RECIPE:
        need = fp16_horizon(ctx.spec.validation.fp16_steps, trials, cand.learning_rate)
        need -= probe.warmup_steps
        probe = probe.model_copy(update={"steps": max(probe.steps, need)})
        # fp16 far slower than fp32 (most CPUs) is cut where it would be twice as slow.
        horizon = ctx.least_probe() + 2 * (need + probe.warmup_steps) * reference_step
        most = max(most, min(VALIDATION_SHARE * ctx.budget.total, horizon))
    limit = max(1.0, min(probe.time_limit, left))
    # A mode far slower than the rest (fp16 on many CPUs) shows it in a few steps; a short
    # budget should not spend a large slice of itself proving it.
    limit = max(1.0, min(limit, max(3.0, most)))
    if len(ctx.found.trial_seconds) >= 3:
        # Once typical trials are known, one far slower than them is cut at a few times
        # their length: its throughput is measured by then.
        typical = statistics.median(ctx.found.trial_seconds)
        limit = max(1.0, min(limit, max(2.0, 4 * typical)))
    return probe.model_copy(update={"time_limit": limit})
