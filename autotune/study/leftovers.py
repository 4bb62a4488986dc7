"""What a search leaves behind in its study, put right: trials left RUNNING by a refused write
or a cut-off start, failed with the reason and retried; trials queued and never run, failed as
``not_run`` when it ends and queued again when a search resumes the study."""

from __future__ import annotations

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune.infra import clock
from autotune.schema.enums import Outcome
from autotune.study.claims import owner_id
from autotune.study.storage import GRACE_PERIOD, fail_stale, retry_stale_trial
from autotune.study.store import StudyStore
from autotune.study.trials import TrialRecord, record, write_attrs

__all__ = [
    "NOT_RUN_REASON",
    "ORPHAN_REASON",
    "fail_orphans",
    "fail_ownerless",
    "fail_waiting",
    "requeue_not_run",
]

# Why a trial the search queued (enqueue_trial) never ran (its outcome: Outcome.NOT_RUN).
NOT_RUN_REASON = "queued, but the search ended before it ran; a resumed search runs it first"

ORPHAN_REASON = (
    "left running by a write the storage refused mid-trial (a full disk, a lost database); "
    "failed when this process's search ended"
)


def fail_orphans(store: StudyStore) -> list[int]:
    """Fail the trials this process left RUNNING, at the end of its search: nothing of it runs
    any more (a study runs in one search per process), so a RUNNING trial of ours is one whose
    last write the storage refused. Each is labelled ``stale`` with the reason and retried once.

    Returns:
        The numbers of the trials failed.
    """
    me = owner_id()
    storage = store.storage
    failed = []
    for trial in store.trials((TrialState.RUNNING,)):
        if record(trial).worker != me:
            continue
        try:
            stale = TrialRecord(outcome=Outcome.STALE, reason=ORPHAN_REASON).to_attrs()
            write_attrs(storage, trial._trial_id, stale)
            if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        failed.append(trial.number)
        retry_stale_trial(store.study, storage.get_trial(trial._trial_id))
    return failed


def fail_ownerless(store: StudyStore, poll: float = 0.5) -> list[int]:
    """At the end of a search: fail what nobody runs any more (:func:`fail_stale`), and wait out
    the grace period of a RUNNING trial nobody recorded running (no ``worker``: its start was
    cut off, e.g. by a full disk just after it was asked), so it is failed too. A live worker
    records itself right after asking, so nothing is waited on but such a trial.

    Returns:
        The numbers of the trials failed.
    """
    deadline = clock.now() + GRACE_PERIOD + poll
    failed: list[int] = []
    while True:
        failed += fail_stale(store.study)
        running = store.trials((TrialState.RUNNING,))
        if not any(record(t).worker is None for t in running) or clock.now() >= deadline:
            return failed
        clock.sleep(poll)


def fail_waiting(store: StudyStore) -> list[int]:
    """At the end of a search: fail what it queued and never ran (WAITING: the first trials, a
    knob flipped, fp32 islands, a retry the budget left no time for), each with outcome
    ``not_run`` and the reason, so a finished study leaves nothing waiting in optuna-dashboard.

    Returns:
        The numbers of the trials failed.
    """
    storage = store.storage
    failed = []
    for trial in store.trials((TrialState.WAITING,)):
        try:
            if storage.get_trial(trial._trial_id).state != TrialState.WAITING:
                continue  # another worker has just started it
            attrs = TrialRecord(outcome=Outcome.NOT_RUN, reason=NOT_RUN_REASON).to_attrs()
            write_attrs(storage, trial._trial_id, attrs)
            if storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                failed.append(trial.number)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    if failed:
        logger.info("{} queued trials never ran: failed as not_run ({})", len(failed), failed)
    return failed


def requeue_not_run(store: StudyStore) -> list[int]:
    """When a search resumes a study: queue again, with their attributes (a role, fp32 modules,
    a retry's origin), the trials an earlier search failed as ``not_run``, unless a later trial
    holds the same parameters.

    Returns:
        The numbers of the trials queued again.
    """
    trials = store.trials()
    queued = []
    for t in trials:
        params, rec = t.system_attrs.get("fixed_params"), record(t)
        if t.state != TrialState.FAIL or rec.outcome != Outcome.NOT_RUN or not params:
            continue
        later = [
            u.system_attrs.get("fixed_params", u.params) for u in trials if u.number > t.number
        ]
        if params in later:
            continue
        store.enqueue(params, rec.without("outcome", "reason"))
        queued.append(t.number)
    return queued
