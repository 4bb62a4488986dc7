"""Many workers on one study in a shared storage (workers that die are
tests/test_distributed_recovery.py's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from _workers import ROOT, start_worker, write_spec
from optuna.trial import TrialState

from autotune.study.crown import stored_config


# Several boxes share a PostgreSQL study (the multi-box mode); one box's workers sharing a SQLite
# file are tests/test_distributed_recovery.py's.
@pytest.mark.parametrize("storage_url", ["postgresql"], indirect=True)
def test_three_workers_finish_one_study_with_every_trial_accounted_for_once(
    storage_url: str, tmp_path: Path
) -> None:
    # Nine points and a budget far longer than they take: the workers end when the space is
    # measured through (the state), not when the budget has bought enough trials (a time).
    spec = write_spec(tmp_path, "90s", steps=3)
    out_dirs = [tmp_path / f"w{i}" for i in range(3)]
    procs = [start_worker(spec, storage_url, out, sleep=0.05) for out in out_dirs]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    study = optuna.load_study(study_name="dist", storage=storage_url)
    measured = {
        (t.params["batch_size"], t.params["lr_multiplier"])
        for t in study.trials
        if t.state.is_finished() and t.params and t.user_attrs.get("duplicate_of") is None
    }
    assert len(measured) == 9, sorted(measured)
    trials = study.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    finished = [t for t in trials if t.state.is_finished()]
    assert len({t.number for t in finished}) == len(finished) >= 6
    # Each finished trial was run (and recorded) by exactly one worker.
    owners = [t.user_attrs.get("worker") for t in finished]
    assert all(owners)
    assert len(set(owners)) >= 2, "the study should have been shared between workers"
    # Validation ran once: exactly one worker wrote best.json.
    written = [p for p in (out / "best.json" for out in out_dirs) if p.is_file()]
    assert len(written) == 1
    assert stored_config(study).study == "dist"


@pytest.mark.parametrize("what", ["password", "port"])
def test_a_worker_with_a_wrong_url_fails_fast_and_clearly(postgres_server, what: str) -> None:
    s = postgres_server
    if what == "password":
        url = s.url(password="wrong")
        needle = "password authentication failed"
    else:
        url = f"postgresql://{s.user}:{s.password}@127.0.0.1:1/postgres"
        needle = "Connection refused"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "worker", "--study", "x", "--storage", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert time.monotonic() - started < 30
    err = proc.stderr
    assert "cannot be opened" in err and needle in err
    assert "Traceback" not in err
    # The password never appears in the message.
    assert s.password not in err and ":wrong@" not in err
