"""Optuna's RDB storage, guarded: a database failure is a :class:`StorageIOError` naming the
database's own reason, and a trial's whole record is written in one statement."""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from autotune.errors import StorageIOError
from autotune.infra.redact import mask_url

__all__ = [
    "GUARDED_PRIVATE",
    "GuardedStorage",
    "advice",
    "damaged",
    "database_error",
    "engine_of",
]


def engine_of(storage: optuna.storages.BaseStorage) -> Any:
    """The SQLAlchemy engine behind a study's storage (Optuna wraps a database storage in a
    cache; the engine lives on the backend), or None for an in-memory one."""
    return getattr(getattr(storage, "_backend", storage), "engine", None)


def database_error(exc: BaseException) -> str:
    """The database's own words for a failure, e.g. ``database or disk is full``.

    Optuna wraps every database error in a StorageInternalError whose message guesses at "invalid
    data ... e.g. exceeding max length"; the real cause is the driver's error underneath.

    Example:
        >>> database_error(ValueError("disk I/O error\\n[SQL: INSERT ...]"))
        'disk I/O error'
    """
    cause: BaseException = exc
    while isinstance(cause, optuna.exceptions.StorageInternalError) and cause.__cause__:
        cause = cause.__cause__
    cause = getattr(cause, "orig", None) or cause
    text = str(cause).strip()
    return (text.splitlines()[0][:200] if text else type(cause).__name__) or "unknown error"


# What SQLite says of a file that is no longer a database it can read.
_DAMAGED = ("malformed", "file is not a database", "database corruption", "file is encrypted")


def damaged(reason: str) -> bool:
    """Whether the database's words (:func:`database_error`) say its file is damaged."""
    return any(sign in reason for sign in _DAMAGED)


def advice(reason: str) -> str:
    """What to do about a storage failure whose database said ``reason``.

    Example:
        >>> advice("database disk image is malformed")
        'its file is damaged: restore it from a backup or give a new --storage (nothing autotune does repairs it)'
    """
    if damaged(reason):
        return (
            "its file is damaged: restore it from a backup or give a new --storage (nothing "
            "autotune does repairs it)"
        )
    return "what it holds is kept: free space on its disk (or bring its server back), then resume"


# Every database call of Optuna's storage: its public methods but those that touch no database,
# and the underscored ones its trial cache calls directly. An Optuna release that renames one of
# these fails tests/test_storage_faults.py instead of leaving the call unguarded.
GUARDED_PRIVATE = (
    "_create_new_trial",
    "_set_trial_param",
    "_get_trials",
    "_get_best_trial_id",
    "_get_stale_trial_ids",
)
_NO_DATABASE = (
    "check_trial_is_updatable",
    "get_failed_trial_callback",
    "get_heartbeat_interval",
    "get_heartbeat_stale_trial_callback",
    "remove_session",
)
_GUARDED = GUARDED_PRIVATE + tuple(
    name
    for name, value in vars(optuna.storages.RDBStorage).items()
    if callable(value) and not name.startswith("_") and name not in _NO_DATABASE
)
_WRITES = ("create", "_create", "set", "_set", "delete", "record")


class GuardedStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage whose database failures are :class:`StorageIOError` naming the
    database's own reason (``database or disk is full``) instead of a generic internal error."""

    def set_trial_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Optuna's ``set_trial_user_attr`` for a whole trial record (~25 keys) in one commit
        (a commit each was half of a search's storage time on SQLite), and on SQLite and
        PostgreSQL in one statement (a look-up and an upsert per key was most of the rest)."""
        from optuna.storages._rdb import models, storage
        from sqlalchemy.dialects import postgresql, sqlite

        model = models.TrialUserAttributeModel
        dialect = {"sqlite": sqlite, "postgresql": postgresql}.get(self.engine.name)
        if dialect is sqlite and sqlite3.sqlite_version_info < (3, 24, 0):
            dialect = None  # no upsert before SQLite 3.24
        with storage._create_scoped_session(self.scoped_session, True) as session:
            if dialect is None or not attrs:
                for key, value in attrs.items():
                    self._set_trial_attr_without_commit(session, model, trial_id, key, value)
                return
            trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
            # Optuna 5.1 types the column; before it, the state reads as a plain column.
            self.check_trial_is_updatable(trial_id, trial.state)  # type: ignore[arg-type, unused-ignore]
            rows = [
                {"trial_id": trial_id, "key": key, "value_json": json.dumps(value)}
                for key, value in attrs.items()
            ]
            insert = dialect.insert(model).values(rows)
            session.execute(
                insert.on_conflict_do_update(
                    index_elements=[model.trial_id, model.key],
                    set_={"value_json": insert.excluded.value_json},
                )
            )


def _guard(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    verb = "written" if name.startswith(_WRITES) else "read"

    @functools.wraps(method)
    def guarded(self: optuna.storages.RDBStorage, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as exc:
            reason = database_error(exc)
            raise StorageIOError(
                f"storage {mask_url(self.url)!r} cannot be {verb} ({reason}); {advice(reason)}"
            ) from exc

    return guarded


for _name in (*_GUARDED, "set_trial_user_attrs"):
    setattr(GuardedStorage, _name, _guard(_name, getattr(GuardedStorage, _name)))
