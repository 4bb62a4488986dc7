"""``python -m autotune.testing.busy ARGS``: the command line, with a colleague's job faked on
every device while ``AUTOTUNE_FAKE_BUSY_FILE`` exists."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from autotune.service import DeviceMonitor, DeviceReading

__all__ = ["FAKE_BUSY_ENV", "install"]

FAKE_BUSY_ENV = "AUTOTUNE_FAKE_BUSY_FILE"


def install(path: Path) -> None:
    """Make every :class:`DeviceMonitor` in this process read busy while ``path`` exists."""
    real_read = DeviceMonitor.read

    def read(self: DeviceMonitor, device: str, *, max_age: float = 0.0) -> DeviceReading:
        reading = real_read(self, device, max_age=max_age)
        if not path.exists():
            return reading
        # A copy: the monitor's cached reading stays what the device said.
        why = f"{device} is used by another process ({FAKE_BUSY_ENV} file {path} exists)"
        return dataclasses.replace(reading, busy_reason=why)

    DeviceMonitor.read = read  # type: ignore[method-assign]


if __name__ == "__main__":
    from autotune.cli import main

    if os.environ.get(FAKE_BUSY_ENV):
        install(Path(os.environ[FAKE_BUSY_ENV]))
    main()
