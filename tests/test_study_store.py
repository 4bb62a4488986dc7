"""The study store: what a study holds reads back typed, in the form it always had on disk.

Each test writes a study in a SQLite file (values pass through JSON, as every storage autotune
opens keeps them), with the raw attributes today's and older versions wrote, and reads it back
through :class:`StudyStore`; writes through the store must leave exactly those raw values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.schema.enums import Outcome, Role
from autotune.study.reference import ReferenceRecord
from autotune.study.storage import open_storage
from autotune.study.store import BudgetWindow, StudyStore
from autotune.study.trials import (
    TrialRecord,
    measurement_name,
    name_measurement,
    record,
)

_REFERENCE: dict[str, Any] = {
    "precision": "fp32",
    "batch_size": 32,
    "learning_rate": 0.1,
    "seed": 0,
    "losses": [2.3, None],
    "peak_memory_bytes": None,
    "measurements": [
        {"at": 1.0, "throughput": 100.0, "low": 90.0, "high": 110.0, "blocks": 8,
         "spread": 0.02, "seed": None, "seed_gap": None},
    ],
}  # fmt: skip

# Study attributes as the search writes them today, key for key.
_TODAY: dict[str, Any] = {
    "space_fingerprint": "abc123",
    "workload": "tiny_convnet",
    "spec": {"name": "s", "workload": "tiny_convnet", "storage": "sqlite:///x.db"},
    "best_config": "studies/s/best.json",
    "budget_window": {"started_at": 1700000000.5, "seconds": 600.0, "id": "a1b2c3d4e5f6"},
    "precision_choices": ["bf16", "fp16"],
    "fp16_diagnosis": {"trial": 3, "fp32_modules": ["fc"], "islands": "on"},
    "ceilings:box1:cuda:0": {"fp32": 256, "bf16": 512},
    "ceiling_limits:box1:cuda:0": {"fp32": "memory", "bf16": "time"},
    "reference:box1:cuda:0": _REFERENCE,
}


@pytest.fixture
def study(tmp_path: Path) -> optuna.Study:
    storage = open_storage(f"sqlite:///{tmp_path / 'store.db'}")
    return optuna.create_study(study_name="s", storage=storage, direction="maximize")


def _raw(study: optuna.Study, attrs: dict[str, Any]) -> StudyStore:
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    return StudyStore(optuna.load_study(study_name="s", storage=study._storage))


def test_a_study_written_with_todays_keys_reads_typed(study: optuna.Study) -> None:
    store = _raw(study, _TODAY)
    assert store.space_fingerprint() == "abc123"
    assert store.workload() == "tiny_convnet"
    assert store.spec() == _TODAY["spec"]
    assert store.best_config_path() == Path("studies/s/best.json")
    assert store.budget_window() == BudgetWindow(1700000000.5, 600.0, "a1b2c3d4e5f6")
    assert store.precision_choices() == ["bf16", "fp16"]
    assert store.diagnosis() == _TODAY["fp16_diagnosis"]
    assert store.ceilings("box1", "cuda:0") == {"fp32": 256, "bf16": 512}
    assert store.ceilings("box2", "cuda:0") is None
    assert store.ceiling_limits("box1", "cuda:0") == {"fp32": "memory", "bf16": "time"}
    assert store.all_ceilings() == {("box1", "cuda:0"): {"fp32": 256, "bf16": 512}}
    assert store.legacy_ceilings() == {}
    ref = store.reference("box1", "cuda:0")
    assert ref is not None and ref.batch_size == 32 and ref.losses == [2.3, None]
    assert store.references() == {("box1", "cuda:0"): ref}


def test_an_older_studys_attributes_still_read(study: optuna.Study) -> None:
    """A window with no id (named by its start), one ceiling table per device without the
    machine (one of them unreadable), no limits stored."""
    older = {
        "budget_window": {"started_at": 1700000000, "seconds": 90},
        "ceilings:cuda": {"fp16": 128},
        "ceilings:cpu": {"fp32": "lots"},
    }
    store = _raw(study, older)
    window = store.budget_window()
    assert window is not None and window.name == "1700000000"
    assert store.legacy_ceilings() == {"cuda": {"fp16": 128}}
    assert store.all_ceilings() == {}
    assert store.ceiling_limits("box1", "cuda") == {}


@pytest.mark.parametrize(
    ("key", "value", "read"),
    [
        ("budget_window", {"seconds": 90.0}, lambda s: s.budget_window()),
        ("spec", "not a spec", lambda s: s.spec()),
        ("precision_choices", [], lambda s: s.precision_choices()),
        ("fp16_diagnosis", "x", lambda s: s.diagnosis()),
        ("reference:box1:cpu", {"batch_size": 32}, lambda s: s.reference("box1", "cpu")),
        ("best_config", "", lambda s: s.best_config_path()),
        ("tuned_config", "{not json", lambda s: s.config()),
    ],
)
def test_a_malformed_value_reads_as_none(
    study: optuna.Study, key: str, value: Any, read: Any
) -> None:
    assert read(_raw(study, {key: value})) is None


def test_an_unreadable_config_is_still_known_to_be_stored(study: optuna.Study) -> None:
    store = _raw(study, {"tuned_config": "{not json"})
    assert store.config() is None and store.config_stored()
    assert not StudyStore(optuna.create_study()).config_stored()


def test_writes_store_the_raw_values_of_today(study: optuna.Study) -> None:
    store = StudyStore(study)
    store.set_identity("abc123", "tiny_convnet", _TODAY["spec"])
    store.set_budget_window(BudgetWindow(1700000000.5, 600.0, "a1b2c3d4e5f6"))
    store.set_precision_choices(("bf16", "fp16"))
    store.set_diagnosis(_TODAY["fp16_diagnosis"])
    store.set_ceilings("box1", "cuda:0", {"fp32": 256, "bf16": 512})
    store.set_ceiling_limits("box1", "cuda:0", {"fp32": "memory", "bf16": "time"})
    store.set_reference("box1", "cuda:0", ReferenceRecord.model_validate(_REFERENCE))
    store.set_best_config_path(Path("studies/s/best.json"))
    raw = optuna.load_study(study_name="s", storage=study._storage).user_attrs
    assert raw == _TODAY
    # The window's fields in the order the study always held them.
    assert list(raw["budget_window"]) == ["started_at", "seconds", "id"]


def test_a_queued_trial_starts_with_its_record(study: optuna.Study) -> None:
    store = StudyStore(study)
    rec = TrialRecord(role=Role.AMP_RECIPE, fp32_modules=["fc"], kept_lr=0.5)
    store.enqueue({"precision": "fp16", "batch_size": 32}, rec)
    store.enqueue({"precision": "fp16", "batch_size": 32}, rec, skip_if_exists=True)
    store.enqueue({"precision": "bf16", "batch_size": 32})
    first, second = study.trials
    assert first.user_attrs == {"role": "amp_recipe", "fp32_modules": ["fc"], "kept_lr": 0.5}
    assert first.system_attrs["fixed_params"] == {"precision": "fp16", "batch_size": 32}
    assert second.user_attrs == {}
    # Asked, a queued trial runs with its record.
    assert record(study.ask()).kept_lr == 0.5


def test_a_record_without_some_fields_stores_the_rest() -> None:
    rec = TrialRecord(outcome=Outcome.NOT_RUN, reason="ended", losses=[1.0], kept_lr=0.5)
    assert rec.without("outcome", "reason").to_attrs() == {"kept_lr": 0.5, "z_losses": [1.0]}


def test_a_trial_names_its_reference_measurement(study: optuna.Study) -> None:
    trial = study.ask()
    assert measurement_name(trial) is None
    name_measurement(trial, {"key": "reference:box1:cpu", "index": 2})
    study.tell(trial, 1.0)
    done = study.trials[0]
    assert done.user_attrs == {"reference_measurement": {"key": "reference:box1:cpu", "index": 2}}
    assert measurement_name(done) == {"key": "reference:box1:cpu", "index": 2}
