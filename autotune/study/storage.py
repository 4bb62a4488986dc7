"""Opening the Optuna study a spec names, with clear errors and a resume check."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import optuna
from sqlalchemy.exc import SQLAlchemyError

from autotune.errors import StorageError
from autotune.infra.files import create_file, make_dirs
from autotune.infra.redact import mask_url, remember, userinfo_ats
from autotune.schema.enums import Outcome
from autotune.schema.spec import StudySpec
from autotune.study.claims import claim, delete_claims, owner_alive, owner_id
from autotune.study.guarded import GuardedStorage, database_error
from autotune.study.store import StudyStore
from autotune.study.trials import TrialRecord, record, write_attrs

__all__ = [
    "GRACE_PERIOD",
    "HEARTBEAT_INTERVAL",
    "STALE_REASON",
    "Storage",
    "claim",
    "database_error",
    "delete_study",
    "fail_stale",
    "heartbeat",
    "in_memory_storage",
    "mask_url",
    "name_objective",
    "open_storage",
    "open_study",
    "owner_alive",
    "owner_id",
    "retry_stale_trial",
    "stored_spec",
]

# A running trial's worker records a heartbeat this often (seconds) ...
HEARTBEAT_INTERVAL = 2
# ... and a trial without one for this long is stale: failed, and retried once elsewhere.
GRACE_PERIOD = 8

# What losing the race to create a fresh database's tables looks like, per backend.
_CREATION_RACE = (
    "already exists",  # PostgreSQL, SQLite: a table another worker just created
    "duplicate key",  # PostgreSQL: the same, in the catalog
    "UNIQUE constraint failed",  # SQLite: the schema version row another worker just wrote
    "database is locked",  # SQLite: another worker is writing the schema right now
)

# What a trial failed by the stale check records as its reason.
STALE_REASON = (
    f"no heartbeat for {GRACE_PERIOD}s: the process running it died or could not write to the "
    "storage; failed as stale"
)


# Where studies are kept, as every layer above this one names it.
Storage = optuna.storages.BaseStorage


def in_memory_storage() -> Storage:
    """A storage in this process's memory (a simulated search's, a test's)."""
    return optuna.storages.InMemoryStorage()


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open an Optuna storage URL, creating the folder of a SQLite file.

    Raises:
        StorageError: the URL cannot be opened, naming it (password hidden) and the fix.
    """
    remember(url)  # whatever quotes its password from now on (a driver's error) shows ***
    file = url[len("sqlite:///") :].split("?")[0] if url.startswith("sqlite:///") else ""
    if file not in ("", ":memory:"):
        path = Path(file)
        if path.parent and not path.parent.exists():
            try:
                make_dirs(path.parent)
            except OSError as exc:
                raise StorageError(
                    f"storage {url!r}: cannot create folder {str(path.parent)!r}: {exc}"
                ) from None
        # SQLite would create the file 0644: created here first, it is the owner's only
        # (autotune.infra.files; AUTOTUNE_UMASK to share it).
        with contextlib.suppress(OSError):  # unwritable: SQLite says why, below
            create_file(path)
    if re.fullmatch(r"sqlite(\+\w+)?:///?(:memory:)?(\?.*)?", url.strip()):
        raise StorageError(
            f"storage {url!r} is an in-memory database: nothing would be saved, and a resumed "
            "run or another worker would find nothing; give a file, e.g. "
            "--storage sqlite:///studies/autotune.db"
        )
    if userinfo_ats(url):
        raise StorageError(
            f"storage {mask_url(url)!r} has a raw '@' in its user name or password, so the "
            "database driver would read part of the password as the host; write it as %40 "
            "(e.g. postgresql://user:p%40ss@host/db)"
        )
    if not re.match(r"^[a-z][a-z0-9+]*://", url):
        raise StorageError(
            f"storage {mask_url(url)!r} is not a database URL; use sqlite:///studies/autotune.db "
            "or postgresql://user:password@host/db"
        )
    engine_kwargs = {}
    if url.startswith("postgresql"):
        # A wrong host or password should fail in seconds, not hang a worker.
        engine_kwargs = {"connect_args": {"connect_timeout": 5}, "pool_pre_ping": True}
    for attempt in range(4):
        try:
            return _rdb(url, engine_kwargs)
        except ImportError as exc:
            raise StorageError(
                f"storage {mask_url(url)!r} needs a database driver that is not installed "
                f"({exc}); for PostgreSQL: pip install 'autotune[postgres]'"
            ) from None
        except (SQLAlchemyError, ValueError, OSError) as exc:
            text = str(exc)
            # Workers starting together on a fresh database race to create its tables; the
            # losers see "already exists" / a duplicate key, and the tables are there now.
            if attempt < 3 and any(sign in text for sign in _CREATION_RACE):
                time.sleep(0.5 + attempt)  # a real race between processes: real time
                continue
            detail = text.splitlines()[0][:300] if text else type(exc).__name__
            raise StorageError(
                f"storage {mask_url(url)!r} cannot be opened: {mask_url(detail, url=url)}; check the URL, "
                "the server and the credentials"
            ) from None
    raise AssertionError("unreachable")


def _rdb(url: str, engine_kwargs: dict) -> optuna.storages.RDBStorage:
    # Optuna warns on every ask() that heartbeats belong to optimize(); autotune's ask/tell loop
    # records them itself (heartbeat() below). One targeted filter, set once: a
    # catch_warnings() around each ask would race between the service's study threads.
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return GuardedStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=HEARTBEAT_INTERVAL,
                grace_period=GRACE_PERIOD,
                heartbeat_stale_trial_callback=retry_stale_trial,
            )
    except optuna.exceptions.StorageInternalError as exc:
        raise SQLAlchemyError(str(exc.__cause__ or exc)) from exc


def open_study(
    spec: StudySpec, storage: optuna.storages.BaseStorage | None = None, *, create: bool = True
) -> optuna.Study:
    """Create the spec's study, or load it to resume when it exists with the same space.

    Args:
        spec: the study spec; its name, storage URL, space and seed.
        storage: an already opened storage; opened from ``spec.storage`` when None.
        create: False to only join an existing study (a worker), never create one.

    Raises:
        StorageError: the storage cannot be opened, or a study of this name exists with a
            different space (its trials are left untouched).
    """
    storage = storage or open_storage(spec.storage)
    direction: Final = "maximize" if spec.objective == "throughput" else "minimize"
    sampler = optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=6)
    fingerprint = spec.space_fingerprint()
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}
    except SQLAlchemyError as exc:
        raise StorageError(f"storage {mask_url(spec.storage)!r} cannot be read: {exc}") from None
    if spec.name in existing:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
        store = StudyStore(study)
        stored = store.space_fingerprint()
        for _ in range(20):
            if stored is not None:
                break
            # Another worker has just created it and is writing its attributes.
            time.sleep(0.25)  # another process writes it: real time
            stored = store.space_fingerprint()
        if stored != fingerprint:
            raise StorageError(
                f"study {spec.name!r} already exists in {mask_url(spec.storage)!r} with a different "
                f"space (workload, space, probe lengths or objective changed; stored "
                f"{store.workload() or '?'!r}); its {len(study.trials)} trials are kept. "
                f"Use --name {spec.name}-2 for a new study, or run with the spec it was made with"
            )
        kept = store.spec()
        if kept is not None and kept.get("storage") != mask_url(str(kept.get("storage"))):
            # Made by a version that stored the password: write it again without.
            with contextlib.suppress(SQLAlchemyError, optuna.exceptions.StorageInternalError):
                store.set_spec({**kept, "storage": mask_url(kept["storage"])})
        if study.metric_names is None:  # made by a version that did not name it
            # Several workers resuming at once may race to write it: one write is enough.
            with contextlib.suppress(SQLAlchemyError, optuna.exceptions.StorageInternalError):
                name_objective(study, spec.objective)
        return study
    if not create:
        known = ", ".join(sorted(existing)) or "none"
        raise StorageError(
            f"study {spec.name!r} does not exist in {mask_url(spec.storage)!r} (studies there: "
            f"{known}); start it with `autotune search` or `autotune submit` first"
        )
    try:
        study = optuna.create_study(
            study_name=spec.name, storage=storage, sampler=sampler, direction=direction
        )
    except optuna.exceptions.DuplicatedStudyError:
        # Another worker created it a moment ago: join it.
        return open_study(spec, storage, create=False)
    # Before the fingerprint: workers joining wait for it, then find the study complete.
    name_objective(study, spec.objective)
    StudyStore(study).set_identity(fingerprint, spec.workload, stored_spec(spec))
    return study


def stored_spec(spec: StudySpec) -> dict[str, Any]:
    """The spec as a study stores it: the storage URL without its password.

    Study attributes are shown to whoever can open the storage (optuna-dashboard shows them
    all); whoever resumes a study gives the storage URL again, so the password is not needed.

    Example:
        >>> from autotune.schema.spec import parse_spec
        >>> spec = parse_spec({"name": "s", "workload": "tiny_convnet",
        ...                    "storage": "postgresql://u:secret@db/autotune"})
        >>> stored_spec(spec)["storage"]
        'postgresql://u:***@db/autotune'
    """
    return {**spec.model_dump(mode="json"), "storage": mask_url(spec.storage)}


# The objective's name where optuna-dashboard (and Optuna's plots) label the axis.
# A throughput study's value is its speedup over the fp32 reference measured close in time.
METRIC_NAMES = {
    "throughput": "speedup over fp32 (x)",
    "time_to_loss": "seconds to the reference's loss",
}


def name_objective(study: optuna.Study, objective: str) -> None:
    """Name the study's objective (``study.set_metric_names``), e.g. ``speedup over fp32 (x)``.

    Example:
        >>> study = optuna.create_study(direction="maximize")
        >>> name_objective(study, "throughput")
        >>> study.metric_names
        ['speedup over fp32 (x)']
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([METRIC_NAMES.get(objective, objective)])


def fail_stale(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials nobody runs any more, each labelled and retried once.

    A trial is stale when its heartbeat is older than the grace period, or at once when the
    process it records as its ``worker`` is on this host and dead. Each gets ``outcome`` stale
    and a ``reason`` before it is failed, and one WAITING retry with ``retry_of`` (see
    :func:`retry_stale_trial`).

    Returns:
        The numbers of the trials this call failed.
    """
    storage = study._storage
    if not hasattr(storage, "_get_stale_trial_ids"):
        return []
    # Optuna's own check is fail_stale_trials(); it fails a trial before anyone can say why.
    stale = set(storage._get_stale_trial_ids(study._study_id))
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = record(trial).worker
        if trial._trial_id in stale:
            reason = STALE_REASON
        elif owner_alive(worker) is False:
            reason = f"the process running it ({worker}) is gone: killed or crashed mid-trial"
        elif worker is None and _age(trial) > GRACE_PERIOD:
            # No owner and no heartbeat: its first writes were refused (a full disk right after
            # it started); nobody will ever finish it.
            reason = "nobody recorded running it (no worker, no heartbeat): its start was cut off"
        else:
            continue
        try:
            write_attrs(
                storage,
                trial._trial_id,
                TrialRecord(outcome=Outcome.STALE, reason=reason).to_attrs(),
            )
            if not storage.set_trial_state_values(
                trial._trial_id, state=optuna.trial.TrialState.FAIL
            ):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process failed it a moment ago
        failed.append(trial.number)
        retry_stale_trial(study, storage.get_trial(trial._trial_id))
    return failed


def _age(trial: optuna.trial.FrozenTrial) -> float:
    """Seconds since the trial started (Optuna stores local wall time)."""
    start = trial.datetime_start
    return (datetime.now() - start).total_seconds() if start is not None else 0.0


def retry_stale_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue one retry of a stale trial (WAITING), with ``retry_of`` and the trial's role.

    A trial that is itself a retry is not retried again: a candidate that kills its worker
    twice is not a worker's accident. Also the heartbeat callback Optuna calls.
    """
    rec = record(trial)
    if rec.retry_of is not None or trial.system_attrs.get("failed_trial") is not None:
        return
    if not trial.params:
        return
    retry = rec.settings(retry_of=trial.number, role=rec.role)
    StudyStore(study).enqueue(trial.params, retry)


@contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """Record the trial's heartbeat every HEARTBEAT_INTERVAL seconds while the block runs.

    Optuna only beats inside ``optimize()``; the ask/tell loop here beats for itself, so a
    worker that dies mid-trial leaves a stale trial that another process fails and retries.
    """
    storage = study._storage
    if not hasattr(storage, "record_heartbeat"):
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            # A missed beat is retried; the grace period covers it.
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial._trial_id)
            if stop.wait(HEARTBEAT_INTERVAL):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def study_names(storage: Storage) -> list[str]:
    """The names of the studies a storage holds, sorted."""
    return sorted(optuna.get_all_study_names(storage))


def stored_study(storage: Storage, name: str) -> optuna.Study | None:
    """The stored study of this name, to read and to record trials in (never to ask a sampler
    for one: it gets a plain sampler, which costs nothing to start); None when there is none."""
    try:
        return optuna.load_study(
            study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler()
        )
    except KeyError:
        return None


def delete_study(storage: optuna.storages.BaseStorage, name: str) -> None:
    """Delete the study ``name`` and its claims: a study created again under the name starts
    with no job claimed (a claim names the study, not one creation of it).

    Raises:
        KeyError: no study of that name.
    """
    optuna.delete_study(study_name=name, storage=storage)
    delete_claims(storage, name)
