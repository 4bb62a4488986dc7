"""What a probe worker says, and how it ended: its workload's stdout and stderr, read as written,
the last :data:`TAIL_BYTES` of each request kept and the rest counted and dropped."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import termios
import threading
import time
from typing import IO

__all__ = ["TAIL_BYTES", "CapturedOutput", "how_it_ended", "last_words"]

# The most of one request's output kept (the end of it).
TAIL_BYTES = 2048
# The most seconds a take waits for output still in the pipe.
_DRAIN = 0.5


class CapturedOutput:
    """Reads a worker's merged stdout and stderr on a thread of its own until the pipe closes.

    Example:
        >>> r, w = os.pipe()
        >>> out = CapturedOutput(os.fdopen(r, "rb"))
        >>> _ = os.write(w, b"x" * 5000 + b"last line\\n"); os.close(w)
        >>> tail, written = out.take()
        >>> tail.endswith("last line\\n"), len(tail.encode()), written
        (True, 2048, 5010)
    """

    def __init__(self, pipe: IO[bytes]) -> None:
        self._fd = pipe.fileno()
        self._pipe = pipe
        self._lock = threading.Lock()
        self._tail = bytearray()
        self._written = 0
        self._thread = threading.Thread(target=self._read, name="worker-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while True:
                select.select([self._fd], [], [])
                # Read under the lock: what has left the pipe is in the tail before a take.
                with self._lock:
                    chunk = os.read(self._fd, 1 << 16)
                    if not chunk:
                        break
                    self._tail += chunk
                    del self._tail[:-TAIL_BYTES]
                    self._written += len(chunk)
        with contextlib.suppress(OSError):
            self._pipe.close()

    def _pending(self) -> bool:
        """Whether the pipe still holds output the thread has not read."""
        if not self._thread.is_alive():
            return False
        size = array.array("i", [0])
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, size)
        except OSError:
            return False
        return size[0] > 0

    def take(self) -> tuple[str, int]:
        """What was written since the last take: ``(tail, bytes written)``, the tail its last
        :data:`TAIL_BYTES` as text. Waits a moment for what is still in the pipe."""
        deadline = time.monotonic() + _DRAIN
        while self._pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            tail, written = bytes(self._tail), self._written
            self._tail.clear()
            self._written = 0
        return tail.decode(errors="replace"), written

    def peek(self) -> str:
        """The tail so far, as text, without taking it."""
        with self._lock:
            return bytes(self._tail).decode(errors="replace")

    def join(self, timeout: float) -> None:
        """Wait for the pipe to close (the worker has exited) and its last output to be read."""
        self._thread.join(timeout)


def last_words(tail: str, limit: int = 300) -> str:
    """The end of a worker's output as one clause for a reason, or ``""`` when it said nothing.

    Example:
        >>> last_words("step 1\\nOpenBLAS error: Memory allocation still failed\\n")
        '; its last output: step 1 | OpenBLAS error: Memory allocation still failed'
    """
    text = " | ".join(line.strip() for line in tail.strip().splitlines() if line.strip())
    if not text:
        return ""
    return "; its last output: " + (text if len(text) <= limit else "…" + text[-limit:])


def how_it_ended(proc: subprocess.Popen | None) -> str:
    """How a worker whose pipe just closed ended: ``exit code 1``, ``killed by SIGKILL``.

    The pipe closes a moment before the process can be reaped: wait a little for its code.
    """
    if proc is None:
        return "no process"
    try:
        code = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return "its pipe closed, the process still runs"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
