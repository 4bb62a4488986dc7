"""`autotune serve` under hostile requests, a full disk, a higher-priority study and a drain.

One service (a real subprocess over real HTTP) serves every test here, in file order; the last
one drains it. Slow-input cases are bounded by the test's own timeout (pytest-timeout), never
by a timing assertion.
"""

from __future__ import annotations

import asyncio
import resource
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
from _service import AUTH, TOKEN, Service, sleepy, wait_for

from autotune.errors import StorageIOError
from autotune.schema.spec import StudySpec
from autotune.search import Budget
from autotune.service import REQUEST_TIMEOUT, StudyQueue, TuningService, create_app
from autotune.service._study_run import StudyRun


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("faults")
    token_file = tmp / "token.txt"
    token_file.write_text(TOKEN + "\n")
    svc = Service(tmp, "--token-file", str(token_file), "--max-budget", "2h")
    try:
        yield svc.start()
    finally:
        svc.stop()


def bomb(levels: int = 9) -> str:
    """A ~1 KB YAML "billion laughs" with no name or workload (it must not be expanded even to
    say what is missing)."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def post(svc: Service, body: str | bytes, kind: str = "application/yaml") -> httpx.Response:
    return svc.http.post("/studies", content=body, headers={**AUTH, "content-type": kind})


@pytest.mark.timeout(90)
def test_alias_bombs_are_refused_at_once_and_the_service_keeps_answering(
    service: Service,
) -> None:
    # A budget no step waits for: the study is cancelled once the bombs are answered.
    assert service.submit(sleepy("clock", budget="60s")).status_code == 201
    service.wait_trial_running("clock", 90)
    with ThreadPoolExecutor(4) as pool:
        bombs = [pool.submit(post, service, bomb()) for _ in range(4)]
        health = [service.http.get("/health") for _ in range(5)]
        replies = [b.result() for b in bombs]
    assert all(r.status_code == 422 for r in replies), [r.text for r in replies]
    assert all("expands to more than 10,000 values" in r.json()["detail"] for r in replies)
    assert all(len(r.json()["detail"]) < 600 for r in replies)
    assert all(h.status_code == 200 for h in health)
    # The study that ran meanwhile runs on, and stops when asked.
    assert service.study("clock")["state"] == "running"
    assert service.http.post("/studies/clock/cancel", headers=AUTH).status_code == 200
    service.wait_state("clock", ("cancelled",), 60)


@pytest.mark.parametrize(
    ("body", "kind", "status", "needle"),
    [
        ('{"name": ' + "[" * 30_000 + "]" * 30_000 + "}", "application/json", 422, "nests"),
        ("name: " + "[" * 30_000 + "\n", "application/yaml", 422, "nests deeper than 32"),
        ('{"name": "x", "seed": ' + "9" * 4301 + "}", "application/json", 422, "4,301 digits"),
        ("name: x\nseed: " + "9" * 4301 + "\n", "application/yaml", 422, "4,301 digits"),
        (
            "name: x\nworkload: tiny_mlp\nseed: 99999999999\n",
            "application/yaml",
            422,
            "seed must be between 0 and 4294967295",
        ),
        (
            "name: x\nworkload: tiny_mlp\nseed: -1\n",
            "application/yaml",
            422,
            "got seed=-1",
        ),
        (
            "name: x\nworkload: tiny_mlp\nbudget: 0.0001\n",
            "application/yaml",
            422,
            "budget must be at least 4s",
        ),
        (
            "name: x\nworkload: tiny_mlp\nbudget: 48h\n",
            "application/yaml",
            422,
            "budget must be at most 2h on this service",
        ),
        (
            "name: x\nworkload: autotune.workloads:load_workload\n",
            "application/yaml",
            422,
            "has no workload 'load_workload'; it has resnet18, tiny_convnet",
        ),
    ],
    ids=[
        "json-30k-deep",
        "yaml-30k-deep",
        "json-4301-digits",
        "yaml-4301-digits",
        "seed-large",
        "seed-negative",
        "budget-tiny",
        "budget-above-max",
        "not-a-factory",
    ],
)
def test_bad_bodies_get_a_4xx_with_detail(
    service: Service, body: str, kind: str, status: int, needle: str
) -> None:
    r = post(service, body, kind)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    "header", ["Bearer tøken".encode(), "Bearer 令牌".encode(), b"Bearer \xff\xfe", b"\xe9"]
)
def test_an_odd_authorization_header_is_a_401_with_detail(service: Service, header: bytes) -> None:
    r = service.http.post("/studies", json=sleepy("x"), headers={"Authorization": header})
    assert r.status_code == 401, r.text
    assert "wrong token" in r.json()["detail"]


@pytest.mark.timeout(180)
def test_a_higher_priority_study_takes_the_device_at_the_next_trial(service: Service) -> None:
    assert service.submit(sleepy("low", budget="60s"), priority=0).status_code == 201
    service.wait_trial_running("low", 90)
    assert service.submit(sleepy("high", budget="60s"), priority=5).status_code == 201

    # The low one goes back to the queue, its spent budget kept; the high one runs.
    low = service.wait_state("low", ("queued",), 60)
    kept = StudyQueue(service.db).get("low")
    assert kept is not None and kept.probe_seconds > 0
    assert "resumes with" in low["detail"] and "of its budget spent" in low["detail"]
    service.wait_state("high", ("running",), 60)
    trials = service.trials("low")
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]

    # When the device is free again the low one resumes from what it had spent.
    assert service.http.post("/studies/high/cancel", headers=AUTH).status_code == 200
    resumed = service.wait_state("low", ("running",), 60)
    assert resumed["progress"]["budget_used_seconds"] >= kept.probe_seconds
    assert service.http.post("/studies/low/cancel", headers=AUTH).status_code == 200
    service.wait_state("low", ("cancelled",), 60)
    service.wait_state("high", ("cancelled",), 60)


@pytest.mark.timeout(240)
def test_a_full_disk_pauses_the_study_and_it_resumes_when_space_returns(
    service: Service,
) -> None:
    assert service.proc is not None
    pid = service.proc.pid
    assert service.submit(sleepy("full", budget="60s", steps=30)).status_code == 201
    service.wait_trial_running("full", 90)
    wait_for(
        lambda: any(t.state.is_finished() for t in service.trials("full")),
        60,
        "a finished trial of 'full'",
    )
    # Its probes take ~1.5 s: the disk fills up under the trial that just started.
    service.wait_trial_started("full", 60)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
    try:
        paused = service.wait_state("full", ("paused",), 60)
        before = {t.number: (t.state, t.value) for t in service.trials("full")}
        assert "cannot be written" in paused["detail"] and "by itself" in paused["detail"]
        assert "cannot be written" in (paused["error"] or "")
        # Nothing new can be stored: a clear 503, not a bare 500; reading still works.
        r = service.submit(sleepy("later"))
        assert r.status_code == 503, r.text
        assert "cannot be written" in r.json()["detail"]
        assert service.http.get("/health").status_code == 200
        assert service.http.get("/studies").status_code == 200
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)

    # Space is back: no restart, the study goes on and measures again.
    service.wait_state("full", ("running",), 60)
    wait_for(
        lambda: any(
            t.state.is_finished() and t.number not in before for t in service.trials("full")
        ),
        90,
        "a trial measured after the pause",
        service.log,
    )
    assert service.http.post("/studies/full/cancel", headers=AUTH).status_code == 200
    service.wait_state("full", ("cancelled",), 60)
    trials = {t.number: t for t in service.trials("full")}
    assert all(
        (trials[n].state, trials[n].value) == v for n, v in before.items() if v[0].is_finished()
    )
    assert not [t for t in trials.values() if t.state == optuna.trial.TrialState.RUNNING]
    # A trial the failed write left RUNNING (when the disk filled mid-trial, not between trials)
    # was failed as stale on resume, with its reason.
    for n in (n for n, (state, _) in before.items() if state == optuna.trial.TrialState.RUNNING):
        assert trials[n].state == optuna.trial.TrialState.FAIL
        assert trials[n].user_attrs["outcome"] == "stale" and trials[n].user_attrs["reason"]
    assert service.submit(sleepy("later")).status_code == 201
    assert service.http.post("/studies/later/cancel", headers=AUTH).status_code == 200


@pytest.mark.timeout(120)
def test_a_client_sending_its_request_slowly_is_disconnected(service: Service) -> None:
    """A "slowloris" client sends its headers a byte at a time and never finishes: the service
    closes the connection (its request deadline), and goes on answering everyone else."""
    sock = socket.create_connection(("127.0.0.1", service.port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    closed = False
    deadline = time.monotonic() + 4 * REQUEST_TIMEOUT
    try:
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"x")
                ready, _, _ = select.select([sock], [], [], 0.5)
                closed = bool(ready) and sock.recv(1024) == b""
            except OSError:  # reset by the service
                closed = True
    finally:
        sock.close()
    assert closed, "the service kept a connection whose headers never ended"
    assert service.http.get("/health").status_code == 200


@pytest.mark.timeout(120)
def test_health_says_draining_during_a_drain(service: Service) -> None:
    """Last: it drains the module's service."""
    # A budget no busy machine spends before the drain ends: the study is requeued, not done.
    assert service.submit(sleepy("d", budget="10m", steps=40)).status_code == 201
    service.wait_trial_running("d", 90)
    assert service.proc is not None
    service.proc.send_signal(signal.SIGTERM)

    def draining() -> dict[str, Any] | None:
        try:
            h = service.http.get("/health").json()
        except httpx.TransportError:
            raise AssertionError("the service stopped answering before saying it drains") from None
        return h if h["status"] == "draining" else None

    wait_for(draining, 30, "/health to say draining")
    r = service.submit(sleepy("too-late"))
    assert r.status_code == 503 and "draining" in r.json()["detail"]
    service.proc.wait(120)
    row = StudyQueue(service.db).get("d")
    assert row is not None and row.state == "queued"


# ---- without a server: holding a study while the storage fails ----------------------------


class _FlakyQueue:
    """A queue whose writes fail until ``ok`` is set."""

    def __init__(self) -> None:
        self.ok = threading.Event()
        self.finished: list[str] = []

    def _write(self) -> None:
        if not self.ok.is_set():
            raise StorageIOError("storage 'x' cannot be written (database or disk is full)")

    def record_progress(self, name: str, seconds: float) -> None:
        self._write()

    def finish(self, name: str, state: str, *, error: str | None = None) -> None:
        self._write()
        self.finished.append(state)

    def requeue(self, name: str) -> None:
        self._write()


@pytest.mark.timeout(60)
def test_a_cancel_while_paused_is_recorded_when_writes_work_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import autotune.service._scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "_STORAGE_RETRY", 0.05)
    service = TuningService(f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path)
    queue = _FlakyQueue()
    service.scheduler.queue = queue  # type: ignore[assignment]
    spec = StudySpec(name="p", workload="tiny_mlp", budget="60s")
    run = StudyRun(name="p", device="cpu", spec=spec, budget=Budget(60.0))
    service.scheduler.runs["cpu"] = run
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(service.scheduler._hold(run, "full")), daemon=True
    )
    thread.start()
    wait_for(lambda: run.paused, 10, "the study to pause")
    used = run.budget_used()
    assert service.scheduler.cancel("p")
    wait_for(lambda: run.detail.startswith("cancelling:"), 10, "the pause to say cancelling")
    assert run.budget_used() == used  # a paused study's clock stands still
    queue.ok.set()
    thread.join(10)
    assert result == [False] and queue.finished == ["cancelled"]
    assert run.paused is None


@pytest.mark.timeout(60)
def test_health_answers_while_every_submit_waits_on_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 submits at once used to hold /health for seconds: each takes a thread of the pool
    (parsing, database writes) and /health queued behind them. Here every submit blocks in the
    pool until /health has answered: it answers from memory, on the event loop."""
    service = TuningService(f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path)
    service.queue.submit("earlier", {"name": "earlier"}, 0)
    answered = threading.Event()
    inside = []
    real_submit = service.submit

    def blocked_submit(*args: Any) -> Any:
        inside.append(1)
        answered.wait(30)
        return real_submit(*args)

    monkeypatch.setattr(service, "submit", blocked_submit)
    app = create_app(service)

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            submits = [
                asyncio.create_task(client.post("/studies", json=sleepy(f"s{i}")))
                for i in range(60)  # more than the thread pool's 40 threads
            ]
            while len(inside) < 40:  # the pool is full of blocked submits
                await asyncio.sleep(0.05)
            try:
                health = await asyncio.wait_for(client.get("/health"), 20)
            finally:
                answered.set()
            return health, await asyncio.gather(*submits)

    health, submits = asyncio.run(scenario())
    assert health.status_code == 200 and health.json()["queued"] == 1
    assert [r.status_code for r in submits] == [201] * 60
    # The counts follow the writes, without /health reading the database.
    assert service.health().queued == 61
    service.cancel("earlier")
    assert service.health().queued == 60


def test_a_cancel_between_taking_and_starting_a_study_is_not_lost(tmp_path: Path) -> None:
    """A device thread has taken the study from the queue but not started it: the cancel is a
    'cancelling' answer, and the study ends cancelled as it starts (not a 409)."""
    service = TuningService(f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path)
    spec = StudySpec(name="t", workload="tiny_mlp", budget="60s")
    service.queue.submit("t", spec.model_dump(mode="json", exclude={"storage"}), 0)
    row = service.queue.take_next("cpu", lambda r: True)
    assert row is not None and row.state == "running"
    assert service.cancel("t").state == "cancelling"
    service.scheduler._run(row, "cpu")
    finished = service.queue.get("t")
    assert finished is not None and finished.state == "cancelled"


def test_a_damaged_database_gets_its_own_message_and_health_says_so(tmp_path: Path) -> None:
    """A corrupt SQLite file answered 503 with "free space on its disk" while /health said
    "ok". Now both name the damage and what to do about it; the study data is not touched."""
    from fastapi.testclient import TestClient

    db = tmp_path / "s.db"
    service = TuningService(f"sqlite:///{db}", ["cpu"], out_dir=tmp_path / "out")
    http = TestClient(create_app(service, loopback_only=True), base_url="http://127.0.0.1:8765")
    assert http.get("/health").json()["status"] == "ok"
    service.queue.engine.dispose()  # nothing cached: every look reads the file
    with db.open("r+b") as f:  # a header overwritten, as by a stray dd or a bad disk
        f.write(b"\0" * 100)
    r = http.post("/studies", content=b"name: x\nworkload: tiny_mlp\nbudget: 10s\n")
    assert r.status_code == 503, r.text
    said = r.json()["detail"]
    assert "file is not a database" in said and "its file is damaged: restore it" in said
    assert "free space" not in said
    health = http.get("/health").json()
    assert health["status"] == "storage_error", health
    assert "its file is damaged" in health["storage_error"]
