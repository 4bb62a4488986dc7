"""What other processes take of this machine's CPU while a search runs: measured from /proc,
our own process tree (the probe worker) left out, and said in the summary where it is
notable. Waits poll with a deadline; nothing asserts a timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.execution import contention
from autotune.execution.contention import CpuContention
from autotune.infra.clock import VirtualClock, use

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")


@pytest.fixture
def neighbour() -> Iterator[int]:
    """A busy loop outside this process's tree, as another user's job is (its parent exits, so
    it is not our descendant)."""
    shell = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", shell], capture_output=True, text=True).stdout)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_neighbours_busy_loop_is_counted_as_its_cores(neighbour: int) -> None:
    measure = CpuContention()
    deadline = time.monotonic() + 60
    taken = None
    while time.monotonic() < deadline:
        time.sleep(0.5)
        taken = measure.others_cores()
        if taken is not None and taken >= 0.5:
            break
    assert taken is not None and taken >= 0.5


def test_our_own_children_are_ours_not_a_neighbours() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = contention._ours(contention._snapshot())
        assert {os.getpid(), child.pid} <= ours
    finally:
        child.kill()
        child.wait()


def test_a_simulated_device_measures_no_contention() -> None:
    """A simulated device runs on a virtual clock: the real machine's load says nothing of it."""
    assert CpuContention().before is not None
    with use(VirtualClock()):
        measure = CpuContention()
    assert measure.before is None and measure.others_cores() is None


def test_the_service_waits_while_a_neighbour_keeps_the_cpu_busy(
    neighbour: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At load 8 on a 2-core box the service's page said "busy: no" and probes ran under
    contention: a CPU device is busy while others keep its cores busy, and says why."""
    from autotune.service._device_monitor import DeviceMonitor

    monkeypatch.setenv(contention.BUSY_ENV, "0.5")
    monitor = DeviceMonitor(["cpu"], own_pids=lambda: {os.getpid()})
    monitor._meter.window = 0.5
    deadline = time.monotonic() + 60
    reason = ""
    while not reason and time.monotonic() < deadline:
        time.sleep(0.6)
        reason = monitor.room_for("cpu", need_bytes=0, margin=0.0)
    assert "other processes kept" in reason and "AUTOTUNE_CPU_BUSY_CORES=0.5" in reason
    assert "kept busy by others" in monitor.read("cpu").description
    # Turned off, the same neighbour never makes it wait.
    monkeypatch.setenv(contention.BUSY_ENV, "off")
    quiet = DeviceMonitor(["cpu"], own_pids=lambda: {os.getpid()})
    quiet._meter.window = 0.0  # every reading measures since the last
    for _ in range(3):
        reading = quiet.read("cpu")
        assert not reading.busy
    assert "kept busy by others" in reading.description  # measured, and still not busy


@pytest.mark.parametrize("value", ["lots", "-1", "0", "nan"])
def test_a_bad_busy_threshold_is_one_error_naming_the_variable(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.errors import SpecError
    from autotune.service._device_monitor import DeviceMonitor

    monkeypatch.setenv(contention.BUSY_ENV, value)
    with pytest.raises(SpecError, match="AUTOTUNE_CPU_BUSY_CORES=.*a positive number.*or off"):
        DeviceMonitor(["cpu"], own_pids=lambda: {os.getpid()})
