"""A process that leaves without the interpreter's teardown keeps what a user would notice: its
exit code, its buffered output, its exit hooks, and a thread still at work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_leave_keeps_the_code_the_output_and_the_exit_hooks(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    done = _run(
        "import atexit, pathlib, sys\n"
        "from autotune.infra.leave import leave\n"
        f"atexit.register(pathlib.Path({str(hook)!r}).write_text, 'ran')\n"
        "sys.stdout.write('no newline, still buffered')\n"
        "sys.stderr.write('and on stderr')\n"
        "leave(3)\n"
        "print('never reached')\n"
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "no newline, still buffered"
    assert done.stderr == "and on stderr"
    assert hook.read_text() == "ran"


def test_leave_waits_like_a_plain_exit_while_another_thread_works(tmp_path: Path) -> None:
    out = tmp_path / "thread"
    done = _run(
        "import pathlib, threading, time\n"
        "from autotune.infra.leave import leave\n"
        "def work():\n"
        "    time.sleep(0.3)\n"
        f"    pathlib.Path({str(out)!r}).write_text('finished')\n"
        "threading.Thread(target=work).start()\n"
        "leave(0)\n"
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "finished"


def test_a_message_is_printed_and_exits_1_as_sys_exit_does() -> None:
    done = _run("from autotune.infra.leave import leave\nleave('error: spelled out')\n")
    assert done.returncode == 1
    assert "error: spelled out" in done.stderr
