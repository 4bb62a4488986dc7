"""What autotune writes on trials and studies, read back the way Optuna and optuna-dashboard do.

The dashboard tests start the real optuna-dashboard on a study's storage and read its JSON API:
the dashboard's best trial must be Optuna's own ``study.best_trial``, feasible, the constraints
and the objective's name must show, and the tuned config must come back whole; after a search,
its best trial is the config best.json holds, with the figure validation stands behind.
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
from _sim import landscape

from autotune.schema.config import TunedConfig
from autotune.schema.enums import Outcome, Phase, Role, StudyState
from autotune.schema.spec import load_spec, parse_spec
from autotune.sim import Landscape, simulate
from autotune.study.crown import store_config, stored_config
from autotune.study.storage import open_storage, open_study
from autotune.study.trials import (
    TrialRecord,
    constraints,
    display_outcome,
    is_feasible,
    objective_value,
    record,
    set_constraints,
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


@pytest.mark.parametrize("outcome", list(Outcome))
def test_outcomes_are_stored_as_the_strings_older_studies_hold(
    tmp_path: Path, outcome: Outcome
) -> None:
    storage = f"sqlite:///{tmp_path / 'old.db'}"
    study = optuna.create_study(study_name="old", storage=storage)
    # As an older version wrote it: plain strings, by hand.
    old = study.ask()
    old.set_user_attr("outcome", outcome.value)
    old.set_user_attr("role", "amp_recipe")
    study.tell(old, state=optuna.trial.TrialState.PRUNED)
    new = study.ask()
    TrialRecord(outcome=outcome, role=Role.at_base("bf16")).write(new)
    study.tell(new, state=optuna.trial.TrialState.PRUNED)
    was, now = optuna.load_study(study_name="old", storage=storage).trials
    assert record(was).outcome is outcome and record(was).role == Role.AMP_RECIPE
    assert display_outcome(was) == outcome.value and f"{record(was).outcome}" == outcome.value
    # Stored as the same plain strings, never as "Outcome.OOM".
    assert now.user_attrs["outcome"] == outcome.value and type(now.user_attrs["outcome"]) is str
    assert now.user_attrs["role"] == "bf16_at_base"


@pytest.mark.parametrize(
    ("enum", "stored"),
    [
        (Role, ["reference", "amp_recipe", "fp32_islands"]),
        (StudyState, ["queued", "running", "paused", "done", "failed", "cancelled"]),
        (Phase, ["ceilings", "reference", "search", "validation"]),
    ],
)
def test_named_values_read_back_from_their_stored_strings(enum: Any, stored: list[str]) -> None:
    assert [enum(v).value for v in stored] == stored
    assert json.loads(json.dumps([enum(v) for v in stored])) == stored


def test_a_search_phase_stored_under_its_old_name_reads_as_search() -> None:
    assert Phase("trials") is Phase.SEARCH


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


def dashboard_exe() -> str:
    pytest.importorskip("optuna_dashboard")
    exe = shutil.which("optuna-dashboard", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the optuna-dashboard command is not installed beside this Python")
    return exe


def dashboard_details(storage: str, names: list[str], log: Path) -> dict[str, Any]:
    """What the real optuna-dashboard serves about each named study of ``storage``."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [dashboard_exe(), storage, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        studies = wait_for_json(proc, f"{base}/api/studies", log)["study_summaries"]
        ids = {s["study_name"]: s["study_id"] for s in studies}
        return {n: httpx.get(f"{base}/api/studies/{ids[n]}", timeout=10).json() for n in names}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_optuna_dashboard_shows_the_same_best_trial_as_optuna(tmp_path: Path) -> None:
    dashboard_exe()
    study = a_study(tmp_path)
    cfg = make_config("bf16", optimizer="SGD")
    cfg.evidence.rejected = [f"fp16 bs={2**i} lr×1: 1 infeasible" for i in range(5, 12)]
    assert len(cfg.model_dump_json()) > 1024  # longer than the dashboard shows of an object
    store_config(study, cfg)
    storage = f"sqlite:///{tmp_path / 'dash.db'}"
    detail = dashboard_details(storage, ["dash"], tmp_path / "dashboard.log")["dash"]

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


# ---- after a search: the config validation stands behind is the best trial ------------------


def told(study: optuna.Study, speedup: float, gap: float = -0.01) -> None:
    """A search trial as the search tells it: its speedup, the value (-inf when infeasible)."""
    trial = study.ask()
    trial.suggest_categorical("precision", ["fp16", "bf16"])
    TrialRecord(speedup=speedup, parity_gap=gap).write(trial)
    set_constraints(trial, {"parity": gap})
    study.tell(trial, objective_value(speedup, {"parity": gap}, maximize=True))


def test_search_figures_above_the_config_are_told_under_it_in_their_order(
    storage_url: str,
) -> None:
    study = optuna.create_study(study_name="c", storage=storage_url, direction="maximize")
    for speedup in (1.5, 1.2, 3.0, 2.0, 3.0):
        told(study, speedup)
    told(study, 4.0, gap=0.07)  # fast, but it learns worse
    cfg = make_config("bf16")
    cfg.evidence.speedup = 1.8
    store_config(study, cfg)

    def values(study: optuna.Study) -> list[float]:
        return [t.value for t in optuna.load_study(study_name="c", storage=storage_url).trials]

    first = values(study)
    assert optuna.load_study(study_name="c", storage=storage_url).best_trial.number == 6
    assert first[6] == 1.8 and first[:2] == [1.5, 1.2] and first[5] == -math.inf
    # Above it: just under it, in the order the search measured them (twins by number).
    assert 1.5 < first[3] < first[4] < first[2] < 1.8
    assert [t.user_attrs["speedup"] for t in study.trials[:6]] == [1.5, 1.2, 3.0, 2.0, 3.0, 4.0]

    # A later config (a resumed study) above some of them: those are told their own again.
    cfg.evidence.speedup = 2.5
    store_config(study, cfg)
    again = values(study)
    assert optuna.load_study(study_name="c", storage=storage_url).best_trial.number == 7
    assert again[7] == 2.5 and again[6] == 1.8 and again[3] == 2.0
    assert 2.0 < again[4] < again[2] < 2.5


def nothing_beats_fp32() -> Landscape:
    """fp32 as fast at every batch, fp16 and bf16 half as fast: validation falls back to the
    fp32 reference, and the search's figures for fp32 scatter around 1.0."""
    flat, half = ({b: v for b in (16, 64, 256, 1024)} for v in (6000.0, 3000.0))
    changes = {"modes.fp32.throughput": flat, "modes.fp16.throughput": half}
    return landscape(**changes, **{"modes.bf16.throughput": half})


def search(storage: str, name: str, land: Landscape, budget: str) -> TunedConfig:
    """A whole search on the simulated device, kept in ``storage``; its config (best.json)."""
    spec = parse_spec(
        {"name": name, "workload": land.workload, "budget": budget, "storage": storage}
    )
    config = simulate(spec, land, storage=open_storage(storage)).config
    assert config is not None
    return config


def searched(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The search's completed, feasible trials (not the validated config's own)."""
    return [t for t in study.trials if is_feasible(t) and not t.user_attrs.get("tuned_config")]


def test_optuna_dashboard_shows_the_config_with_its_validated_figure_as_the_best_trial(
    tmp_path: Path,
) -> None:
    """The search's figures are unpaired, and the best of many noisy ones runs high: the
    dashboard crowned a search trial at 23.88x while best.json said 1.31x. Now its best trial
    is the config, valued at what validation measured (1.0, the reference, for a fallback)."""
    dashboard_exe()
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    configs = {
        # Large batches well within parity: validated on any seed (at the default's 0.004 per
        # batch ratio, bs=1024 is 6% off, and a 90 s search may end at the reference).
        "validated": search(
            storage, "validated", landscape(**{"parity.gap_per_batch_ratio": 0.001}), "90s"
        ),
        "fallback": search(storage, "fallback", nothing_beats_fp32(), "45s"),
    }
    assert configs["validated"].evidence.validated and not configs["fallback"].evidence.validated
    details = dashboard_details(storage, list(configs), tmp_path / "dashboard.log")

    for name, cfg in configs.items():
        study = optuna.load_study(study_name=name, storage=storage)
        speedup = cfg.evidence.speedup
        (best,) = details[name]["best_trials"]
        assert best["values"] == [speedup], name
        assert best["number"] == study.best_trial.number
        assert study.best_trial.value == speedup
        attrs = {a["key"]: a["value"] for a in best["user_attrs"]}
        assert attrs["tuned_config"] == "True"
        assert attrs["reason"] == cfg.evidence.validation_note
        params = {p["name"]: p["param_external_value"] for p in best["params"]}
        if cfg.evidence.validated:
            assert params["precision"] == cfg.precision
            assert params["batch_size"] == str(cfg.batch_size)
            assert attrs["blocks"] == str(cfg.evidence.paired_blocks)
            source = study.trials[int(attrs["validated_trial"])]
            assert source.user_attrs["speedup"] == cfg.evidence.search_speedup
        else:
            assert params == {}  # the fp32 reference is no point of the search space
        # No search figure is crowned over it; each stays in the trial list, as measured.
        shown = {t["number"]: t for t in details[name]["trials"]}
        for t in searched(study):
            assert t.value < speedup
            kept = {a["key"]: a["value"] for a in shown[t.number]["user_attrs"]}
            assert float(kept["speedup"]) == t.user_attrs["speedup"]


# Two whole searches: on SQLite only (the stored order of figures on both backends is the
# previous test's).
@pytest.mark.parametrize("storage_url", ["sqlite"], indirect=True)
def test_a_resumed_study_searches_on_and_crowns_its_next_config(storage_url: str) -> None:
    """The search's figures keep their order (all the sampler, the shortlist and the early-stop
    bar read of them), so a resumed study searches as before; its new config is the best trial."""
    first = search(storage_url, "resumed", landscape(), "60s")
    study = optuna.load_study(study_name="resumed", storage=storage_url)
    before = len(study.trials)
    assert study.best_trial.value == first.evidence.speedup

    def in_order(study: optuna.Study) -> None:
        by_value = sorted(searched(study), key=lambda t: (-t.value, t.number))
        by_figure = sorted(searched(study), key=lambda t: (-t.user_attrs["speedup"], t.number))
        assert [t.number for t in by_value] == [t.number for t in by_figure]

    in_order(study)
    again = search(storage_url, "resumed", landscape(), "60s")
    study = optuna.load_study(study_name="resumed", storage=storage_url)
    crowns = [t for t in study.trials if t.user_attrs.get("tuned_config")]
    assert len(study.trials) > before + 1 and len(crowns) == 2
    assert study.best_trial.number == crowns[-1].number
    assert study.best_trial.value == again.evidence.speedup
    in_order(study)
