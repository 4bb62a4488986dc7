"""A service stopped under a study: killed and restarted, drained by SIGTERM, or stopped while
it measures the fp32 reference. Each test runs its own service (a subprocess on 127.0.0.1, or
in-process), in a file of its own so these long tests run beside tests/test_service.py's."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

for _name in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_name)

import optuna  # noqa: E402
from _service import Service, sleepy, wait_for  # noqa: E402

from autotune.service import StudyQueue, TuningService  # noqa: E402


def test_sigkill_restart_resumes_and_sigterm_drains(tmp_path: Path) -> None:
    svc = Service(tmp_path).start()
    try:
        # A budget far longer than its ceilings and two reference measurements, a kill, a
        # restart and a trial's re-run (45 s ran out on a slow machine beside a busy process:
        # the restarted service took 13 s to start, and the re-run never ran); no step waits for
        # it to run out. Batch sizes up to the base (32): the reference's parity curve is one
        # probe long.
        space = {"precisions": ["fp32"], "batch_sizes": [16, 32], "lr_multipliers": [0.5, 1, 2]}
        assert svc.submit(sleepy("r", budget="180s", steps=60, space=space)).status_code == 201
        svc.wait_trial_started("r")  # its probe takes ~3 s: the kill lands inside it
        finished = [t.number for t in svc.trials("r") if t.state.is_finished()]
        assert svc.proc is not None
        svc.proc.kill()
        svc.proc.wait()
        row = StudyQueue(svc.db).get("r")
        assert row is not None
        used_before = row.probe_seconds

        # Restarted on the same storage: the study resumes, the trial in flight is failed as
        # stale and its re-run starts; nothing finished is lost.
        svc.start()

        def rerun_started() -> bool:
            trials = svc.trials("r")
            stale = {t.number for t in trials if t.user_attrs.get("outcome") == "stale"}
            return any(t.user_attrs.get("retry_of") in stale for t in trials)

        wait_for(rerun_started, 90, "the re-run of the trial the kill cut off", svc.log)
        trials = svc.trials("r")
        by_number = {t.number: t for t in trials}
        assert all(by_number[n].state.is_finished() for n in finished)
        # The trial in flight is labelled on its FAIL record, and its re-run says which it re-runs.
        stale = [t for t in trials if t.user_attrs.get("outcome") == "stale"]
        assert all(t.state == optuna.trial.TrialState.FAIL for t in stale)
        # Failed at once (its process is gone), or by the heartbeat check if the restart took
        # longer than the grace period: either way the reason says so.
        assert all(
            "killed or crashed" in t.user_attrs["reason"]
            or "no heartbeat" in t.user_attrs["reason"]
            for t in stale
        )
        detail = svc.study("r")["trials"]
        assert any(t["outcome"] == "stale" and t["reason"] for t in detail)

        # SIGTERM drains the resumed study: the probe in flight is finished or stopped and
        # recorded, then exit; the study waits in the queue with the budget it has used, which
        # counts on from where the killed run left it (it is not given again).
        svc.wait_trial_running("r")
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(60)  # the probe in flight gets its grace, then the service exits
        trials = svc.trials("r")
        assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
        row = StudyQueue(svc.db).get("r")
        assert row is not None and row.state == "queued"
        assert used_before <= row.probe_seconds < 180
    finally:
        svc.stop()


@pytest.mark.parametrize("stop", ["drain", "cancel"])
def test_a_stop_during_the_reference_never_fails_the_study(tmp_path: Path, stop: str) -> None:
    """A drain (every restart) or a cancel kills the worker under the fp32 reference: the study
    goes back to the queue (and the next start finishes it) or ends cancelled, never failed."""
    db = f"sqlite:///{tmp_path / 's.db'}"
    spec = json.dumps(sleepy("ref", budget="12s", steps=100)).encode()
    service = TuningService(db, ["cpu"], out_dir=tmp_path / "out")
    service.start()
    try:
        service.submit(spec, "application/json", 0)

        def measuring_reference() -> bool:
            run = service.scheduler.run_of("ref")
            return run is not None and run.phase == "reference" and run.probing

        wait_for(measuring_reference, 90, "the fp32 reference probe in flight")
        if stop == "drain":
            service.scheduler.drain(grace=0)  # a drain whose grace ran out
        else:
            service.cancel("ref")
            wait_for(lambda: StudyQueue(db).get("ref").state != "running", 60, "the cancel")
    finally:
        service.stop()
    row = StudyQueue(db).get("ref")
    assert row is not None
    if stop == "cancel":
        assert row.state == "cancelled", (row.state, row.error)
        return
    assert row.state == "queued", (row.state, row.error)
    again = TuningService(db, ["cpu"], out_dir=tmp_path / "out")
    again.start()
    try:
        wait_for(lambda: StudyQueue(db).get("ref").state in ("done", "failed"), 120, "the study")
    finally:
        again.stop()
    row = StudyQueue(db).get("ref")
    assert row.state == "done", row.error
    trials = optuna.load_study(study_name="ref", storage=db).get_trials()
    assert trials and not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


def _running(queue: StudyQueue, spec: Any, owner: str) -> None:
    """Queue ``spec`` as taken and running by the service ``owner``."""
    from autotune.service._queue import QUEUE_TABLE

    queue.submit(spec.name, spec.model_dump(mode="json", exclude={"storage"}), 0)
    with queue._db(write=True) as conn:
        conn.execute(
            QUEUE_TABLE.update()
            .where(QUEUE_TABLE.c.name == spec.name)
            .values(state="running", device="cpu", owner=owner)
        )


def test_services_sharing_a_queue_start_beside_each_other_and_adopt_a_dead_ones_study(
    tmp_path: Path,
) -> None:
    """Two services on one SQLite file; kill -9 one while it runs a study. Restarting it exited
    2 ("being run by another autotune serve") while the other was busy, and the other never
    adopted the dead one's study. Now a service starts beside a live one, and the dead one's
    study is queued again and run to its config by the one still serving."""
    import socket
    import subprocess
    import sys

    db = f"sqlite:///{tmp_path / 's.db'}"
    queue = StudyQueue(db)
    host = socket.gethostname()
    # A live autotune service elsewhere on this host, busy with a study of its own ...
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "autotune"])
    service = TuningService(db, ["cpu"], out_dir=tmp_path / "out")

    def spec(name: str, budget: str) -> Any:
        return service.parse(json.dumps(sleepy(name, budget=budget)).encode(), "application/json")

    try:
        _running(queue, spec("theirs", "10s"), f"{host}:{other.pid}")
        assert service.recover() == []  # it starts, and leaves the live one's study alone
        service.start()
        # ... then a third service dies (kill -9) in the middle of its study.
        _running(queue, spec("orphan", "8s"), f"{host}:999999")
        wait_for(
            lambda: StudyQueue(db).get("orphan").state in ("done", "failed"), 120, "the adoption"
        )
    finally:
        service.stop()
        other.kill()
        other.wait()
    row = StudyQueue(db).get("orphan")
    assert row.state == "done", row.error
    assert StudyQueue(db).get("theirs").state == "running"  # the live one's, untouched


@pytest.mark.parametrize("storage_url", ["sqlite", "postgresql"], indirect=True)
def test_a_service_on_another_host_holds_its_study_while_it_beats_and_loses_it_when_silent(
    storage_url: str, tmp_path: Path
) -> None:
    """Services on two boxes share a PostgreSQL queue: the other box's process cannot be seen
    from here, so its hold on a study is its beat. A fresh beat keeps the study (a restart here
    used to take it back into the queue at once); one silent past the lease loses it."""
    from autotune.infra import clock
    from autotune.service._queue import LEASE, QUEUE_TABLE

    queue = StudyQueue(storage_url)
    service = TuningService(storage_url, ["cpu"], out_dir=tmp_path / "out")
    spec = service.parse(json.dumps(sleepy("remote")).encode(), "application/json")
    _running(queue, spec, "another-box:7")

    def beat(ago: float) -> None:
        with queue._db(write=True) as conn:
            conn.execute(QUEUE_TABLE.update().values(beat_at=clock.wall() - ago))

    beat(1.0)
    assert StudyQueue(storage_url).recover() == []
    assert StudyQueue(storage_url).adopt_orphans() == []
    assert queue.get("remote").state == "running"
    beat(LEASE + 5)
    assert StudyQueue(storage_url).adopt_orphans() == ["remote"]
    assert queue.get("remote").state == "queued"
    # And a service beats for the studies it runs itself.
    from autotune.study.storage import owner_id

    _running(
        queue, service.parse(json.dumps(sleepy("mine")).encode(), "application/json"), owner_id()
    )
    beat(LEASE + 5)
    queue.beat()
    assert clock.wall() - queue.get("mine").beat_at < LEASE
    assert StudyQueue(storage_url).adopt_orphans() == []
