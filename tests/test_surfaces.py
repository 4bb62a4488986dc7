"""One story in the numbers: two finished studies (one validated, one fallen back to fp32 on a
machine whose other processes kept 1.6 cores busy), made once by `autotune search` on the
simulated device, and read by every surface a person sees: best.json, the summary the search
printed, report.html (the search's and `autotune report --out`'s), `autotune report --text`,
`autotune status` (one study and the list), the service's page, optuna-dashboard, and
`autotune.tune()`'s closing lines and return value. Each shows the record's speedup with its
interval, its timing noise, why it fell back and the others' load, and no other figure for
them. The record is the config the study stores (best.json is written from it)."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pytest
from _sim import landscape
from typer.testing import CliRunner

import autotune
import autotune.search
from autotune.cli import app
from autotune.cli._app import console
from autotune.execution.contention import CpuContention
from autotune.report import ratio_text
from autotune.schema.config import TunedConfig
from autotune.study.store import StudyStore

# What other processes kept busy while the fallen-back study searched (the simulated device's
# clock is virtual, so the machine's real load is not measured: the figure is set).
OTHERS = 1.6
FLAT = {b: 6000.0 for b in (16, 64, 256, 1024)}
HALF = {b: 3000.0 for b in (16, 64, 256, 1024)}
# Each study: its landscape's changes and its budget. "validated": large batches well within
# parity; "fallback": nothing is faster than fp32 (as tests/test_trials.py's searches).
STUDIES: dict[str, tuple[dict[str, Any], str, float | None]] = {
    "validated": ({"parity.gap_per_batch_ratio": 0.001}, "90s", None),
    "fallback": (
        {
            "modes.fp32.throughput": FLAT,
            "modes.fp16.throughput": HALF,
            "modes.bf16.throughput": HALF,
        },
        "45s",
        OTHERS,
    ),
}
KINDS = list(STUDIES)


@dataclass
class Finished:
    """A study `autotune search` finished, and what it printed."""

    name: str
    storage: str
    out: Path
    summary: str
    # The search's result and its events, as run_search handed them to the command.
    result: Any = None
    events: list[Any] = field(default_factory=list)

    @property
    def record(self) -> TunedConfig:
        """The config the study stores: the one record every surface reads."""
        cfg = StudyStore(optuna.load_study(study_name=self.name, storage=self.storage)).config()
        assert cfg is not None
        return cfg


def cli(*args: str) -> str:
    """An `autotune` command run as a user runs it, its output; the console wide enough that no
    line wraps (the figures are compared, not the layout)."""
    width = console.width
    console.width = 1000
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        console.width = width
    assert result.exit_code == 0, result.output
    return result.output


def _search(tmp: Path, kind: str, storage: str) -> Finished:
    changes, budget, others = STUDIES[kind]
    land = landscape(**changes)
    land_file, spec_file = tmp / f"{kind}.landscape.json", tmp / f"{kind}.yaml"
    land_file.write_text(land.model_dump_json())
    spec_file.write_text(f"name: {kind}\nworkload: {land.workload}\nbudget: {budget}\n")
    real = autotune.search.run_search
    seen: dict[str, Any] = {"events": []}

    def recorded(spec: Any, *, on_event: Callable[[Any], None], **kw: Any) -> Any:
        def both(event: Any) -> None:
            seen["events"].append(event)
            on_event(event)

        seen["result"] = real(spec, on_event=both, **kw)
        return seen["result"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune.search, "run_search", recorded)
        if others is not None:
            mp.setattr(CpuContention, "others_cores", lambda self: others)
        out = tmp / kind
        printed = cli(
            "search", str(spec_file), "--simulate", str(land_file), "--storage", storage,
            "--out", str(out),
        )  # fmt: skip
    return Finished(
        name=f"{kind}.sim-{land.name}",
        storage=storage,
        out=out,
        summary=printed,
        result=seen["result"],
        events=seen["events"],
    )


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Finished]:
    """The two studies, searched once per session into one storage."""
    tmp = tmp_path_factory.mktemp("surfaces")
    storage = f"sqlite:///{tmp / 'studies.db'}"
    studies = {kind: _search(tmp, kind, storage) for kind in KINDS}
    assert studies["validated"].record.evidence.validated
    assert not studies["fallback"].record.evidence.validated
    return studies


def flat(text: str) -> str:
    """Text with its whitespace runs made single spaces (HTML and wrapped lines alike)."""
    return " ".join(text.split())


def plain(page: str) -> str:
    """What a reader sees of an HTML page: its text, without scripts and styles."""
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return flat(html.unescape(re.sub(r"<[^>]+>", " ", page)))


def tells_the_story(
    text: str, cfg: TunedConfig, *, x: str = "x", why: bool = True, how: bool = False
) -> None:
    """``text`` shows the record's speedup with its interval (``x``: the sign after the
    number), its timing noise, why it fell back (``why``: where the surface says it) and the
    others' load; a validated config on a quiet machine claims neither of the last two, and
    says how it was validated (``how``: where the surface gives the details)."""
    ev = cfg.evidence
    text = flat(text)
    assert ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high, x=x) in text
    assert f"{ev.noise:.1%}" in text
    assert ev.validation_note
    if ev.validated:
        assert "fp32 fallback" not in text and "fell back" not in text
        assert "cores busy" not in text
        # How it was validated: its pairs and its parity bar, in the summary's words.
        assert not how or ev.validation_note.lower() in text.lower()
        return
    if why:
        # HTML writes it as a sentence: a capital first letter and a full stop.
        assert ev.validation_note.lower() in text.lower()
    assert f"kept {OTHERS:.1f} " in text and "cores busy" in text


def line_with(text: str, needle: str) -> str:
    """The one line of ``text`` that holds ``needle``."""
    (line,) = [line for line in text.splitlines() if needle in line]
    return line


# ---- the record, and the files the search wrote ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_best_json_is_the_record(finished: dict[str, Finished], kind: str) -> None:
    study = finished[kind]
    written = TunedConfig.model_validate_json((study.out / "best.json").read_text())
    assert written.model_dump(mode="json") == study.record.model_dump(mode="json")
    ev = written.evidence
    assert ev.noise and ev.others_cores == (OTHERS if kind == "fallback" else None)
    if ev.validated:
        assert ev.speedup_low is not None and ev.speedup_low < ev.speedup < ev.speedup_high
    else:
        assert ev.speedup == 1.0 and ev.speedup_low is None  # the reference: no ratio measured


@pytest.mark.parametrize("kind", KINDS)
def test_the_summary_the_search_printed(finished: dict[str, Finished], kind: str) -> None:
    study, cfg = finished[kind], finished[kind].record
    tells_the_story(study.summary, cfg, how=True)
    ev = cfg.evidence
    winner = line_with(study.summary, "winner   ")  # the table's row, not the note's words
    assert ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high) in winner
    assert ("validated over" if ev.validated else "NOT validated: fp32 fallback") in winner
    assert f"timing noise: {ev.noise:.1%}" in study.summary


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("made_by", ["search", "report"])
def test_report_html(
    finished: dict[str, Finished], kind: str, made_by: str, tmp_path: Path
) -> None:
    """The report the search wrote beside best.json, and `autotune report NAME --storage URL
    --out DIR` into a folder without a best.json (it reads the study's record)."""
    study = finished[kind]
    path = study.out / "report.html"
    if made_by == "report":
        cli("report", study.name, "--storage", study.storage, "--out", str(tmp_path))
        path = tmp_path / "report.html"
    text = plain(path.read_text())
    tells_the_story(text, study.record, x="×", how=True)
    assert f"timing noise of this device {study.record.evidence.noise:.1%}" in text


@pytest.mark.parametrize("kind", KINDS)
def test_report_text(finished: dict[str, Finished], kind: str, tmp_path: Path) -> None:
    study = finished[kind]
    text = cli("report", study.name, "--storage", study.storage, "--out", str(tmp_path), "--text")
    tells_the_story(text, study.record, how=True)
    ev = study.record.evidence
    assert ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high) in line_with(text, "winner:")
    if not ev.validated:
        assert line_with(text, "why:").strip() == f"why: {ev.validation_note}"


@pytest.mark.parametrize("kind", KINDS)
def test_trial_counts_agree_and_count_reused_measurements_apart(
    finished: dict[str, Finished], kind: str, tmp_path: Path
) -> None:
    """The search's trials as the summary, `autotune report --text` and the config count them:
    a trial whose parameters an earlier one had reused that one's measurement and measured
    nothing. Counted in with the measured ones (by their twin's state), `make search`'s summary
    said "21 complete, 28 pruned" where its progress line had said 3 complete, 22 pruned and
    24 reused."""
    study = finished[kind]
    trials = StudyStore(optuna.load_study(study_name=study.name, storage=study.storage)).trials()
    copies = [t for t in trials if t.user_attrs.get("duplicate_of") is not None]
    assert copies or kind == "fallback"  # the validated search's sampler proposed repeats
    crowned = {t.number for t in trials if t.user_attrs.get("tuned_config")}
    measured = [t for t in trials if t not in copies and t.number not in crowned]
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in measured)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in measured)
    counts = f"{len(copies)} reused an earlier trial's measurement"
    report = cli("report", study.name, "--storage", study.storage, "--out", str(tmp_path), "--text")
    for text in (flat(study.summary), report):
        line = line_with(text, "trials: ")
        assert f"trials: {complete} complete" in line and f", {pruned} pruned" in line, line
        assert (counts in line) == bool(copies) and ("reused" in line) == bool(copies), line
    t = study.record.evidence.trials
    assert (t.complete, t.pruned) == (complete, pruned)


# ---- the service: `autotune status` and the page ------------------------------------------


@pytest.fixture(scope="session")
def service(finished: dict[str, Finished], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A service over the studies' storage (never started: nothing runs), where both studies
    ran and are done."""
    pytest.importorskip("fastapi")
    from autotune.schema.enums import StudyState
    from autotune.service import TuningService

    storage = next(iter(finished.values())).storage
    service = TuningService(storage, ["cpu"], out_dir=tmp_path_factory.mktemp("service"))
    for study in finished.values():
        spec = {"name": study.name, "workload": "autotune.workloads:resnet18", "budget": "90s"}
        service.queue.submit(study.name, spec, 0)
        service.queue.take_next("cpu", lambda row, name=study.name: row.name == name)
        service.queue.finish(study.name, StudyState.DONE)
    return service


@pytest.fixture
def status(service: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """`autotune status [NAME]`, its client talking to the service's app in this process."""
    from fastapi.testclient import TestClient

    from autotune.cli import _service as cli_service
    from autotune.service import ServiceClient, create_app

    app_ = create_app(service, loopback_only=True)

    def client(server: str, token: str | None) -> ServiceClient:
        made = ServiceClient(server, token)
        made._http.close()
        made._http = TestClient(app_, base_url=server)
        return made

    monkeypatch.setattr(cli_service, "_client", client)
    return lambda *args: cli("status", *args)


@pytest.mark.parametrize("kind", KINDS)
def test_status_of_one_study(finished: dict[str, Finished], kind: str, status: Any) -> None:
    study, cfg = finished[kind], finished[kind].record
    text = status(study.name)
    tells_the_story(text, cfg)
    ev = cfg.evidence
    config = line_with(text, "config:")
    assert f"config: {cfg.precision} bs={cfg.batch_size}" in config
    assert ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high) in config
    assert "best so far" not in text
    # The search's trials as the summary and the report count them (not the config's own).
    t = ev.trials
    assert f"trials: {t.complete} complete {t.pruned} pruned" in text


@pytest.mark.parametrize("kind", KINDS)
def test_status_of_every_study(finished: dict[str, Finished], kind: str, status: Any) -> None:
    study = finished[kind]
    row = line_with(status(), study.name)
    tells_the_story(row, study.record)
    assert ("(validated)" if kind == "validated" else "(fp32 fallback)") in row


def test_status_says_a_cpu_is_busy_while_others_take_its_cores(
    service: Any, status: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes keeping the CPU's cores busy make it busy, as others' memory makes a
    GPU busy: the service waits, and `autotune status` says why."""
    monitor = service.monitor
    monkeypatch.setattr(monitor, "busy_cores", 1.0)
    monkeypatch.setattr(monitor._meter, "read", lambda own: 1.7)
    monkeypatch.setattr(monitor._meter, "seconds", 2.0)
    monkeypatch.setattr(monitor, "_cache", {})
    text = flat(status())
    assert "other processes kept 1.7 of" in text and "cores busy over the last 2s" in text
    assert "waiting, so probes are timed on a quiet CPU" in text
    assert "1.7 kept busy by others" in text


@pytest.mark.parametrize("kind", KINDS)
def test_the_service_page(finished: dict[str, Finished], kind: str, service: Any) -> None:
    from fastapi.testclient import TestClient

    from autotune.service import create_app

    study = finished[kind]
    with TestClient(create_app(service, loopback_only=True), base_url="http://127.0.0.1") as http:
        page = http.get("/").text
    row = re.search(rf'<tr data-study="{re.escape(study.name)}">.*?</tr>', page, flags=re.S)
    assert row is not None
    text = plain(row.group(0))
    tells_the_story(text, study.record)
    verdict = "validated" if kind == "validated" else "not validated: fp32 fallback"
    assert f"the fp32 reference, {verdict}" in text


# ---- optuna-dashboard and tune() ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_optuna_dashboard(finished: dict[str, Finished], kind: str) -> None:
    """The dashboard's best trial is the config with its validated figure and interval, its
    reason why it fell back; the study's stored config (noise, others' load) is best.json."""
    dashboard = pytest.importorskip("optuna_dashboard")
    import httpx

    study, cfg = finished[kind], finished[kind].record
    ev = cfg.evidence
    transport = httpx.WSGITransport(app=dashboard.wsgi(study.storage))
    with httpx.Client(transport=transport, base_url="http://dashboard") as http:
        summaries = http.get("/api/studies").json()["study_summaries"]
        (sid,) = [s["study_id"] for s in summaries if s["study_name"] == study.name]
        detail = http.get(f"/api/studies/{sid}").json()
    (best,) = detail["best_trials"]
    assert best["values"] == [ev.speedup]
    attrs = {a["key"]: a["value"] for a in best["user_attrs"]}
    assert attrs["tuned_config"] == "True" and attrs["reason"] == ev.validation_note
    for bound in ("speedup_low", "speedup_high"):
        shown = attrs.get(bound)
        assert (float(shown) if shown is not None else None) == getattr(ev, bound)
    study_attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
    stored = TunedConfig.model_validate_json(study_attrs["tuned_config"])
    assert stored.model_dump(mode="json") == cfg.model_dump(mode="json")


@pytest.mark.parametrize("kind", KINDS)
def test_tune_says_and_returns_the_record(
    finished: dict[str, Finished],
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tune() is a front over the same search: the finished study's search (its events and its
    result, replayed) ends in tune()'s closing lines and return value."""
    study, cfg = finished[kind], finished[kind].record

    def replay(spec: Any, *, on_event: Callable[[Any], None], **kw: Any) -> Any:
        for event in study.events:
            on_event(event)
        return study.result

    monkeypatch.setattr(autotune.search, "run_search", replay)
    returned = autotune.tune(
        workload="autotune.workloads:resnet18",
        name=study.name,
        storage=study.storage,
        out=tmp_path,
        device="cpu",
        progress=False,
    )
    assert returned.model_dump(mode="json") == cfg.model_dump(mode="json")
    printed = capsys.readouterr().out
    tells_the_story(printed, cfg)
    closing = printed.strip().splitlines()[-1]
    ev = cfg.evidence
    assert closing.startswith("done: ") and f"config {cfg.precision} bs={cfg.batch_size}" in closing
    if ev.validated:
        assert ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high) in closing
    else:
        assert ev.validation_note in closing
        assert closing.count("back to the fp32 reference") == 1  # said once
