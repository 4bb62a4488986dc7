"""The CLI and the service open no CUDA context in their own process.

A context holds about half a GiB of the GPU for as long as the process lives, on a box shared
with colleagues; only the probe worker may open one. These tests forbid every context-opening
torch call in the calling process (tests/_no_cuda_parent.py) and, on a CPU, fake a visible GPU
so that the code which would have touched it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from autotune.errors import DeviceError
from autotune.execution.probe_worker import WorkerMemory
from autotune.measure.precision import resolve_device

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "_no_cuda_parent.py"
FORBIDDEN = "CUDA was initialised in the calling process"
_GIB = 2**30


def _forbid(*args: object, **kwargs: object) -> None:
    raise RuntimeError(FORBIDDEN)


@pytest.fixture
def fake_gpu_no_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """One visible GPU, and every call that would open a context on it raises."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("_lazy_init", "init", "current_device", "mem_get_info", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, _forbid)
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", _forbid)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def _drive(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DRIVER), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("text", ["auto", "cuda", "cuda:0"])
def test_resolve_device_counts_gpus_without_opening_a_context(
    fake_gpu_no_context: None, text: str
) -> None:
    assert resolve_device(text) == torch.device("cuda", 0)


def test_resolve_device_names_a_missing_gpu_without_opening_a_context(
    fake_gpu_no_context: None,
) -> None:
    with pytest.raises(DeviceError, match=r"1 CUDA device\(s\) visible \(cuda:0..cuda:0\)"):
        resolve_device("cuda:1")


def test_help_imports_no_service_stack() -> None:
    """`autotune --help` (and every command that does not serve) runs without fastapi."""
    code = (
        "import sys\n"
        "sys.argv = ['autotune', '--help']\n"
        "from autotune.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules)\n"
        "print('LOADED', loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "serve" in done.stdout  # the help was printed, service commands included
    assert "LOADED []" in done.stdout, done.stdout[-500:] + done.stderr[-2000:]


class _FakeNVML:
    """pynvml with one 80 GiB GPU: our worker holds ``ours`` under a pid we do not know (a
    container numbers its processes its own way), a colleague holds ``theirs`` as pid 200."""

    class NVMLError(Exception):
        pass

    def __init__(self, ours: int, theirs: int) -> None:
        self.ours, self.theirs = ours, theirs

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        total = 80 * _GIB
        return type("M", (), {"total": total, "free": total - self.ours - self.theirs})()

    def nvmlDeviceGetName(self, h: Any) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return type("U", (), {"gpu": 0})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        proc = lambda pid, used: type("P", (), {"pid": pid, "usedGpuMemory": used})()  # noqa: E731
        return [proc(4242, self.ours), proc(200, self.theirs)]


def _monitor(monkeypatch: pytest.MonkeyPatch, nvml: Any, report: WorkerMemory | None) -> Any:
    devices = pytest.importorskip("autotune.service._device_monitor")
    if nvml is None:

        def no_nvml() -> Any:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

        monkeypatch.setattr(devices, "_nvml", no_nvml)
    else:
        monkeypatch.setattr(devices, "_nvml", lambda: nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return devices.DeviceMonitor(
        ["cuda:0"], own_pids=lambda: {os.getpid(), 100}, worker_memory=lambda d: report
    )


def test_the_workers_cache_is_its_own_memory_when_nvml_cannot_tell_its_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Our worker holds 60 GiB (an earlier probe's cache), a colleague 4 GiB: 16 GiB free.
    report = WorkerMemory(free=16 * _GIB, total=80 * _GIB, reserved=60 * _GIB)
    monitor = _monitor(monkeypatch, _FakeNVML(ours=60 * _GIB, theirs=4 * _GIB), report)
    reading = monitor.read("cuda:0")
    assert reading.own_bytes == 60 * _GIB
    assert reading.others_bytes == 4 * _GIB
    # A 50 GiB probe fits in the worker's own cache plus what is free, with 10% kept free.
    assert monitor.room_for("cuda:0", 50 * _GIB, 0.1) == ""
    assert "waiting for other work" in monitor.room_for("cuda:0", 70 * _GIB, 0.1)


def test_without_nvml_the_service_reads_the_workers_report_and_opens_no_context(
    monkeypatch: pytest.MonkeyPatch, fake_gpu_no_context: None
) -> None:
    report: list[WorkerMemory | None] = [None]
    devices = pytest.importorskip("autotune.service._device_monitor")
    monkeypatch.setattr(devices, "_nvml", _forbid)
    monitor = devices.DeviceMonitor(
        ["cuda:0"], own_pids=lambda: {os.getpid()}, worker_memory=lambda d: report[0]
    )
    before = monitor.read("cuda:0")
    assert (before.free_bytes, before.total_bytes) == (None, None)  # no report yet: unknown
    assert monitor.room_for("cuda:0", 10 * _GIB, 0.1) == ""
    report[0] = WorkerMemory(free=6 * _GIB, total=80 * _GIB, reserved=20 * _GIB)
    after = monitor.read("cuda:0")
    assert (after.free_bytes, after.total_bytes, after.own_bytes) == (
        6 * _GIB,
        80 * _GIB,
        20 * _GIB,
    )
    assert monitor.room_for("cuda:0", 18 * _GIB, 0.1) == ""
    assert "waiting for other work" in monitor.room_for("cuda:0", 24 * _GIB, 0.1)


def _tiny_search(tmp_path: Path, device: str, budget: str) -> list[str]:
    return [
        "cli",
        "search",
        str(ROOT / "studies" / "tiny.yaml"),
        "--device",
        device,
        "--budget",
        budget,
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        "--out",
        str(tmp_path / "out"),
        "--quiet",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes a GPU; the gpu test runs on one")
def test_cli_search_leaves_the_gpu_to_its_worker(tmp_path: Path) -> None:
    """With a GPU faked here, the search gets as far as the worker, which has none."""
    # (A budget the worker's start fits in beside a busy neighbour: one that ran out first would
    # stop the worker before it could say it has no GPU.)
    done = _drive("--fake-gpu", *_tiny_search(tmp_path, "cuda", "30s"))
    assert FORBIDDEN not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "no CUDA device is visible" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes a GPU; the gpu test runs on one")
def test_the_service_leaves_the_gpu_to_its_worker(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    spec = yaml.safe_load((ROOT / "studies" / "tiny.yaml").read_text())
    spec.update(name="ctx", device="cuda", budget="30s")
    spec_file = tmp_path / "ctx.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = _drive("--fake-gpu", "service", f"sqlite:///{tmp_path / 's.db'}", str(spec_file))
    assert done.returncode == 0, done.stderr[-3000:]
    ended = json.loads(done.stdout.strip().splitlines()[-1])
    assert FORBIDDEN not in ended["detail"]
    # The worker, with no GPU, says so; the service itself never looked.
    assert ended["state"] == "failed" and "no CUDA device is visible" in ended["detail"]
    assert ended["devices"][0]["name"] == "cuda:0"


@pytest.mark.gpu
def test_a_search_on_a_gpu_opens_no_context_in_the_calling_process(tmp_path: Path) -> None:
    done = _drive(*_tiny_search(tmp_path, "cuda", "15s"))
    assert FORBIDDEN not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "best.json").is_file()
