"""What a finished search leaves in its storage, as optuna-dashboard shows it: nothing WAITING
(what the search queued and never ran is failed with its reason, and queued again when the
search resumes), the reason above the bulky loss curve, and no attribute stored as null."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from _sim import landscape
from optuna.trial import TrialState

from autotune.infra import clock
from autotune.schema.spec import parse_spec
from autotune.search import Budget, run_search
from autotune.sim import SimulatedRunner
from autotune.study.trials import TrialRecord, record

WORKLOAD = "autotune.workloads:tiny_convnet"


def search(storage: str, out: Path, budget: str) -> optuna.Study:
    """The real search on a simulated GPU, on a virtual clock (milliseconds of real time)."""
    spec = parse_spec(
        {
            "name": "tidy",
            "workload": WORKLOAD,
            "device": "cuda",
            "budget": budget,
            "storage": storage,
        }
    )
    runner = SimulatedRunner(landscape(WORKLOAD, **{"facts.base_batch_size": 32}))
    with clock.use(runner.clock):
        return run_search(spec, out_dir=out, runner=runner, budget=Budget(spec.budget)).store.study


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A search whose budget ends before the trials it queued run, then the same study resumed
    with time to run them."""
    tmp = tmp_path_factory.mktemp("tidy")
    storage = f"sqlite:///{tmp / 'tidy.db'}"
    short = search(storage, tmp / "out", "8s")
    first = short.get_trials()
    resumed = search(storage, tmp / "out", "40s")
    return SimpleNamespace(first=first, study=resumed, trials=resumed.get_trials())


def test_a_finished_search_leaves_nothing_waiting(studies: SimpleNamespace) -> None:
    # The short run queued its first trials (the plain AMP recipe among them) and ran none.
    not_run = [t for t in studies.first if t.state == TrialState.FAIL]
    assert not_run and not [t for t in studies.first if t.state == TrialState.WAITING]
    for t in not_run:
        assert record(t).outcome == "not_run"
        assert "queued, but the search ended before it ran" in record(t).reason
    assert any(record(t).role == "amp_recipe" for t in not_run)
    # Resumed, the study queues them again and runs them; it too ends with nothing waiting.
    assert not [t for t in studies.trials if t.state == TrialState.WAITING]
    amp = [t for t in studies.trials if record(t).role == "amp_recipe"]
    assert amp[-1].state == TrialState.COMPLETE and amp[-1].number > max(t.number for t in not_run)


def serialized(trial: optuna.trial.FrozenTrial) -> list[dict[str, str]]:
    """A trial's user attributes as optuna-dashboard lists them (key, JSON text), in order."""
    dashboard = pytest.importorskip("optuna_dashboard._serializer")
    return dashboard.serialize_frozen_trial(0, trial, {})["user_attrs"]


def test_the_dashboard_shows_the_reason_before_the_loss_curve(studies: SimpleNamespace) -> None:
    pruned = [t for t in studies.trials if t.state == TrialState.PRUNED and record(t).losses]
    assert pruned, "the resumed search pruned no trial that recorded losses"
    for t in pruned:
        keys = [a["key"] for a in serialized(t)]
        assert keys.index("reason") < keys.index("z_losses")
        # The bulky series come last, after every attribute a person reads.
        assert set(keys[-2:]) <= {"z_losses", "z_scales"}


def test_no_attribute_is_stored_as_null(studies: SimpleNamespace) -> None:
    for t in studies.trials:
        shown = {a["key"]: a["value"] for a in serialized(t)}
        assert "null" not in shown.values(), (t.number, shown)
        # A trial without a role has none stored; a baseline's names it.
        assert ("role" in shown) == (record(t).role is not None)


def test_older_studies_with_losses_under_their_old_name_still_read() -> None:
    old = optuna.trial.create_trial(
        state=TrialState.PRUNED,
        user_attrs={"outcome": "diverged", "losses": [2.3, None], "scales": [[1, 256.0]]},
    )
    rec = record(old)
    assert rec.losses == [2.3, None] and rec.scales == [(1, 256.0)]
    assert sorted(TrialRecord(losses=[2.3], role=None).to_attrs()) == ["z_losses"]
    assert json.dumps(TrialRecord(losses=[2.3]).to_attrs()) == '{"z_losses": [2.3]}'
