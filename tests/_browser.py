"""Headless Chromium for tests, driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` reads commands on file descriptor 3 and writes answers and events on
4, each a JSON object ended by a NUL byte: no port to find, nothing another process can reach.
A test opens pages, runs a line of script in them, reads what they show and takes screenshots.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

# Debian's package; .ci/run installs it.
CHROMIUM = shutil.which("chromium")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
]


def _high(fd: int) -> int:
    """The same pipe end as a descriptor numbered 100 or above, so that putting the pipe on 3
    and 4 in the child never overwrites the other end."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 100)
    os.close(fd)
    return high


class Browser:
    """One headless Chromium with one page.

    Args:
        profile: an empty folder for its profile.
        width, height: the window, in CSS pixels.
    """

    def __init__(self, profile: Path, *, width: int = 1280, height: int = 900) -> None:
        assert CHROMIUM is not None, "needs Debian's chromium package"
        to_browser_r, self._to_browser = (_high(fd) for fd in os.pipe())
        self._from_browser, from_browser_w = (_high(fd) for fd in os.pipe())
        # The browser reads on 3 and writes on 4: put the pipe ends there as it starts.
        redirect = f"3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-"
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" {redirect}', "chromium", CHROMIUM, *FLAGS,
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next = 0
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="chromium-pipe", daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        # A screenshot shows the page, not a scroll bar across part of it.
        self.call("Emulation.setScrollbarsHidden", session=True, hidden=True)
        self.size(width, height)

    # ---- the protocol ------------------------------------------------------------------------

    def _read(self) -> None:
        buf = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                buf += chunk
                while b"\0" in buf:
                    raw, buf = buf.split(b"\0", 1)
                    message = json.loads(raw)
                    if "id" in message:
                        with self._lock:
                            box = self._answers.get(message["id"])
                        if box is not None:
                            box.put(message)

    def call(
        self, method: str, *, session: bool = False, timeout: float = 30, **params: Any
    ) -> Any:
        """Send one command; its result, or AssertionError with the browser's error."""
        with self._lock:
            self._next += 1
            ident = self._next
            box: queue.Queue[dict[str, Any]] = queue.Queue()
            self._answers[ident] = box
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        try:
            answer = box.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"chromium did not answer {method} within {timeout}s") from None
        finally:
            with self._lock:
                self._answers.pop(ident, None)
        if "error" in answer:
            raise AssertionError(f"chromium refused {method}: {answer['error']}")
        return answer.get("result", {})

    # ---- what a test does --------------------------------------------------------------------

    def size(self, width: int, height: int, *, mobile: bool = False) -> None:
        """Resize the page's viewport (``mobile``: as a phone shows it)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=2 if mobile else 1,
            mobile=mobile,
        )

    def open(self, url: str, timeout: float = 20) -> None:
        """Go to ``url`` and wait until it has loaded."""
        self.call("Page.navigate", session=True, url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def js(self, expression: str) -> Any:
        """The value of a line of script in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"the page's script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float, what: str = "") -> Any:
        """Until ``expression`` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what or expression}")

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the window too) as a PNG."""
        metrics = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"], "scale": 1}
        data = self.call(
            "Page.captureScreenshot",
            session=True,
            format="png",
            captureBeyondViewport=True,
            clip=clip,
        )["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(AssertionError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
