"""The summary `autotune search` prints and logs at the end: the winner's speedup with its
interval and paired blocks, the search's figure beside it, the fp32 reference's latest
measurement, the device's noise, and the validation rejections (read as data)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from _configs import make_config
from loguru import logger
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from autotune.cli import _search
from autotune.cli._app import console
from autotune.reference import ReferenceMeasurement, ReferenceRecord
from autotune.trials import (
    Rejection,
    TrialRecord,
)

REFERENCE = ReferenceRecord(
    batch_size=32,
    learning_rate=0.1,
    measurements=[
        ReferenceMeasurement(at=1.0, throughput=1000.0, low=990.0, high=1010.0, blocks=9),
        ReferenceMeasurement(
            at=2.0, throughput=950.0, low=940.0, high=960.0, blocks=9, spread=0.031
        ),
    ],
)
REJECTED = [
    Rejection(label="fp16 bs=64 lr×2", stage="search", kind="diverged", count=3),
    Rejection(
        label="bf16 bs=128 lr×4",
        stage="validation",
        kind="parity",
        detail="loss parity +7.0% vs the fp32 reference (tolerance 5%)",
    ),
]


def _result(tmp_path: Path, **evidence: object) -> SimpleNamespace:
    study = optuna.create_study(
        study_name="test", storage=f"sqlite:///{tmp_path / 's.db'}", direction="maximize"
    )
    study.add_trial(
        create_trial(
            value=0.9,
            params={"precision": "fp16", "batch_size": 32},
            distributions={
                "precision": CategoricalDistribution(["fp16"]),
                "batch_size": CategoricalDistribution([32]),
            },
            user_attrs=TrialRecord(
                role="amp_recipe",
                outcome="completed",
                throughput=855.0,
                throughput_low=850.0,
                throughput_high=860.0,
                speedup=0.9,
                speedup_low=0.88,
                speedup_high=0.92,
            ).to_attrs(),
            system_attrs={"constraints:parity": 0.0},
        )
    )
    cfg = make_config("bf16", batch_size=64)
    ev = cfg.evidence.model_copy(
        update={
            "throughput": 1800.0,
            "throughput_low": 1780.0,
            "throughput_high": 1820.0,
            "speedup": 1.93,
            "speedup_low": 1.85,
            "speedup_high": 2.01,
            "paired_blocks": 24,
            "search_speedup": 2.1,
            "search_optimism": 0.088,
            **evidence,
        }
    )
    return SimpleNamespace(
        config=cfg.model_copy(update={"evidence": ev}),
        path=tmp_path / "best.json",
        study=study,
        reference=REFERENCE,
        rejected=REJECTED,
        elapsed=12.0,
    )


@pytest.fixture
def wide() -> Iterator[None]:
    """The console wide enough that no figure wraps."""
    width = console.width
    console.width = 200
    yield
    console.width = width


def test_summary_shows_intervals_the_search_figure_and_the_noise(tmp_path: Path, wide) -> None:
    with console.capture() as out:
        _search._print_summary(_result(tmp_path, noise=0.024))
    text = out.get()
    winner = next(line for line in text.splitlines() if "winner" in line)
    assert "1.93x (1.85–2.01)" in winner and "validated over 24 paired blocks" in winner
    assert "1,800.0" in winner
    search = next(line for line in text.splitlines() if "in the search" in line)
    assert "2.10x" in search and "search optimism +8.8%" in search
    ref = next(line for line in text.splitlines() if "fp32 reference" in line)
    assert "950.0 (940.0–960.0)" in ref and "measured 2 times" in ref
    amp = next(line for line in text.splitlines() if "plain AMP recipe" in line)
    assert "0.90x (0.88–0.92)" in amp
    assert "timing noise: 2.4%" in text
    assert "bf16 bs=128 lr×4: failed validation: loss parity +7.0%" in text


def test_summary_noise_falls_back_to_the_reference(tmp_path: Path, wide) -> None:
    with console.capture() as out:
        _search._print_summary(_result(tmp_path))
    assert "timing noise: 3.1%" in out.get()


def test_log_outcome_logs_validation_rejections_from_their_stage(tmp_path: Path) -> None:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        _search._log_outcome(_result(tmp_path))
    finally:
        logger.remove(sink)
    rejected = [line for line in lines if line.startswith("rejected in validation")]
    assert rejected == [
        "rejected in validation: bf16 bs=128 lr×4: failed validation: loss parity +7.0% vs "
        "the fp32 reference (tolerance 5%)"
    ]
    config = next(line for line in lines if line.startswith("config:"))
    assert "1.93x (1.85–2.01) the fp32 reference over 24 paired blocks (validated)" in config


def test_a_fallback_summary_describes_the_reference(tmp_path: Path, wide) -> None:
    result = _result(
        tmp_path,
        validated=False,
        throughput=950.0,
        baseline_throughput=950.0,
        speedup=1.0,
        speedup_low=None,
        speedup_high=None,
        throughput_low=None,
        throughput_high=None,
        paired_blocks=0,
        search_speedup=None,
        search_optimism=None,
    )
    with console.capture() as out:
        _search._print_summary(result)
    winner = next(line for line in out.get().splitlines() if "winner" in line)
    assert "1.00x" in winner and "NOT validated: fp32 fallback" in winner
    assert "in the search" not in out.get()


# The amp trial is COMPLETE; a pruned one shows its outcome and reason instead.
def test_an_amp_recipe_that_did_not_complete_shows_why(tmp_path: Path, wide) -> None:
    result = _result(tmp_path)
    study = optuna.create_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.db'}")
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"precision": "fp16"},
            distributions={"precision": CategoricalDistribution(["fp16"])},
            user_attrs=TrialRecord(
                role="amp_recipe", outcome="diverged", reason="loss=inf at step 3"
            ).to_attrs(),
        )
    )
    result.study = study
    with console.capture() as out:
        _search._print_summary(result)
    amp = next(line for line in out.get().splitlines() if "plain AMP recipe" in line)
    assert "diverged: loss=inf at step 3" in amp
