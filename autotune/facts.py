"""What only the worker may find out: the workload's facts and the device's.

Importing a workload runs the user's code, and touching a GPU opens a CUDA context that holds
memory for as long as the process lives. The CLI and the service do neither: they ask the probe
worker (a ``facts`` request) and get a :class:`WorkerFacts` back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from autotune.config import Environment, current_environment
from autotune.precision import resolve_device, unsupported_modes
from autotune.workloads import Workload, load_workload

__all__ = ["WorkerFacts", "collect_facts", "device_memory", "workload_facts"]


class WorkerFacts(BaseModel):
    """A workload's facts and its device's, as the worker found them."""

    model_config = ConfigDict(extra="forbid")

    workload: str
    name: str
    base_lr: float
    base_batch_size: int
    lr_scaling: Literal["linear", "sqrt"]
    channels_last: bool
    # The class of what the workload's build_optimizer returns: the lr belongs to it.
    optimizer: str
    device: str
    # Modes this device cannot really run, each with the reason.
    unsupported: dict[str, str]
    # Bytes free and in all on the device (CUDA: the driver's view, other processes count, plus
    # what the worker's own allocator holds; CPU: MemAvailable and MemTotal); None when they
    # cannot be read.
    memory_free: int | None = None
    memory_total: int | None = None
    environment: Environment

    def memory_budget(self, margin: float) -> int | None:
        """Bytes a probe may use so that ``margin`` of the device's memory stays free.

        Example:
            >>> f = WorkerFacts.model_construct(memory_free=8 * 2**30, memory_total=16 * 2**30)
            >>> f.memory_budget(0.25) / 2**30
            4.0
        """
        if self.memory_free is None or self.memory_total is None:
            return None
        return max(0, int(self.memory_free - margin * self.memory_total))


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """``(free, total)`` bytes of a device; ``(None, None)`` when they cannot be read.

    On CUDA, free includes this process's allocator cache: its next probe reuses that memory,
    and a probe's peak counts it, so leaving it out would count it twice (a persistent worker's
    earlier probes would shrink the budget of later ones).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device)), int(total)
    try:
        info = {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
        }
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None, None


def workload_facts(workload: Workload) -> dict[str, object]:
    """The workload's own facts: name, base lr and batch, lr rule, memory format, optimizer."""
    probe = torch.nn.Parameter(torch.zeros(1))
    optimizer = type(workload.build_optimizer([probe], workload.base_lr)).__name__
    return {
        "workload": workload.reference or workload.name,
        "name": workload.name,
        "base_lr": workload.base_lr,
        "base_batch_size": workload.base_batch_size,
        "lr_scaling": workload.lr_scaling,
        "channels_last": workload.channels_last,
        "optimizer": optimizer,
    }


def collect_facts(reference: str, device: str | torch.device) -> WorkerFacts:
    """Load a workload and look at a device, here: call this only inside a worker process.

    Raises:
        WorkloadError: the reference cannot be loaded.
        DeviceError: the device does not exist.
    """
    dev = resolve_device(device)
    free, total = device_memory(dev)
    return WorkerFacts(
        **workload_facts(load_workload(reference)),
        device=str(dev),
        unsupported=unsupported_modes(dev),
        memory_free=free,
        memory_total=total,
        environment=current_environment(dev),
    )
