"""How long a trial's probe runs: the spec's settings, cut to the budget, long enough for fp16."""

from __future__ import annotations

import math
import statistics

from optuna.trial import FrozenTrial, TrialState

from autotune.enums import Role
from autotune.search._budget import TRIAL_SHARE, VALIDATION_SHARE
from autotune.search._context import SearchContext
from autotune.search._risk import fp16_horizon, overflow_step
from autotune.spec import Candidate, ProbeSettings

__all__ = ["trial_settings"]


def trial_settings(
    ctx: SearchContext,
    trials: list[FrozenTrial],
    left: float,
    cand: Candidate,
    role: str | None = None,
) -> ProbeSettings:
    """Probe settings for a trial: the spec's, with a time limit that fits the budget; an fp16
    candidate runs past the step where fp16 has been seen to overflow (a shorter run would call
    it safe before it could know), and the AMP recipe to the steps its validation must cover
    (then its pair alone validates it, without a second build for a run alone)."""
    probe = ctx.spec.probe
    overflow = overflow_step([t for t in trials if t.state == TrialState.PRUNED])
    share = TRIAL_SHARE
    if cand.precision == "fp16" and overflow is not None:
        need = math.ceil(1.25 * overflow) + 1 - probe.warmup_steps
        probe = probe.model_copy(update={"steps": max(probe.steps, need)})
    if role == Role.AMP_RECIPE:
        need = fp16_horizon(ctx.spec.validation.fp16_steps, trials) - probe.warmup_steps
        probe = probe.model_copy(update={"steps": max(probe.steps, need)})
        share = VALIDATION_SHARE
    limit = max(1.0, min(probe.time_limit, left))
    # A mode far slower than the rest (fp16 on many CPUs) shows it in a few steps; a short
    # budget should not spend a large slice of itself proving it.
    limit = max(1.0, min(limit, max(3.0, share * ctx.budget.total)))
    if len(ctx.trial_seconds) >= 3:
        # Once typical trials are known, one far slower than them is cut at a few times
        # their length: its throughput is measured by then.
        typical = statistics.median(ctx.trial_seconds)
        limit = max(1.0, min(limit, max(2.0, 4 * typical)))
    return probe.model_copy(update={"time_limit": limit})
