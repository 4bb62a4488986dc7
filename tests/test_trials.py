"""What autotune writes on trials and studies, read back the way Optuna and optuna-dashboard do.

The last test starts the real optuna-dashboard on a study's storage and reads its JSON API: the
dashboard's best trial must be Optuna's own ``study.best_trial``, feasible, the constraints and
the objective's name must show, and the tuned config must come back whole.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
from _configs import make_config

from autotune.spec import load_spec
from autotune.storage import open_study
from autotune.trials import (
    TrialRecord,
    constraints,
    is_feasible,
    objective_value,
    set_constraints,
    store_config,
    stored_config,
)

ROOT = Path(__file__).resolve().parent.parent


def add_trial(
    study: optuna.Study, precision: str, batch_size: int, throughput: float | None, gap: float
) -> optuna.trial.FrozenTrial:
    """One trial as the search records it: parameters, its record, constraints, the value."""
    trial = study.ask()
    trial.suggest_categorical("precision", ["fp32", "fp16", "bf16"])
    trial.suggest_categorical("batch_size", [32, 64, 128])
    if throughput is None:  # ran out of memory: pruned, no constraint
        TrialRecord(outcome="oom", reason="CUDA out of memory").write(trial)
        return study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    values = {"parity": gap}
    feasible = gap <= 0
    TrialRecord(
        outcome="completed" if feasible else "infeasible", throughput=throughput, parity_gap=gap
    ).write(trial)
    set_constraints(trial, values)
    return study.tell(trial, objective_value(throughput, values, maximize=True))


def a_study(tmp_path: Path) -> optuna.Study:
    spec = load_spec(ROOT / "studies" / "tiny.yaml").with_overrides(
        {"storage": f"sqlite:///{tmp_path / 'dash.db'}", "name": "dash"}
    )
    study = open_study(spec)
    add_trial(study, "fp32", 64, 1000.0, 0.0)  # the reference
    add_trial(study, "fp16", 128, 1500.0, 0.07)  # the fastest, but it learns worse: infeasible
    add_trial(study, "bf16", 128, 1200.0, -0.01)  # the best feasible
    add_trial(study, "fp16", 256, None, 0.0)  # pruned
    return study


def test_constraints_are_kept_by_name_and_feasibility_follows_them(tmp_path: Path) -> None:
    study = a_study(tmp_path)
    ref, fast, best, pruned = study.trials
    assert constraints(ref) == {"parity": 0.0} and is_feasible(ref)
    assert constraints(fast) == {"parity": 0.07} and not is_feasible(fast)
    assert is_feasible(best) and not is_feasible(pruned)
    # Where optuna-dashboard reads them (Optuna 5 keeps them per name).
    assert fast.system_attrs["constraints"] == [0.07]
    assert study.best_trial.number == best.number


def test_copying_a_twins_constraints_keeps_one_copy_each(tmp_path: Path) -> None:
    study = a_study(tmp_path)
    twin = study.trials[1]
    assert set(twin.constraints) == {"0", "parity"}  # Optuna merges both places
    trial = study.ask()
    set_constraints(trial, twin.constraints)
    copied = study.tell(trial, twin.value)
    assert constraints(copied) == {"parity": 0.07}
    assert copied.system_attrs["constraints"] == [0.07]


@pytest.mark.parametrize(
    ("values", "maximize", "expected"),
    [
        ({"parity": -0.01}, True, 812.5),
        ({"parity": 0.0}, False, 812.5),
        ({"parity": 0.07}, True, -math.inf),
        ({"parity": -0.01, "reaches_reference_loss": 1.0}, False, math.inf),
    ],
)
def test_an_infeasible_trial_is_told_the_worst_value(
    values: dict[str, float], maximize: bool, expected: float
) -> None:
    assert objective_value(812.5, values, maximize=maximize) == expected


def test_the_config_is_stored_whole_and_old_studies_still_read(tmp_path: Path) -> None:
    study = optuna.create_study()
    assert stored_config(study) is None
    cfg = make_config("fp16", init_scale=1024.0, optimizer="SGD")
    store_config(study, cfg)
    assert isinstance(study.user_attrs["tuned_config"], str)  # text: shown whole
    assert stored_config(study) == cfg
    study.set_user_attr("tuned_config", cfg.model_dump(mode="json"))  # as earlier versions
    assert stored_config(study) == cfg
    study.set_user_attr("tuned_config", {"precision": "fp8"})
    assert stored_config(study) is None


def test_the_objective_is_named(tmp_path: Path) -> None:
    assert a_study(tmp_path).metric_names == ["speedup over fp32 (x)"]


# ---- the real optuna-dashboard ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_json(proc: subprocess.Popen, url: str, log: Path, deadline_s: float = 60.0) -> Any:
    """GET ``url`` until the server answers with JSON, polling, up to a deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"optuna-dashboard exited with {proc.returncode}: {log.read_text()}")
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"optuna-dashboard did not answer {url} within {deadline_s:.0f}s")
        time.sleep(0.2)


def test_optuna_dashboard_shows_the_same_best_trial_as_optuna(tmp_path: Path) -> None:
    pytest.importorskip("optuna_dashboard")
    exe = shutil.which("optuna-dashboard", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the optuna-dashboard command is not installed beside this Python")
    study = a_study(tmp_path)
    cfg = make_config("bf16", optimizer="SGD")
    cfg.evidence.rejected = [f"fp16 bs={2**i} lr×1: 1 infeasible" for i in range(5, 12)]
    assert len(cfg.model_dump_json()) > 1024  # longer than the dashboard shows of an object
    store_config(study, cfg)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "dashboard.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [exe, f"sqlite:///{tmp_path / 'dash.db'}", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        studies = wait_for_json(proc, f"{base}/api/studies", log)["study_summaries"]
        (study_id,) = [s["study_id"] for s in studies if s["study_name"] == "dash"]
        detail = httpx.get(f"{base}/api/studies/{study_id}", timeout=10).json()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # The dashboard's "Best Trial" is Optuna's, and it keeps parity.
    assert [t["number"] for t in detail["best_trials"]] == [study.best_trial.number]
    assert is_feasible(study.best_trial)
    assert detail["objective_names"] == ["speedup over fp32 (x)"]
    shown = {t["number"]: t for t in detail["trials"]}
    assert shown[1]["constraints"] == [0.07]  # the infeasible one, visibly so
    assert shown[2]["constraints"] == [-0.01]
    attrs = {a["key"]: a["value"] for a in shown[1]["user_attrs"]}
    assert (attrs["outcome"], attrs["throughput"]) == ("infeasible", "1500.0")
    study_attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
    assert json.loads(study_attrs["tuned_config"]) == json.loads(cfg.model_dump_json())
