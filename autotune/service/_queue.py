"""The durable study queue: one row per submitted study, in the same database as the trials."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from loguru import logger
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from autotune.errors import StorageError, StorageIOError
from autotune.infra import clock
from autotune.schema.enums import StudyState
from autotune.study.guarded import advice
from autotune.study.storage import database_error, mask_url, owner_alive, owner_id

__all__ = ["QUEUE_TABLE", "STATES", "QueueRow", "StudyQueue"]

# What a row's state column holds (paused is shown, never stored).
STATES = tuple(s for s in StudyState if s != StudyState.PAUSED)
FINISHED = tuple(s for s in StudyState if s.finished)
# Seconds between two looks for the studies of a dead service sharing the queue.
ADOPT_EVERY = 5.0

_META = sa.MetaData()
QUEUE_TABLE = sa.Table(
    "autotune_queue",
    _META,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    sa.Column("submitted_at", sa.Float, nullable=False),
    # Breaks ties between submissions in the same clock tick.
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("device", sa.String(32)),
    sa.Column("owner", sa.String(256)),
    sa.Column("error", sa.Text),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    # Budget spent so far (probe time, not queue time): a resumed study continues from here.
    sa.Column("probe_seconds", sa.Float, nullable=False, default=0.0),
    # How many times the study was started: above 1 it resumes.
    sa.Column("runs", sa.Integer, nullable=False, default=0),
    # Who submitted it, as their client said (a label for people, not an identity).
    sa.Column("submitted_by", sa.String(64)),
    # When the service running it last said it still does (wall time; see StudyQueue.beat).
    sa.Column("beat_at", sa.Float),
)
# Columns later versions added, created in an older database when it is opened.
_ADDED = {"submitted_by": "VARCHAR(64)", "beat_at": "FLOAT"}
# A running study's service beats this often (seconds); one silent for LEASE has lost it (a
# service on another host, whose process this one cannot see).
BEAT_EVERY = 2.0
LEASE = 16.0


@dataclass
class QueueRow:
    """One study in the queue, as stored."""

    name: str
    spec: dict[str, Any]
    priority: int
    submitted_at: float
    seq: int
    state: str
    device: str | None = None
    owner: str | None = None
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    probe_seconds: float = 0.0
    runs: int = 0
    submitted_by: str | None = None
    beat_at: float | None = None

    @classmethod
    def from_db(cls, row: Any) -> QueueRow:
        data = dict(row._mapping)
        data["spec"] = json.loads(data["spec"])
        return cls(**data)

    @property
    def requested_device(self) -> str:
        return str(self.spec.get("device", "auto"))


def service_owner() -> str:
    """Who runs a study: ``host:pid`` of this service process."""
    return owner_id()


class StudyQueue:
    """The queue table in a study database.

    Args:
        url: the storage URL (``sqlite:///studies/autotune.db`` or ``postgresql://...``); the
            Optuna study storage may be the same database.

    Raises:
        StorageError: the database cannot be opened or the table cannot be created.

    Example:
        >>> queue = StudyQueue("sqlite:///studies/autotune.db")  # doctest: +SKIP
        >>> queue.submit(spec, priority=5).state  # doctest: +SKIP
        'queued'
    """

    def __init__(self, url: str) -> None:
        self.url = url
        # What the last look at the database found wrong (None: nothing), for /health.
        self.problem: str | None = None
        self._problem_in_write = False
        # Studies per state, kept in memory for /health (see counts()).
        self._counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        self._next_adopt = -math.inf  # when adopt_orphans looks again
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            # Optuna's heartbeats and trial writes share the file: wait for a lock, don't fail.
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        elif url.startswith("postgresql"):
            kwargs = {"connect_args": {"connect_timeout": 5}, "pool_pre_ping": True}
        try:
            self.engine = sa.create_engine(url, **kwargs)
            _META.create_all(self.engine, checkfirst=True)
            self._add_columns()
            if url.startswith("sqlite"):
                self._write_ahead_log()
        except (SQLAlchemyError, ImportError, ValueError) as exc:
            detail = str(exc).splitlines()[0][:300]
            raise StorageError(
                f"queue storage {mask_url(url)!r} cannot be opened: {detail}; check --storage"
            ) from None
        self._refresh_counts()

    def _add_columns(self) -> None:
        """Add the columns a queue table written by an older version lacks (another service
        opening the same database may add them first)."""
        for name, kind in _ADDED.items():
            if name in {c["name"] for c in sa.inspect(self.engine).get_columns(QUEUE_TABLE.name)}:
                continue
            try:
                with self.engine.begin() as conn:
                    conn.exec_driver_sql(f"ALTER TABLE {QUEUE_TABLE.name} ADD COLUMN {name} {kind}")
            except SQLAlchemyError:
                columns = sa.inspect(self.engine).get_columns(QUEUE_TABLE.name)
                if name not in {c["name"] for c in columns}:
                    raise

    def _write_ahead_log(self) -> None:
        """Switch a SQLite file to write-ahead logging (it stays so, for every process).

        In SQLite's default mode a reader waits while a trial is written, and its busy handler
        sleeps in steps up to 100 ms: status polls would stall behind every heartbeat. With
        WAL, readers never wait for the writer. (WAL needs a local filesystem, as SQLite does.)
        """
        try:
            with self.engine.connect() as conn:
                mode = conn.exec_driver_sql("PRAGMA journal_mode=WAL").scalar()
        except SQLAlchemyError as exc:
            logger.warning(
                "{}: could not switch to WAL ({}); status reads may stall", self.url, exc
            )
            return
        if str(mode).lower() != "wal":
            logger.warning("{}: journal mode stays {!r}; status reads may stall", self.url, mode)

    @contextmanager
    def _db(self, *, write: bool) -> Iterator[sa.Connection]:
        """A connection (a transaction when writing); a database failure is a StorageIOError
        naming the database's reason, e.g. a full disk."""
        try:
            with self.engine.begin() if write else self.engine.connect() as conn:
                yield conn
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            verb, reason = "written" if write else "read", database_error(exc)
            self.problem = (
                f"the service's storage {mask_url(self.url)!r} cannot be {verb} ({reason}); "
                f"{advice(reason)}"
            )
            self._problem_in_write = write
            raise StorageIOError(self.problem) from exc
        if write or not self._problem_in_write:  # a read says nothing of a refused write
            self.problem = None
        if write:
            self._refresh_counts()

    def _refresh_counts(self) -> None:
        """Count the studies per state again, after a write (by the writer's thread).

        Under the lock, refreshes run one after another, so the last one has seen every write
        before it: the counts never go back to an older state.
        """
        query = sa.select(QUEUE_TABLE.c.state, sa.func.count()).group_by(QUEUE_TABLE.c.state)
        try:
            with self._counts_lock, self.engine.connect() as conn:
                self._counts = {state: int(n) for state, n in conn.execute(query).all()}
        except SQLAlchemyError as exc:  # the write itself went through; the counts lag
            logger.debug("{}: queue counts not refreshed ({})", mask_url(self.url), exc)

    # ---- reading -------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Studies per state (``{"queued": 3, "running": 1, ...}``) as of this process's last
        write: from memory, never the database, so ``/health`` answers at once even while
        hundreds of submits wait for it.

        Example:
            >>> StudyQueue("sqlite:///studies/autotune.db").counts()  # doctest: +SKIP
            {'done': 4, 'queued': 2, 'running': 1}
        """
        return dict(self._counts)

    def get(self, name: str) -> QueueRow | None:
        with self._db(write=False) as conn:
            row = conn.execute(sa.select(QUEUE_TABLE).where(QUEUE_TABLE.c.name == name)).first()
        return QueueRow.from_db(row) if row else None

    def rows(self) -> list[QueueRow]:
        """Every study, in queue order (priority, then submission)."""
        order = (QUEUE_TABLE.c.priority.desc(), QUEUE_TABLE.c.seq)
        with self._db(write=False) as conn:
            return [
                QueueRow.from_db(r)
                for r in conn.execute(sa.select(QUEUE_TABLE).order_by(*order)).all()
            ]

    # ---- changing ------------------------------------------------------------------------

    def submit(
        self, name: str, spec: dict[str, Any], priority: int, *, submitted_by: str | None = None
    ) -> QueueRow:
        """Queue a new study, or queue again one that failed or was cancelled (it resumes).

        Raises:
            ValueError: a study of this name is queued, running or done (the message says which).
        """
        now = clock.wall()
        values = {
            "spec": json.dumps(spec),
            "priority": priority,
            "submitted_at": now,
            "state": StudyState.QUEUED,
            "device": None,
            "owner": None,
            "error": None,
            "started_at": None,
            "finished_at": None,
            "probe_seconds": 0.0,
            "submitted_by": submitted_by,
        }
        try:
            with self._db(write=True) as conn:
                conn.execute(
                    QUEUE_TABLE.insert().values(
                        name=name, seq=self._next_seq(conn), runs=0, **values
                    )
                )
        except IntegrityError:
            return self._resubmit(name, values)
        row = self.get(name)
        assert row is not None
        return row

    @staticmethod
    def _next_seq(conn: sa.Connection) -> int:
        top = conn.execute(sa.select(sa.func.max(QUEUE_TABLE.c.seq))).scalar()
        return int(top or 0) + 1

    def _resubmit(self, name: str, values: dict[str, Any]) -> QueueRow:
        with self._db(write=True) as conn:
            seq = self._next_seq(conn)
            done = conn.execute(
                QUEUE_TABLE.update()
                .where(
                    (QUEUE_TABLE.c.name == name)
                    & QUEUE_TABLE.c.state.in_((StudyState.FAILED, StudyState.CANCELLED))
                )
                .values(seq=seq, **values)
            )
        row = self.get(name)
        assert row is not None
        if done.rowcount != 1:
            raise ValueError(row.state)
        return row

    def take_next(self, device: str, accepts: Callable[[QueueRow], bool]) -> QueueRow | None:
        """Mark the first queued study ``device`` can run as running there, and return it."""
        for row in self.rows():
            if row.state != StudyState.QUEUED or not accepts(row):
                continue
            with self._db(write=True) as conn:
                # Conditional: another device thread (or service) may have taken it meanwhile.
                taken = conn.execute(
                    QUEUE_TABLE.update()
                    .where(
                        (QUEUE_TABLE.c.name == row.name)
                        & (QUEUE_TABLE.c.state == StudyState.QUEUED)
                    )
                    .values(
                        state=StudyState.RUNNING,
                        device=device,
                        owner=service_owner(),
                        started_at=clock.wall(),
                        beat_at=clock.wall(),
                        runs=QUEUE_TABLE.c.runs + 1,
                    )
                )
            if taken.rowcount == 1:
                return self.get(row.name)
        return None

    def finish(self, name: str, state: StudyState, *, error: str | None = None) -> None:
        """Record that a running study ended: done, failed (with the error) or cancelled."""
        with self._db(write=True) as conn:
            conn.execute(
                QUEUE_TABLE.update()
                .where(QUEUE_TABLE.c.name == name)
                .values(state=state, error=error, finished_at=clock.wall(), owner=None)
            )

    def requeue(self, name: str, owner: str | None = None) -> bool:
        """Put a running study back in the queue (the service is draining, or the one running
        it is gone: then only while ``owner`` still holds it); it resumes later."""
        held = QUEUE_TABLE.c.owner == owner if owner is not None else sa.true()
        with self._db(write=True) as conn:
            done = conn.execute(
                QUEUE_TABLE.update()
                .where(
                    (QUEUE_TABLE.c.name == name)
                    & (QUEUE_TABLE.c.state == StudyState.RUNNING)
                    & held
                )
                .values(state=StudyState.QUEUED, device=None, owner=None)
            )
        return done.rowcount == 1

    def cancel_queued(self, name: str) -> bool:
        """Cancel a study that has not started; False when it is not queued (any more)."""
        with self._db(write=True) as conn:
            done = conn.execute(
                QUEUE_TABLE.update()
                .where((QUEUE_TABLE.c.name == name) & (QUEUE_TABLE.c.state == StudyState.QUEUED))
                .values(state=StudyState.CANCELLED, finished_at=clock.wall())
            )
        return done.rowcount == 1

    def record_progress(self, name: str, probe_seconds: float) -> None:
        """Store the budget a running study has spent, so a restart resumes with the rest."""
        with self._db(write=True) as conn:
            conn.execute(
                QUEUE_TABLE.update()
                .where(QUEUE_TABLE.c.name == name)
                .values(probe_seconds=round(probe_seconds, 3))
            )

    def recover(self) -> list[str]:
        """At start: studies left ``running`` by a service that died go back to the queue; a
        live service on this host sharing the queue keeps its own.

        Returns:
            The names put back.
        """
        stuck = [
            r
            for r in self.rows()
            if r.state == StudyState.RUNNING and (r.owner == owner_id() or _gone(r, unknown=True))
        ]
        return [r.name for r in stuck if self.requeue(r.name, r.owner)]

    def adopt_orphans(self) -> list[str]:
        """While serving, every :data:`ADOPT_EVERY` seconds at most: studies a service on this
        host left ``running`` when it died (kill -9) go back to the queue, for whichever
        service sharing it takes them next (a restart of that one may never come).

        Returns:
            The names put back.
        """
        if clock.now() < self._next_adopt:  # device threads racing here requeue each row once
            return []
        self._next_adopt = clock.now() + ADOPT_EVERY
        stuck = [
            r
            for r in self.rows()
            if r.state == StudyState.RUNNING and r.owner != owner_id() and _gone(r)
        ]
        names = [r.name for r in stuck if self.requeue(r.name, r.owner)]
        for name in names:
            logger.warning("study {!r}: the service running it is gone; queued again", name)
        return names

    def beat(self) -> None:
        """Say that this service still runs its running studies (every BEAT_EVERY seconds, on
        a thread of its own: :meth:`start_beating`)."""
        with self._db(write=True) as conn:
            conn.execute(
                QUEUE_TABLE.update()
                .where(
                    (QUEUE_TABLE.c.owner == owner_id())
                    & (QUEUE_TABLE.c.state == StudyState.RUNNING)
                )
                .values(beat_at=clock.wall())
            )

    def start_beating(self, stop: threading.Event) -> None:
        """Beat until ``stop`` is set; a beat the storage refuses is tried again next time."""

        def beating() -> None:
            while not stop.wait(BEAT_EVERY):
                with contextlib.suppress(StorageIOError):
                    self.beat()

        threading.Thread(target=beating, name="queue-beat", daemon=True).start()


def _gone(row: QueueRow, *, unknown: bool = False) -> bool:
    """Whether the service running ``row`` is gone: dead on this host, or silent past the
    lease (another host's); one that never beat (an older version) counts as gone when
    ``unknown``."""
    alive = owner_alive(row.owner)
    if alive is not None:
        return not alive
    if row.beat_at is None:
        return unknown
    return clock.wall() - row.beat_at > LEASE
