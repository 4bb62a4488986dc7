"""What each device has to spare: free and total memory, utilisation, and who else uses it (NVML
on a GPU, ``/proc`` on the CPU)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from autotune.errors import DeviceError, SpecError
from autotune.execution.contention import BUSY_ENV, CoreMeter, busy_cores, cores
from autotune.execution.limits import (
    VISIBLE_ENV,
    gpu_handle,
    load_nvml,
    pci_bus_order,
    visible_entries,
)
from autotune.infra import clock

if TYPE_CHECKING:
    from autotune.execution.probe_worker import WorkerMemory
    from autotune.search import Event

__all__ = [
    "BUSY_UTILIZATION",
    "DeviceMonitor",
    "DeviceReading",
    "ProcessUse",
    "SimulatedHardware",
    "parse_devices",
]

# NVML samples utilisation over the last second or so; half the SMs busy with someone else's
# kernels means our timings would be noise and their job would slow down.
BUSY_UTILIZATION = 50.0

_GIB = 2**30


@dataclass
class ProcessUse:
    """Another process on a device and the memory it holds (None where the driver hides it)."""

    pid: int
    used_bytes: int | None = None


@dataclass
class DeviceReading:
    """One look at a device."""

    name: str
    kind: str
    description: str
    total_bytes: int | None = None
    free_bytes: int | None = None
    # GPU only: NVML's sampled utilisation in percent.
    utilization: float | None = None
    # Memory our own processes (the service and its worker) hold there.
    own_bytes: int = 0
    others: list[ProcessUse] = field(default_factory=list)
    others_bytes: int | None = None
    # Why the device is left alone now; empty when it is not busy.
    busy_reason: str = ""

    @property
    def busy(self) -> bool:
        return bool(self.busy_reason)


def parse_devices(text: str | None, *, gpu_count: Callable[[], int] | None = None) -> list[str]:
    """``cpu`` → ``["cpu"]``; ``0,1`` or ``cuda:0,cuda:1`` → ``["cuda:0", "cuda:1"]``.

    GPU indices are in PCI bus order, whatever CUDA's default: this sets
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in this process where it is unset (the service calls this
    first, before anything reads a GPU).

    Args:
        text: the ``--devices`` value; None means every visible GPU, or the CPU without one.
        gpu_count: how many GPUs are visible (NVML by default).

    Raises:
        SpecError: naming the bad entry and what would work.

    Example:
        >>> parse_devices("0,cuda:1")
        ['cuda:0', 'cuda:1']
    """
    pci_bus_order()
    if text is None or not text.strip():
        count = (gpu_count or _visible_gpu_count)()
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    out: list[str] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if item == "cpu":
            name = "cpu"
        elif re.fullmatch(r"(cuda:)?\d+", item):
            name = f"cuda:{item.removeprefix('cuda:')}"
        else:
            raise SpecError(
                f"--devices takes cpu or GPU indices like 0,1, got an entry {raw.strip()!r} in "
                f"--devices {text!r}"
            )
        if name not in out:
            out.append(name)
    return out


def _visible_gpu_count() -> int:
    """GPUs this process may use, without creating a CUDA context."""
    visible = os.environ.get(VISIBLE_ENV)
    try:
        nvml = _nvml()
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:  # no NVML: ask torch (it counts without creating a context)
        import torch

        return torch.cuda.device_count()
    if visible is None:
        return count
    # CUDA stops at the first invalid entry (e.g. -1, or an index past the last GPU).
    entries = visible_entries(visible)
    for n, entry in enumerate(entries):
        if entry.isdigit() and int(entry) >= count:
            return n
    return len(entries)


def _nvml() -> Any:
    """The initialised ``pynvml`` module (initialised once per process)."""
    return load_nvml()


def _nvml_handle(nvml: Any, index: int) -> Any:
    """The NVML handle of ``cuda:index`` as autotune numbers GPUs: the index-th entry of
    ``CUDA_VISIBLE_DEVICES`` (a UUID, or an index in PCI bus order), else the index-th GPU in
    PCI bus order (:func:`parse_devices` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` where unset, so
    CUDA numbers them alike)."""
    return gpu_handle(nvml, index)


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def _rss(pid: int) -> int:
    """Resident memory of a process in bytes; 0 when it is gone."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class DeviceMonitor:
    """Reads the devices a service schedules on.

    Args:
        devices: ``cpu`` and/or ``cuda:N`` names (see :func:`parse_devices`).
        own_pids: the service's own processes (itself and its workers): their use of a device
            is ours, not a colleague's.
        probing: whether the utilisation of a device may be our own now (our probe runs there,
            or has just ended).
        worker_memory: what our probe worker on a device last reported of its memory (None
            before its first report).

    Example:
        >>> monitor = DeviceMonitor(["cpu"], own_pids=lambda: {os.getpid()})
        >>> monitor.read("cpu").kind
        'cpu'
    """

    def __init__(
        self,
        devices: list[str],
        *,
        own_pids: Callable[[], set[int]],
        probing: Callable[[str], bool] | None = None,
        worker_memory: Callable[[str], WorkerMemory | None] | None = None,
    ) -> None:
        self.devices = list(devices)
        self.own_pids = own_pids
        self.probing = probing or (lambda device: False)
        self.worker_memory = worker_memory or (lambda device: None)
        self._warned_fallback = False
        self._cache: dict[str, tuple[float, DeviceReading]] = {}
        # Others' cores at which the CPU is busy (None: never); read once, so a bad value
        # stops the service at its start.
        self.busy_cores = busy_cores()
        self._meter = CoreMeter()

    def check(self) -> None:
        """Fail early when a configured device does not exist on this machine.

        Raises:
            DeviceError: naming the device and what is visible.
        """
        for device in self.devices:
            if device == "cpu":
                continue
            index = int(device.split(":")[1])
            count = _visible_gpu_count()
            if index >= count:
                raise DeviceError(
                    f"--devices names {device}, but {count} GPU(s) are visible here"
                    + (f" (cuda:0..cuda:{count - 1})" if count else "; use --devices cpu")
                )

    def read(self, device: str, *, max_age: float = 0.0) -> DeviceReading:
        """One reading of ``device``: memory, utilisation, other processes, busy or not.

        Args:
            device: the device's name.
            max_age: a reading up to this many seconds old will do (status pages use one;
                scheduling decisions read afresh).
        """
        now = clock.now()
        cached = self._cache.get(device)
        if cached is not None and now - cached[0] <= max_age:
            return cached[1]
        reading = self._read_cpu() if device == "cpu" else self._read_cuda(device)
        self._cache[device] = (now, reading)
        return reading

    def room_for(self, device: str, need_bytes: int, margin: float) -> str:
        """Why a probe needing ``need_bytes`` cannot start on ``device`` now; empty if it can.

        The device must be free of other people's work, and its free memory (plus what our own
        worker already holds) must cover the need plus ``margin`` of the total.
        """
        r = self.read(device)
        if r.busy:
            return r.busy_reason
        if r.free_bytes is None or r.total_bytes is None:
            return ""
        want = need_bytes + margin * r.total_bytes
        have = r.free_bytes + r.own_bytes
        if have < want:
            return (
                f"{device} has {have / _GIB:.2f} GiB free; the next probe needs about "
                f"{need_bytes / _GIB:.2f} GiB plus the {margin:.0%} margin "
                f"({want / _GIB:.2f} GiB): waiting for other work to free memory"
            )
        return ""

    # ---- readers ---------------------------------------------------------------------------

    def _read_cpu(self) -> DeviceReading:
        info = _meminfo()
        total, free = info.get("MemTotal"), info.get("MemAvailable")
        own = sum(_rss(pid) for pid in self.own_pids())
        others = None if total is None or free is None else max(0, total - free - own)
        taken = self._meter.read(self.own_pids())
        busy = ""
        if taken is not None and self.busy_cores is not None and taken >= self.busy_cores:
            busy = (
                f"other processes kept {taken:.1f} of {cores()} cores busy over the last "
                f"{self._meter.seconds:.0f}s ({BUSY_ENV}={self.busy_cores:g}): waiting, so "
                "probes are timed on a quiet CPU"
            )
        return DeviceReading(
            name="cpu",
            kind="cpu",
            description=f"{cores()} cores"
            + (f", {taken:.1f} kept busy by others" if taken is not None else ""),
            total_bytes=total,
            free_bytes=free,
            own_bytes=own,
            others_bytes=others,
            busy_reason=busy,
        )

    def _read_cuda(self, device: str) -> DeviceReading:
        index = int(device.split(":")[1])
        try:
            nvml = _nvml()
            handle = _nvml_handle(nvml, index)
            return self._read_nvml(nvml, handle, device)
        except DeviceError:
            raise
        except Exception as exc:  # NVML missing or failing: what our worker saw
            return self._read_reported(device, exc)

    def _read_nvml(self, nvml: Any, handle: Any, device: str) -> DeviceReading:
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            util: float | None = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            util = None
        try:
            procs = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except nvml.NVMLError:
            procs = []
        mine = self.own_pids()
        own = others_bytes = 0
        others: list[ProcessUse] = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            used = int(used) if isinstance(used, int) else None
            if p.pid in mine:
                own += used or 0
            else:
                others.append(ProcessUse(pid=int(p.pid), used_bytes=used))
                others_bytes += used or 0
        reported = self.worker_memory(device)
        if reported is not None and reported.reserved > own:
            # NVML did not tie our worker's memory to its pid: take it out of the neighbours'.
            others_bytes = max(0, others_bytes - (reported.reserved - own))
            own = reported.reserved
        reading = DeviceReading(
            name=device,
            kind="cuda",
            description=name,
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            utilization=util,
            own_bytes=own,
            others=others,
            others_bytes=others_bytes,
        )
        # While our probe runs the utilisation is (at least partly) ours: not a reason to wait.
        if util is not None and util >= BUSY_UTILIZATION and not self.probing(device):
            pids = ", ".join(str(p.pid) for p in others[:5]) or "not visible from here"
            reading.busy_reason = (
                f"{device} is {util:.0f}% utilised by another process (pids: {pids}); "
                f"autotune waits below {BUSY_UTILIZATION:.0f}%"
            )
        return reading

    def _read_reported(self, device: str, why: Exception) -> DeviceReading:
        """Without NVML: the device's memory as our worker last reported it (nothing before
        its first probe). Never torch here: it would open a CUDA context in the service."""
        if not self._warned_fallback:
            logger.warning(
                "NVML cannot read {} ({}); the service uses what its probe worker reports after "
                "each probe, and cannot see other processes there; pip install nvidia-ml-py",
                device,
                why,
            )
            self._warned_fallback = True
        reported = self.worker_memory(device)
        return DeviceReading(
            name=device,
            kind="cuda",
            description="CUDA device (NVML unavailable)",
            total_bytes=None if reported is None else reported.total,
            free_bytes=None if reported is None else reported.free,
            own_bytes=0 if reported is None else reported.reserved,
        )


@dataclass
class SimulatedHardware:
    """What a simulated box gives the scheduler in place of this machine's devices.

    Attributes:
        monitor: reads the simulated devices (``devices``, ``read``, ``room_for``).
        workers: each device's simulated probe worker.
        poll: seconds between looks at an empty queue (simulated seconds).
        observer: told ``(study name, event)`` for every event of every study's search.
    """

    monitor: Any
    workers: dict[str, Any]
    poll: float = 5.0
    observer: Callable[[str, Event], None] | None = None

    def scheduling(self) -> dict[str, Any]:
        return {"workers": self.workers, "poll": self.poll, "observer": self.observer}
