"""Workers of one study: let the others' last trials finish, and claim once-per-window jobs.

Optuna's storage is the only coordination: heartbeats mark a trial alive, a trial without one
is failed as stale (and retried once), and a row in the ``autotune_claims`` table says who
validates a budget window.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from autotune import clock
from autotune.storage import (
    GRACE_PERIOD,
    HEARTBEAT_INTERVAL,
    claim,
    fail_stale,
    owner_id,
    retry_stale_trial,
)
from autotune.trials import TrialRecord, record

__all__ = ["SETTLE_WAIT", "claim_validation", "fail_orphans", "fail_ownerless", "settle"]

ORPHAN_REASON = (
    "left running by a write the storage refused mid-trial (a full disk, a lost database); "
    "failed when this process's search ended"
)

# Long enough for a dead worker's trial to go stale: the grace period plus two missed beats.
SETTLE_WAIT = GRACE_PERIOD + 2 * HEARTBEAT_INTERVAL


def settle(
    study: optuna.Study,
    *,
    wait: float = SETTLE_WAIT,
    stop: Callable[[], bool] = lambda: False,
    on_wait: Callable[[int], None] | None = None,
    poll: float = 0.5,
) -> list[int]:
    """Wait until no trial of the study is RUNNING: each finishes, or goes stale and is failed
    (and re-enqueued once). Gives up after ``wait`` seconds or when ``stop()`` says so.

    Args:
        study: the study.
        wait: the most seconds to wait.
        stop: polled between looks; True ends the wait.
        on_wait: told how many trials are still running, before each wait.
        poll: seconds between looks.

    Returns:
        The numbers of the trials still RUNNING when it gave up (empty when none).
    """
    deadline = clock.now() + wait
    while True:
        fail_stale(study)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running or stop() or clock.now() >= deadline:
            return [t.number for t in running]
        if on_wait is not None:
            on_wait(len(running))
        clock.sleep(min(poll, max(0.05, deadline - clock.now())))


def claim_validation(study: optuna.Study, window: str) -> tuple[bool, str]:
    """Claim the validation of a budget window: ``(won, owner)``."""
    me = owner_id()
    owner = claim(study, f"validation:{window}", me)
    return owner == me, owner


def fail_orphans(study: optuna.Study) -> list[int]:
    """Fail the trials this process left RUNNING, at the end of its search: nothing of it runs
    any more (a study runs in one search per process), so a RUNNING trial of ours is one whose
    last write the storage refused. Each is labelled ``stale`` with the reason and retried once.

    Returns:
        The numbers of the trials failed.
    """
    me = owner_id()
    storage = study._storage
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if record(trial).worker != me:
            continue
        try:
            for key, value in TrialRecord(outcome="stale", reason=ORPHAN_REASON).to_attrs().items():
                storage.set_trial_user_attr(trial._trial_id, key, value)
            if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        failed.append(trial.number)
        retry_stale_trial(study, storage.get_trial(trial._trial_id))
    return failed


def fail_ownerless(study: optuna.Study, poll: float = 0.5) -> list[int]:
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
        failed += fail_stale(study)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not any(record(t).worker is None for t in running) or clock.now() >= deadline:
            return failed
        clock.sleep(poll)
