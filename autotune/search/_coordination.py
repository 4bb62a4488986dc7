"""Workers of one study: let the others' last trials finish, and claim once-per-window jobs."""

from __future__ import annotations

from collections.abc import Callable

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune.infra import clock
from autotune.schema.enums import Outcome
from autotune.study.claims import LEASE, done_by, owner_id, take
from autotune.study.storage import (
    GRACE_PERIOD,
    HEARTBEAT_INTERVAL,
    fail_stale,
    retry_stale_trial,
)
from autotune.study.store import StudyStore
from autotune.study.trials import TrialRecord, record, write_attrs

__all__ = [
    "SETTLE_WAIT",
    "await_validation",
    "fail_orphans",
    "fail_ownerless",
    "fail_waiting",
    "requeue_not_run",
    "settle",
]

# Why a trial the search queued (enqueue_trial) never ran (its outcome: Outcome.NOT_RUN).
NOT_RUN_REASON = "queued, but the search ended before it ran; a resumed search runs it first"

ORPHAN_REASON = (
    "left running by a write the storage refused mid-trial (a full disk, a lost database); "
    "failed when this process's search ended"
)

# Long enough for a dead worker's trial to go stale: the grace period plus two missed beats.
SETTLE_WAIT = GRACE_PERIOD + 2 * HEARTBEAT_INTERVAL


def settle(
    store: StudyStore,
    *,
    wait: float = SETTLE_WAIT,
    stop: Callable[[], bool] = lambda: False,
    on_wait: Callable[[int], None] | None = None,
    poll: float = 0.5,
) -> list[int]:
    """Wait until no trial of the study is RUNNING: each finishes, or goes stale and is failed
    (and re-enqueued once). Gives up after ``wait`` seconds or when ``stop()`` says so.

    Args:
        store: the study's store.
        wait: the most seconds to wait.
        stop: polled between looks; True ends the wait.
        on_wait: told how many trials are still running, before each wait.
        poll: seconds between looks.

    Returns:
        The numbers of the trials still RUNNING when it gave up (empty when none).
    """
    deadline = clock.now() + wait
    while True:
        fail_stale(store.study)
        running = store.trials((TrialState.RUNNING,))
        if not running or stop() or clock.now() >= deadline:
            return [t.number for t in running]
        if on_wait is not None:
            on_wait(len(running))
        clock.sleep(min(poll, max(0.05, deadline - clock.now())))


def validation_job(window: str) -> str:
    """The claim's name for the validation of a budget window."""
    return f"validation:{window}"


def await_validation(
    store: StudyStore,
    window: str,
    *,
    wait: float,
    stop: Callable[[], bool] = lambda: False,
    poll: float = 1.0,
) -> tuple[bool, str, str]:
    """Claim the validation of a budget window, or wait for the worker that holds it: until
    it is done, its owner loses the claim (dead, or silent for
    :data:`~autotune.study.claims.LEASE` seconds) and this worker takes it over, ``stop()``
    says so, or ``wait`` seconds (and two leases) have passed. A done validation is never
    claimed again.

    Returns:
        ``(won, owner, lost_by)``: won when this worker is to validate; the claim's owner; and
        who lost it to this worker (``""`` when nobody held it or this worker did not win).
    """
    job, me = validation_job(window), owner_id()
    deadline = clock.now() + wait + 2 * LEASE
    seen = ""  # the other worker that held it, while this one waited
    while True:
        if (by := done_by(store.study, job)) is not None:
            return False, by, ""
        owner, taken_from = take(store.study, job, me)
        if owner == me and (by := done_by(store.study, job)) is not None:  # done between two looks
            return False, by, ""
        if owner == me:
            return True, me, taken_from or seen
        if stop() or clock.now() >= deadline:
            return False, owner, ""
        seen = owner
        clock.sleep(poll)


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
