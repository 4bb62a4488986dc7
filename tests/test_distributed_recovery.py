"""Workers that die: a worker killed mid-trial (its trial failed as stale and run again by the
survivor), and a study whose workers all died before its config (a new worker finishes it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from _workers import ROOT, resume, start_worker, write_spec
from optuna.trial import TrialState

from autotune.study.crown import stored_config


# Workers on one box share a SQLite file; PostgreSQL's shared study is tests/test_distributed.py's.
@pytest.mark.parametrize("storage_url", ["sqlite"], indirect=True)
def test_a_killed_worker_has_its_trial_failed_as_stale_and_rerun(
    storage_url: str, tmp_path: Path
) -> None:
    # Far longer than the victim's way to its first trial: before it, the victim starts, measures
    # its ceilings and the reference (twice), which took 40 s on a slow machine beside a busy
    # process. Nothing waits for the budget to run out: the victim is killed in its first trial
    # and the survivor stopped once the re-run has finished.
    spec = write_spec(tmp_path, "120s", steps=5)
    victim = start_worker(spec, storage_url, tmp_path / "victim", sleep=0.4)
    survivor = None
    killed_trial = None
    try:
        deadline = time.monotonic() + 150
        me = None
        while time.monotonic() < deadline and killed_trial is None:
            time.sleep(0.3)
            if victim.poll() is not None:  # it ended before running a trial: say how
                raise AssertionError(victim.communicate()[0][-3000:])
            try:
                study = optuna.load_study(study_name="dist", storage=storage_url)
            except KeyError:
                continue
            if survivor is None:
                survivor = start_worker(spec, storage_url, tmp_path / "survivor", sleep=0.4)
            running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
            for t in running:
                me = t.user_attrs.get("worker", "")
                if me.endswith(f":{victim.pid}") and "precision" in t.params:
                    # Frozen, the victim writes nothing more: if its trial is still RUNNING now,
                    # the kill leaves it so (it may have finished since it was read).
                    victim.send_signal(signal.SIGSTOP)
                    again = optuna.load_study(study_name="dist", storage=storage_url)
                    if again.trials[t.number].state == TrialState.RUNNING:
                        killed_trial = t.number
                    else:
                        victim.send_signal(signal.SIGCONT)
                    break
        assert killed_trial is not None, "the victim never ran a trial"
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        # The survivor fails the dead trial and runs it again: once the re-run has finished,
        # Ctrl-C ends it (what is left of its budget proves nothing more).
        number = killed_trial

        def rerun_finished() -> bool:
            trials = optuna.load_study(study_name="dist", storage=storage_url).trials
            return any(
                t.user_attrs.get("retry_of") == number and t.params and t.state.is_finished()
                for t in trials
            )

        while survivor.poll() is None and time.monotonic() < deadline + 120:
            if rerun_finished():
                survivor.send_signal(signal.SIGINT)
                break
            time.sleep(0.3)
        out = survivor.communicate(timeout=120)[0]
        assert survivor.returncode in (0, 130), out[-3000:]
    finally:
        for p in (victim, survivor):
            if p is not None and p.poll() is None:
                p.kill()
    study = optuna.load_study(study_name="dist", storage=storage_url)
    if study.trials[killed_trial].state == TrialState.FAIL:
        # On a busy machine the survivor's budget may end before the retry ran (it is then
        # failed as not run): resume the study (a new run queues it again and takes it first)
        # until it has, waiting on the state, not a time.
        for _ in range(3):
            retries = [t for t in study.trials if t.user_attrs.get("retry_of") == killed_trial]
            if not retries or retries[-1].user_attrs.get("outcome") != "not_run":
                break
            resume(spec, storage_url, tmp_path / "resume", budget="30s")
            study = optuna.load_study(study_name="dist", storage=storage_url)
    trials = study.get_trials(deepcopy=False)
    dead = trials[killed_trial]
    assert dead.state == TrialState.FAIL
    # Its FAIL record says why; its retry says which trial it runs again.
    assert dead.user_attrs["outcome"] == "stale" and dead.user_attrs["reason"]
    retries = [t for t in trials if t.user_attrs.get("retry_of") == killed_trial and t.params]
    assert retries and retries[-1].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert retries[-1].params == dead.params
    assert not [t for t in trials if t.state == TrialState.RUNNING]


def test_a_worker_finishes_a_study_whose_workers_died_before_its_config(tmp_path: Path) -> None:
    """After a database restart killed every worker: the budget window is spent, a trial is
    left RUNNING and no config was written. `autotune worker --study NAME` fails the orphan
    and validates what was measured, in a short window, instead of saying "nothing to do"."""
    import socket

    from _sim import landscape

    from autotune.infra import clock
    from autotune.schema.spec import parse_spec
    from autotune.search import Budget, SearchStopped, TrialFinished, run_search
    from autotune.sim import SimulatedRunner

    storage = f"sqlite:///{tmp_path / 's.db'}"
    spec = parse_spec(
        {
            "name": "orphaned",
            "workload": "autotune.workloads:tiny_convnet",
            # Its finishing window is a tenth of it: 30 s, room for a busy machine's worker
            # start (at 90 s the 9 s window went to a start of 6.7 s, and no config).
            "budget": "300s",
            "storage": storage,
            "space": {"precisions": ["fp32", "bf16"], "batch_sizes": [16, 32]},
            "probe": {"min_time": 0.2, "steps": 6, "warmup_steps": 1},
        }
    )
    # Its measurements, made on a (simulated) device before the workers died.
    # The landscape knows tiny_convnet's own facts: the real worker later sees the same space.
    facts = {"base_lr": 0.2, "base_batch_size": 32, "lr_scaling": "linear", "channels_last": True}
    runner = SimulatedRunner(landscape("autotune.workloads:tiny_convnet", facts=facts))
    finished: list[object] = []
    with clock.use(runner.clock), pytest.raises(SearchStopped):
        run_search(
            spec,
            out_dir=tmp_path / "sim",
            runner=runner,
            budget=Budget(spec.budget),
            on_event=lambda e: finished.append(e) if isinstance(e, TrialFinished) else None,
            should_stop=lambda: len(finished) >= 3,
        )
    study = optuna.load_study(study_name="orphaned", storage=storage)
    study.set_user_attr("budget_window", {"started_at": time.time() - 3600, "seconds": 300.0})
    orphan = study.ask()
    orphan.set_user_attr("worker", f"{socket.gethostname()}:999999")  # no such process
    assert stored_config(study) is None

    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "worker", "--study", "orphaned", "--storage", storage,
         "--device", "cpu", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())  # the console wraps long lines
    assert "failed 1 trials its dead workers left running" in said
    assert "validating what it measured in 30s" in said
    study = optuna.load_study(study_name="orphaned", storage=storage)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert study.trials[orphan.number].user_attrs["outcome"] == "stale"
    assert stored_config(study) is not None and (tmp_path / "out" / "best.json").is_file()
