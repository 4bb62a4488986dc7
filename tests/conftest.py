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

import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

PG_PASSWORD = "autotune-test"


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> None:
    """PostgreSQL refuses to run as root: run its tools as the `postgres` OS user then."""
    if os.geteuid() == 0:
        cmd = ["su", "postgres", "-c", " ".join(f"'{c}'" for c in cmd)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[dict]:
    """Start a PostgreSQL cluster in a temp dir on 127.0.0.1; stop and remove it afterwards.

    Yields the connection facts: host, port, user, password. Skips when the server binaries are
    missing (.ci/run installs them).
    """
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    data = root / "data"
    pwfile = root / "pw"
    pwfile.write_text(PG_PASSWORD + "\n")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    port = _free_port()
    _as_postgres(
        [
            initdb,
            "-D",
            str(data),
            "-U",
            "autotune",
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        ]
    )
    _as_postgres(
        [
            pg_ctl,
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            "start",
        ]
    )
    try:
        yield {"host": "127.0.0.1", "port": port, "user": "autotune", "password": PG_PASSWORD}
    finally:
        try:
            _as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"])
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: dict, request: pytest.FixtureRequest) -> str:
    """A fresh database on the session's cluster, as a SQLAlchemy URL."""
    import psycopg

    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:50]
    s = postgres_server
    conn = psycopg.connect(
        host=s["host"],
        port=s["port"],
        user=s["user"],
        password=s["password"],
        dbname="postgres",
        autocommit=True,
    )
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return f"postgresql://{s['user']}:{s['password']}@{s['host']}:{s['port']}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each storage-level test runs on both backends: embedded SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    return request.getfixturevalue("postgres_url")
