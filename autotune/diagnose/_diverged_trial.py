"""From a study: the diverged trial worth diagnosing, and the candidate it ran."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate
from autotune.study.trials import DEFAULT_INIT_SCALE, candidate, record
from autotune.workloads import Workload

__all__ = ["trial_candidate", "worst_diverged_trial"]


def worst_diverged_trial(trials: Iterable[Any], precision: str = "fp16") -> Any | None:
    """The diverged trial of a precision that broke soonest, or None.

    "Worst" is the earliest divergence (fewest finite losses recorded), then the highest
    learning rate. Works on Optuna ``FrozenTrial`` objects (anything with ``params`` that
    :func:`~autotune.study.trials.record` reads).

    Args:
        trials: the study's trials.
        precision: which precision's trials to consider.

    Returns:
        The trial, or None when no trial of that precision diverged.

    Example:
        >>> from optuna.distributions import CategoricalDistribution
        >>> from autotune.study.trials import TrialRecord, frozen_trial
        >>> def made(lr, losses):
        ...     return frozen_trial(
        ...         TrialRecord(outcome=Outcome.DIVERGED, learning_rate=lr, losses=losses),
        ...         params={"precision": "fp16"},
        ...         distributions={"precision": CategoricalDistribution(["fp16"])},
        ...         value=0.0,
        ...     )
        >>> worst = worst_diverged_trial([made(0.1, [2.3, None]), made(0.4, [2.3, 2.2, None])])
        >>> record(worst).learning_rate
        0.1
    """
    diverged = [
        (t, record(t))
        for t in trials
        if t.params.get("precision") == precision and record(t).outcome == Outcome.DIVERGED
    ]

    def key(pair: tuple[Any, Any]) -> tuple[int, float]:
        losses = pair[1].losses
        finite = next((n for n, v in enumerate(losses) if v is None), len(losses))
        return finite, -(pair[1].learning_rate or 0.0)

    return min(diverged, key=key)[0] if diverged else None


def trial_candidate(trial: Any, workload: Workload) -> Candidate:
    """The Candidate a stored search trial ran: its params and its recorded learning rate.

    Args:
        trial: an Optuna trial of an autotune study.
        workload: its workload: its base batch size and lr stand in where a trial (an older or
            hand-made one) lacks them.

    Returns:
        The Candidate.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> from optuna.trial import create_trial
        >>> trial_candidate(create_trial(value=0.0), tiny_mlp()).batch_size
        64
    """
    try:
        return candidate(trial)
    except ValueError:
        p = trial.params
        return Candidate(
            precision=p.get("precision", "fp16"),
            batch_size=int(p.get("batch_size", workload.base_batch_size)),
            learning_rate=record(trial).learning_rate or workload.base_lr,
            init_scale=float(p.get("init_scale", DEFAULT_INIT_SCALE)),
        )
