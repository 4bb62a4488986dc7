"""Shared test set-up: tests marked ``gpu`` run only where CUDA is visible."""

from __future__ import annotations

import pytest
import torch


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

from autotune.pgtest import PostgresServer, postgres_binaries, throwaway_postgres  # noqa: E402


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
