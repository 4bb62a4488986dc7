"""A real `autotune serve` for tests: a subprocess on 127.0.0.1, driven over real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import optuna

from autotune.testing.busy import FAKE_BUSY_ENV

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def sleepy(name: str, *, budget: str = "10s", steps: int = 12, **extra: Any) -> dict[str, Any]:
    """A test-sized study: fp32 only, probes of ``steps`` sleeping steps (0.05 s each)."""
    return {
        "name": name,
        "workload": "autotune.testing.workloads:sleepy",
        "budget": budget,
        # Two batch sizes up to the base (32: the reference's parity curve is one probe long)
        # and three learning rates: trials enough for a short budget.
        "space": {
            "precisions": ["fp32"],
            "batch_sizes": [16, 32],
            "lr_multipliers": [0.5, 1.0, 2.0],
        },
        # Counted, not timed, and never stopped early: a probe's length is known in advance.
        "probe": {
            "warmup_steps": 1,
            "steps": steps,
            "check_every": 6,
            "min_time": 0,
            "early_stop": False,
            "time_limit": "8s",
        },
        "validation": {"top_k": 1, "steps": 12},
        **extra,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], Any], timeout: float, what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


class Service:
    """A `python -m autotune serve` subprocess and an HTTP client for it."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = f"sqlite:///{tmp / 's.db'}"
        self.args = args
        self.env = {**os.environ, "AUTOTUNE_WORKER_LOG_LEVEL": "ERROR", **(env or {})}
        self.env.pop("AUTOTUNE_TOKEN", None)
        self.log = tmp / "service.log"
        self.proc: subprocess.Popen | None = None
        # Generous: a request answers in well under a second, but on a slow machine beside a busy
        # process a submit once took over 10 s (the tests wait on states, never on this).
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def start(self) -> Service:
        # With a fake-busy file, the command line that can fake a colleague's job.
        entry = "autotune.testing.busy" if FAKE_BUSY_ENV in self.env else "autotune"
        cmd = [sys.executable, "-m", entry, "serve", "--port", str(self.port)]
        cmd += ["--devices", "cpu", "--storage", self.db, "--out", str(self.tmp / "out")]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [*cmd, *self.args], cwd=ROOT, env=self.env, stdout=log, stderr=log
            )
        wait_for(self._up, 60, "the service to answer /health", self.log)
        return self

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the service exited {self.proc.returncode}:\n{self.log.read_text()}"
            )
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def study(self, name: str) -> dict[str, Any]:
        return self.http.get(f"/studies/{name}").json()

    def submit(self, spec: dict[str, Any], priority: int = 0) -> httpx.Response:
        return self.http.post("/studies", json=spec, params={"priority": priority}, headers=AUTH)

    def wait_state(self, name: str, states: tuple[str, ...], timeout: float) -> dict[str, Any]:
        return wait_for(
            lambda: (s := self.study(name))["state"] in states and s,
            timeout,
            f"study {name!r} to be {'/'.join(states)}",
            self.log,
        )

    def wait_trial_running(self, name: str, timeout: float = 40) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            s = self.study(name)
            if s["progress"]["phase"] == "search" and s["progress"]["trials"].get("running"):
                return s
            return None

        return wait_for(running, timeout, f"a running trial of {name!r}", self.log)

    def trials(self, name: str) -> list[optuna.trial.FrozenTrial]:
        return optuna.load_study(study_name=name, storage=self.db).get_trials()

    def wait_trial_started(self, name: str, timeout: float = 40) -> None:
        """Until a trial of ``name`` started under a second ago: with probes of 3 s (60 steps of
        0.05 s), its probe is surely in flight."""
        self.wait_trial_running(name, timeout)
        wait_for(
            lambda: any(
                t.state == optuna.trial.TrialState.RUNNING
                and (datetime.now() - t.datetime_start).total_seconds() < 1.0
                for t in self.trials(name)
            ),
            timeout,
            f"a trial of {name!r} that just started",
            self.log,
        )
