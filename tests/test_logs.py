"""Logging: the library configures nothing on import; JSON logs are one object per line, on
stderr and in the study's search.log, whatever a message or a third-party library writes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli import run_tiny_search
from loguru import logger

from autotune.infra.logs import json_from_env, log_to_file, reset_logging, setup_logging

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """What the CLI's log set-up writes to stderr; every logger is put back afterwards."""
    yield capsys
    reset_logging()


def test_importing_autotune_configures_no_logging() -> None:
    """An application that imports autotune keeps its own loguru and stdlib logging set-up."""
    code = (
        "import logging\n"
        "from loguru import logger\n"
        "before = (sorted(logger._core.handlers), logging.getLogger().handlers[:])\n"
        "import autotune, autotune.search, autotune.infra.logs, autotune.report.progress\n"
        "import autotune.report, autotune.cli\n"
        "after = (sorted(logger._core.handlers), logging.getLogger().handlers[:])\n"
        "assert before == after, (before, after)\n"
        "print('untouched', before[0])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "untouched [0]"  # loguru's own default stderr handler only


def test_json_lines_parse_whatever_the_message_holds(
    stderr: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    setup_logging("DEBUG", json_lines=True)
    file_handler = log_to_file(tmp_path / "search.log", json_lines=True)
    logger.info("trial {}: fp16 bs=512 → diverged: loss=inf at step {}", 3, 14)
    logger.bind(event="progress", gap=float("nan"), best=float("inf")).info("{{}} and {}", 1)
    logger.warning("two\nlines")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("a bug")
    logging.getLogger("optuna.storages").warning("from the standard library")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("heads up", UserWarning, stacklevel=1)
    logger.remove(file_handler)
    lines = stderr.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["message"] for r in records[:3]] == [
        "trial 3: fp16 bs=512 → diverged: loss=inf at step 14",
        "{} and 1",
        "two\nlines",
    ]
    assert {"time", "level", "message", "logger", "function", "line"} <= set(records[0])
    assert records[1]["event"] == "progress"
    assert (records[1]["gap"], records[1]["best"]) == ("nan", "inf")
    assert records[3]["level"] == "ERROR" and "ValueError: boom" in records[3]["exception"]
    assert records[4]["logger"] == "optuna.storages" and records[4]["level"] == "WARNING"
    assert "heads up" in records[5]["message"]
    assert len(records) == 6
    file_lines = (tmp_path / "search.log").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["message"] for line in file_lines] == [r["message"] for r in records]


def test_human_logs_are_one_readable_line_each(
    stderr: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    setup_logging("INFO")
    file_handler = log_to_file(tmp_path / "search.log")
    logger.debug("only in the file")
    logger.info("ceiling {} bs={} → {}", "fp32", 128, "fits")
    logger.remove(file_handler)
    (line,) = stderr.readouterr().err.splitlines()
    assert line.endswith(" | INFO    | ceiling fp32 bs=128 → fits")
    text = (tmp_path / "search.log").read_text(encoding="utf-8")
    assert "| DEBUG   | tests.test_logs:" in text or "| DEBUG   | test_logs:" in text
    assert "ceiling fp32 bs=128 → fits" in text


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("YES", True), ("0", False), ("", False), ("no", False)],
)
def test_json_from_env(value: str, expected: bool) -> None:
    assert json_from_env({"AUTOTUNE_LOG_JSON": value}) is expected


def test_search_with_json_logs_writes_only_json_to_stderr_and_the_log(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    proc = run_tiny_search(tmp_path, out_dir, env={**os.environ, "AUTOTUNE_LOG_JSON": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records, "no log lines on stderr"
    events = {r.get("event") for r in records}
    assert {"modes", "phase", "config"} <= events
    assert any(
        r["message"].startswith("study 'tiny.sim-cpu-tiny_convnet': workload") for r in records
    )
    phases = [r["phase"] for r in records if r.get("event") == "phase"]
    assert "search" in phases and "validation" in phases
    in_file = [json.loads(line) for line in (out_dir / "search.log").read_text().splitlines()]
    # The file has everything stderr has, and the DEBUG lines too.
    assert {r["message"] for r in records} <= {r["message"] for r in in_file}
    assert "\x1b" not in proc.stdout + proc.stderr
