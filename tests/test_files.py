"""What autotune writes is its owner's only on a shared box: the study database, best.json,
report.html and the logs are 0600, the folders it creates 0700, unless AUTOTUNE_UMASK says
otherwise. Each test runs under a shell's usual umask (022), which would give 0644."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from _configs import make_config
from loguru import logger
from typer.testing import CliRunner

from autotune.cli import app
from autotune.infra.logs import log_to_file
from autotune.service import StudyQueue
from autotune.study.storage import open_storage


def modes(root: Path) -> dict[str, str]:
    """Every path under ``root`` (relative) and its permission bits, e.g. ``'600'``."""
    return {
        str(p.relative_to(root)): format(p.stat().st_mode & 0o777, "o")
        for p in sorted(root.rglob("*"))
    }


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture(autouse=True)
def shell_umask(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("AUTOTUNE_UMASK", raising=False)
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_new_study_database_and_its_folders_are_the_owners_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'studies' / 'team' / 'autotune.db'}"
    open_storage(url)
    StudyQueue(url).submit("tiny", {"name": "tiny"}, 0)  # written, in WAL mode: journals too
    found = modes(tmp_path)
    assert found.pop("studies") == "700" and found.pop("studies/team") == "700"
    assert found.pop("studies/team/autotune.db") == "600"
    assert all(mode == "600" for mode in found.values()), found  # -wal, -shm


def test_best_json_and_the_search_log_are_the_owners_only(tmp_path: Path) -> None:
    out = tmp_path / "studies" / "tiny"
    make_config("fp32").save(out / "best.json")
    handler = log_to_file(out / "search.log")
    logger.info("a line")
    logger.remove(handler)
    assert modes(tmp_path) == {
        "studies": "700",
        "studies/tiny": "700",
        "studies/tiny/best.json": "600",
        "studies/tiny/search.log": "600",
    }


def _study(tmp_path: Path) -> str:
    storage = f"sqlite:///{tmp_path / 'hand.db'}"
    study = optuna.create_study(study_name="hand", storage=storage, direction="maximize")
    study.set_user_attr("spec", {"name": "hand", "workload": "tiny_mlp"})
    return storage


def test_autotune_report_writes_an_owner_only_page_and_restores_the_umask(
    tmp_path: Path,
) -> None:
    storage = _study(tmp_path)
    result = CliRunner().invoke(
        app, ["report", "hand", "--storage", storage, "--out", str(tmp_path / "out" / "hand")]
    )
    assert result.exit_code == 0, result.output
    assert modes(tmp_path / "out") == {"hand": "700", "hand/report.html": "600"}
    assert current_umask() == 0o022  # the command's umask ends with it


@pytest.mark.parametrize(
    ("umask", "file", "folder"), [("022", "644", "755"), ("027", "640", "750")]
)
def test_autotune_umask_shares_the_outputs_when_the_operator_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask: str, file: str, folder: str
) -> None:
    monkeypatch.setenv("AUTOTUNE_UMASK", umask)
    make_config("fp32").save(tmp_path / "out" / "best.json")
    open_storage(f"sqlite:///{tmp_path / 'db' / 's.db'}")
    assert modes(tmp_path) == {
        "db": folder,
        "db/s.db": file,
        "out": folder,
        "out/best.json": file,
    }


@pytest.mark.parametrize("bad", ["abc", "999", "1000", "-1", "u=rw"])
def test_a_bad_autotune_umask_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("AUTOTUNE_UMASK", bad)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["report", "hand", "--storage", _study(tmp_path), "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert f"AUTOTUNE_UMASK must be an octal umask from 000 to 777, got AUTOTUNE_UMASK={bad!r}" in (
        " ".join(result.output.split())
    )
    assert "Traceback" not in result.output
    assert not out.exists()  # refused before anything was written
