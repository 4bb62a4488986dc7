"""The summary `autotune search` prints and logs at the end: the winner's speedup with its
interval and paired blocks, the search's figure beside it, the fp32 reference's latest
measurement, the device's noise, and the validation rejections (read as data). The table fits
80 columns, each row's settings written the same way."""

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
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.trials import (
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
        store=StudyStore(study),
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
    assert "1,800.0 ±1.1%" in winner
    search = next(line for line in text.splitlines() if "in search" in line)
    assert "2.10x" in search and "search optimism +8.8%" in search
    ref = next(line for line in text.splitlines() if "fp32 reference" in line)
    assert "950.0 ±1.1%" in ref and "measured 2 times" in ref
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
    result.store.study = study
    with console.capture() as out:
        _search._print_summary(result)
    amp = [line for line in out.get().splitlines() if "plain AMP recipe" in line]
    assert "diverged" in amp[0] and "loss=inf" not in amp[0]  # the table: its outcome
    assert amp[1] == "plain AMP recipe: diverged: loss=inf at step 3"  # below: why


# ---- 80 columns ----------------------------------------------------------------------------

LONG_REASON = (
    "GradScaler skipped 5 of 20 steps after warmup (limit 25%) at step 25, scale=2048; the "
    "loss was 2.3 at step 24"
)


@pytest.fixture
def narrow() -> Iterator[None]:
    """A terminal of 80 columns."""
    width = console.width
    console.width = 80
    yield
    console.width = width


def _with_amp(result: SimpleNamespace, tmp_path: Path, **fields: object) -> SimpleNamespace:
    study = optuna.create_study(study_name="a", storage=f"sqlite:///{tmp_path / 'a.db'}")
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"precision": "fp16", "batch_size": 32, "init_scale": 65536.0},
            distributions={
                "precision": CategoricalDistribution(["fp16"]),
                "batch_size": CategoricalDistribution([32]),
                "init_scale": CategoricalDistribution([65536.0]),
            },
            user_attrs=TrialRecord(role="amp_recipe", learning_rate=0.1, **fields).to_attrs(),
        )
    )
    result.store.study = study
    return result


def test_the_table_fits_80_columns_and_no_cell_runs_past_two_lines(tmp_path: Path, narrow) -> None:
    result = _with_amp(_result(tmp_path), tmp_path, outcome="diverged", reason=LONG_REASON)
    with console.capture() as out:
        _search._print_summary(result)
    lines = out.get().splitlines()
    assert max(len(line) for line in lines) <= 80
    # The table: a header, its rule, then four rows (winner, in search, reference, AMP recipe),
    # two lines each at most: before, the AMP recipe's reason ran over five.
    rule = next(i for i, line in enumerate(lines) if "────" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("plain AMP recipe:"))
    assert end - rule - 1 <= 2 * 4
    table = "\n".join(lines[:end])
    # Figures and settings are never cut inside a word.
    for whole in ("init_scale=65536", "(1.85–2.01)", "1,800.0", "±1.1%", "measured 2"):
        assert whole in table
    # The reason in full, below the table.
    assert " ".join(lines[end:]).startswith(f"plain AMP recipe: diverged: {LONG_REASON}")


def test_the_noise_agrees_with_the_reference_interval(tmp_path: Path, wide) -> None:
    """A reference run of 3 blocks has no spread (0 by convention): its interval, ±3.9%, is
    the noise shown, not 0.0%."""
    result = _result(tmp_path, noise=0.0)
    result.reference = REFERENCE.model_copy(
        update={
            "measurements": [
                ReferenceMeasurement(
                    at=1.0, throughput=32.1, low=30.9, high=33.4, blocks=3, spread=0.0
                )
            ]
        }
    )
    with console.capture() as out:
        _search._print_summary(result)
    text = out.get()
    assert "32.1 ±3.9%" in text
    assert "timing noise: ±3.9% (the fp32 reference's 95% interval" in text
    assert "0.0%" not in text


@pytest.mark.parametrize(
    ("params", "shown"),
    [
        # The workload's own memory format, which the fp32 reference runs too: not a setting.
        ({"precision": "bf16", "batch_size": 64}, False),
        # A searched choice: said, as in the trials' labels.
        ({"precision": "bf16", "batch_size": 64, "channels_last": True}, True),
    ],
)
def test_every_row_shows_its_settings_the_same_way(
    tmp_path: Path, wide, params: dict, shown: bool
) -> None:
    result = _result(tmp_path)
    result.config = result.config.model_copy(update={"channels_last": True})
    # The config's own trial (store_config's), with the parameters of the trial it validated.
    result.store.study = optuna.create_study(
        study_name="c", storage=f"sqlite:///{tmp_path / 'c.db'}"
    )
    result.store.study.add_trial(
        create_trial(
            value=1.93,
            params=params,
            distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
            user_attrs=TrialRecord(tuned_config=True, learning_rate=0.1).to_attrs(),
        )
    )
    with console.capture() as out:
        _search._print_summary(result)
    rows = out.get().splitlines()
    winner = next(line for line in rows if line.startswith("winner"))
    ref = next(line for line in rows if line.startswith("fp32 reference"))
    assert ("channels_last" in winner) is shown
    assert "bf16 bs=64 lr=0.1" in winner and "fp32 bs=32 lr=0.1" in ref


def _common_evidence() -> dict[str, object]:
    """What every config's evidence shares (the tolerance, the counts, the space), as a search
    passes it to its evidence builders."""
    return make_config("fp32", batch_size=32).evidence.model_dump(
        include={"parity_tolerance", "trials", "lr_scaling", "base_learning_rate",
                 "base_batch_size", "rejected", "cut", "ceilings"}
    )  # fmt: skip


def test_a_fallback_whose_last_run_timed_too_few_blocks_shows_one_noise_everywhere(
    tmp_path: Path, wide
) -> None:
    """The reference's latest run timed 3 blocks, too few for a spread: best.json said
    ``"noise": 0.0``, the summary the interval's 50% and the report the median spread, 72%.
    Now the config carries the median of the measured spreads, and the summary and the text
    report show that one figure."""
    from autotune.report import collect, render_text
    from autotune.report._format import noise_text
    from autotune.schema.spec import parse_spec
    from autotune.search._artifact import _fallback_evidence

    reference = ReferenceRecord(
        batch_size=32,
        learning_rate=0.1,
        measurements=[
            ReferenceMeasurement(at=1, throughput=1000, low=900, high=1100, blocks=12, spread=0.6),
            ReferenceMeasurement(at=2, throughput=1100, low=1000, high=1200, blocks=9, spread=0.84),
            ReferenceMeasurement(at=3, throughput=1000, low=500, high=1500, blocks=3, spread=0.0),
        ],
    )
    spec = parse_spec({"name": "test", "workload": "autotune.workloads:tiny_mlp"})
    common = _common_evidence()
    ev = _fallback_evidence(spec, None, reference, None, {}, common)
    assert ev.noise == pytest.approx(0.72)
    result = _result(tmp_path)
    cfg = make_config("fp32", batch_size=32)
    result.config = cfg.model_copy(update={"evidence": ev})
    result.reference = reference
    with console.capture() as out:
        _search._print_summary(result)
    shown = f"timing noise: {noise_text(ev.noise)}"
    assert shown in out.get()
    # The report reads the stored study: the reference, and the config, as a search stores them.
    from autotune.study.crown import store_config
    from autotune.study.reference import reference_key

    result.store.study.set_user_attr(reference_key("vm", "cpu"), reference.model_dump(mode="json"))
    store_config(result.store.study, result.config)
    assert shown in render_text(collect(result.store))


def test_a_fallback_and_the_reference_show_one_throughput(tmp_path: Path, wide) -> None:
    """A fallback is the fp32 reference: its row and the reference's show one figure (the
    fallback took a validation pair's reference arm, 6,179.9 samples/s, beside the
    reference's own 1,469.1, both called 1.00x)."""
    from autotune.measure.result import PairedResult, ProbeResult
    from autotune.schema.spec import Candidate, parse_spec
    from autotune.search._artifact import _fallback_evidence

    cand = Candidate(precision="fp32", batch_size=32, learning_rate=0.1)

    def probe(throughput: float) -> ProbeResult:
        return ProbeResult(
            candidate=cand, workload="w", device="cpu", outcome="completed",
            throughput=throughput, throughput_low=throughput * 0.9,
            throughput_high=throughput * 1.1,
        )  # fmt: skip

    arm = PairedResult(candidate=probe(9000.0), reference=probe(6179.9))
    spec = parse_spec({"name": "test", "workload": "autotune.workloads:tiny_mlp"})
    common = _common_evidence()
    ev = _fallback_evidence(spec, None, REFERENCE, arm, {}, common)
    assert ev.throughput == REFERENCE.measurements[-1].throughput
    result = _result(tmp_path)
    result.config = make_config("fp32", batch_size=32).model_copy(update={"evidence": ev})
    with console.capture() as out:
        _search._print_summary(result)
    rows = out.get().splitlines()
    winner = next(line for line in rows if line.startswith("winner"))
    ref = next(line for line in rows if "fp32 reference" in line and "1.00x" in line)
    assert "950.0 ±1.1%" in winner and "950.0 ±1.1%" in ref
    assert "6,179.9" not in out.get()


def test_a_reference_that_moved_over_the_search_says_to_compare_rows_by_ratio(
    tmp_path: Path, wide
) -> None:
    """On an H200 the reference drifted from 21,760 to 14,922 samples/s: the AMP recipe's
    19,756 stood at 0.94x beside the reference's latest 14,922, which read as faster."""
    result = _result(tmp_path)
    with console.capture() as out:
        _search._print_summary(result)
    assert "compare rows by their ratios" not in out.get()  # 950 and 1,000: 5% apart
    moved = [
        ReferenceMeasurement(at=1.0, throughput=21760.0, low=21500.0, high=22000.0, blocks=9),
        ReferenceMeasurement(at=2.0, throughput=14922.4, low=14362.0, high=16113.0, blocks=9),
    ]
    result.reference = REFERENCE.model_copy(update={"measurements": moved})
    with console.capture() as out:
        _search._print_summary(result)
    text = " ".join(out.get().split())
    assert "the fp32 reference measured 14,922–21,760 samples/s over the search (2 runs)" in text
    assert "compare rows by their ratios" in text


def test_a_search_beside_a_busy_neighbour_says_how_much_it_took(tmp_path: Path, wide) -> None:
    result = _result(tmp_path)
    result.others_cores = 0.2
    with console.capture() as out:
        _search._print_summary(result)
    assert "other processes kept" not in out.get()
    result.others_cores = 1.02
    with console.capture() as out:
        _search._print_summary(result)
    assert "other processes kept 1.0 of this machine's" in " ".join(out.get().split())
    # best.json carries the figure; the summary says the config's, as the report does.
    ev = result.config.evidence.model_copy(update={"others_cores": 1.6})
    result.config = result.config.model_copy(update={"evidence": ev})
    with console.capture() as out:
        _search._print_summary(result)
    assert "other processes kept 1.6 of this machine's" in " ".join(out.get().split())


def test_an_adapter_workload_is_titled_by_its_objects_not_its_json(
    tmp_path: Path, wide: None
) -> None:
    """A Lightning spec's summary was titled with the spec's raw workload JSON."""
    result = _result(tmp_path)
    workload = (
        '{"lightning": {"datamodule": "examples.lightning.data:CIFARData", "module": '
        '"examples.lightning.model:LitClassifier", "module_args": {"channels": 16}}}'
    )
    result.config = result.config.model_copy(update={"workload": workload})
    with console.capture() as out:
        _search._print_summary(result)
    title = out.get().splitlines()[0]
    assert "lightning examples.lightning.model:LitClassifier + examples.lightning.data:" in title
    assert "{" not in title
