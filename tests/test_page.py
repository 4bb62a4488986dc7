"""The service's page at ``/``, a study's report and its best.json: what a person sees.

The browser tests open the page in headless Chromium against a running service (the real app,
queue, scheduler and search over two simulated GPUs, ``_page_box.py``) with a study in flight,
one finished and one queued, and check what a person would see: the devices, the study's
progress moving without a reload, the report's plots, the cancel button working from the page
and the same request refused from another site's page. They save screenshots in the folder
named by ``AUTOTUNE_PAGE_SHOTS`` (a temporary one otherwise) and print where.
The other tests read the HTML the app answers: escaping, headers, refusals.
"""

from __future__ import annotations

import getpass
import html
import http.server
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

for _name in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_name)

import httpx  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from _browser import CHROMIUM, Browser  # noqa: E402
from _service import ROOT, TOKEN, free_port, wait_for  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from autotune.errors import ServiceError  # noqa: E402
from autotune.infra.logs import reset_logging, setup_logging  # noqa: E402
from autotune.service import ServiceClient, StudyQueue, TuningService, create_app  # noqa: E402

SHOTS_ENV = "AUTOTUNE_PAGE_SHOTS"
HOSTILE = '<script>alert("owner")</script>'
SPEC = "name: a1\nworkload: tiny_convnet\nbudget: 1h\n"


class Parsed(HTMLParser):
    """Every tag with its attributes, and the text a reader sees (entities decoded)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.parts: list[str] = []
        self.feed(text)
        self.text = "".join(self.parts)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.parts.append(data)

    def attrs(self, tag: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, TuningService]]:
    """The app over a service that is never started: studies are queued, nothing runs."""
    service = TuningService(f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path / "out")
    yield (
        TestClient(create_app(service, loopback_only=True), base_url="http://127.0.0.1:8765"),
        service,
    )


def test_every_string_from_outside_is_shown_as_text(client: tuple[TestClient, Any]) -> None:
    http, service = client
    assert http.post("/studies", content=SPEC, params={"owner": HOSTILE}).status_code == 201
    # A queue written elsewhere (by hand, by another version): nothing in it was checked.
    name = "<script>alert(1)</script>"
    workload = '"><img src=x onerror=alert(2)>'
    spec = {"name": "x", "workload": workload, "device": "<b>cuda</b>"}
    service.queue.submit(name, spec, 0, submitted_by="<i>eve</i>")
    for path, own_scripts in (("/", 1), ("/page/live", 0)):
        page = Parsed(http.get(path).text)
        assert len(page.attrs("script")) == own_scripts, path
        assert not {"img", "b", "i"} & {t for t, _ in page.tags}, path
        for shown in (f"by {HOSTILE}", name, workload, "by <i>eve</i>", "device <b>cuda</b>"):
            assert shown in page.text, (path, shown)
        # The cancel buttons carry the names whole, for the page's script to send back.
        assert {b["data-cancel"] for b in page.attrs("button")} == {"a1", name}


def test_the_page_runs_only_its_own_script_and_loads_nothing(
    client: tuple[TestClient, Any],
) -> None:
    http, _ = client
    first, second = http.get("/"), http.get("/")
    csp = first.headers["content-security-policy"]
    nonce = re.search(r"'nonce-([^']+)'", csp)
    assert nonce is not None
    page = Parsed(first.text)
    own = [a.get("nonce") for t, a in page.tags if t in ("style", "script")]
    assert own == [nonce.group(1)] * 2
    assert nonce.group(1) not in second.text  # a new one every time
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert first.headers["x-frame-options"] == "DENY"
    assert first.headers["cache-control"] == "no-store"
    urls = [a[k] for _, a in page.tags for k in ("src", "href") if k in a]
    assert not [u for u in urls if re.match(r"^([a-z]+:)?//", u)], urls
    viewport = [m for m in page.attrs("meta") if m.get("name") == "viewport"]
    assert viewport == [{"name": "viewport", "content": "width=device-width, initial-scale=1"}]


@pytest.mark.parametrize(
    ("owner", "needle"),
    [
        ("x" * 65, "owner: String should have at most 64 characters"),
        ("a\nb", "owner: String"),
        # Shown as "ana\u202egnp.exe" it reads "anaexe.png": the name on the page is not the one sent.
        ("ana\u202egnp.exe", "owner holds U+202E (RIGHT-TO-LEFT OVERRIDE) at position 4"),
        ("bob\u200b", "owner holds U+200B (ZERO WIDTH SPACE)"),
    ],
    ids=["long", "newline", "bidi", "invisible"],
)
def test_an_owner_the_page_could_not_show_is_refused(
    client: tuple[TestClient, Any], owner: str, needle: str
) -> None:
    http, service = client
    r = http.post("/studies", content=SPEC, params={"owner": owner})
    assert r.status_code == 422 and needle in r.json()["detail"], r.text
    assert service.queue.get("a1") is None


@pytest.mark.parametrize(
    ("path", "status", "needle"),
    [
        ("/studies/nope/report", 404, "study 'nope' is not in this service's queue"),
        ("/studies/nope/best.json", 404, "study 'nope' is not in this service's queue"),
        ("/studies/a1/report", 409, "study 'a1' has nothing stored yet (queued: 1st in line)"),
        ("/studies/a1/best.json", 409, "study 'a1' is queued, so it has no config yet"),
    ],
)
def test_report_and_best_json_say_why_they_are_not_there(
    client: tuple[TestClient, Any], path: str, status: int, needle: str
) -> None:
    http, _ = client
    assert http.post("/studies", content=SPEC).status_code == 201
    r = http.get(path)
    assert r.status_code == status and needle in r.json()["detail"], r.text


def test_a_queue_an_older_version_wrote_gains_the_owner_column(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with sa.create_engine(url).begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE autotune_queue (name VARCHAR(128) PRIMARY KEY, spec TEXT NOT NULL, "
            "priority INTEGER NOT NULL, submitted_at FLOAT NOT NULL, seq INTEGER NOT NULL, "
            "state VARCHAR(16) NOT NULL, device VARCHAR(32), owner VARCHAR(256), error TEXT, "
            "started_at FLOAT, finished_at FLOAT, probe_seconds FLOAT NOT NULL, "
            "runs INTEGER NOT NULL)"
        )
        conn.exec_driver_sql(
            "INSERT INTO autotune_queue VALUES ('old', '{}', 0, 1.0, 1, 'queued', NULL, NULL, "
            "NULL, NULL, NULL, 0.0, 0)"
        )
    queue = StudyQueue(url)
    old = queue.get("old")
    assert old is not None and old.submitted_by is None
    assert queue.submit("new", {}, 0, submitted_by="ada").submitted_by == "ada"
    assert StudyQueue(url).get("new").submitted_by == "ada"  # opened again: nothing to add


def test_a_token_in_the_address_stays_out_of_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    # The page takes its token from #token=… (never sent); a ?token=… is sent, and every log
    # line is masked before it is written, requests logged by the server among them.
    setup_logging("INFO")
    try:
        logging.getLogger("uvicorn.access").warning(
            '%s - "GET %s HTTP/1.1" 200', "127.0.0.1:50000", f"/?token={TOKEN}"
        )
    finally:
        reset_logging()
    err = capsys.readouterr().err
    assert "GET /?token=*** HTTP/1.1" in err and TOKEN not in err


# ---- in a browser, against a running service --------------------------------------------------

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium package (.ci/run installs it)"
)


def _spec(name: str, device: str, budget: str) -> str:
    return json.dumps({"name": name, "workload": "resnet18", "device": device, "budget": budget})


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A service on two simulated GPUs: ``long`` in flight on cuda:0 (its budget lasts eight minutes here), ``quick`` done on cuda:1,
    ``waits`` queued behind ``long``, the page behind a token."""
    tmp = tmp_path_factory.mktemp("page")
    (tmp / "token.txt").write_text(TOKEN + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "service.log"
    script = ROOT / "tests" / "_page_box.py"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(port), str(tmp), str(tmp / "token.txt")],
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )
    api = ServiceClient(url, TOKEN, timeout=10)
    try:
        wait_for(lambda: _up(api, proc), 60, "the service to answer", log)
        api.submit(_spec("long", "cuda:0", "4h"), json_body=True)  # owner: this machine's user
        api.submit(_spec("quick", "cuda:1", "2m"), json_body=True, owner="bo")
        api.submit(_spec("waits", "cuda:0", "30m"), json_body=True, owner=HOSTILE)
        wait_for(lambda: api.study("quick").state == "done", 60, "quick to finish", log)
        wait_for(lambda: api.study("long").best is not None, 60, "a best trial of long", log)
        shots = Path(os.environ.get(SHOTS_ENV) or tmp / "shots")
        shots.mkdir(parents=True, exist_ok=True)
        yield SimpleNamespace(url=url, api=api, log=log, shots=shots, tmp=tmp)
    finally:
        api.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _up(api: ServiceClient, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"the service exited {proc.returncode}"
    try:
        return api.health().status == "ok"
    except ServiceError:  # not listening yet
        return False


@pytest.fixture
def browser(box: SimpleNamespace, tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "profile")
    # Any alert() a study name smuggled in would land here instead of a dialog.
    b.call(
        "Page.addScriptToEvaluateOnNewDocument",
        session=True,
        source="window.alerts = []; window.alert = (m) => window.alerts.push(String(m));",
    )
    try:
        yield b
    finally:
        b.close()


def _text(b: Browser, selector: str) -> str:
    return b.js(f"document.querySelector({json.dumps(selector)})?.innerText ?? ''")


def _shot(b: Browser, box: SimpleNamespace, name: str) -> Path:
    path = b.screenshot(box.shots / name)
    image = pytest.importorskip("PIL.Image").open(path).convert("L")
    # Not a blank page: text, bars and tables put plenty of dark pixels on it.
    assert sum(image.histogram()[:128]) > 0.003 * image.width * image.height, path
    return path


@needs_chromium
def test_the_page_shows_the_box_and_keeps_itself_live(
    box: SimpleNamespace, browser: Browser
) -> None:
    b = browser
    b.open(f"{box.url}/#token={TOKEN}")
    # The token went into this tab's storage and out of the address bar.
    assert b.js("location.href") == f"{box.url}/"
    assert b.js("sessionStorage.getItem('autotune-token')") == TOKEN
    rows = b.js("[...document.querySelectorAll('#devices tr[data-device]')].map(r => r.innerText)")
    assert len(rows) == 2
    assert "cuda:0" in rows[0] and "NVIDIA H100 80GB HBM3" in rows[0]
    assert f"study long by {getpass.getuser()}" in rows[0] and "31.0 GiB used" in rows[0]
    assert "another process: pid 4242 (12.0 GiB)" in rows[1]
    card = _text(b, "#study-long")
    assert "Phase\tsearch" in card or "Phase\nsearch" in card, card
    assert re.search(
        r"Best so far\s+(fp|bf|tf)\d\d bs=\d+ .*\d\.\d\dx \(\d\.\d\d–\d\.\d\d\)", card
    ), card
    assert re.search(r"of 4h \(\d+%\)", card), card
    # The hostile owner is text on the page; no script of it ran.
    assert f"by {HOSTILE}" in _text(b, "#queue tr[data-study='waits']")
    assert b.js("document.scripts.length") == 1 and b.js("window.alerts") == []
    # The emitted config with its figure: validated, or (where a busy machine's real seconds ate
    # the sped-up budget) the fp32 fallback with its reason.
    done = _text(b, "#finished tr[data-study='quick']")
    assert re.search(
        r"(fp|bf|tf)\d\d bs=\d+ lr=\S+\s+\d\.\d\dx (\(\S+\) )?the fp32 reference, "
        r"(validated|not validated: \S.*)",
        done,
    ), done
    assert "report · best.json" in done and "by bo" in done

    # Live: the same document (no reload) shows the study further along a moment later.
    b.js("window.sameDocument = true")
    b.wait(f"document.querySelector('#study-long').innerText !== {json.dumps(card)}", 15)
    assert b.js("window.sameDocument") is True
    assert _text(b, "#live").startswith("live, updated")
    print(f"\nscreenshots of the page and the report: {box.shots}")
    _shot(b, box, "page-running.png")

    # A phone: nothing wider than the screen but the tables, which scroll in their boxes.
    b.size(390, 844, mobile=True)
    b.open(f"{box.url}/")
    assert b.js("document.documentElement.scrollWidth") <= 390
    _shot(b, box, "page-phone.png")
    b.size(1280, 900)

    # The finished study's report, served by the service, with its plots.
    b.open(b.js("document.querySelector('#finished a[href$=\"/report\"]').href"))
    assert b.js("location.pathname") == "/studies/quick/report"
    assert "quick" in _text(b, "h1")
    # Throughput, loss, history and the reference always; validation's where it validated (a
    # busy machine's fallback has none, and too few trials no importance plot).
    validated = "not validated" not in done
    assert b.js("document.querySelectorAll('svg.plot').length") >= 4 + validated
    _shot(b, box, "report.png")
    r = httpx.get(f"{box.url}/studies/quick/best.json")
    assert r.headers["content-disposition"] == 'attachment; filename="quick-best.json"'
    assert r.json()["study"] == "quick" and "validated" in r.json()["evidence"]


class _Evil(http.server.BaseHTTPRequestHandler):
    """Another site's page that tries to cancel a study on the service, as any page could."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        body = (
            "<!DOCTYPE html><title>elsewhere</title><script>"
            f"fetch({json.dumps(self.target)}, {{method: 'POST', mode: 'no-cors', body: 'x'}})"
            ".then(() => document.title = 'sent', e => document.title = 'failed ' + e);"
            "</script>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@needs_chromium
def test_cancel_works_from_the_page_and_not_from_another_site(
    box: SimpleNamespace, browser: Browser
) -> None:
    b = browser
    _Evil.target = f"{box.url}/studies/long/cancel"
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        b.open(f"http://localhost:{evil.server_address[1]}/")
        b.wait("document.title === 'sent'", 10, "the other site's request to be sent")
    finally:
        evil.shutdown()
    wait_for(
        lambda: "refused POST /studies/long/cancel: a cross-site request" in box.log.read_text(),
        10,
        "the service to refuse the other site's cancel",
    )
    assert box.api.study("long").state == "running"

    # Without the token the buttons cannot be used; with it, two clicks cancel.
    b.open(f"{box.url}/")
    assert b.js("sessionStorage.getItem('autotune-token')") is None
    assert b.js("document.querySelector('button[data-cancel=\"waits\"]').disabled") is True
    b.js(f"document.getElementById('token').value = {json.dumps(TOKEN)}")
    b.js("document.querySelector('#token-form button[type=submit]').click()")
    b.wait("!document.querySelector('button[data-cancel=\"waits\"]').disabled", 10)
    for name, said in (("waits", "removed from the queue"), ("long", "stopping")):
        click = f"document.querySelector('button[data-cancel={json.dumps(name)}]').click()"
        b.js(click)
        assert _text(b, f"button[data-cancel={json.dumps(name)}]") == "Really cancel?"
        b.js(click)
        b.wait(f"document.getElementById('notice').innerText.includes({json.dumps(said)})", 10)
        b.wait(
            f"document.querySelector('#finished tr[data-study={json.dumps(name)}]')"
            "?.innerText.includes('cancelled')",
            20,
            f"{name} to be listed cancelled",
        )
    assert box.api.study("long").state == "cancelled"
    assert _text(b, "#running p.empty") == "Nothing is running."
    _shot(b, box, "page-finished.png")


def test_a_private_service_shows_nothing_without_its_token(tmp_path: Path) -> None:
    service = TuningService(
        f"sqlite:///{tmp_path / 's.db'}", ["cpu"], out_dir=tmp_path / "out", token=TOKEN
    )
    app = create_app(service, loopback_only=True, private=True)
    http = TestClient(app, base_url="http://127.0.0.1:8765")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert http.post("/studies", content=SPEC, headers=auth).status_code == 201
    # Without the token: the page says so and holds no study; every read is refused.
    shell = http.get("/")
    assert shell.status_code == 200 and "This service is private" in shell.text
    assert 'data-cancel="a1"' not in shell.text and "a1" not in Parsed(shell.text).text
    for path in ("/page/live", "/studies", "/studies/a1", "/devices", "/studies/a1/report"):
        r = http.get(path)
        assert r.status_code == 401 and "private" in r.json()["detail"], path
    assert http.get("/health").status_code == 200
    # With it, everything reads; the page's view cookie then reads too, and never writes.
    assert http.get("/studies", headers=auth).status_code == 200
    assert 'data-cancel="a1"' in http.get("/", headers=auth).text
    assert http.post("/page/session").status_code == 401  # the cookie is only for the token
    assert http.post("/page/session", headers=auth).status_code == 204
    assert http.get("/studies").status_code == 200 and "a1" in http.get("/page/live").text
    assert http.post("/studies/a1/cancel").status_code == 401
    # Forgotten: reading is refused again.
    assert http.post("/page/session/end").status_code == 204
    assert http.get("/studies").status_code == 401


def test_serve_private_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from autotune.cli import app

    monkeypatch.delenv("AUTOTUNE_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["serve", "--private", "--port", str(free_port())])
    assert result.exit_code == 2
    assert "--private needs a token" in result.output and "Traceback" not in result.output


@needs_chromium
def test_a_private_service_s_page_reads_once_its_token_is_given(tmp_path: Path) -> None:
    (tmp_path / "token.txt").write_text(TOKEN + "\n")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "service.log"
    script = [str(ROOT / "tests" / "_page_box.py"), str(port), str(tmp_path)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *script, str(tmp_path / "token.txt"), "private"],
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )
    api = ServiceClient(url, TOKEN, timeout=10)
    b = Browser(tmp_path / "profile")
    try:
        wait_for(lambda: _up(api, proc), 60, "the service to answer", log)
        api.submit(_spec("p1", "cuda:1", "30m"), json_body=True)
        main = "document.querySelector('#live-main').innerText"
        b.open(f"{url}/")
        assert "This service is private" in b.js(main) and "p1" not in b.js(main)
        # Given the token, the page shows the box; its links (here the API's list) read too.
        b.js(
            f"document.getElementById('token').value = {json.dumps(TOKEN)};"
            "document.getElementById('token-form').requestSubmit()"
        )
        b.wait(f"{main}.includes('p1')", 20, "the study on the page")
        b.open(f"{url}/studies")
        assert '"name":"p1"' in b.js("document.body.innerText").replace(" ", "")
        # Forgotten: nothing shows, and the links are refused again.
        b.open(f"{url}/")
        b.js("document.getElementById('forget').click()")
        b.wait(f"{main}.includes('This service is private')", 20, "the page emptied")
        b.open(f"{url}/studies")
        assert "private" in b.js("document.body.innerText")
        # Forgotten while the page, opened with its token, still waits for its view cookie:
        # the cookie that call sets is ended after it, and the links stay refused (the page
        # ended the cookie first, the late answer set it again, and the page went on reading).
        b.open(f"{url}/")
        b.js(f"sessionStorage.setItem('autotune-token', {json.dumps(TOKEN)})")
        (tmp_path / "hold").write_text("")
        b.open(f"{url}/")
        wait_for(lambda: (tmp_path / "holding").exists(), 20, "the page's call held", log)
        b.js("document.getElementById('forget').click()")
        (tmp_path / "hold").unlink()
        wait_for(lambda: (tmp_path / "released").exists(), 20, "the held call's answer", log)
        b.wait(f"{main}.includes('This service is private')", 20, "the page emptied again")
        b.open(f"{url}/studies")
        assert "private" in b.js("document.body.innerText")
    finally:
        b.close()
        api.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_finished_row_says_why_it_fell_back_and_what_others_took() -> None:
    """The page's finished row shows, under the figure, why a config fell back (best.json's
    words) and, where other processes kept half a core or more busy, how much; a validated
    config on a quiet machine shows neither."""
    from datetime import datetime, timezone

    from _configs import make_config

    from autotune.service._models import StudyProgress, StudyStatus
    from autotune.service._page import _result

    status = StudyStatus(
        name="quick", state="done", detail="done", priority=0, workload="w", device="cpu",
        submitted_at=datetime.now(timezone.utc),
        progress=StudyProgress(budget_seconds=60.0, budget_used_seconds=30.0),
    )  # fmt: skip
    cfg = make_config("fp32")
    why = "no candidate's validated lower bound cleared 1.05x (bf16 bs=64: 4 pairs)"
    fell = cfg.evidence.model_copy(
        update={"validated": False, "validation_note": why, "others_cores": 1.6}
    )
    row = html.unescape(_result(status, cfg.model_copy(update={"evidence": fell})))
    assert "not validated: fp32 fallback" in row and why in row
    assert "other processes kept 1.6 cores busy while the search measured" in row
    quiet = cfg.evidence.model_copy(update={"validated": True, "others_cores": 0.2})
    row = html.unescape(_result(status, cfg.model_copy(update={"evidence": quiet})))
    assert "cores busy" not in row and "lower bound" not in row
