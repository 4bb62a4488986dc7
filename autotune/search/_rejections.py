"""Why search trials were rejected, grouped: the config's evidence and the report list them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from optuna.trial import FrozenTrial, TrialState

from autotune.schema.enums import Outcome
from autotune.study.trials import Rejection, display_outcome, record

__all__ = ["rejection_summary"]


def rejection_summary(trials: Iterable[FrozenTrial]) -> list[Rejection]:
    """Why search trials were rejected, grouped by mode and outcome, most common first.

    Example:
        >>> from autotune.study.trials import TrialRecord, frozen_trial
        >>> queued = TrialRecord(outcome=Outcome.NOT_RUN, reason="the search ended first")
        >>> rejection_summary([frozen_trial(queued, state=TrialState.FAIL)])
        []
    """
    groups: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for t in trials:
        rec = record(t)
        if rec.duplicate_of is not None:
            continue
        outcome = display_outcome(t)
        # Queued and never run (the search ended first) is no rejection: nothing was measured
        # (the summary listed it as "?: 1 not_run", a queued trial having no params).
        skip = (None, Outcome.COMPLETED, Outcome.NOT_RUN)
        if outcome in skip or t.state == TrialState.WAITING:
            continue
        key = (str(t.params.get("precision", "?")), outcome)
        groups[key] += 1
        example.setdefault(key, rec.reason)
    return [
        Rejection(
            label=mode, stage="search", kind=outcome, detail=example[(mode, outcome)], count=n
        )
        for (mode, outcome), n in groups.most_common()
    ]
