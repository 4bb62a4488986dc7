"""Opening the Optuna study a spec names, with clear errors and a resume check."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from autotune.errors import StorageError
from autotune.spec import StudySpec

__all__ = [
    "HEARTBEAT_INTERVAL",
    "claim",
    "fail_stale",
    "heartbeat",
    "mask_url",
    "name_objective",
    "open_storage",
    "open_study",
    "owner_id",
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

_CLAIMS = sa.Table(
    "autotune_claims",
    sa.MetaData(),
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("what", sa.String(128), primary_key=True),
    sa.Column("owner", sa.String(512), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
)


def owner_id() -> str:
    """Who this process is, for claims and logs: ``host:pid``."""
    import os

    return f"{socket.gethostname()}:{os.getpid()}"


def mask_url(url: str) -> str:
    """Hide a password in a storage URL: ``postgresql://u:secret@h/db`` → ``postgresql://u:***@h/db``."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open an Optuna storage URL, creating the folder of a SQLite file.

    Raises:
        StorageError: the URL cannot be opened, naming it (password hidden) and the fix.
    """
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///") :])
        if path.parent and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(
                    f"storage {url!r}: cannot create folder {str(path.parent)!r}: {exc}"
                ) from None
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
                time.sleep(0.5 + attempt)
                continue
            detail = text.splitlines()[0][:300] if text else type(exc).__name__
            raise StorageError(
                f"storage {mask_url(url)!r} cannot be opened: {mask_url(detail)}; check the URL, "
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
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=HEARTBEAT_INTERVAL,
                grace_period=GRACE_PERIOD,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=1
                ),
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
    direction = "maximize" if spec.objective == "throughput" else "minimize"
    sampler = optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=6)
    fingerprint = spec.space_fingerprint()
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}
    except SQLAlchemyError as exc:
        raise StorageError(f"storage {mask_url(spec.storage)!r} cannot be read: {exc}") from None
    if spec.name in existing:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
        stored = study.user_attrs.get("space_fingerprint")
        for _ in range(20):
            if stored is not None:
                break
            # Another worker has just created it and is writing its attributes.
            time.sleep(0.25)
            stored = optuna.load_study(study_name=spec.name, storage=storage).user_attrs.get(
                "space_fingerprint"
            )
        if stored != fingerprint:
            raise StorageError(
                f"study {spec.name!r} already exists in {mask_url(spec.storage)!r} with a different "
                f"space (workload, space, probe lengths or objective changed; stored "
                f"{study.user_attrs.get('workload', '?')!r}); its {len(study.trials)} trials are kept. "
                f"Use --name {spec.name}-2 for a new study, or run with the spec it was made with"
            )
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
    study.set_user_attr("space_fingerprint", fingerprint)
    study.set_user_attr("workload", spec.workload)
    study.set_user_attr("spec", spec.model_dump(mode="json"))
    return study


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


def fail_stale(study: optuna.Study) -> None:
    """Fail trials whose worker stopped sending heartbeats; each is retried once (WAITING)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


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


def claim(study: optuna.Study, what: str, owner: str | None = None) -> str:
    """Claim a once-per-study job (e.g. validation) in the study's database.

    Returns:
        The owner of the claim: ``owner`` when this call won it, else whoever holds it.
    """
    owner = owner or owner_id()
    storage = study._storage
    # Optuna wraps an RDBStorage in a cache; the engine lives on the backend.
    engine = getattr(getattr(storage, "_backend", storage), "engine", None)
    if engine is None:  # in-memory storage: one process, nothing to race
        return owner
    with contextlib.suppress(SQLAlchemyError):  # another worker may be creating it right now
        _CLAIMS.create(engine, checkfirst=True)
    try:
        with engine.begin() as conn:
            conn.execute(
                _CLAIMS.insert().values(
                    study=study.study_name, what=what, owner=owner, at=time.time()
                )
            )
        return owner
    except IntegrityError:
        with engine.begin() as conn:
            row = conn.execute(
                sa.select(_CLAIMS.c.owner).where(
                    (_CLAIMS.c.study == study.study_name) & (_CLAIMS.c.what == what)
                )
            ).first()
        return row[0] if row else owner
