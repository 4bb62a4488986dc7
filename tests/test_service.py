"""`autotune serve` against a real uvicorn server on 127.0.0.1, over real HTTP.

One service (with a token, a workload dir and the fake-busy hook) serves most tests; a service
killed, drained or stopped under a study is tests/test_service_restarts.py's. Studies use the ``sleepy`` workload: its steps sleep, so
probe times are predictable and the tests leave the shared cores to others.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

# The service stack is not everywhere (a bare GPU machine lacks it): skip, do not fail collection.
for _name in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_name)

import optuna  # noqa: E402
from _service import AUTH, ROOT, TOKEN, Service, free_port, sleepy, wait_for  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from autotune.cli import app  # noqa: E402
from autotune.errors import SpecError, WorkloadError  # noqa: E402
from autotune.service import (  # noqa: E402
    MAX_BODY,
    RequestError,
    TuningService,
    WorkloadPolicy,
    is_loopback,
)
from autotune.service._access import WorkloadRefused, check_bind  # noqa: E402
from autotune.service._device_monitor import parse_devices  # noqa: E402
from autotune.study.store import StudyStore  # noqa: E402
from autotune.testing.busy import FAKE_BUSY_ENV  # noqa: E402


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("service")
    token_file = tmp / "token.txt"
    token_file.write_text(TOKEN + "\n")
    svc = Service(
        tmp,
        "--token-file",
        str(token_file),
        "--workload-dir",
        str(ROOT / "examples"),
        env={FAKE_BUSY_ENV: str(tmp / "busy")},
    )
    try:
        yield svc.start()
    finally:
        svc.stop()


def snapshot(svc: Service) -> tuple[Any, list[str]]:
    """What a refused request must leave unchanged: the queue and the stored studies."""
    queue = svc.http.get("/studies").json()
    for s in queue:  # a running study's clock moves on its own
        s["progress"].pop("budget_used_seconds", None)
    names = optuna.study.get_all_study_names(svc.db) if (svc.tmp / "s.db").exists() else []
    return queue, sorted(names)


TINY_YAML = (ROOT / "studies" / "tiny.yaml").read_text()


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "needle"),
    [
        ("post", "/studies", {"json": sleepy("x")}, 401, "needs a token"),
        (
            "post",
            "/studies",
            {"json": sleepy("x"), "headers": {"Authorization": "Bearer nope"}},
            401,
            "wrong token",
        ),
        ("post", "/studies/x/cancel", {}, 401, "needs a token"),
        (
            "post",
            "/studies",
            {"content": "name: [unclosed\n", "headers": AUTH},
            422,
            "not valid YAML",
        ),
        (
            "post",
            "/studies",
            {"content": "{", "headers": {**AUTH, "content-type": "application/json"}},
            422,
            "not valid JSON",
        ),
        ("post", "/studies", {"content": "- a\n- b\n", "headers": AUTH}, 422, "must be a mapping"),
        (
            "post",
            "/studies",
            {"json": {**sleepy("x"), "colour": "blue"}, "headers": AUTH},
            422,
            "colour: unknown field",
        ),
        (
            "post",
            "/studies",
            {"json": sleepy("x", budget="-5m"), "headers": AUTH},
            422,
            "budget must be positive",
        ),
        (
            "post",
            "/studies",
            {"json": {**sleepy("x"), "workload": "os:system"}, "headers": AUTH},
            403,
            "imports only the built-in workloads",
        ),
        (
            "post",
            "/studies",
            {"json": {**sleepy("x"), "workload": "evil.mod:fn"}, "headers": AUTH},
            403,
            "'evil' is not there",
        ),
        (
            "post",
            "/studies",
            {"json": {**sleepy("x"), "workload": "autotune.workloads:nope"}, "headers": AUTH},
            422,
            "has no workload 'nope'",
        ),
        (
            "post",
            "/studies",
            {"json": {**sleepy("x"), "device": "cuda:3"}, "headers": AUTH},
            422,
            "this service runs on cpu",
        ),
        (
            "post",
            "/studies",
            {"content": "x" * (MAX_BODY + 1), "headers": AUTH},
            413,
            "the limit is 65536 bytes",
        ),
        ("post", "/studies?priority=abc", {"json": sleepy("x"), "headers": AUTH}, 422, "priority"),
        ("get", "/studies/nosuch", {}, 404, "'nosuch' is not in this service's queue"),
        ("get", "/studies/nosuch/config", {}, 404, "not in this service's queue"),
        ("post", "/studies/nosuch/cancel", {"headers": AUTH}, 404, "not in this service's queue"),
    ],
    ids=lambda v: v if isinstance(v, (int, str)) and not str(v).startswith("/") else None,
)
def test_refused_requests_change_nothing(
    service: Service, method: str, path: str, kwargs: dict, status: int, needle: str
) -> None:
    before = snapshot(service)
    response = getattr(service.http, method)(path, **kwargs)
    assert response.status_code == status, response.text
    assert needle in response.json()["detail"]
    assert snapshot(service) == before


def test_busy_device_holds_the_queue_and_the_result_comes_over_http_and_the_cli(
    service: Service, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Priority order and waiting off the budget on a busy device are tested on a simulated box
    (test_box.py); here, as a user sees them through the real service."""
    busy = service.tmp / "busy"
    busy.write_text("a colleague's job")
    # Whatever happens here, the next test of this service finds the device free.
    request.addfinalizer(lambda: busy.unlink(missing_ok=True))
    tiny = TINY_YAML.replace("budget: 45s", "budget: 8s").replace("name: tiny", "name: tiny-a")
    r = service.http.post(
        "/studies",
        content=tiny,
        params={"owner": "ada"},
        headers={**AUTH, "content-type": "application/yaml"},
    )
    assert r.status_code == 201, r.text
    # A workload under --workload-dir is accepted; cancelled while still queued.
    r = service.submit({**sleepy("mine"), "workload": "mypkg.train:workload"})
    assert r.status_code == 201, r.text
    r = service.http.post("/studies/mine/cancel", headers=AUTH)
    assert r.json()["state"] == "cancelled"

    # While the device is taken, nothing starts, and the study says why.
    queued = wait_for(
        lambda: "used by another process" in (s := service.study("tiny-a"))["detail"] and s,
        20,
        "tiny-a to say the device is taken",
        service.log,
    )
    assert queued["state"] == "queued"
    devices = service.http.get("/devices").json()
    assert devices[0]["busy"] and devices[0]["worker_pid"]
    busy.unlink()
    service.wait_state("tiny-a", ("done",), 60)

    # The result, over HTTP and through the CLI client.
    config = service.http.get("/studies/tiny-a/config").json()
    assert config["study"] == "tiny-a" and config["workload"].endswith("tiny_convnet")
    assert (service.tmp / "out" / "tiny-a" / "best.json").is_file()
    out = tmp_path / "best.json"
    cli = CliRunner().invoke(app, ["result", "tiny-a", "-o", str(out), "--server", service.url])
    assert cli.exit_code == 0, cli.output
    assert json.loads(out.read_text())["study"] == "tiny-a"
    cli = CliRunner().invoke(app, ["status", "--server", service.url])
    assert cli.exit_code == 0 and "tiny-a" in cli.output and "done" in cli.output
    assert "by ada" in cli.output  # who submitted it

    # A finished study cannot be cancelled or submitted again; nothing changes.
    before = snapshot(service)
    r = service.http.post("/studies/tiny-a/cancel", headers=AUTH)
    assert r.status_code == 409 and "already done" in r.json()["detail"]
    r = service.http.post(
        "/studies", content=tiny, headers={**AUTH, "content-type": "application/yaml"}
    )
    assert r.status_code == 409 and "already done" in r.json()["detail"]
    r = service.http.get("/studies/mine/config")
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]
    assert snapshot(service) == before


def test_killed_worker_fails_the_trial_and_it_is_retried(service: Service) -> None:
    assert service.submit(sleepy("k", budget="30s", steps=60)).status_code == 201
    killed: list[int] = []
    for _ in range(3):
        service.wait_trial_started("k")  # its probe takes ~3 s: the kill lands inside it
        pid = service.http.get("/devices").json()[0]["worker_pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        time.sleep(1.0)
        trials = service.study("k")["trials"]
        if any("worker process died" in (t["reason"] or "") for t in trials):
            break

    def crashed_and_retried() -> list[optuna.trial.FrozenTrial] | None:
        trials = service.trials("k")
        crashed = [t for t in trials if "worker process died" in t.user_attrs.get("reason", "")]
        retried = {t.user_attrs.get("retry_of") for t in trials if t.datetime_start}
        return trials if crashed and crashed[0].number in retried else None

    trials = wait_for(crashed_and_retried, 60, "the killed trial's re-run", service.log)
    crashed = [t for t in trials if "worker process died" in t.user_attrs.get("reason", "")]
    assert crashed[0].state == optuna.trial.TrialState.FAIL
    # The re-run runs in a fresh worker; a cancel then leaves nothing running.
    assert service.http.get("/devices").json()[0]["worker_pid"] not in killed
    # (409: its budget ran out first, on a machine slow enough.)
    assert service.http.post("/studies/k/cancel", headers=AUTH).status_code in (200, 409)
    service.wait_state("k", ("cancelled", "done"), 60)
    assert not [t for t in service.trials("k") if t.state == optuna.trial.TrialState.RUNNING]


# ---- without a server: the rules behind the endpoints ---------------------------------------


def test_cli_client_says_when_no_service_answers() -> None:
    result = CliRunner().invoke(app, ["status", "--server", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 2
    assert "cannot reach the autotune service" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("host", "token", "ok"),
    [
        ("127.0.0.1", None, True),
        ("::1", None, True),
        ("0.0.0.0", None, False),
        ("0.0.0.0", TOKEN, True),
    ],
)
def test_binding_beyond_loopback_needs_a_token(host: str, token: str | None, ok: bool) -> None:
    if ok:
        check_bind(host, token)
    else:
        with pytest.raises(SpecError, match="needs a token"):
            check_bind(host, token)
    assert is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_serve_refuses_a_public_address_without_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_TOKEN"}
    result = CliRunner(env=env).invoke(
        app, ["serve", "--host", "0.0.0.0", "--port", str(free_port())]
    )
    assert result.exit_code == 2
    assert "needs a token" in result.output


@pytest.mark.parametrize(
    ("ref", "error", "needle"),
    [
        ("tiny_convnet", None, "autotune.workloads:tiny_convnet"),
        ("autotune.testing.workloads:sleepy", None, "sleepy"),
        ("mypkg.train:workload", None, "mypkg.train:workload"),
        ("mypkg.nosuch:workload", WorkloadError, "does not exist"),
        ("autotune.cli:main", WorkloadRefused, "imports only the built-in"),
        # Callable, but not workload factories: refused before anything runs.
        ("autotune.workloads:load_workload", WorkloadError, "has no workload 'load_workload'"),
        ("autotune.workloads:Workload", WorkloadError, "has no workload 'Workload'"),
        (
            "autotune.testing.workloads:make_oom_workload",
            WorkloadError,
            "it has cuda_context_lost, diverging",
        ),
        ("json:loads", WorkloadRefused, "imports only the built-in"),
        ("not a reference", WorkloadError, "must look like package.module:function"),
    ],
)
def test_workload_policy(ref: str, error: type[Exception] | None, needle: str) -> None:
    policy = WorkloadPolicy([ROOT / "examples"])
    if error is None:
        assert needle in policy.check(ref)
    else:
        with pytest.raises(error, match=needle):
            policy.check(ref)


MYPKG = "mypkg.train"  # a package under the service's workload dir (examples/)


@pytest.mark.parametrize(
    ("workload", "status", "needle"),
    [
        (
            {
                "loop": {
                    "model": f"{MYPKG}:Net",
                    "data": f"{MYPKG}:load",
                    "optimizer": f"{MYPKG}:opt",
                }
            },
            None,
            "",
        ),
        (
            {"lightning": {"module": f"{MYPKG}:Lit", "datamodule": "mypkg.nosuch:Data"}},
            422,
            "workload lightning.datamodule 'mypkg.nosuch:Data': module 'mypkg.nosuch' does not "
            "exist under",
        ),
        # A library's function is code the spec's args reach too: through the user's package.
        (
            {
                "loop": {
                    "model": f"{MYPKG}:Net",
                    "data": f"{MYPKG}:load",
                    "optimizer": f"{MYPKG}:opt",
                    "loss": "torch.nn.functional:cross_entropy",
                }
            },
            403,
            "workload loop.loss 'torch.nn.functional:cross_entropy': this service imports only",
        ),
        (
            {"huggingface": {"model": f"{MYPKG}:build", "dataset": "pickle:/tmp/rows.pkl"}},
            403,
            "workload huggingface.dataset 'pickle:/tmp/rows.pkl': this service does not load "
            "pickled objects",
        ),
    ],
)
def test_an_adapter_spec_is_held_to_the_workload_policy_object_by_object(
    tmp_path: Path, workload: dict[str, Any], status: int | None, needle: str
) -> None:
    service = TuningService(
        f"sqlite:///{tmp_path / 's.db'}",
        ["cpu"],
        out_dir=tmp_path / "out",
        workload_dirs=[ROOT / "examples"],
    )
    body = json.dumps({"name": "a", "workload": workload, "budget": "1m"}).encode()
    if status is None:
        spec = service.parse(body, "application/json")
        assert json.loads(spec.workload) == workload  # stored as the spec holds it
        return
    with pytest.raises(RequestError, match="workload") as caught:
        service.parse(body, "application/json")
    assert (caught.value.status, str(caught.value)[: len(needle)]) == (status, needle)


def test_devices_parse() -> None:
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("0, cuda:1,0") == ["cuda:0", "cuda:1"]
    with pytest.raises(SpecError, match="got an entry 'tpu'"):
        parse_devices("tpu")


class _FakeNVML:
    """Just enough of pynvml: one 80 GiB GPU, our worker (pid 100) and a colleague (pid 200)."""

    class NVMLError(Exception):
        pass

    def __init__(self, util: float, colleague_gib: float) -> None:
        self.util, self.colleague = util, int(colleague_gib * 2**30)
        self.handles: list[Any] = []

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self.handles.append(i)
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(uuid)
        return uuid

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        total, ours = 80 * 2**30, 2 * 2**30
        return type("M", (), {"total": total, "free": total - ours - self.colleague})()

    def nvmlDeviceGetName(self, h: Any) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return type("U", (), {"gpu": self.util})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        proc = lambda pid, used: type("P", (), {"pid": pid, "usedGpuMemory": used})()  # noqa: E731
        return [proc(100, 2 * 2**30), proc(200, self.colleague)]


@pytest.mark.parametrize(
    ("util", "colleague_gib", "need_gib", "why"),
    [
        (0.0, 10.0, 20.0, ""),
        (90.0, 10.0, 1.0, "90% utilised by another process (pids: 200)"),
        (0.0, 70.0, 20.0, "the next probe needs about 20.00 GiB plus the 10% margin"),
    ],
)
def test_gpu_room_from_nvml(
    monkeypatch: pytest.MonkeyPatch, util: float, colleague_gib: float, need_gib: float, why: str
) -> None:
    from autotune.service import _device_monitor

    fake = _FakeNVML(util, colleague_gib)
    monkeypatch.setattr(_device_monitor, "_nvml", lambda: fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monitor = _device_monitor.DeviceMonitor(["cuda:0"], own_pids=lambda: {100})
    reading = monitor.read("cuda:0")
    assert fake.handles == [1]  # cuda:0 is physical GPU 1 under CUDA_VISIBLE_DEVICES=1,0
    assert reading.own_bytes == 2 * 2**30 and [p.pid for p in reading.others] == [200]
    room = monitor.room_for("cuda:0", int(need_gib * 2**30), 0.1)
    assert (why in room) if why else room == ""


# ---- a study's standing, read through the trial record -----------------------------------------


def _detail(name: str, state: str, standing: Any, progress: dict[str, Any]) -> Any:
    """The API's answer for a study with this standing, as the service builds it."""
    from autotune.service._models import StudyDetail

    return StudyDetail(
        name=name,
        state=state,
        detail=state if state == "done" else "",
        priority=0,
        workload="w",
        device="cpu",
        submitted_at=datetime.now().astimezone(),
        progress=progress,
        best=standing.best,
        trials=standing.latest,
    )


def test_standing_reads_trials_through_their_record(tmp_path: Path) -> None:
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    from autotune.service._models import StudyDetail
    from autotune.service._standing import read_standing
    from autotune.study.reference import ReferenceMeasurement, ReferenceRecord, reference_key
    from autotune.study.trials import TrialRecord

    dists = {
        "precision": CategoricalDistribution(["fp32", "bf16"]),
        "batch_size": CategoricalDistribution([32, 64]),
    }

    def trial(state: TrialState, value: float | None = None, gap: float = 0.0, **fields: Any):
        return create_trial(
            state=state,
            value=value,
            params={"precision": "bf16", "batch_size": 64},
            distributions=dists,
            user_attrs=TrialRecord(**fields).to_attrs(),
            system_attrs={"constraints:parity": gap} if state == TrialState.COMPLETE else {},
        )

    study = optuna.create_study(
        study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}", direction="maximize"
    )
    reference = ReferenceRecord(
        batch_size=32,
        learning_rate=0.1,
        measurements=[
            ReferenceMeasurement(at=100.0, throughput=1000.0, low=990.0, high=1010.0, blocks=9),
            ReferenceMeasurement(at=200.0, throughput=950.0, low=940.0, high=960.0, blocks=9),
        ],
    )
    study.set_user_attr(reference_key("box", "cpu"), reference.model_dump(mode="json"))
    measured = {"throughput": 1800.0, "reference_throughput": 950.0}
    for t in (
        trial(
            TrialState.COMPLETE,
            1.9,
            outcome="completed",
            speedup=1.9,
            speedup_low=1.8,
            speedup_high=2.0,
            **measured,
        ),
        # Faster, but breaks parity: not the best.
        trial(TrialState.COMPLETE, 2.5, gap=0.04, outcome="infeasible", speedup=2.5, **measured),
        # Faster still, but a copy of a twin's measurement: not ranked.
        trial(TrialState.COMPLETE, 3.0, outcome="completed", speedup=3.0, duplicate_of=0),
        trial(TrialState.PRUNED, outcome="oom", reason="out of memory at batch_size=64"),
        trial(TrialState.FAIL),  # failed by the heartbeat check: nobody recorded why
        trial(TrialState.RUNNING),
    ):
        study.add_trial(t)

    standing = read_standing(StudyStore(study))
    assert standing.reference_throughput == 950.0  # the latest measurement
    # The copy is counted apart, as the summary and the report count it: nothing was measured.
    assert standing.by_outcome == {
        "completed": 1, "infeasible": 1, "reused": 1, "oom": 1, "stale": 1,
    }  # fmt: skip
    assert standing.trials == {"complete": 2, "reused": 1, "pruned": 1, "fail": 1, "running": 1}
    best = standing.best
    assert best is not None and best.number == 0
    assert (best.speedup, best.speedup_low, best.speedup_high) == (1.9, 1.8, 2.0)
    by_number = {t.number: t for t in standing.latest}
    assert by_number[1].outcome == "infeasible" and by_number[1].speedup == 2.5
    assert by_number[4].outcome == "stale" and "no heartbeat" in (by_number[4].reason or "")
    assert by_number[5].outcome is None and by_number[5].speedup is None
    # The API's answer carries the intervals (and parses back: the client reads it).
    detail = _detail("s", "running", standing, {"budget_seconds": 60.0, "budget_used_seconds": 1.0})
    again = StudyDetail.model_validate_json(detail.model_dump_json())
    assert again.best is not None and again.best.speedup_low == 1.8


def test_standing_without_a_reference(tmp_path: Path) -> None:
    from autotune.service._standing import read_standing

    study = optuna.create_study(study_name="e", storage=f"sqlite:///{tmp_path / 'e.db'}")
    standing = read_standing(StudyStore(study))
    assert standing.reference_throughput is None and standing.best is None


def test_a_done_studys_status_names_the_config_not_the_searchs_best(tmp_path: Path) -> None:
    """After a study is done, `autotune status` showed "best so far: trial 1 … 1.99x" (the
    search's unpaired figure) while the config was trial 6 at 1.75x; settings unlabelled
    ("fp16 32 1 65536"), and a trial queued and never run counted as a failure."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    from autotune.cli import _service as cli_service
    from autotune.cli._app import console
    from autotune.service._standing import read_standing
    from autotune.study.trials import TrialRecord

    dists = {
        "precision": CategoricalDistribution(["fp16"]),
        "batch_size": CategoricalDistribution([32]),
        "lr_multiplier": FloatDistribution(1.0, 1.0),
        "init_scale": CategoricalDistribution([65536.0]),
    }
    params = {"precision": "fp16", "batch_size": 32, "lr_multiplier": 1.0, "init_scale": 65536.0}
    study = optuna.create_study(
        study_name="d", storage=f"sqlite:///{tmp_path / 'd.db'}", direction="maximize"
    )
    search = TrialRecord(outcome="completed", speedup=1.99, throughput=1990.0)
    crowned = TrialRecord(tuned_config=True, speedup=1.75, throughput=1750.0)
    never = TrialRecord(outcome="not_run", reason="the search ended before it ran")
    for state, value, rec in (
        (TrialState.COMPLETE, 1.74, search),
        (TrialState.FAIL, None, never),
        (TrialState.COMPLETE, 1.75, crowned),
    ):
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params=params,
                distributions=dists,
                user_attrs=rec.to_attrs(),
                system_attrs={"constraints:parity": 0.0} if rec is search else {},
            )
        )
    standing = read_standing(StudyStore(study))
    assert standing.best is not None and standing.best.number == 2
    # The config's own trial is no trial of the search's: counted as the report counts.
    assert standing.trials == {"complete": 1, "not_run": 1}
    progress = {"budget_seconds": 60.0, "budget_used_seconds": 60.0, "trials": standing.trials}
    detail = _detail("d", "done", standing, progress)
    width = console.width
    console.width = 200
    try:
        with console.capture() as out:
            cli_service._print_study(detail)
    finally:
        console.width = width
    text = out.get()
    assert "config: trial 2 fp16 bs=32 lr×1 init_scale=65536 → 1,750" in text
    assert "1.75x" in text and "best so far" not in text and "1.99" not in text.split("trials")[0]
    assert "1 complete 1 not_run" in text and "fail" not in text.split("latest trials")[0]
