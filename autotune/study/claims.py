"""Once-per-study jobs (a window's validation) claimed in the study's database, on a lease that a
dead owner loses."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optuna
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from autotune.infra import clock
from autotune.study.guarded import engine_of

__all__ = [
    "LEASE",
    "RENEW_INTERVAL",
    "claim",
    "delete_claims",
    "done_by",
    "holding",
    "mark_done",
    "owner_alive",
    "owner_id",
    "renew",
    "take",
]

# An owner renews its claim this often (seconds) ...
RENEW_INTERVAL = 2.0
# ... and one that has not for this long has lost it (a frozen box, a cut network).
LEASE = 16.0

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
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether the process an ``owner_id()`` names is alive.

    Returns:
        False when it is on this host and gone (or a zombie); True when it is this process or
        a live autotune process here; None when it cannot tell (another host, or a live process
        that may have reused the pid): only a heartbeat can tell then.
    """
    if not owner or ":" not in owner:
        return None
    host, _, pid_text = owner.rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    if int(pid_text) == os.getpid():
        return True
    try:
        with open(f"/proc/{pid_text}/stat") as f:
            # A zombie (killed, not yet reaped) holds nothing.
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid_text}/cmdline", "rb") as f:
            # After a reboot or in a container the pid may be reused by something else.
            return True if b"autotune" in f.read() else None
    except FileNotFoundError:
        return False
    except OSError:
        return None


def _key(study: optuna.Study, what: str) -> Any:
    return (_CLAIMS.c.study == study.study_name) & (_CLAIMS.c.what == what)


def claim(study: optuna.Study, what: str, owner: str | None = None) -> str:
    """Claim a once-per-study job, or take it over from an owner that lost its lease.

    Returns:
        The owner of the claim: ``owner`` when this call won it, else whoever holds it.
    """
    return take(study, what, owner)[0]


def take(study: optuna.Study, what: str, owner: str | None = None) -> tuple[str, str]:
    """:func:`claim`, saying from whom: ``(owner, taken_from)``, ``taken_from`` naming the owner
    that lost the claim to this call (``""`` when it was free or is held)."""
    owner = owner or owner_id()
    engine = engine_of(study._storage)
    if engine is None:  # in-memory storage: one process, nothing to race
        return owner, ""
    with contextlib.suppress(SQLAlchemyError):  # another worker may be creating it right now
        _CLAIMS.create(engine, checkfirst=True)
    try:
        with engine.begin() as conn:
            conn.execute(
                _CLAIMS.insert().values(
                    study=study.study_name, what=what, owner=owner, at=clock.wall()
                )
            )
        return owner, ""
    except IntegrityError:
        pass
    with engine.begin() as conn:
        row = conn.execute(
            sa.select(_CLAIMS.c.owner, _CLAIMS.c.at).where(_key(study, what))
        ).first()
        if row is not None:
            if row.owner == owner or not _lapsed(row.owner, row.at):
                return row.owner, ""
            # Taken over only if nobody else took it since it was read.
            held = _key(study, what) & (_CLAIMS.c.owner == row.owner) & (_CLAIMS.c.at == row.at)
            won = conn.execute(_CLAIMS.update().where(held).values(owner=owner, at=clock.wall()))
            if won.rowcount == 1:
                return owner, row.owner
    return take(study, what, owner)  # given up or taken meanwhile: ask again


def _lapsed(holder: str, at: float) -> bool:
    """Whether a claim's owner has lost it: gone from this host, or silent past the lease."""
    alive = owner_alive(holder)
    if alive is False:
        return True
    return clock.wall() - at > LEASE


@contextmanager
def holding(study: optuna.Study, what: str, owner: str | None = None) -> Iterator[None]:
    """Renew a won claim every :data:`RENEW_INTERVAL` seconds while the block runs; a block that
    raises gives the claim up, so the next asker takes the job at once."""
    owner = owner or owner_id()
    engine = engine_of(study._storage)
    if engine is None:
        yield
        return
    stop = threading.Event()

    def renewing() -> None:
        while not stop.wait(RENEW_INTERVAL):
            # A missed renewal is retried; the lease covers several.
            with contextlib.suppress(Exception):
                renew(study, what, owner)

    thread = threading.Thread(target=renewing, name=f"claim-{what}", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception), engine.begin() as conn:
            conn.execute(_CLAIMS.delete().where(_key(study, what) & (_CLAIMS.c.owner == owner)))
        raise
    finally:
        stop.set()
        thread.join(5)


def renew(study: optuna.Study, what: str, owner: str | None = None) -> None:
    """Renew ``owner``'s claim on ``what`` (nothing when another holds it)."""
    engine = engine_of(study._storage)
    if engine is None:
        return
    with engine.begin() as conn:
        conn.execute(
            _CLAIMS.update()
            .where(_key(study, what) & (_CLAIMS.c.owner == (owner or owner_id())))
            .values(at=clock.wall())
        )


def mark_done(study: optuna.Study, what: str, owner: str | None = None) -> None:
    """Record that the claimed job ``what`` is done: nobody takes it over any more."""
    claim(study, f"done:{what}", owner)


def done_by(study: optuna.Study, what: str) -> str | None:
    """Who did the job ``what`` (:func:`mark_done`), or None while it is not done."""
    engine = engine_of(study._storage)
    if engine is None or not sa.inspect(engine).has_table(_CLAIMS.name):
        return None
    with engine.begin() as conn:
        row = conn.execute(sa.select(_CLAIMS.c.owner).where(_key(study, f"done:{what}"))).first()
    return row.owner if row else None


def delete_claims(storage: optuna.storages.BaseStorage, name: str) -> None:
    """Delete the claims of the study ``name`` (a claim names the study, not one creation of it)."""
    engine = engine_of(storage)
    # In-memory storage keeps no claims; a database where none was ever made has no table.
    if engine is None or not sa.inspect(engine).has_table(_CLAIMS.name):
        return
    with engine.begin() as conn:
        conn.execute(_CLAIMS.delete().where(_CLAIMS.c.study == name))
