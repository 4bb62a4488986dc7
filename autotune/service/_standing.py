"""Where a study stands, read from its Optuna storage (trials by state and outcome, the best),
cached so that many clients polling cost the database little."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

from optuna.trial import FrozenTrial, TrialState

from autotune.schema.enums import Outcome
from autotune.service._models import TrialInfo
from autotune.study.reference import ReferenceMeasurement
from autotune.study.storage import Storage, stored_study
from autotune.study.store import StudyStore
from autotune.study.trials import (
    display_outcome,
    feasible_trials,
    record,
)

__all__ = ["StudyStanding", "StandingCache", "latest_reference", "read_standing", "trial_info"]

# Seconds a running study's standing is reused: trials take seconds, polls come faster.
_TTL = 1.0
# Trials a detail answer lists, newest first.
_LATEST = 100


@dataclass
class StudyStanding:
    """A study's trials summed up."""

    trials: dict[str, int] = field(default_factory=dict)
    by_outcome: dict[str, int] = field(default_factory=dict)
    best: TrialInfo | None = None
    reference_throughput: float | None = None
    latest: list[TrialInfo] = field(default_factory=list)
    tuned_config: dict[str, Any] | None = None


def trial_info(t: FrozenTrial) -> TrialInfo:
    """One trial for the API, read through its record."""
    rec = record(t)
    reason = rec.reason or None
    if t.state == TrialState.FAIL and not rec.outcome:
        reason = "no heartbeat: its worker or the service died mid-trial; failed as stale"
    # Optuna's own retry callback marks a rerun with the trial it repeats.
    failed = t.system_attrs.get("failed_trial")
    retry_of = rec.retry_of if rec.retry_of is not None else failed
    done = t.state == TrialState.COMPLETE
    return TrialInfo(
        number=t.number,
        state=t.state.name,
        params=dict(t.params),
        outcome=display_outcome(t),
        reason=reason,
        throughput=rec.throughput,
        speedup=rec.speedup if done else None,
        speedup_low=rec.speedup_low if done else None,
        speedup_high=rec.speedup_high if done else None,
        peak_memory_bytes=rec.peak_memory_bytes,
        # The config's trial is named as such: it carries validation's figure, not a search's.
        role="tuned_config" if rec.tuned_config else rec.role,
        retry_of=retry_of if isinstance(retry_of, int) else None,
    )


def latest_reference(store: StudyStore) -> ReferenceMeasurement | None:
    """The most recent measurement of the study's fp32 references (a study the service runs
    is measured on one device at a time: the latest is the one its trials divide by now)."""
    latest = [m for ref in store.references().values() if (m := ref.latest()) is not None]
    return max(latest, key=lambda m: m.at) if latest else None


def read_standing(store: StudyStore) -> StudyStanding:
    """The standing of a study, from its trials and what it stores."""
    trials = store.trials()
    out = StudyStanding()
    # The config's own trial is not one the search ran: left out of the counts, as in the report.
    crowned = [t for t in trials if record(t).tuned_config]
    apart = {t.number for t in crowned}
    for t in trials:
        if t.number in apart:
            continue
        key = t.state.name.lower()
        if t.state == TrialState.FAIL and record(t).outcome == Outcome.NOT_RUN:
            key = "not_run"  # queued and never started: no failure of the workload's
        elif record(t).duplicate_of is not None:
            key = Outcome.REUSED  # an earlier trial's measurement: nothing was measured
        out.trials[key] = out.trials.get(key, 0) + 1
        outcome = Outcome.REUSED if key == Outcome.REUSED else display_outcome(t)
        if outcome is not None:
            out.by_outcome[outcome] = out.by_outcome.get(outcome, 0) + 1
    ref = latest_reference(store)
    out.reference_throughput = ref.throughput if ref is not None else None
    # The config, once there is one (the trial that carries validation's figure); before,
    # as validation ranks them: feasible, measured (not copied from a twin), best value first.
    feasible = [t for t in feasible_trials(trials) if t.value is not None]
    if crowned:
        out.best = trial_info(crowned[-1])
    elif feasible:
        pick = max if store.maximize else min
        out.best = trial_info(pick(feasible, key=lambda t: cast(float, t.value)))
    out.latest = [trial_info(t) for t in trials[-_LATEST:]][::-1]
    stored = store.config()
    out.tuned_config = stored.model_dump(mode="json") if stored is not None else None
    return out


class StandingCache:
    """Standings by study name, refreshed at most once a second while a study can change."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Any, StudyStanding | None]] = {}
        self._refreshing: set[str] = set()
        self._studies: dict[str, StudyStore] = {}

    def get(self, name: str, version: Any, *, final: bool) -> StudyStanding | None:
        """The standing of ``name``; ``version`` changes whenever the queue row does, and a
        ``final`` (finished) study is read once."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(name)
            if hit is not None and hit[1] == version:
                if final or now - hit[0] < _TTL:
                    return hit[2]
                # One reader refreshes; the others answer with the second-old standing meanwhile
                # instead of all reading the same study at once.
                if name in self._refreshing:
                    return hit[2]
            self._refreshing.add(name)
        try:
            standing = self._read(name)
        finally:
            with self._lock:
                self._refreshing.discard(name)
                if final:  # read for good: its trials need not stay in memory
                    self._studies.pop(name, None)
        with self._lock:
            self._entries[name] = (now, version, standing)
        return standing

    def _read(self, name: str) -> StudyStanding | None:
        # One Study object per name: its storage cache keeps finished trials, so a refresh
        # reads only the trials that changed, however long the study grows.
        store = self._studies.get(name)
        if store is None:
            study = stored_study(self.storage, name)
            if study is None:
                return None
            store = self._studies[name] = StudyStore(study)
        return read_standing(store)
