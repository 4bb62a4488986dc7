"""The study report: HTML structure (every trial, every plot, nothing external), the text
summary, the CLI command and its errors; a headless-Chromium look where Chromium exists."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from _browser import FLAGS
from _configs import make_config, write_config
from _sim import landscape
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import StorageError
from autotune.infra import clock
from autotune.infra.logs import reset_logging
from autotune.report import collect, load_study, render_html, render_text, write_report
from autotune.schema.config import TunedConfig
from autotune.schema.spec import load_spec
from autotune.search import Budget, run_search
from autotune.sim import SimulatedRunner
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord, reference_key
from autotune.study.store import StudyStore
from autotune.study.trials import (
    TrialRecord,
    ceilings_key,
    record,
)

STUDIES = Path(__file__).resolve().parent.parent / "studies"
PLOTS = ("throughput", "parity", "validation", "reference", "scaler", "history", "importance")


class Page(HTMLParser):
    """What a reader (or a browser) finds in the report, by section."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.svgs: dict[str, list[dict[str, int]]] = {}  # section → each chart's mark counts
        self.svg_text: dict[str, list[str]] = {}  # section → the charts' text labels
        self.notes: dict[str, list[str]] = {}  # section → <p class="note"> texts
        self.rows: list[int] = []  # trial numbers of the trials table, in order
        self.row_text: dict[int, str] = {}
        self.baseline_rows: list[str] = []
        self.urls: list[str] = []
        self.tags: set[str] = set()
        self._section: str | None = None
        self._svg: dict[str, int] | None = None
        self._capture: str | None = None
        self._buf: list[str] = []
        self._row: int | None = None
        self._in_baselines = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.add(tag)
        self.urls += [a[k] for k in ("src", "href") if k in a]
        if tag == "section":
            self._section = a.get("id")
        elif tag == "svg" and "plot" in a.get("class", "").split():
            self._svg = {"circle": 0, "polyline": 0, "path": 0, "rect": 0, "line": 0, "errorbar": 0}
            self.svgs.setdefault(self._section or "", []).append(self._svg)
        elif self._svg is not None and "errorbar" in a.get("class", "").split():
            self._svg["errorbar"] += 1
        elif self._svg is not None and tag in self._svg:
            self._svg[tag] += 1
        elif tag == "table" and "baselines" in a.get("class", ""):
            self._in_baselines = True
        if tag in ("h1", "h2") or (tag == "p" and "note" in a.get("class", "")):
            self._capture, self._buf = tag, []
        elif tag == "text" and self._svg is not None:
            self._capture, self._buf = "svgtext", []
        elif tag == "tr" and "data-trial" in a:
            self._row = int(a["data-trial"])
            self.rows.append(self._row)
            self._buf = []
        elif tag == "tr" and self._in_baselines:
            self._capture, self._buf = "baseline", []

    def handle_endtag(self, tag: str) -> None:
        text = "".join(self._buf).strip()
        if tag == "svg":
            self._svg = None
        elif tag == "table":
            self._in_baselines = False
        elif tag in ("h1", "h2") and self._capture == tag:
            self.headings.append(text)
            self._capture = None
        elif tag == "p" and self._capture == "p":
            self.notes.setdefault(self._section or "", []).append(text)
            self._capture = None
        elif tag == "text" and self._capture == "svgtext":
            self.svg_text.setdefault(self._section or "", []).append(text)
            self._capture = None
        elif tag == "tr" and self._row is not None:
            self.row_text[self._row] = text
            self._row = None
        elif tag == "tr" and self._capture == "baseline":
            self.baseline_rows.append(text)
            self._capture = None

    def handle_data(self, data: str) -> None:
        self._buf.append(data)


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One finished test-sized study (the real search on a simulated device: fp16 and bf16
    about 1.5x fp32, fp16 diverging at a large init_scale), and its report."""
    tmp = tmp_path_factory.mktemp("report")
    spec = load_spec(STUDIES / "tiny.yaml").with_overrides(
        {"storage": f"sqlite:///{tmp / 's.db'}", "device": "cuda", "budget": "3m"}
    )
    land = landscape("autotune.workloads:tiny_convnet", **{"facts.base_batch_size": 32})
    runner = SimulatedRunner(land)
    with clock.use(runner.clock):
        result = run_search(spec, out_dir=tmp / "out", runner=runner, budget=Budget(spec.budget))
    path = write_report(result.store, storage=spec.storage, out_dir=tmp / "out")
    html = path.read_text(encoding="utf-8")
    return SimpleNamespace(spec=spec, result=result, path=path, html=html, page=parse(html))


def test_report_is_written_beside_best_json(searched: SimpleNamespace) -> None:
    assert searched.path == searched.result.path.parent / "report.html"
    assert searched.page.headings[0] == "autotune report · tiny"


def test_every_trial_has_exactly_one_row(searched: SimpleNamespace) -> None:
    numbers = [t.number for t in searched.result.store.trials()]
    assert numbers, "the search ran no trial: the fixture's budget is too short"
    assert searched.page.rows == sorted(numbers)
    for t in searched.result.store.trials():
        text = searched.page.row_text[t.number]
        assert t.state.name.lower() in text
        if t.params:
            assert t.params["precision"] in text


def test_every_plot_section_is_there_and_drawn(searched: SimpleNamespace) -> None:
    page, study = searched.page, searched.result.store.study
    for heading in (
        "Summary",
        "Throughput by batch size",
        "Loss parity: winner against the fp32 reference",
        "Search against validation",
        "The fp32 reference over time",
        "GradScaler scale (fp16 trials)",
        "Optimization history",
        "Parameter importances",
    ):
        assert heading in page.headings
    assert any(h.startswith("Every trial") for h in page.headings)
    # Each plot section holds a chart or a note that says why there is none.
    for section in PLOTS:
        assert page.svgs.get(section) or page.notes.get(section), section
    ref = searched.result.reference
    assert ref is not None and ref.measurements
    # The search's trials: the config validation stood behind is a trial of its own, in the
    # table but in no plot of the search.
    search = [t for t in study.trials if not record(t).tuned_config]
    measured = [
        t
        for t in search
        if t.state == TrialState.COMPLETE
        and record(t).duplicate_of is None
        and record(t).throughput
    ]
    # One point per measured trial, the reference apart (a square); each interval a bar; every
    # ceiling marked and labelled.
    (throughput,) = page.svgs["throughput"]
    assert throughput["circle"] == len(measured)
    with_interval = [t for t in measured if record(t).throughput_low is not None]
    assert throughput["errorbar"] == len(with_interval) + (ref.latest().blocks > 0)
    # Each ceiling says what limited it, as the search stored it.
    limits = collect(StudyStore(study), out_dir=searched.path.parent).ceiling_limits
    for mode, size in searched.result.ceilings.items():
        if size > 0:
            assert limits[mode] in ("memory", "margin", "time", "cap", "crash")
            words = {"margin": "memory margin"}.get(limits[mode], limits[mode])
            assert f"{mode} ceiling {size} ({words})" in page.svg_text["throughput"]
    # The reference's loss curve, on a samples-seen axis.
    (parity,) = page.svgs["parity"]
    assert parity["polyline"] + parity["circle"] >= 1
    assert "samples seen" in page.svg_text["parity"]
    # The optimization history has a point per completed trial and the best-so-far line.
    (history,) = page.svgs["history"]
    done = [t for t in search if t.state == TrialState.COMPLETE]
    assert history["circle"] >= len(done)
    assert history["polyline"] >= 1
    # Every fp16 trial that ran its own probe, stopped early ones too (drawn dashed).
    fp16 = [
        t
        for t in study.trials
        if t.params.get("precision") == "fp16"
        and record(t).duplicate_of is None
        and record(t).scales
    ]
    if fp16:
        # A line per fp16 trial with two or more positive check points, a dot at each of them
        # (a scale of 0 has no place on a log axis).
        positive = [[v for _, v in record(t).scales if v and v > 0] for t in fp16]
        (scaler,) = page.svgs["scaler"]
        assert scaler["polyline"] == sum(len(p) > 1 for p in positive)
        assert scaler["circle"] >= sum(len(p) for p in positive)
    # The reference's measurements over time: a point each.
    (drift,) = page.svgs["reference"]
    assert drift["circle"] == len(ref.measurements)


def test_summary_names_the_winner_and_both_baselines(searched: SimpleNamespace) -> None:
    cfg = searched.result.config
    rows = searched.page.baseline_rows
    assert any(r.startswith("fp32 reference") for r in rows)
    assert any(r.startswith("plain AMP recipe") for r in rows)
    assert f"{cfg.precision} · batch {cfg.batch_size}" in searched.html
    assert ("validated" in searched.html) and f"{cfg.evidence.speedup:.2f}×" in searched.html


def test_report_is_self_contained(searched: SimpleNamespace) -> None:
    page = searched.page
    assert not [u for u in page.urls if u.startswith(("http:", "https:", "//"))]
    assert not {"script", "link", "img", "iframe"} & page.tags
    assert "http://" not in searched.html and "https://" not in searched.html


def test_text_summary(searched: SimpleNamespace) -> None:
    data = collect(searched.result.store, out_dir=searched.path.parent)
    text = render_text(data)
    cfg = searched.result.config
    assert text.startswith("study 'tiny':")
    assert f"winner: {cfg.precision} bs={cfg.batch_size}" in text
    assert "fp32 reference: fp32 bs=32" in text
    assert "timing noise: " in text
    # The search's trials: the config validation stood behind is a trial of its own, and a
    # trial that reused an earlier one's measurement measured nothing (counted apart).
    search = [t for t in searched.result.store.trials() if not record(t).tuned_config]
    copies = [t for t in search if record(t).duplicate_of is not None]
    complete = sum(t.state == TrialState.COMPLETE for t in search if t not in copies)
    assert f"trials: {complete} complete" in text
    assert bool(copies) == (f"{len(copies)} reused an earlier trial's measurement" in text)


@pytest.fixture
def cli() -> Iterator[CliRunner]:
    """The CLI in-process; it configures logging, which is put back afterwards."""
    yield CliRunner()
    reset_logging()


def test_cli_report_and_text(searched: SimpleNamespace, tmp_path: Path, cli: CliRunner) -> None:
    storage = searched.spec.storage
    res = cli.invoke(app, ["report", "tiny", "--storage", storage, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "report.html").is_file()
    assert parse((tmp_path / "report.html").read_text()).rows == searched.page.rows
    res = cli.invoke(app, ["report", "tiny", "--storage", storage, "--text"])
    assert res.exit_code == 0, res.output
    assert "fp32 reference:" in res.output and "trials:" in res.output


@pytest.mark.parametrize("name", ["nosuch", "TINY"])
def test_unknown_study_is_named_with_the_known_ones(
    searched: SimpleNamespace, name: str, cli: CliRunner
) -> None:
    res = cli.invoke(app, ["report", name, "--storage", searched.spec.storage])
    assert res.exit_code == 2
    out = res.output + (res.stderr if res.stderr_bytes else "")
    assert f"study {name!r} is not in storage" in out
    assert "known studies: 'tiny'" in out
    assert "Traceback" not in out


def test_missing_sqlite_file_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    db = tmp_path / "nope" / "autotune.db"
    with pytest.raises(StorageError, match="no database file"):
        load_study("tiny", f"sqlite:///{db}")
    assert not db.exists() and not db.parent.exists()


# ---- every outcome, from a hand-made study (fast, deterministic) -----------------------------

DISTS = {
    "precision": CategoricalDistribution(["fp32", "fp16", "bf16"]),
    "batch_size": CategoricalDistribution([32, 64, 128]),
    "lr_multiplier": FloatDistribution(0.5, 2.0, log=True),
    "init_scale": CategoricalDistribution([256.0, 65536.0]),
}
SPEC = {
    "workload": "autotune.workloads:tiny_convnet",
    "device": "cpu",
    "budget": "1m",
    "parity_tolerance": 0.05,
    "space": {"precisions": ["fp32", "fp16", "bf16"]},
    "validation": {"min_speedup": 1.05},
}
BASE = {"precision": "fp32", "batch_size": 32, "lr_multiplier": 1.0}
FP16 = {**BASE, "precision": "fp16", "init_scale": 65536.0}
CURVE = [2.3 - 0.05 * i for i in range(12)]
OK = {"parity": 0.0}
# The fp32 reference measured three times; the third moved out of the second's interval.
T0 = 1_700_000_000.0
MEASUREMENTS = [
    ReferenceMeasurement(at=T0, throughput=1000.0, low=980.0, high=1020.0, blocks=12, spread=0.02),
    ReferenceMeasurement(
        at=T0 + 60, throughput=1010.0, low=990.0, high=1030.0, blocks=10, spread=0.03
    ),
    ReferenceMeasurement(
        at=T0 + 180, throughput=900.0, low=880.0, high=915.0, blocks=11, spread=0.02
    ),
]


def _trial(
    state: TrialState,
    params: dict,
    value: float | None = None,
    constraints: dict | None = None,
    **fields,
) -> object:
    """A trial as a search stores it: its record as user attributes, its constraints as
    Optuna's system attributes."""
    return create_trial(
        state=state,
        value=value,
        params=params,
        distributions={k: DISTS[k] for k in params},
        user_attrs=TrialRecord(**fields).to_attrs(),
        system_attrs={f"constraints:{k}": v for k, v in (constraints or {}).items()},
    )


def _interval(tp: float, speedup: float, ref: float = 1000.0) -> dict:
    """A completed trial's figures with ±5% intervals, against a reference of ``ref``."""
    return {
        "throughput": tp,
        "throughput_low": tp * 0.95,
        "throughput_high": tp * 1.05,
        "blocks": 12,
        "reference_throughput": ref,
        "speedup": speedup,
        "speedup_low": round(speedup - 0.1, 2),
        "speedup_high": round(speedup + 0.1, 2),
    }


def build_handmade(tmp_path: Path) -> SimpleNamespace:
    """A study with one trial of each outcome a search can write, the fp32 reference stored
    with the study (three measurements, one drifted), and no best.json."""
    storage = f"sqlite:///{tmp_path / 'h.db'}"
    study = optuna.create_study(study_name="hand", storage=storage, direction="maximize")
    study.set_user_attr("spec", SPEC)
    study.set_user_attr(ceilings_key("box", "cpu"), {"fp32": 128, "fp16": 64, "bf16": 64})
    study.set_user_attr(
        reference_key("box", "cpu"),
        ReferenceRecord(
            batch_size=32,
            learning_rate=0.2,
            losses=CURVE,
            peak_memory_bytes=2**20,
            measurements=MEASUREMENTS,
        ).model_dump(mode="json"),
    )
    good = {**BASE, "precision": "bf16", "batch_size": 64}
    trials = [
        _trial(
            TrialState.COMPLETE,
            FP16,
            0.9,
            OK,
            role="amp_recipe",
            outcome="completed",
            losses=CURVE,
            learning_rate=0.2,
            scales=[(1, 65536.0), (5, 32768.0), (11, 16384.0)],
            **_interval(900.0, 0.9),
        ),
        _trial(
            TrialState.COMPLETE,
            good,
            1.8,
            OK,
            outcome="completed",
            losses=CURVE[:6],
            learning_rate=0.4,
            parity_gap=0.01,
            **_interval(1800.0, 1.8),
        ),
        _trial(
            TrialState.COMPLETE,
            {**BASE, "precision": "bf16", "lr_multiplier": 2.0},
            # Infeasible: told the worst value (trials.objective_value), as the search does.
            float("-inf"),
            {"parity": 0.07},
            outcome="infeasible",
            losses=[2.3] * 12,
            learning_rate=0.4,
            parity_gap=0.12,
            reason="parity: loss 2.3 is +12.0% vs the fp32 reference's 2.05 (tolerance 5%)",
            **_interval(1500.0, 1.5),
        ),
        _trial(
            TrialState.PRUNED,
            {**FP16, "init_scale": 256.0, "batch_size": 64},
            outcome="diverged",
            reason="loss=inf at step 14, scale=0.5",
            losses=[2.3, None, None],
            scales=[(1, 256.0), (5, 1.0), (11, 0.5)],
        ),
        _trial(
            TrialState.PRUNED,
            {**BASE, "batch_size": 128},
            outcome="oom",
            reason="out of memory at batch_size=128",
        ),
        _trial(
            TrialState.FAIL,
            {**BASE, "precision": "bf16"},
            outcome="crashed",
            reason="worker process died (exit code -9) during the probe",
        ),
        _trial(
            TrialState.COMPLETE,
            good,
            1.8,
            OK,
            outcome="completed",
            losses=CURVE[:6],
            learning_rate=0.4,
            duplicate_of=1,
            **_interval(1800.0, 1.8),
        ),
        create_trial(state=TrialState.WAITING),
    ]
    for t in trials:
        study.add_trial(t)
    return SimpleNamespace(study=study, storage=storage, tmp=tmp_path)


def build_legacy(tmp_path: Path) -> SimpleNamespace:
    """A study an older autotune wrote: the fp32 reference is trial 0, no figure has an
    interval, the objective is samples/s, and the ceilings key names no machine."""
    storage = f"sqlite:///{tmp_path / 'old.db'}"
    study = optuna.create_study(study_name="old", storage=storage, direction="maximize")
    study.set_user_attr("spec", {k: v for k, v in SPEC.items() if k != "validation"})
    study.set_user_attr("ceilings:cpu", {"fp32": 128, "fp16": 64, "bf16": 64})
    old = [
        _trial(
            TrialState.COMPLETE,
            BASE,
            1000.0,
            OK,
            role="reference",
            outcome="completed",
            throughput=1000.0,
            losses=CURVE,
            learning_rate=0.2,
        ),
        _trial(
            TrialState.COMPLETE,
            {**BASE, "precision": "bf16", "batch_size": 64},
            1800.0,
            OK,
            outcome="completed",
            throughput=1800.0,
            losses=CURVE[:6],
            learning_rate=0.4,
            parity_gap=0.01,
        ),
        _trial(
            TrialState.PRUNED,
            {**BASE, "batch_size": 128},
            outcome="oom",
            reason="out of memory at batch_size=128",
        ),
    ]
    for t in old:
        study.add_trial(t)
    return SimpleNamespace(study=study, storage=storage, tmp=tmp_path)


def validated_config(**evidence: object) -> TunedConfig:
    """The config a search of the hand-made study would write: bf16 bs=64, validated."""
    cfg = make_config("bf16", batch_size=64, learning_rate=0.4)
    ev = cfg.evidence.model_copy(
        update={
            "throughput": 1750.0,
            "throughput_low": 1700.0,
            "throughput_high": 1800.0,
            "baseline_throughput": 1000.0,
            "speedup": 1.75,
            "speedup_low": 1.66,
            "speedup_high": 1.84,
            "paired_blocks": 24,
            "search_speedup": 1.8,
            "search_optimism": 0.0286,
            "noise": 0.021,
            **evidence,
        }
    )
    return cfg.model_copy(update={"study": "hand", "evidence": ev})


@pytest.fixture
def handmade(tmp_path: Path) -> SimpleNamespace:
    return build_handmade(tmp_path)


def test_every_outcome_renders_with_its_reason(handmade: SimpleNamespace) -> None:
    data = collect(
        StudyStore(handmade.study), out_dir=handmade.tmp / "out", storage=handmade.storage
    )
    page = parse(render_html(data))
    assert page.rows == list(range(8))
    assert "diverged" in page.row_text[3] and "loss=inf at step 14" in page.row_text[3]
    assert "oom" in page.row_text[4] and "pruned" in page.row_text[4]
    assert "crashed" in page.row_text[5] and "fail" in page.row_text[5]
    assert "infeasible" in page.row_text[2] and "+12.0%" in page.row_text[2]
    # The history draws the infeasible trial at the speedup it measured, not at -inf.
    assert "1.50×" in render_html(data)
    assert "Same parameters as trial 1: measurement reused." in page.row_text[6]
    assert "waiting" in page.row_text[7]
    # No best.json: the summary says so, and the winner is the best feasible trial.
    assert any("No best.json" in n for n in page.notes["summary"])
    assert data.winner is not None and data.winner.number == 1
    # Both fp16 runs are drawn; the diverged one falls to the "scale < 1" line.
    (scaler,) = page.svgs["scaler"]
    assert scaler["polyline"] == 2
    assert "scale < 1: diverging" in page.svg_text["scaler"]
    # The winner (bs 64) and the stored reference (bs 32) share the samples-seen axis.
    (parity,) = page.svgs["parity"]
    assert parity["polyline"] >= 2
    assert "parity window" in page.svg_text["parity"]
    # Pruned and failed trials are marked on the throughput chart, with each ceiling.
    assert page.svgs["throughput"][0]["path"] >= 3
    assert {"fp32 ceiling 128", "fp16 ceiling 64", "bf16 ceiling 64"} <= set(
        page.svg_text["throughput"]
    )


def test_intervals_are_shown_in_the_table_the_plots_and_the_summary(
    handmade: SimpleNamespace,
) -> None:
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    page = parse(render_html(data))
    # The trial table: each speedup with its interval; a trial without figures shows "—".
    assert "1.80× (1.70–1.90)" in page.row_text[1]
    assert "0.90× (0.80–1.00)" in page.row_text[0]
    assert "—" in page.row_text[4]
    # Error bars: the three measured trials (the duplicate reuses a twin's) and the reference.
    (throughput,) = page.svgs["throughput"]
    assert throughput["errorbar"] == 4
    assert throughput["circle"] == 3 and throughput["rect"] >= 1
    (history,) = page.svgs["history"]
    assert history["errorbar"] == 4
    assert "speedup over the fp32 reference (×)" in page.svg_text["history"]
    # The baselines: the reference's latest measurement with its interval; the AMP recipe.
    ref_row = next(r for r in page.baseline_rows if r.startswith("fp32 reference"))
    assert "900.0 (880.0–915.0)" in ref_row and "measured 3 times" in ref_row
    amp_row = next(r for r in page.baseline_rows if r.startswith("plain AMP recipe"))
    assert "0.90× (0.80–1.00)" in amp_row
    # The device's noise: the median spread of the reference's timed blocks.
    assert "timing noise" in render_html(data) and "2.0% (spread" in render_html(data)


def test_the_reference_over_time_shows_its_drift(handmade: SimpleNamespace) -> None:
    page = parse(render_html(collect(StudyStore(handmade.study), storage=handmade.storage)))
    (drift,) = page.svgs["reference"]
    assert drift["circle"] == 3 and drift["errorbar"] == 3
    html = render_html(collect(StudyStore(handmade.study), storage=handmade.storage))
    assert (
        "1 of 2 re-measurements moved outside the previous interval or 1.5 times from it (drift)"
        in html
    )
    assert "drifted from the previous one" in html


def test_a_reference_that_fell_fivefold_is_said_to_have_drifted(
    handmade: SimpleNamespace,
) -> None:
    """Runs too short for an interval, or whose intervals are wide, still count a fall from
    12.5k to 2.2k samples/s as drift (the caption said none moved under such a plot)."""
    falls = ReferenceRecord(
        batch_size=32,
        learning_rate=0.1,
        measurements=[
            ReferenceMeasurement(at=0, throughput=12500, low=11000, high=14000, blocks=8),
            ReferenceMeasurement(at=60, throughput=2200, low=500, high=11500, blocks=3),
            ReferenceMeasurement(at=120, throughput=2300, low=0, high=0, blocks=0),
        ],
    )
    handmade.study.set_user_attr(reference_key("box", "cpu"), falls.model_dump(mode="json"))
    html = render_html(collect(StudyStore(handmade.study), storage=handmade.storage))
    assert "2 of 2 re-measurements moved outside the previous interval or 1.5 times" not in html
    assert "1 of 2 re-measurements moved outside the previous interval or 1.5 times" in html


def test_a_validated_config_shows_search_against_validation(handmade: SimpleNamespace) -> None:
    out = handmade.tmp / "out"
    out.mkdir()
    write_config(out / "best.json", validated_config())
    data = collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage)
    html = render_html(data)
    page = parse(html)
    assert data.winner is not None and data.winner.number == 1
    # The winner card: validated speedup with interval and paired blocks, the search's figure
    # and its optimism, the noise that validation recorded.
    # The ratio's divisor is the reference's arm of the same pairs, named beside it (the
    # reference's latest measurement elsewhere on the page is another run: 900 samples/s).
    assert (
        "<b>1.75×</b> (1.66–1.84) the fp32 reference measured beside it (its arm 1,000.0 "
        "samples/s), over 24 paired blocks" in html
    )
    assert "the search measured 1.80× (search optimism +2.9%)" in html
    assert "timing noise of this device 2.1%" in html
    rows = page.baseline_rows
    assert any(
        r.startswith("winner (validation, paired)") and "1.75× (1.66–1.84)" in r for r in rows
    )
    assert any(r.startswith("winner (in the search)") and "1.80× (1.70–1.90)" in r for r in rows)
    # The figure: the search's interval above validation's.
    (fig,) = page.svgs["validation"]
    assert fig["errorbar"] == 2 and fig["circle"] == 2
    assert "search optimism: +2.9%" in html.lower()
    text = render_text(data)
    assert "1.75x (1.66–1.84) the fp32 reference over 24 paired blocks (validated)" in text
    assert "the search measured 1.80x: search optimism +2.9%" in text
    assert "timing noise: 2.1%" in text


def test_the_winner_card_divides_only_figures_measured_together(
    handmade: SimpleNamespace,
) -> None:
    """The plain AMP recipe's figure is its own search trial's, said as such: the card read
    "18.53× the plain AMP recipe", a ratio of two runs never measured together."""
    out = handmade.tmp / "amp"
    out.mkdir()
    write_config(out / "best.json", validated_config(speedup_vs_amp=1.75 / 0.9))
    html = render_html(collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage))
    assert "the plain AMP recipe: 0.90× the fp32 reference in the search (another run)" in html
    assert "× the plain AMP recipe" not in html


def test_a_fallback_config_says_no_candidate_validated(handmade: SimpleNamespace) -> None:
    out = handmade.tmp / "out"
    out.mkdir()
    cfg = make_config("fp32", batch_size=32, learning_rate=0.2)
    ev = cfg.evidence.model_copy(
        update={
            "throughput": 900.0,
            "baseline_throughput": 900.0,
            "speedup": 1.0,
            "validated": False,
        }
    )
    write_config(out / "best.json", cfg.model_copy(update={"study": "hand", "evidence": ev}))
    data = collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage)
    page = parse(render_html(data))
    assert any("lower bound cleared the bar" in n for n in page.notes["validation"])
    assert "NOT validated: fp32 fallback" in render_text(data)


def test_the_text_report_shows_intervals_and_the_noise(handmade: SimpleNamespace) -> None:
    text = render_text(collect(StudyStore(handmade.study), storage=handmade.storage))
    assert "fp32 reference: fp32 bs=32 lr×1: 900.0 samples/s (880.0–915.0)" in text
    assert "latest of 3 measurements; range 900.0–1,010.0" in text
    assert "timing noise: 2.0%" in text
    assert (
        "plain AMP recipe: fp16 bs=32 lr×1 init_scale=65536: 900.0 samples/s, 0.90x (0.80–1.00)"
        in text
    )
    best = text.split("best feasible trials:")[1]
    # Feasible and measured only: the infeasible trial and the duplicate are not ranked.
    assert "#1" in best and "1.80x (1.70–1.90)" in best
    assert "#2 " not in best and "#6 " not in best


def test_importances_are_said_to_be_on_the_speedup(handmade: SimpleNamespace) -> None:
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    assert data.objective == "speedup" and data.importances is not None
    assert "computed on the objective: each trial's speedup" in data.importance_note
    html = render_html(data)
    caption = html.split('<section id="importance">')[1].split("</section>")[0]
    assert "speedup over the fp32 reference measured close to it in time" in caption


def test_an_older_study_still_renders_with_dashes_for_intervals(tmp_path: Path) -> None:
    old = build_legacy(tmp_path)
    data = collect(StudyStore(old.study), storage=old.storage)
    html = render_html(data)
    page = parse(html)
    assert page.rows == [0, 1, 2]
    assert data.objective == "throughput"
    # The reference trial is the divisor, measured once; figures without interval show "—".
    assert "reference" in page.row_text[0]
    assert "1.80× (—)" in page.row_text[1]
    ref_row = next(r for r in page.baseline_rows if r.startswith("fp32 reference"))
    assert "1,000.0 (—)" in ref_row
    (throughput,) = page.svgs["throughput"]
    assert throughput["errorbar"] == 0
    assert any("measured once" in n for n in page.notes["reference"])
    assert {"fp32 ceiling 128", "fp16 ceiling 64"} <= set(page.svg_text["throughput"])
    assert "samples/s" in page.svg_text["history"]
    text = render_text(data)
    assert "fp32 reference: fp32 bs=32 lr×1: 1,000.0 samples/s" in text
    assert "1.80x" in text and "timing noise: —" in text
    assert "older autotune" in text


def test_the_spec_device_picks_the_reference(handmade: SimpleNamespace) -> None:
    other = ReferenceRecord(
        batch_size=32,
        learning_rate=0.2,
        losses=CURVE,
        measurements=[MEASUREMENTS[0].model_copy(update={"throughput": 50_000.0})],
    )
    handmade.study.set_user_attr(reference_key("box", "cuda:0"), other.model_dump(mode="json"))
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    assert data.reference_where == "box:cpu" and data.reference_throughput == 900.0
    assert any("box:cuda:0" in n for n in data.notes)
    spec = {**SPEC, "device": "cuda"}
    handmade.study.set_user_attr("spec", spec)
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    assert data.reference_where == "box:cuda:0" and data.reference_throughput == 50_000.0


def test_a_study_without_a_reference_says_so(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'n.db'}"
    study = optuna.create_study(study_name="noref", storage=storage, direction="maximize")
    study.add_trial(
        _trial(TrialState.PRUNED, BASE, outcome="oom", reason="out of memory at batch_size=32")
    )
    data = collect(StudyStore(study), storage=storage)
    page = parse(render_html(data))
    assert page.rows == [0]
    assert any("has not been measured" in n for n in page.notes["summary"])
    assert page.notes["reference"]
    assert "fp32 reference: not run" in render_text(data)


def test_a_study_with_too_few_trials_explains_what_is_missing(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'e.db'}"
    study = optuna.create_study(study_name="empty", storage=storage, direction="maximize")
    page = parse(render_html(collect(StudyStore(study), storage=storage)))
    assert page.rows == []
    for section in PLOTS:
        assert not page.svgs.get(section) and page.notes.get(section), section
    assert any("needs at least 2 completed trials" in n for n in page.notes["importance"])
    text = render_text(collect(StudyStore(study), storage=storage))
    assert "no winner yet" in text and "fp32 reference: not run" in text


def test_storage_password_is_hidden(handmade: SimpleNamespace) -> None:
    data = collect(StudyStore(handmade.study), storage="postgresql://me:s3cret@db/autotune")
    html = render_html(data)
    assert "s3cret" not in html and "me:***@db" in html


def test_each_ceiling_says_what_limited_it(handmade: SimpleNamespace) -> None:
    """A ceiling is where memory ran out, or where a try ran out of time, or the space's cap;
    a study written before the cause was stored shows a bare ceiling, and none says OOM."""
    handmade.study.set_user_attr(
        ceilings_key("box", "cpu", limits=True), {"fp32": "memory", "fp16": "time", "bf16": "cap"}
    )
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    html_text = render_html(data)
    labels = set(parse(html_text).svg_text["throughput"])
    assert {
        "fp32 ceiling 128 (memory)",
        "fp16 ceiling 64 (time)",
        "bf16 ceiling 64 (cap)",
    } <= labels
    assert "fp16 ceiling 64: a larger batch&#x27;s try would not fit its time limit" in html_text
    assert "bf16 ceiling 64: the space&#x27;s cap, its largest batch size" in html_text
    assert "OOM" not in html_text and "where memory runs out" not in html_text
    text = render_text(data)
    assert "  fp32 ceiling 128: memory runs out above it" in text
    (handmade.tmp / "old").mkdir()
    old = build_legacy(handmade.tmp / "old")
    old_html = render_html(collect(StudyStore(old.study), storage=old.storage))
    assert {"fp32 ceiling 128", "fp16 ceiling 64"} <= set(parse(old_html).svg_text["throughput"])
    assert "did not record what limited it" in old_html and "OOM" not in old_html


def test_a_diverged_fp16_trial_is_on_the_gradscaler_plot(tmp_path: Path) -> None:
    """A probe that diverged before its first check recorded no scale, only its skipped steps:
    it is drawn all the same, from its init_scale, and marked where it stopped."""
    storage = f"sqlite:///{tmp_path / 'd.db'}"
    study = optuna.create_study(study_name="div", storage=storage, direction="maximize")
    study.set_user_attr("spec", SPEC)
    study.add_trial(
        _trial(
            TrialState.PRUNED,
            {**FP16, "init_scale": 256.0},
            outcome="diverged",
            reason="loss=nan at step 3",
            losses=[2.3, 2.2, None],
            skipped_steps=2,
            scales=[],
        )
    )
    page = parse(render_html(collect(StudyStore(study), storage=storage)))
    (scaler,) = page.svgs["scaler"]
    assert scaler["polyline"] == 1 and scaler["path"] >= 1  # its line, and × where it stopped
    html_text = render_html(collect(StudyStore(study), storage=storage))
    assert "trial 0 · init_scale 256 · diverged: loss=nan at step 3" in html_text
    assert (
        "diverged at step 2; the scale there is init_scale halved at each of its 2 skipped"
        in html_text
    )
    assert "diverged: where it stopped" in html_text


def _text_of(html_text: str) -> str:
    """What a reader reads: the page without its tags, tooltips included."""
    titles = " ".join(re.findall(r"<title>(.*?)</title>", html_text))
    return html.unescape(re.sub(r"<[^>]+>", " ", html_text) + " " + titles)


def test_no_sentence_starts_lower_case_after_a_full_stop(handmade: SimpleNamespace) -> None:
    study = handmade.study
    study.add_trial(
        _trial(
            TrialState.PRUNED,
            {**BASE, "precision": "bf16", "batch_size": 128},
            outcome="slower",
            reason="upper bound 1,100 < best 1,700 samples/s after 6 blocks",
            duplicate_of=4,
        )
    )
    out = handmade.tmp / "out"
    out.mkdir()
    cfg = make_config("fp32", batch_size=32, learning_rate=0.2)
    note = (
        "no feasible candidate's speedup reached 1.05x the fp32 reference in the search: "
        "falling back to the fp32 reference, the safe mode"
    )
    ev = cfg.evidence.model_copy(
        update={"throughput": 900.0, "speedup": 1.0, "validated": False, "validation_note": note}
    )
    write_config(out / "best.json", cfg.model_copy(update={"study": "hand", "evidence": ev}))
    text = _text_of(render_html(collect(StudyStore(study), out_dir=out, storage=handmade.storage)))
    assert "Same parameters as trial 4: measurement reused. Upper bound 1,100" in text
    assert "No feasible candidate" in text
    # "e.g." is no full stop.
    assert not re.findall(r"(?<!e\.g)(?<!i\.e)\. [a-z]\w*", text)


def test_the_noise_agrees_with_the_reference_interval(tmp_path: Path) -> None:
    """A reference measured over 3 blocks has no spread (0 by convention): the noise shown is
    its interval's ±3.9%, never 0.0% beside an interval of 30.9–33.4."""
    storage = f"sqlite:///{tmp_path / 'n.db'}"
    study = optuna.create_study(study_name="noise", storage=storage, direction="maximize")
    study.set_user_attr("spec", SPEC)
    short = ReferenceMeasurement(at=T0, throughput=32.1, low=30.9, high=33.4, blocks=3)
    record_ = ReferenceRecord(batch_size=32, learning_rate=0.2, losses=CURVE, measurements=[short])
    study.set_user_attr(reference_key("box", "cpu"), record_.model_dump(mode="json"))
    data = collect(StudyStore(study), storage=storage)
    text = render_text(data)
    assert "fp32 reference: fp32 bs=32 lr×1: 32.1 samples/s (30.9–33.4)" in text
    assert "timing noise: ±3.9% (the fp32 reference's 95% interval" in text
    html_text = render_html(data)
    assert "±3.9% (the fp32 reference&#x27;s 95% interval" in html_text
    assert "0.0%" not in text and "0.0%" not in html_text


def test_a_trial_that_never_ran_is_counted_apart_and_shows_what_was_queued(
    handmade: SimpleNamespace,
) -> None:
    handmade.study.add_trial(
        create_trial(
            state=TrialState.FAIL,
            system_attrs={"fixed_params": FP16},
            user_attrs=TrialRecord(
                role="amp_recipe", outcome="not_run", reason="queued, but the search ended"
            ).to_attrs(),
        )
    )
    data = collect(StudyStore(handmade.study), storage=handmade.storage)
    page = parse(render_html(data))
    row = page.row_text[8]
    assert "not_run" in row and "fp16bs=32lr=" in row.replace(" ", "") and "queued" in row
    assert "1 failed, 1 queued but never run" in render_text(data)
    # Nothing to draw for it: the history has the crashed trial's cross, not a second one.
    crosses = page.svgs["history"][0]["path"]
    handmade.study.add_trial(
        _trial(TrialState.FAIL, {**BASE, "batch_size": 64}, outcome="crashed", reason="died")
    )
    again = parse(render_html(collect(StudyStore(handmade.study), storage=handmade.storage)))
    assert again.svgs["history"][0]["path"] == crosses + 1


# ---- a look at it, as a person would -----------------------------------------------------------


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium package")
def test_report_renders_in_headless_chromium(searched: SimpleNamespace, tmp_path: Path) -> None:
    png = tmp_path / "report.png"
    quiet = [f for f in FLAGS if f != "--remote-debugging-pipe"]  # one screenshot, no session
    subprocess.run(
        [
            "chromium",
            *quiet,
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={png}",
            "--window-size=1400,3000",
            searched.path.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert png.stat().st_size > 20_000
    image = pytest.importorskip("PIL.Image").open(png).convert("L")
    # Not a blank page: the plots and tables put plenty of dark pixels on it.
    dark = sum(image.histogram()[:128])
    assert dark > 0.005 * image.width * image.height, dark


# Measures the laid-out page and writes what it found where --dump-dom shows it.
_MEASURE = """<script>
addEventListener('load', () => {
  const table = document.querySelector('table.trials');
  const reasons = [...table.querySelectorAll('td.reason')].map(c => c.getBoundingClientRect());
  document.body.setAttribute('data-fit', JSON.stringify({
    table: table.scrollWidth, box: table.parentElement.clientWidth, window: innerWidth,
    right: Math.max(...reasons.map(r => r.right)), narrowest: Math.min(...reasons.map(r => r.width)),
  }));
});
</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium package")
def test_the_trials_table_fits_a_1400_pixel_window_with_its_reason_in_view(
    searched: SimpleNamespace, tmp_path: Path
) -> None:
    page = tmp_path / "measured.html"
    page.write_text(searched.html.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1400,3000",
            "--dump-dom",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    fit = json.loads(html.unescape(re.search(r'data-fit="([^"]*)"', dom).group(1)))
    # No sideways scrolling, and every reason inside the window, wide enough to read.
    assert fit["table"] <= fit["box"], fit
    assert fit["right"] <= fit["window"] and fit["narrowest"] >= 180, fit


def test_the_report_shows_what_each_knob_brought_and_what_compiling_cost(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'k.db'}"
    study = optuna.create_study(study_name="knobs", storage=storage, direction="maximize")
    study.set_user_attr("spec", SPEC)
    dists = {
        **DISTS,
        "compile": CategoricalDistribution([False, True]),
        "fp32_islands": CategoricalDistribution(["none", "diagnosed"]),
    }
    eager = {**BASE, "precision": "bf16", "batch_size": 64, "compile": False}
    overflowing = {**FP16, "compile": False}

    def add(state: TrialState, params: dict, value: float | None = None, **fields) -> None:
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params=params,
                distributions={k: dists[k] for k in params},
                user_attrs=TrialRecord(learning_rate=0.4, **fields).to_attrs(),
                system_attrs={"constraints:parity": -0.05} if value is not None else {},
            )
        )

    add(TrialState.COMPLETE, eager, 1.8, outcome="completed", **_interval(1800.0, 1.8))
    add(
        TrialState.COMPLETE,
        {**eager, "compile": True},
        2.7,
        outcome="completed",
        compile_seconds=12.0,
        **_interval(2700.0, 2.7),
    )
    add(TrialState.PRUNED, overflowing, outcome="diverged", reason="loss=nan at step 0")
    add(
        TrialState.COMPLETE,
        {**overflowing, "fp32_islands": "diagnosed"},
        0.6,
        outcome="completed",
        fp32_modules=["amplify"],
        **_interval(600.0, 0.6),
    )
    data = collect(StudyStore(study), storage=storage)
    text = render_text(data)
    # 1.8x → 2.7x at bf16 bs=64; 0.064 s of samples a step at 1,000 samples/s: 12 s of
    # compiling is paid back after 12 / (0.064/1.8 - 0.064/2.7) = 1,013 steps.
    assert (
        "compile: bf16 bs=64 lr×1 compile 2.70x vs 1.80x without (+50%); compiling took 12.0s "
        "(untimed, charged to the budget), paid off after 1,013 steps"
    ) in text
    assert (
        "fp32 islands: fp16 bs=32 lr×1 init_scale=65536 fp32 islands 0.60x; without it: "
        "diverged (loss=nan at step 0)"
    ) in text
    html = render_html(data)
    page = parse(html)
    assert "What each knob brought" in page.headings
    assert "compiling 12.0s, pays off after 1,013 steps" in html
    assert "compile (12.0s)" in html and "fp32: amplify" in html


def test_a_config_at_a_kept_lr_says_so_in_the_report_as_in_the_summary(
    handmade: SimpleNamespace,
) -> None:
    """The rule gives bf16 bs=64 lr 0.05 here: a config validated at 0.025 was kept below it
    (the rule's blew up), and the report says so where it names the lr rule, in the words the
    terminal summary uses."""
    out = handmade.tmp / "out"
    out.mkdir()
    cfg = validated_config()
    write_config(out / "best.json", cfg.model_copy(update={"learning_rate": 0.025}))
    html = render_html(collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage))
    text = html.replace("&#x27;", "'")
    assert "linear scaling with the batch size (the winner's lr 0.025 is kept below the rule's " \
        "0.05, which blew up at this batch)" in text  # fmt: skip
    write_config(out / "best.json", cfg)  # lr 0.4, above the rule's: nothing to say
    html = render_html(collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage))
    assert "is kept below the rule" not in html


def test_a_search_beside_a_busy_neighbour_says_so_in_the_report_as_in_best_json(
    handmade: SimpleNamespace,
) -> None:
    """best.json says other processes kept 1.6 cores busy while the search measured: the report
    and its text say the same figure; below half a core, nothing."""
    out = handmade.tmp / "out"
    out.mkdir()
    cfg = validated_config()
    busy = cfg.evidence.model_copy(update={"others_cores": 1.6})
    write_config(out / "best.json", cfg.model_copy(update={"evidence": busy}))
    data = collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage)
    line = "other processes kept 1.6 cores busy while the search measured"
    assert line in render_html(data) and line in render_text(data)
    quiet = cfg.evidence.model_copy(update={"others_cores": 0.3})
    write_config(out / "best.json", cfg.model_copy(update={"evidence": quiet}))
    data = collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage)
    assert "cores busy" not in render_html(data) and "cores busy" not in render_text(data)


def test_a_fallback_says_why_in_the_text_report_as_in_best_json(handmade: SimpleNamespace) -> None:
    """A config that fell back carries its reason in best.json; `autotune report --text` says
    it fell back and why, in the same words."""
    out = handmade.tmp / "out"
    out.mkdir()
    cfg = validated_config()
    why = "no candidate's validated lower bound cleared 1.05x (bf16 bs=64 lr×1: 4 pairs)"
    fell = cfg.evidence.model_copy(update={"validated": False, "validation_note": why})
    write_config(out / "best.json", cfg.model_copy(update={"evidence": fell}))
    text = render_text(collect(StudyStore(handmade.study), out_dir=out, storage=handmade.storage))
    assert "NOT validated: fp32 fallback" in text and f"why: {why}" in text


def test_a_validated_configs_parity_names_the_samples_it_was_read_at(
    searched: SimpleNamespace, cli: CliRunner
) -> None:
    """Parity holds for the horizon it was measured over, not for any run: best.json keeps the
    samples seen at which validation read the winner's gap (where the shorter of the two
    curves ends: whole steps of the candidate's batch or of the reference's), and the
    summary's note, the page and the text report say so."""
    cfg = searched.result.config
    ev = cfg.evidence
    assert ev.validated, ev.validation_note
    seen = ev.parity_samples
    assert seen and ev.base_batch_size
    assert seen % cfg.batch_size == 0 or seen % ev.base_batch_size == 0
    phrase = f"over {seen:,} samples seen"
    assert phrase in ev.validation_note
    assert phrase in searched.html
    res = cli.invoke(app, ["report", "tiny", "--storage", searched.spec.storage, "--text"])
    assert res.exit_code == 0, res.output
    assert f"loss parity {ev.parity_gap:+.1%} {phrase}" in res.output
