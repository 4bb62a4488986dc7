"""Shared test set-up: tests marked ``gpu`` run only where CUDA is visible."""

from __future__ import annotations

import os

# One torch thread per test process, and per worker process a test starts (they inherit it):
# two test processes share two cores, and torch's default of a thread per core oversubscribes
# them; on a busy machine every step then waits for a descheduled thread (a 2 s test took a
# minute). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# The suite runs beside a busy process (CI's, and its own second worker): a service under test
# must not wait for a quiet CPU (tests/test_contention.py turns the wait on where it tests it).
os.environ.setdefault("AUTOTUNE_CPU_BUSY_CORES", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# SQLite studies this process opens write without waiting for the disk (no fsync per commit):
# a simulated search commits thousands of times, and an fsync each was a third of its time on
# this disk. What a test sees of a study is the same; only a power cut could lose more.
# (Subprocesses a test starts, real searches and services, keep SQLite's defaults.)
import sqlite3  # noqa: E402

from sqlalchemy import event  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402


@event.listens_for(Engine, "connect")
def _sqlite_without_fsync(connection: object, _record: object) -> None:
    if isinstance(connection, sqlite3.Connection):
        connection.execute("PRAGMA synchronous=OFF")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- a throwaway PostgreSQL cluster on 127.0.0.1 -------------------------------------------

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from autotune.testing.pgtest import (  # noqa: E402
    PostgresServer,
    postgres_binaries,
    throwaway_postgres,
)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster for the whole session; skipped when the server is not installed
    (.ci/run installs it)."""
    if postgres_binaries() is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    with throwaway_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A fresh database on the session's cluster, as a SQLAlchemy URL."""
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:50]
    return postgres_server.create_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each storage-level test runs on both backends: embedded SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    return request.getfixturevalue("postgres_url")
