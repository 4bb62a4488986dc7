"""A shared box's safety: no password stored, logged or printed, whatever form the URL takes;
no study or cancel driven by another site's page.

The drain-during-the-reference case is an end-to-end test in ``test_service.py`` (it needs a
real service and a real kill).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from fastapi.testclient import TestClient
from loguru import logger

from autotune.infra.logs import log_to_file, reset_logging, setup_logging
from autotune.infra.redact import mask_url
from autotune.schema.spec import parse_spec
from autotune.service import TuningService, create_app
from autotune.study.storage import open_study

ROOT = Path(__file__).resolve().parent.parent
SECRET = "hunter2-Xq9"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://tuner:{SECRET}@db.example:5432/autotune",
        f"postgresql://:{SECRET}@db.example/autotune",  # no user name
        f"postgresql://tuner:{SECRET}@@db.example/autotune",  # a raw '@' in the password
        f"postgresql://tuner:a@{SECRET}@db.example/autotune",
        f"postgresql://tuner@db.example/autotune?password={SECRET}",
        f"postgresql+psycopg://tuner@db.example/autotune?sslmode=require&password={SECRET}",
        f"postgresql://tuner:pa/{SECRET}@db.example/autotune",  # a raw '/' in the password
        f"postgresql://tuner:QW?{SECRET}@db.example:5432/autotune",  # '?' (not a query)
        f"postgresql://tuner:QW {SECRET}@db.example/autotune",  # white space
        f"postgresql://tuner:QW'{SECRET}@db.example/autotune",  # a quote
    ],
)
def test_no_url_form_shows_its_password(url: str) -> None:
    masked = mask_url(url)
    assert SECRET not in masked
    assert "db.example" in masked  # where it points stays readable
    # Inside a message too, and quoted as a repr.
    assert SECRET not in mask_url(f"storage {url!r} cannot be opened: refused")


@pytest.mark.parametrize(
    "password_form",
    # The plain user:password form is checked by the distributed tests' wrong-URL case.
    ["empty-user", "raw-at", "query", "question", "space-quote"],
)
def test_cli_prints_and_logs_no_password(tmp_path: Path, password_form: str) -> None:
    """A search whose storage cannot be reached: the message names the URL, never the password."""
    url = {
        "user": f"postgresql://tuner:{SECRET}@127.0.0.1:1/autotune",
        "empty-user": f"postgresql://:{SECRET}@127.0.0.1:1/autotune",
        "raw-at": f"postgresql://tuner:x@{SECRET}@127.0.0.1:1/autotune",
        "query": f"postgresql://tuner@127.0.0.1:1/autotune?password={SECRET}",
        "question": f"postgresql://tuner:QW?{SECRET}@127.0.0.1:1/autotune",
        "space-quote": f"postgresql://tuner:Q W'{SECRET}@127.0.0.1:1/autotune",
    }[password_form]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "search", str(ROOT / "studies" / "tiny.yaml")]
        + ["--budget", "5s", "--device", "cpu", "--storage", url, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    printed = proc.stdout + proc.stderr
    assert "127.0.0.1:1" in printed, printed[-2000:]
    assert SECRET not in printed, printed[-2000:]
    assert "Traceback" not in printed
    for log in out.rglob("*.log"):
        assert SECRET not in log.read_text(), log


def test_serve_prints_no_password_whatever_it_holds() -> None:
    url = f"postgresql://tuner:Q W'?{SECRET}@127.0.0.1:1/autotune"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "serve", "--port", "0", "--storage", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 2, printed[-2000:]
    assert "127.0.0.1:1" in printed and SECRET not in printed, printed[-2000:]
    assert "Traceback" not in printed


def test_a_password_seen_once_is_hidden_wherever_it_is_quoted_later() -> None:
    """A password with white space cannot be told from a message's words; once its URL has been
    through the masking (as every storage URL is when it is opened), any text quoting it hides it."""
    url = f"postgresql://tuner:a b{SECRET}@h/db"
    assert SECRET not in mask_url(url)
    assert SECRET not in mask_url(f"driver said: password 'a b{SECRET}' was refused for {url}")


def test_log_sinks_mask_a_password_a_message_forgot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("INFO")
    handler = log_to_file(tmp_path / "search.log")
    try:
        logger.warning("could not reach postgresql://tuner:{}@h/db (password={})", SECRET, SECRET)
    finally:
        logger.remove(handler)
        reset_logging()
    assert "postgresql://tuner:***@h/db" in capsys.readouterr().err
    text = (tmp_path / "search.log").read_text()
    assert "tuner:***@h" in text and SECRET not in text


def test_a_study_stores_its_spec_without_the_password(
    postgres_server, postgres_url: str, tmp_path: Path
) -> None:
    assert postgres_server.password in postgres_url
    spec = parse_spec({"name": "p", "workload": "tiny_convnet", "storage": postgres_url})
    study = open_study(spec)
    stored = study.user_attrs["spec"]
    assert postgres_server.password not in str(stored)
    assert stored["storage"] == mask_url(postgres_url)
    # A study an older version stored with the password is cleaned when it is opened again.
    study.set_user_attr("spec", {**stored, "storage": postgres_url})
    open_study(spec)
    again = optuna.load_study(study_name="p", storage=postgres_url).user_attrs["spec"]
    assert postgres_server.password not in str(again)


# ---- cross-site requests --------------------------------------------------------------------

SPEC = "name: xs\nworkload: tiny_convnet\nbudget: 1h\n"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, TuningService]]:
    """The HTTP app over a service that is never started (no lifespan): submits are queued,
    nothing runs."""
    service = TuningService(f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path / "out")
    app = create_app(service, loopback_only=True)
    yield TestClient(app, base_url="http://127.0.0.1:8765"), service


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
        {"Origin": "null", "Content-Type": "text/plain"},  # a sandboxed frame or a file
        {"Origin": "http://127.0.0.1:9999"},  # another service on the same machine
        {"Sec-Fetch-Site": "cross-site"},
        {"Host": "evil.example:8765"},  # DNS rebinding: a name that points at loopback
    ],
)
def test_cross_site_writes_are_refused_and_change_nothing(
    client: tuple[TestClient, TuningService], headers: dict[str, str]
) -> None:
    http, service = client
    r = http.post("/studies", content=SPEC, headers=headers)
    assert r.status_code == 403, r.text
    assert "another site" in r.json()["detail"]
    assert service.queue.get("xs") is None
    # A cancel from there is refused the same way.
    assert http.post("/studies/xs/cancel", headers=headers).status_code == 403


def test_same_site_and_non_browser_writes_pass(client: tuple[TestClient, TuningService]) -> None:
    http, service = client
    r = http.post("/studies", content=SPEC, headers={"Origin": "http://127.0.0.1:8765"})
    assert r.status_code == 201, r.text
    r = http.post("/studies/xs/cancel", headers={"Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200, r.text
    # The CLI and curl send no Origin.
    r = http.post("/studies", content=SPEC.replace("xs", "ys"))
    assert r.status_code == 201, r.text
    assert service.queue.get("ys") is not None
    # Reading stays open to the service's own address.
    assert http.get("/health").status_code == 200
