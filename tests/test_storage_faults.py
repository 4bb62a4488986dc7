"""The study storage when things go wrong: its disk fills up mid-search, or the process running
a trial dies. Nothing stored is lost, the state says what happened, and it recovers.

The full disk is a file-size limit (``RLIMIT_FSIZE``, set on the running process with
``prlimit``): every write past the first byte of any file then fails, as on a full disk, with
no mount and no root needed.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from _service import wait_for

from autotune.schema.spec import StudySpec
from autotune.study.storage import fail_stale, open_storage, open_study, owner_id
from autotune.study.store import StudyStore

ROOT = Path(__file__).resolve().parent.parent

# Sleepy probes (0.05 s a step) leave the shared cores alone; the budget leaves room for start-up
# on a busy machine, and the run is ended by the fault long before.
SPEC = """\
name: full
workload: autotune.testing.workloads:sleepy
device: cpu
budget: 60s
space: {precisions: [fp32], batch_size: {min: 16, max: 32}}
probe: {warmup_steps: 1, steps: 12, check_every: 6, time_limit: 8s}
validation: {top_k: 1, steps: 12}
"""


def trials(db: str, name: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=db).get_trials()
    except KeyError:
        return []


def _finished_and_running(ts: list[optuna.trial.FrozenTrial]) -> bool:
    return any(t.state.is_finished() for t in ts) and any(
        t.state == optuna.trial.TrialState.RUNNING for t in ts
    )


def fill_disk(pid: int) -> None:
    """From now on, every write of ``pid`` past a file's first byte fails (EFBIG)."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))


def free_disk(pid: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)


@pytest.mark.timeout(240)
def test_cli_search_on_a_full_disk_says_so_and_resumes(tmp_path: Path) -> None:
    spec = tmp_path / "full.yaml"
    spec.write_text(SPEC)
    db = f"sqlite:///{tmp_path / 's.db'}"
    cmd = [sys.executable, "-m", "autotune", "search", str(spec), "--storage", db]
    cmd += ["--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # A finished trial, and the next one in flight: the disk fills up under it.
        wait_for(
            lambda: _finished_and_running(trials(db, "full")),
            150,
            "a finished trial and a running one",
        )
        fill_disk(proc.pid)
        finished = [t for t in trials(db, "full") if t.state.is_finished()]
        before = {t.number: (t.state, t.value) for t in finished}
        measured = {
            t.number: t.user_attrs["speedup"] for t in finished if "speedup" in t.user_attrs
        }
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # One clear line (a log file that cannot be written says so once, as a warning).
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "exceeding max length" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "cannot be written (disk I/O error)" in errors[0]
    assert "then resume by running the same command again" in errors[0]
    kept = {t.number: (t.state, t.value) for t in trials(db, "full")}
    assert all(kept[n] == before[n] for n in before)

    # Space is back: the same command resumes; nothing stored is lost, nothing stays RUNNING,
    # and the trial the disk failed under is labelled and run again. (A budget the worker's
    # start leaves room in on a busy machine: at 6 s its start took all of it, 3.4 s and more.)
    done = subprocess.run(
        [*cmd, "--budget", "20s"], cwd=ROOT, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr
    after = {t.number: t for t in trials(db, "full")}
    # What each trial measured is kept (its objective value may be set just below the written
    # config's, so the dashboard crowns the config: see crown.store_config).
    assert all(after[n].state == before[n][0] for n in before)
    assert all(after[n].user_attrs.get("speedup") == measured[n] for n in before if n in measured)
    assert not [t for t in after.values() if t.state == optuna.trial.TrialState.RUNNING]
    # Every trial the full disk left RUNNING (none when it filled between two trials: the next
    # ask was refused) is failed as stale, with its reason, and run again: all but one the disk
    # cut off before its parameters were written, which holds nothing to run again.
    left = [n for n, (state, _) in kept.items() if state == optuna.trial.TrialState.RUNNING]
    retried = {t.user_attrs.get("retry_of") for t in after.values()}
    for n in left:
        assert after[n].state == optuna.trial.TrialState.FAIL
        assert after[n].user_attrs["outcome"] == "stale" and after[n].user_attrs["reason"]
        assert n in retried or not after[n].params


# ---- the stale-trial path -------------------------------------------------------------------


def _study(tmp_path: Path) -> tuple[optuna.Study, optuna.storages.BaseStorage]:
    spec = StudySpec(name="stale", workload="tiny_mlp", storage=f"sqlite:///{tmp_path / 's.db'}")
    storage = open_storage(spec.storage)
    return open_study(spec, storage), storage


def _running(study: optuna.Study, worker: str, role: str | None = None) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_categorical("precision", ["fp32", "bf16"])
    trial.set_user_attr("worker", worker)
    if role:
        trial.set_user_attr("role", role)
    return trial


def test_a_dead_process_trial_is_failed_labelled_and_retried_at_once(tmp_path: Path) -> None:
    study, _ = _study(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = _running(study, f"{socket.gethostname()}:{gone.pid}", role="reference")
    alive = _running(study, owner_id())

    assert fail_stale(study) == [dead.number]
    by_number = {t.number: t for t in study.get_trials()}
    failed = by_number[dead.number]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["outcome"] == "stale"
    assert f":{gone.pid}) is gone" in failed.user_attrs["reason"]
    assert by_number[alive.number].state == optuna.trial.TrialState.RUNNING
    retries = [t for t in by_number.values() if t.user_attrs.get("retry_of") == dead.number]
    assert len(retries) == 1
    assert retries[0].state == optuna.trial.TrialState.WAITING
    assert retries[0].user_attrs["role"] == "reference" and "outcome" not in retries[0].user_attrs
    assert fail_stale(study) == []  # once


def test_a_silent_trial_is_failed_after_its_grace_and_a_retry_only_once(tmp_path: Path) -> None:
    study, storage = _study(tmp_path)
    storage.grace_period = 0  # stale as soon as its heartbeat is a second old
    trial = _running(study, "elsewhere:1")
    storage.record_heartbeat(trial._trial_id)
    failed = wait_for(lambda: fail_stale(study), 20, "the trial to go stale")
    assert failed == [trial.number]
    stored = study.get_trials()[trial.number]
    assert stored.user_attrs["outcome"] == "stale"
    assert stored.user_attrs["reason"].startswith("no heartbeat for")

    # Its retry runs, and goes silent too: failed, not retried again.
    retry = study.ask()
    assert retry.user_attrs["retry_of"] == trial.number
    storage.record_heartbeat(retry._trial_id)
    assert wait_for(lambda: fail_stale(study), 20, "the retry to go stale") == [retry.number]
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))


def test_write_failures_name_the_database_reason(tmp_path: Path) -> None:
    """In a process whose disk is full, a study write is a StorageIOError that says why (not
    Optuna's guess of "exceeding max length")."""
    script = f"""
import resource, sys
from autotune.errors import StorageIOError
from autotune.schema.spec import StudySpec
from autotune.study.storage import open_study
spec = StudySpec(name="w", workload="tiny_mlp", storage="sqlite:///{tmp_path / "w.db"}")
study = open_study(spec)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
try:
    study.set_user_attr("x", "y" * 100000)
except StorageIOError as exc:
    sys.stdout.write(str(exc))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "cannot be written (disk I/O error); what it holds is kept" in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_trial_nobody_recorded_running_is_failed_once_it_is_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk filled right after a trial started: no worker name, no heartbeat, and Optuna's
    own check never calls it stale. Past the grace period it is failed with its reason."""
    study, _ = _study(tmp_path)
    trial = study.ask()
    assert fail_stale(study) == []  # just started: a live worker may be about to write its name
    monkeypatch.setattr("autotune.study.storage._age", lambda t: 60.0)
    assert fail_stale(study) == [trial.number]
    failed = study.trials[trial.number]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["outcome"] == "stale"
    assert "nobody recorded running it" in failed.user_attrs["reason"]


def test_the_end_of_a_search_waits_out_a_trial_nobody_recorded_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed search that ends within the grace period of such a trial (left by the run the
    disk stopped) still fails it: the study never ends with a trial RUNNING."""
    from autotune.study.leftovers import fail_ownerless

    study, _ = _study(tmp_path)
    orphan = study.ask()
    live = _running(study, owner_id())  # a worker that named itself: not waited on
    monkeypatch.setattr("autotune.study.storage.GRACE_PERIOD", 1)
    monkeypatch.setattr("autotune.search._coordination.GRACE_PERIOD", 1)
    assert fail_ownerless(StudyStore(study), poll=0.1) == [orphan.number]
    assert study.trials[orphan.number].state == optuna.trial.TrialState.FAIL
    assert study.trials[live.number].state == optuna.trial.TrialState.RUNNING


def test_every_optuna_storage_call_autotune_relies_on_exists_in_the_installed_optuna() -> None:
    """The storage wrapper guards Optuna's calls by name, and writes a trial's record through
    two of its private pieces: a release that renames one must fail here, not go unguarded."""
    from optuna.storages._rdb import models
    from optuna.storages._rdb import storage as rdb

    from autotune.study.guarded import GUARDED_PRIVATE

    for name in GUARDED_PRIVATE:
        assert callable(getattr(optuna.storages.RDBStorage, name, None)), name
    assert callable(getattr(optuna.storages.RDBStorage, "_set_trial_attr_without_commit", None))
    assert callable(getattr(rdb, "_create_scoped_session", None))
    assert hasattr(models, "TrialUserAttributeModel")
    # Optuna's trial cache hands attribute writes to the storage it wraps, as _backend.
    assert "_backend" in vars(optuna.storages._CachedStorage(optuna.storages.InMemoryStorage()))


def test_a_trial_record_is_written_whole_and_read_back(storage_url: str) -> None:
    from autotune.study.storage import open_storage
    from autotune.study.trials import TrialRecord, record

    storage = open_storage(storage_url)
    study = optuna.create_study(study_name="r", storage=storage)
    trial = study.ask()
    TrialRecord(outcome="completed", reason="first", throughput=1.0).write(trial)
    # Written again over the same keys: the second record is what is stored.
    TrialRecord(outcome="completed", reason="measured", throughput=12.5, losses=[2.0, 1.5]).write(
        trial
    )
    assert trial.user_attrs["throughput"] == 12.5  # the running trial sees it at once
    study.tell(trial, 1.0)
    stored = record(optuna.load_study(study_name="r", storage=storage).trials[0])
    assert (stored.outcome, stored.reason, stored.throughput) == ("completed", "measured", 12.5)
    assert stored.losses == [2.0, 1.5]
    # A finished trial's record is closed, as Optuna's own writes are.
    with pytest.raises(RuntimeError, match="finished"):
        TrialRecord(outcome="crashed").write(trial)
