"""Which GPU is which: a probe worker for ``cuda:N`` sees that one GPU only, and the service reads
the same GPU through NVML. autotune numbers GPUs in PCI bus order; ``CUDA_VISIBLE_DEVICES`` may
name them by index or by UUID. On a CPU, NVML is faked and no worker process starts."""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
from io import StringIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from loguru import logger

from autotune.errors import DeviceError
from autotune.execution import limits, probe_worker
from autotune.execution.limits import worker_device, worker_env
from autotune.execution.messages import ProbeRequest, ReadyReply, ResultReply, decode_reply, encode
from autotune.execution.probe_worker import ProbeWorker
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.service import _device_monitor


class FakeNVML:
    """Three GPUs whose NVML order is not their PCI bus order: by bus they are aaaa (0x01),
    bbbb (0x21), cccc (0x41). A handle is the GPU's UUID."""

    class NVMLError(Exception):
        pass

    GPUS = [("GPU-cccc-0041", 0x41), ("GPU-aaaa-0001", 0x01), ("GPU-bbbb-0021", 0x21)]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.GPUS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return self.GPUS[i][0]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in [u for u, _ in self.GPUS]:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle

    def nvmlDeviceGetPciInfo(self, handle: str) -> Any:
        return SimpleNamespace(domain=0, bus=dict(self.GPUS)[handle], device=0)

    # What DeviceMonitor reads: the GPU's name says which one it read.
    def nvmlDeviceGetName(self, handle: str) -> str:
        return f"H200 {handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(total=80 * 2**30, free=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return SimpleNamespace(gpu=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return []


PCI = "PCI_BUS_ID"


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML()
    monkeypatch.setattr(limits, "load_nvml", lambda: fake)
    monkeypatch.setattr(_device_monitor, "_nvml", lambda: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", PCI)
    return fake


# ---- the worker's environment ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "visible", "seen"),
    [
        ("cuda:1", None, "GPU-bbbb-0021"),  # the second GPU by PCI bus id, not by NVML's order
        ("cuda:0", None, "GPU-aaaa-0001"),
        ("cuda", None, "GPU-aaaa-0001"),
        ("cuda:0", "2,0", "GPU-cccc-0041"),  # indices in CUDA_VISIBLE_DEVICES: PCI bus order
        ("cuda:1", "2,0", "GPU-aaaa-0001"),
        ("cuda:1", "GPU-cccc-0041,GPU-bbbb-0021", "GPU-bbbb-0021"),
    ],
)
def test_a_cuda_workers_environment_names_its_one_gpu_by_uuid(
    fake_nvml: FakeNVML, device: str, visible: str | None, seen: str
) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert worker_env(device, lambda: fake_nvml, environ) == {
        "CUDA_VISIBLE_DEVICES": seen,
        "CUDA_DEVICE_ORDER": PCI,
    }


class _FakePopen:
    """Records how the worker would start and answers ``ready``; runs nothing."""

    started: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, args: list[str], *, pass_fds: tuple[int, int], env: dict, **_: Any):
        _FakePopen.started.append((args, env))
        os.write(pass_fds[1], encode(ReadyReply(pid=4242)).encode())
        self.pid = 4242
        out, said = os.pipe()  # it prints nothing
        os.close(said)
        self.stdout = os.fdopen(out, "rb")

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.fixture
def fake_popen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    _FakePopen.started = []
    monkeypatch.setattr(probe_worker.subprocess, "Popen", _FakePopen)
    return _FakePopen.started


def test_a_worker_for_cuda_1_starts_seeing_only_gpu_1(
    fake_nvml: FakeNVML, fake_popen: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to see every GPU: a workload's stray .cuda() landed on GPU 0, maybe a
    colleague's."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    with ProbeWorker("cuda:1") as w:
        w.start()
    (args, env) = fake_popen[0]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb-0021"
    assert env["CUDA_DEVICE_ORDER"] == PCI
    assert args[3] == "cuda:1"  # told the name the caller used: its results say cuda:1


def test_a_cpu_worker_starts_as_before(
    fake_nvml: FakeNVML, fake_popen: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    with ProbeWorker("cpu") as w:
        w.start()
    (_, env) = fake_popen[0]
    assert {k: v for k, v in env.items() if k != "PYTHONPATH"} == {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"
    }
    assert worker_env("cpu") == {}


def test_an_auto_worker_sees_the_first_gpu_only_and_none_where_there_is_none(
    fake_nvml: FakeNVML, fake_popen: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device: auto`` (the spec's default) gave the worker every GPU: it sees the one it runs
    on, as ``cuda:0`` does."""
    with ProbeWorker("auto") as w:
        w.start()
    assert fake_popen[0][1]["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa-0001"
    monkeypatch.setattr(FakeNVML, "GPUS", [])
    assert worker_env("auto", lambda: fake_nvml, {}) == {}


def test_without_nvml_a_worker_sees_its_gpu_by_pci_index_and_a_debug_line_says_so() -> None:
    def no_nvml() -> Any:
        raise ModuleNotFoundError("No module named 'pynvml'")

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG")
    try:
        env = worker_env("cuda:1", no_nvml, {})
    finally:
        logger.remove(sink)
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": PCI}
    assert any("NVML cannot name GPU 1" in line and "PCI bus order" in line for line in lines)


def test_a_user_order_other_than_pci_is_warned_about_and_the_worker_still_uses_pci(
    fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "_warned_order", False)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        env = worker_env("cuda:1", lambda: fake_nvml, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    finally:
        logger.remove(sink)
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-bbbb-0021", "CUDA_DEVICE_ORDER": PCI}
    assert len(lines) == 1 and "autotune numbers GPUs in PCI bus order" in lines[0]


@pytest.mark.parametrize(
    ("device", "environ", "message"),
    [
        (
            "cuda:1",
            {"CUDA_VISIBLE_DEVICES": "GPU-aaaa-0001"},
            "device cuda:1 does not exist: CUDA_VISIBLE_DEVICES='GPU-aaaa-0001' shows 1 GPU(s)",
        ),
        ("cuda:3", {}, "device cuda:3 does not exist: this machine has 3 GPU(s)"),
        (
            "cuda:0",
            {"CUDA_VISIBLE_DEVICES": "7"},
            "device cuda:0 (CUDA_VISIBLE_DEVICES entry 7) does not exist: this machine has 3",
        ),
    ],
)
def test_a_gpu_that_does_not_exist_is_one_error_line(
    fake_nvml: FakeNVML, device: str, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(DeviceError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        worker_env(device, lambda: fake_nvml, environ)


def test_inside_the_worker_its_one_gpu_is_cuda_0() -> None:
    one = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb-0021"}
    assert worker_device("cuda:1", one) == worker_device("cuda", one) == "cuda:0"
    assert worker_device("cpu", one) == "cpu"
    assert worker_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "0,1"}) == "cuda:1"


# ---- the service's view: the same GPU through NVML ---------------------------------------------


@pytest.mark.parametrize(
    ("visible", "seen"),
    [
        (None, ["GPU-aaaa-0001", "GPU-bbbb-0021", "GPU-cccc-0041"]),  # PCI bus order
        ("2,0", ["GPU-cccc-0041", "GPU-aaaa-0001"]),
        ("GPU-cccc-0041,GPU-aaaa-0001", ["GPU-cccc-0041", "GPU-aaaa-0001"]),
        ("GPU-bbbb,1", ["GPU-bbbb-0021", "GPU-bbbb-0021"]),  # a unique prefix, as CUDA takes
    ],
)
def test_the_service_reads_the_gpu_cuda_n_is(
    fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch, visible: str | None, seen: list[str]
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    devices = [f"cuda:{i}" for i in range(len(seen))]
    monitor = _device_monitor.DeviceMonitor(devices, own_pids=lambda: {os.getpid()})
    monitor.check()
    assert [monitor.read(d).description for d in devices] == [f"H200 {u}" for u in seen]


@pytest.mark.parametrize(
    ("visible", "count"),
    [("0,5,1", 1), ("GPU-aaaa-0001,1", 2), ("-1", 0), ("1, 2", 2), (None, 3)],
)
def test_the_visible_gpu_count_stops_where_cuda_does(
    fake_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch, visible: str | None, count: int
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert _device_monitor._visible_gpu_count() == count


def test_the_service_numbers_gpus_in_pci_bus_order_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "x")  # restored afterwards, whatever happens
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    _device_monitor.parse_devices("cpu")
    assert os.environ["CUDA_DEVICE_ORDER"] == PCI
    monkeypatch.setattr(limits, "_warned_order", True)  # said once per process; not here
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    _device_monitor.parse_devices("cpu")
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


# ---- on a real GPU ------------------------------------------------------------------------------

SHORT = ProbeSettings(warmup_steps=1, steps=2, check_every=2, min_time=0)
_CAND = Candidate(precision="fp32", batch_size=16, learning_rate=0.05)


@pytest.fixture
def seeing_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A workload that writes down, when the worker loads it, what the worker sees."""
    (tmp_path / "autotune_test_seeing.py").write_text(
        textwrap.dedent(
            """
            import json, os
            import torch
            from autotune.workloads import tiny_mlp

            def workload():
                props = torch.cuda.get_device_properties(0)
                stray = torch.zeros(1).cuda()  # no index: the current device
                with open(os.environ["AUTOTUNE_TEST_SEEN"], "w") as f:
                    json.dump({
                        "count": torch.cuda.device_count(),
                        "order": os.environ.get("CUDA_DEVICE_ORDER"),
                        "uuid": str(getattr(props, "uuid", "")),
                        "stray": str(stray.device),
                    }, f)
                return tiny_mlp()
            """
        )
    )
    seen = tmp_path / "seen.json"
    monkeypatch.setenv("AUTOTUNE_TEST_SEEN", str(seen))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    return seen


@pytest.mark.gpu
def test_a_gpu_worker_sees_only_its_gpu_and_reports_the_name_asked_for(
    seeing_workload: Path,
) -> None:
    last = torch.cuda.device_count() - 1
    device = f"cuda:{last}"
    with ProbeWorker(device) as w:
        facts = w.facts("autotune_test_seeing:workload", timeout=300)
        result = w.run("tiny_mlp", _CAND, SHORT, timeout=300)
    assert facts.device == device
    assert result.outcome == "completed" and result.device == device
    seen = json.loads(seeing_workload.read_text())
    assert seen["count"] == 1 and seen["order"] == PCI and seen["stray"] == "cuda:0"
    try:
        nvml = limits.load_nvml()
        expected = limits.gpu_handle(nvml, last)
        uuid = str(nvml.nvmlDeviceGetUUID(expected))
    except Exception:  # noqa: BLE001 - no NVML here: the UUID cannot be checked
        return
    hexes = [re.sub(r"[^0-9a-f]", "", u.lower()) for u in (uuid, seen["uuid"])]
    if len(hexes[1]) == 32:  # torch tells the UUID too: the same GPU
        assert hexes[0] == hexes[1]


@pytest.mark.gpu
def test_a_gpu_worker_runs_on_its_cuda_0_and_replies_with_the_callers_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's loop, in this process, as a worker for cuda:5 that sees one GPU (this
    process's CUDA_VISIBLE_DEVICES is left alone: CUDA here has already read it)."""
    monkeypatch.setattr(probe_worker, "worker_device", lambda device: "cuda:0")
    request = ProbeRequest(workload="tiny_mlp", candidate=_CAND, settings=SHORT)
    replies = StringIO()
    previous = signal.getsignal(signal.SIGINT)
    try:
        probe_worker._serve(StringIO(encode(request)), replies, "cuda:5")
    finally:
        signal.signal(signal.SIGINT, previous)
    reply = decode_reply(replies.getvalue().splitlines()[1])
    assert isinstance(reply, ResultReply), reply
    assert reply.result.outcome == Outcome.COMPLETED and reply.result.device == "cuda:5"
