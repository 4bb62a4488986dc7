"""A throwaway PostgreSQL cluster on 127.0.0.1, for tests and benchmarks of shared studies."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PostgresServer", "postgres_binaries", "throwaway_postgres"]

PASSWORD = "autotune-test"


def postgres_binaries() -> tuple[str, str] | None:
    """``(initdb, pg_ctl)`` from the PATH or Debian's /usr/lib/postgresql/*/bin, else None."""
    found = []
    for name in ("initdb", "pg_ctl"):
        path = shutil.which(name)
        if path is None:
            candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
            path = str(candidates[0]) if candidates else None
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> None:
    if os.geteuid() == 0:
        cmd = ["su", "postgres", "-c", " ".join(f"'{c}'" for c in cmd)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


@dataclass
class PostgresServer:
    host: str
    port: int
    user: str
    password: str

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{self.user}:{pw}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database (dropped first if it exists); returns its URL."""
        import psycopg

        with psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextmanager
def throwaway_postgres() -> Iterator[PostgresServer]:
    """Start a cluster in a temp dir on 127.0.0.1 (password auth); stop and remove it after.

    Raises:
        FileNotFoundError: the server binaries are not installed (Debian: apt-get install
            postgresql).

    Example:
        >>> with throwaway_postgres() as server:  # doctest: +SKIP
        ...     url = server.create_database("study")
    """
    binaries = postgres_binaries()
    if binaries is None:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    initdb, pg_ctl = binaries
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    data = root / "data"
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    port = _free_port()
    try:
        _run(
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
        _run(
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
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200",
                "start",
            ]
        )
        yield PostgresServer("127.0.0.1", port, "autotune", PASSWORD)
    finally:
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                _run([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)
