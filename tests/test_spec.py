"""The study spec: durations, validation messages that name the field, files and overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.errors import SpecError
from autotune.schema.spec import (
    MAX_BUDGET,
    Candidate,
    ProbeSettings,
    StudySpec,
    format_duration,
    load_spec,
    parse_duration,
    parse_spec,
)

MINIMAL: dict[str, Any] = {"name": "tiny", "workload": "tiny_mlp"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800.0),
        ("1h30m", 5400.0),
        ("90s", 90.0),
        ("1.5h", 5400.0),
        ("1h 2m 3s", 3723.0),
        (" 2M ", 120.0),
        ("45", 45.0),
        (45, 45.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration_reads_every_form(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["-5m", "abc", "0", "", "0s", "5x", "m", True, -1, float("inf")])
def test_parse_duration_rejects_bad_values_naming_the_field(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^budget must be") as info:
        parse_duration(bad, field="budget")
    assert f"budget={bad!r}" in str(info.value)


@pytest.mark.parametrize("budget", ["1e9", 1e9, "169h", "10081m"])
def test_a_budget_above_a_week_is_refused_naming_the_cap(budget: Any) -> None:
    """``--budget 1e9`` would hold a device for 31 years."""
    with pytest.raises(SpecError, match=r"budget must be at most 168h \(7 days\), got budget="):
        parse_spec({**MINIMAL, "budget": budget})
    assert parse_spec({**MINIMAL, "budget": "168h"}).budget == MAX_BUDGET


@pytest.mark.parametrize("budget", ["1e400", float("inf"), float("nan"), "nan"])
def test_a_budget_that_is_not_finite_is_refused(budget: Any) -> None:
    with pytest.raises(SpecError, match="budget must be a finite duration"):
        parse_spec({**MINIMAL, "budget": budget})


# Every float of the spec that bounds a check: inf or nan there would switch the check off
# (parity_tolerance: inf accepts any loss) or fail at run time.
BOUNDS = [
    "parity_tolerance",
    "memory_margin",
    "validation.min_speedup",
    "probe.loss_blowup_factor",
    "probe.max_skip_rate",
    "probe.precision",
    "space.lr_multiplier.max",
    "space.init_scale.max",
]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "1e400"])
@pytest.mark.parametrize("field", BOUNDS)
def test_a_bound_that_is_not_finite_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(MINIMAL).with_overrides({field: value})
    message = str(info.value)
    name = field.rsplit(".", 1)[-1]
    assert f"{field}: must be a finite number, got {name}=" in message
    assert "leave the field out for its default" in message


@pytest.mark.parametrize(("seconds", "text"), [(5400, "1h30m"), (95, "1m35s"), (2.5, "2.5s")])
def test_format_duration_round_trips(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("budget", [1799.6, 59.97, 26.8834051084697, 90.4])
def test_a_copy_of_a_spec_keeps_its_budget_to_the_last_digit(budget: float) -> None:
    """A budget of 1799.6 s copied through the spec's stored form stayed 1799.6 s, not 30m (a
    search ran 0.4 s past the budget it was given); whole budgets keep their readable form."""
    spec = parse_spec({**MINIMAL, "budget": budget})
    assert spec.with_overrides({"seed": 3}).budget == budget
    assert parse_spec(spec.model_dump(mode="json")).budget == budget
    whole = parse_spec({**MINIMAL, "budget": "1h30m"}).model_dump(mode="json")
    assert whole["budget"] == "1h30m"


def test_spec_defaults_and_durations_parse() -> None:
    spec = StudySpec(name="tiny", workload="tiny_mlp", budget="1h30m")
    assert spec.budget == 5400.0
    assert spec.probe.time_limit == 120.0
    assert spec.device == "auto"
    assert spec.space.precisions == ["fp32", "tf32", "fp16", "bf16"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"bogus": 1}, "bogus: unknown field"),
        ({"probe": {"stepz": 3}}, "probe.stepz: unknown field"),
        ({"space": {"batch_size": {"min": 64, "max": 16}}}, "space.batch_size: "),
        ({"space": {"lr_multiplier": {"min": 4, "max": 1}}}, "space.lr_multiplier: "),
        ({"space": {"precisions": ["fp8"]}}, "space.precisions.0: "),
        ({"device": "gpu"}, "device: "),
        ({"budget": "-5m"}, "budget: "),
        ({"probe": {"steps": 0}}, "probe.steps: "),
        ({"name": "has space"}, "name: "),
    ],
    ids=[
        "unknown-top-level",
        "unknown-nested",
        "batch-min-above-max",
        "lr-multiplier-min-above-max",
        "unknown-precision",
        "bad-device",
        "negative-budget",
        "zero-steps",
        "bad-name",
    ],
)
def test_invalid_spec_names_the_field(extra: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**MINIMAL, **extra})
    message = str(info.value)
    assert message.startswith("invalid study spec:")
    assert expected in message


@pytest.mark.parametrize(
    ("extra", "detail"),
    [
        ({"space": {"batch_size": {"min": 64, "max": 16}}}, "min=64, max=16"),
        ({"space": {"lr_multiplier": {"min": 4, "max": 1}}}, "min=4, max=1"),
        ({"space": {"precisions": ["fp8"]}}, "'fp8'"),
        ({"device": "gpu"}, "cuda:N"),
    ],
    ids=["batch", "lr-multiplier", "precision", "device"],
)
def test_invalid_spec_says_what_is_wrong(extra: dict[str, Any], detail: str) -> None:
    with pytest.raises(SpecError, match="invalid study spec") as info:
        parse_spec({**MINIMAL, **extra})
    assert detail in str(info.value)


@pytest.mark.parametrize(
    ("device", "stored"),
    [("auto", "auto"), (" CPU ", "cpu"), ("cuda", "cuda"), ("cuda:3", "cuda:3")],
)
def test_valid_devices_are_normalized(device: str, stored: str) -> None:
    assert parse_spec({**MINIMAL, "device": device}).device == stored


def test_missing_required_field_is_named() -> None:
    with pytest.raises(SpecError, match="workload: required field is missing"):
        parse_spec({"name": "tiny"})


def test_spec_that_is_not_a_mapping_is_rejected() -> None:
    with pytest.raises(SpecError, match="expected a mapping of fields, got list"):
        parse_spec(["name", "tiny"])


def test_duplicate_precisions_collapse_in_order() -> None:
    spec = parse_spec({**MINIMAL, "space": {"precisions": ["bf16", "fp32", "bf16"]}})
    assert spec.space.precisions == ["bf16", "fp32"]


def test_load_spec_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nworkload: tiny_mlp\nbudget: 90s\nprobe:\n  steps: 7\n  time_limit: 1m\n"
    )
    spec = load_spec(path)
    assert (spec.budget, spec.probe.steps, spec.probe.time_limit) == (90.0, 7, 60.0)


def test_load_spec_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="does not exist") as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_load_spec_invalid_yaml_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: tiny\nworkload: [unclosed\n")
    with pytest.raises(SpecError, match="is not valid YAML") as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_load_spec_invalid_field_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: tiny\nworkload: tiny_mlp\nprobe:\n  stepz: 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value)
    assert "probe.stepz: unknown field" in str(info.value)


def test_with_overrides_applies_dotted_paths_and_keeps_the_original() -> None:
    spec = parse_spec(MINIMAL)
    changed = spec.with_overrides({"probe.steps": 5, "budget": "10m", "device": None})
    assert (changed.probe.steps, changed.budget, changed.device) == (5, 600.0, "auto")
    assert spec.probe.steps == ProbeSettings().steps


@pytest.mark.parametrize("path", ["probe.stepz", "nope.steps", "name.x", "bogus"])
def test_with_overrides_unknown_path_is_named(path: str) -> None:
    with pytest.raises(SpecError, match=f"unknown spec field {path!r}"):
        parse_spec(MINIMAL).with_overrides({path: 1})


def test_with_overrides_invalid_value_names_the_field() -> None:
    with pytest.raises(SpecError, match=r"probe\.steps: .*got steps=0"):
        parse_spec(MINIMAL).with_overrides({"probe.steps": 0})


@pytest.mark.parametrize(
    "fields",
    [
        {"batch_size": 0},
        {"learning_rate": 0},
        {"learning_rate": float("nan")},
        {"precision": "fp8"},
        {"init_scale": -1.0},
        {"colour": "red"},
    ],
    ids=["zero-batch", "zero-lr", "nan-lr", "unknown-precision", "negative-scale", "unknown"],
)
def test_candidate_rejects_invalid_values(fields: dict[str, Any]) -> None:
    data = {"precision": "fp32", "batch_size": 8, "learning_rate": 0.1, **fields}
    with pytest.raises(ValueError, match=next(iter(fields))):
        Candidate(**data)


def test_space_fingerprint_ignores_time_limit_but_not_the_space() -> None:
    spec = parse_spec(MINIMAL)
    same = spec.with_overrides({"probe.time_limit": "5m", "budget": "2h"})
    other = spec.with_overrides({"space.precisions": ["bf16"]})
    assert spec.space_fingerprint() == same.space_fingerprint()
    assert spec.space_fingerprint() != other.space_fingerprint()


# studies/tiny.yaml's space fingerprint.
FINGERPRINT = "562b89f5bcbe76b1"


def test_the_knobs_are_optional_and_leave_a_stored_studys_fingerprint_alone() -> None:
    """torch.compile, channels_last and fp32 islands at their defaults change neither the space
    nor the fingerprint: a study stored before they existed resumes."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "studies" / "tiny.yaml")
    # This spec's fingerprint as the knobs leave it (pinned: a change here breaks resumes).
    assert spec.space_fingerprint() == FINGERPRINT
    assert spec.space.compile == [False] and spec.space.channels_last is None
    defaults = spec.with_overrides(
        {"space.compile": [False], "space.compile_modes": ["default"], "space.fp32_islands": True}
    )
    assert defaults.space_fingerprint() == spec.space_fingerprint()
    for knob, value in (
        ("space.compile", [False, True]),
        ("space.channels_last", [False, True]),
        ("space.fp32_islands", False),
    ):
        assert spec.with_overrides({knob: value}).space_fingerprint() != spec.space_fingerprint()


@pytest.mark.parametrize(
    ("field", "value"),
    [("compile", ["yes please"]), ("compile_modes", ["fastest"]), ("channels_last", [])],
)
def test_a_bad_knob_is_named_with_its_field(field: str, value: Any) -> None:
    with pytest.raises(SpecError, match=rf"space\.{field}"):
        parse_spec({**MINIMAL, "space": {field: value}})


def test_a_run_length_gives_one_measure_and_epochs_their_size() -> None:
    """The real run's length: one of steps, samples or epochs; epochs with the samples in one;
    each mistake named with the fix."""
    spec = parse_spec(
        {"name": "a", "workload": "tiny", "run": {"epochs": 10, "samples_per_epoch": 8192}}
    )
    assert spec.run is not None and spec.run.samples_at(32) == 81_920
    assert (
        parse_spec({"name": "a", "workload": "tiny", "run": {"steps": 100}}).run.samples_at(32)
        == 3_200
    )
    for run, words in (
        ({"epochs": 10}, "epochs needs samples_per_epoch"),
        ({"steps": 10, "samples": 100}, "give exactly one of steps, samples or epochs"),
        ({"steps": 0}, "run.steps"),
        ({"sample": 100}, "run.sample"),
    ):
        with pytest.raises(SpecError, match=words):
            parse_spec({"name": "a", "workload": "tiny", "run": run})
