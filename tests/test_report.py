"""The study report: HTML structure (every trial, every plot, nothing external), the text
summary, the CLI command and its errors; a headless-Chromium look where Chromium exists."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import StorageError
from autotune.logs import reset_logging
from autotune.report import collect, load_study, render_html, render_text, write_report
from autotune.search import run_search
from autotune.spec import Candidate, ProbeSettings, load_spec
from autotune.worker import InProcessRunner

STUDIES = Path(__file__).resolve().parent.parent / "studies"
PLOTS = ("throughput", "parity", "scaler", "history", "importance")


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
            self._svg = {"circle": 0, "polyline": 0, "path": 0, "rect": 0, "line": 0}
            self.svgs.setdefault(self._section or "", []).append(self._svg)
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
    """One finished test-sized study (a real search, in-process), and its report."""
    tmp = tmp_path_factory.mktemp("report")
    spec = load_spec(STUDIES / "tiny.yaml").with_overrides(
        {
            "storage": f"sqlite:///{tmp / 's.db'}",
            "device": "cpu",
            "budget": "8s",
            # Shorter probes and a smaller ladder: more trials in the same seconds.
            "probe.steps": 6,
            "space.batch_size.max": 64,
        }
    )
    runner = InProcessRunner("cpu")
    # Pay torch's first-use costs before the clock starts, as a long-lived worker already has:
    # on a busy CPU the first step of a mode can take seconds, a whole 8 s budget.
    for mode in ("fp32", "fp16", "bf16"):
        runner.run(
            spec.workload,
            Candidate(precision=mode, batch_size=32, learning_rate=0.1),
            ProbeSettings(warmup_steps=0, steps=1, check_every=1, time_limit="20s"),
        )
    for _ in range(3):
        result = run_search(spec, out_dir=tmp / "out", runner=runner)
        done = [t for t in result.study.trials if t.state.is_finished()]
        if len(done) >= 3 and result.baselines["reference"].get("state") == "COMPLETE":
            break
        # Still too busy to finish the baselines: run the same command again, as a user would;
        # the study resumes where it stopped.
    path = write_report(result.study, storage=spec.storage, out_dir=tmp / "out")
    html = path.read_text(encoding="utf-8")
    return SimpleNamespace(spec=spec, result=result, path=path, html=html, page=parse(html))


def test_report_is_written_beside_best_json(searched: SimpleNamespace) -> None:
    assert searched.path == searched.result.path.parent / "report.html"
    assert searched.page.headings[0] == "autotune report · tiny"


def test_every_trial_has_exactly_one_row(searched: SimpleNamespace) -> None:
    numbers = [t.number for t in searched.result.study.trials]
    assert numbers, "the search ran no trial: the fixture's budget is too short"
    assert searched.page.rows == sorted(numbers)
    for t in searched.result.study.trials:
        text = searched.page.row_text[t.number]
        assert t.state.name.lower() in text
        if t.params:
            assert t.params["precision"] in text


def test_every_plot_section_is_there_and_drawn(searched: SimpleNamespace) -> None:
    page, study = searched.page, searched.result.study
    for heading in (
        "Summary",
        "Throughput by batch size",
        "Loss parity: winner against the fp32 reference",
        "GradScaler scale (fp16 trials)",
        "Optimization history",
        "Parameter importances",
    ):
        assert heading in page.headings
    assert any(h.startswith("Every trial") for h in page.headings)
    # Each plot section holds a chart or a note that says why there is none.
    for section in PLOTS:
        assert page.svgs.get(section) or page.notes.get(section), section
    ref = next(t for t in study.trials if t.user_attrs.get("role") == "reference")
    assert ref.state == TrialState.COMPLETE
    measured = [
        t
        for t in study.trials
        if t.state == TrialState.COMPLETE
        and t.user_attrs.get("duplicate_of") is None
        and t.user_attrs.get("throughput")
    ]
    # One point per measured trial; every ceiling marked and labelled.
    (throughput,) = page.svgs["throughput"]
    assert throughput["circle"] == len(measured)
    for mode, size in searched.result.ceilings.items():
        if size > 0:
            assert f"{mode} ceiling {size}" in page.svg_text["throughput"]
    # The reference's loss curve, on a samples-seen axis.
    (parity,) = page.svgs["parity"]
    assert parity["polyline"] + parity["circle"] >= 1
    assert "samples seen" in page.svg_text["parity"]
    # The optimization history has a point per completed trial and the best-so-far line.
    (history,) = page.svgs["history"]
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert history["circle"] >= len(done)
    assert history["polyline"] >= 1
    fp16 = [t for t in measured if t.params["precision"] == "fp16" and t.user_attrs["scales"]]
    if fp16:
        # A line per fp16 trial with two or more check points, a dot at every check point.
        (scaler,) = page.svgs["scaler"]
        assert scaler["polyline"] == sum(len(t.user_attrs["scales"]) > 1 for t in fp16)
        assert scaler["circle"] >= sum(len(t.user_attrs["scales"]) for t in fp16)


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
    data = collect(searched.result.study, out_dir=searched.path.parent)
    text = render_text(data)
    cfg = searched.result.config
    assert text.startswith("study 'tiny':")
    assert f"winner: {cfg.precision} bs={cfg.batch_size}" in text
    assert "fp32 reference: fp32 bs=32" in text
    complete = sum(t.state == TrialState.COMPLETE for t in searched.result.study.trials)
    assert f"trials: {complete} complete" in text


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


def _trial(state: TrialState, params: dict, value: float | None = None, **attrs) -> object:
    dists = {k: DISTS[k] for k in params}
    constraints = attrs.pop("constraints", None)
    return create_trial(
        state=state,
        value=value,
        params=params,
        distributions=dists,
        user_attrs=attrs,
        constraints=constraints,
    )


def build_handmade(tmp_path: Path) -> SimpleNamespace:
    """A study with one trial of each outcome a search can write, and no best.json."""
    storage = f"sqlite:///{tmp_path / 'h.db'}"
    study = optuna.create_study(study_name="hand", storage=storage, direction="maximize")
    study.set_user_attr(
        "spec",
        {
            "workload": "autotune.workloads:tiny_convnet",
            "device": "cpu",
            "budget": "1m",
            "parity_tolerance": 0.05,
            "space": {"precisions": ["fp32", "fp16", "bf16"]},
        },
    )
    study.set_user_attr("ceilings:cpu", {"fp32": 128, "fp16": 64, "bf16": 64})
    base = {"precision": "fp32", "batch_size": 32, "lr_multiplier": 1.0}
    fp16 = {**base, "precision": "fp16", "init_scale": 65536.0}
    curve = [2.3 - 0.05 * i for i in range(12)]
    ok = {"parity": 0.0}
    trials = [
        _trial(
            TrialState.COMPLETE,
            base,
            1000.0,
            role="reference",
            outcome="completed",
            throughput=1000.0,
            losses=curve,
            scales=[],
            learning_rate=0.2,
            constraints=ok,
        ),
        _trial(
            TrialState.COMPLETE,
            fp16,
            900.0,
            role="amp_recipe",
            outcome="completed",
            throughput=900.0,
            losses=curve,
            learning_rate=0.2,
            constraints=ok,
            scales=[[1, 65536.0], [5, 32768.0], [11, 16384.0]],
        ),
        _trial(
            TrialState.COMPLETE,
            {**base, "precision": "bf16", "batch_size": 64},
            1800.0,
            outcome="completed",
            throughput=1800.0,
            losses=curve[:6],
            learning_rate=0.4,
            parity_gap=0.01,
            constraints=ok,
        ),
        _trial(
            TrialState.COMPLETE,
            {**base, "precision": "bf16", "lr_multiplier": 2.0},
            # Infeasible: told the worst value (trials.objective_value), as the search does.
            float("-inf"),
            outcome="infeasible",
            throughput=1500.0,
            losses=[2.3] * 12,
            learning_rate=0.4,
            parity_gap=0.12,
            constraints={"parity": 0.07},
            reason="parity: loss 2.3 is +12.0% vs the fp32 reference's 2.05 (tolerance 5%)",
        ),
        _trial(
            TrialState.PRUNED,
            {**fp16, "init_scale": 256.0, "batch_size": 64},
            outcome="diverged",
            reason="loss=inf at step 14, scale=0.5",
            losses=[2.3, None, None],
            scales=[[1, 256.0], [5, 1.0], [11, 0.5]],
        ),
        _trial(
            TrialState.PRUNED,
            {**base, "batch_size": 128},
            outcome="oom",
            reason="out of memory at batch_size=128",
        ),
        _trial(
            TrialState.FAIL,
            {**base, "precision": "bf16"},
            outcome="crashed",
            reason="worker process died (exit code -9) during the probe",
        ),
        _trial(
            TrialState.COMPLETE,
            {**base, "precision": "bf16", "batch_size": 64},
            1800.0,
            outcome="completed",
            throughput=1800.0,
            losses=curve[:6],
            learning_rate=0.4,
            duplicate_of=2,
            constraints=ok,
        ),
        _trial(TrialState.WAITING, {}),
    ]
    for t in trials:
        study.add_trial(t)
    return SimpleNamespace(study=study, storage=storage, tmp=tmp_path)


@pytest.fixture
def handmade(tmp_path: Path) -> SimpleNamespace:
    return build_handmade(tmp_path)


def test_every_outcome_renders_with_its_reason(handmade: SimpleNamespace) -> None:
    data = collect(handmade.study, out_dir=handmade.tmp / "out", storage=handmade.storage)
    page = parse(render_html(data))
    assert page.rows == list(range(9))
    assert "diverged" in page.row_text[4] and "loss=inf at step 14" in page.row_text[4]
    assert "oom" in page.row_text[5] and "pruned" in page.row_text[5]
    assert "crashed" in page.row_text[6] and "fail" in page.row_text[6]
    assert "infeasible" in page.row_text[3] and "+12.0%" in page.row_text[3]
    # The history draws the infeasible trial at the throughput it measured, not at -inf.
    assert "1,500.0, infeasible (parity)" in render_html(data)
    assert "same parameters as trial 2" in page.row_text[7]
    assert "waiting" in page.row_text[8]
    # No best.json: the summary says so, and the winner is the best feasible trial.
    assert any("No best.json" in n for n in page.notes["summary"])
    assert data.winner is not None and data.winner.number == 2
    # Both fp16 runs are drawn; the diverged one falls to the "scale < 1" line.
    (scaler,) = page.svgs["scaler"]
    assert scaler["polyline"] == 2
    assert "scale < 1: diverging" in page.svg_text["scaler"]
    # The winner (bs 64) and the reference (bs 32) share the samples-seen axis.
    (parity,) = page.svgs["parity"]
    assert parity["polyline"] >= 2
    assert "parity window" in page.svg_text["parity"]
    # Pruned and failed trials are marked on the throughput chart, with each ceiling.
    assert page.svgs["throughput"][0]["path"] >= 3
    assert {"fp32 ceiling 128", "fp16 ceiling 64", "bf16 ceiling 64"} <= set(
        page.svg_text["throughput"]
    )


def test_a_study_with_too_few_trials_explains_what_is_missing(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'e.db'}"
    study = optuna.create_study(study_name="empty", storage=storage, direction="maximize")
    page = parse(render_html(collect(study, storage=storage)))
    assert page.rows == []
    for section in PLOTS:
        assert not page.svgs.get(section) and page.notes.get(section), section
    assert any("needs at least 2 completed trials" in n for n in page.notes["importance"])
    text = render_text(collect(study, storage=storage))
    assert "no winner yet" in text and "fp32 reference: not run" in text


def test_storage_password_is_hidden(handmade: SimpleNamespace) -> None:
    data = collect(handmade.study, storage="postgresql://me:s3cret@db/autotune")
    html = render_html(data)
    assert "s3cret" not in html and "me:***@db" in html


# ---- a look at it, as a person would -----------------------------------------------------------


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium package")
def test_report_renders_in_headless_chromium(searched: SimpleNamespace, tmp_path: Path) -> None:
    png = tmp_path / "report.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
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
