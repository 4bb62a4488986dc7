"""Finding the facts, in the worker: the workload loaded and asked, the device looked at
(returned as :class:`~autotune.execution.facts.WorkerFacts`)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from autotune.errors import WorkloadError
from autotune.execution.facts import WorkerFacts
from autotune.measure.precision import resolve_device, unsupported_modes
from autotune.schema.config import (
    MAX_OPTIMIZER_KWARGS,
    current_environment,
    is_lr_schedule,
    is_optimizer_setting,
)
from autotune.workloads import Workload, load_workload

__all__ = ["collect_facts", "device_memory", "optimizer_settings", "workload_facts"]

# Optimizer arguments that choose how the update runs (kernels, graph capture, autograd through
# it), not what it computes: a config does not pin them to the tuning machine's choice.
_HOW_IT_RUNS = frozenset({"foreach", "fused", "capturable", "differentiable"})


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


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """An optimizer's constructor arguments besides ``params`` and ``lr``, as it was built.

    What changes only how it runs (``foreach``, ``fused``, ...) is left out: an export rebuilds
    the same update on another device. None when a setting is not a plain value (a tensor, a
    callable) that a config can hold.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
        >>> optimizer_settings(opt)
        {'momentum': 0.9, 'dampening': 0, 'weight_decay': 0, 'nesterov': False, 'maximize': False}
    """
    params = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: dict[str, Any] = {}
    for key, value in optimizer.defaults.items():
        if key in ("params", "lr") or key in _HOW_IT_RUNS or not (key in params or takes_any):
            continue  # AdamW's defaults hold decoupled_weight_decay, which it does not take
        value = list(value) if isinstance(value, tuple) else value
        if not (key.isidentifier() and len(key) <= 64 and is_optimizer_setting(value)):
            return None  # what a config cannot hold is not recorded at all
        out[key] = value
    if len(out) > MAX_OPTIMIZER_KWARGS:
        return None
    return out


def workload_facts(workload: Workload) -> dict[str, object]:
    """The workload's own facts: name, base lr and batch, lr rule, memory format, optimizer,
    lr schedule.

    Raises:
        WorkloadError: the workload's ``lr_schedule`` is not a name a config can hold.
    """
    if not is_lr_schedule(workload.lr_schedule):
        # Checked here, before the search, not when the config is written at its end.
        raise WorkloadError(
            f"workload {workload.name!r}: lr_schedule={workload.lr_schedule!r} is not a "
            "schedule's name; use a word such as 'constant', 'linear' or 'CosineAnnealingLR'"
        )
    probe = torch.nn.Parameter(torch.zeros(1))
    built = workload.build_optimizer([probe], workload.base_lr)
    return {
        "workload": workload.reference or workload.name,
        "name": workload.name,
        "base_lr": workload.base_lr,
        "base_batch_size": workload.base_batch_size,
        "lr_scaling": workload.lr_scaling,
        "channels_last": workload.channels_last,
        "optimizer": type(built).__name__,
        "optimizer_kwargs": optimizer_settings(built),
        "lr_schedule": workload.lr_schedule,
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
