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

from autotune.clock import VirtualClock, use
from autotune.execution import contention
from autotune.execution.contention import CpuContention

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
