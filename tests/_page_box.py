"""A real ``autotune serve`` app over two simulated GPUs, in real time sped up: for the page's tests.

Run as a script: ``python tests/_page_box.py PORT FOLDER [TOKEN_FILE]``. The service, its
queue, scheduler, search and HTTP app are the real ones; only the devices are simulated
(``autotune.sim``, the ``h100-resnet18`` landscape) and the clock runs ``SPEED`` times faster
than the wall's, so a study of minutes runs in seconds of waiting, not of computing.

- ``cuda:0`` runs every probe after its 12th ``SLOW`` times slower (as a busy neighbour would
  make it): a study there stays in flight for minutes of real time, its trials coming about a
  second apart.
- ``cuda:1`` holds 12 GiB of another process (pid 4242) and runs at full speed.

While a file ``hold`` lies in FOLDER, the page's call for its view cookie (``POST
/page/session``) writes ``holding`` there and waits for it to go; the answer to each call that
waited then writes ``released``: a test can click the page's Forget while the page's opening
call is in flight.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from autotune.infra import clock
from autotune.infra.clock import SystemClock, VirtualClock
from autotune.service import (
    DeviceReading,
    SimulatedHardware,
    TuningService,
    create_app,
    load_token,
)
from autotune.service._device_monitor import ProcessUse
from autotune.sim import SimulatedRunner, load_landscape

SPEED = 30.0
SLOW = 12.0
GIB = 2**30
DEVICES = ["cuda:0", "cuda:1"]


class FastClock(VirtualClock):
    """The wall's clock, ``speed`` times faster: a wait of ``s`` seconds sleeps ``s / speed``."""

    def __init__(self, speed: float) -> None:
        super().__init__()
        self.speed = speed
        self._t0, self._w0 = time.monotonic(), time.time()

    def monotonic(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def time(self) -> float:
        return self._w0 + self.monotonic()

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.speed)

    sleep = advance

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        with cond:
            cond.wait(max(0.0, seconds) / self.speed)

    notify = SystemClock.notify
    start_thread = SystemClock.start_thread


class Monitor:
    """The two GPUs as NVML would show them: our worker's memory while a study runs there."""

    def __init__(self, description: str, total: int) -> None:
        self.devices = list(DEVICES)
        self.description, self.total = description, total
        self.service: TuningService | None = None

    def read(self, device: str, *, max_age: float = 0.0) -> DeviceReading:
        others = [ProcessUse(pid=4242, used_bytes=12 * GIB)] if device == "cuda:1" else []
        runs = self.service.scheduler.runs if self.service is not None else {}
        own = 31 * GIB if device in runs else 0
        held = own + sum(p.used_bytes or 0 for p in others)
        return DeviceReading(
            name=device, kind="cuda", description=self.description, total_bytes=self.total,
            free_bytes=self.total - held, utilization=87.0 if own else 0.0, own_bytes=own,
            others=others, others_bytes=sum(p.used_bytes or 0 for p in others),
        )  # fmt: skip

    def room_for(self, device: str, need_bytes: int, margin: float) -> str:
        return ""


def _hold_view_cookie(app: Any, folder: Path) -> None:
    """The page's call for its view cookie held while ``folder / "hold"`` exists."""

    @app.middleware("http")
    async def hold(request: Any, call_next: Any) -> Any:
        held = False
        if request.method == "POST" and request.url.path == "/page/session":
            while (folder / "hold").exists():
                if not held:
                    (folder / "holding").write_text("1")
                held = True
                await asyncio.sleep(0.05)
        response = await call_next(request)
        if held:
            (folder / "released").write_text("1")
        return response


def main(port: int, folder: Path, token_file: Path | None, private: bool = False) -> None:
    land = load_landscape("h100-resnet18")
    fast = FastClock(SPEED)
    slow = {n: SLOW for n in range(13, 100_000)}
    workers = {
        "cuda:0": SimulatedRunner(land, seed=1, clock=fast, device="cuda:0", slow_at=slow),
        "cuda:1": SimulatedRunner(land, seed=2, clock=fast, device="cuda:1"),
    }
    monitor = Monitor(land.device, land.memory_total_bytes)
    with clock.use(fast):
        service = TuningService(
            f"sqlite:///{folder / 'page.db'}",
            DEVICES,
            out_dir=folder / "out",
            token=load_token(token_file) if token_file else None,
            box=SimulatedHardware(monitor, workers, poll=5.0),
        )
        monitor.service = service
        app = create_app(service, loopback_only=True, private=private)
        _hold_view_cookie(app, folder)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        uvicorn.Server(config).run()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]) if len(sys.argv) > 3 else None,
        private=sys.argv[4:] == ["private"],
    )
