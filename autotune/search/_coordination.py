"""Workers of one study: let the others' last trials finish, and claim once-per-window jobs."""

from __future__ import annotations

from collections.abc import Callable

from optuna.trial import TrialState

from autotune.infra import clock
from autotune.study.claims import LEASE, done_by, owner_id, take
from autotune.study.storage import GRACE_PERIOD, HEARTBEAT_INTERVAL, fail_stale
from autotune.study.store import StudyStore

__all__ = [
    "SETTLE_WAIT",
    "await_validation",
    "settle",
    "validation_job",
]

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
