"""The probe worker's limits: the memory a CPU worker may map (``AUTOTUNE_WORKER_MEMORY``), and
the one GPU a GPU worker sees."""

from __future__ import annotations

import math
import os
import re
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from autotune.errors import DeviceError, SpecError

__all__ = [
    "DEFAULT_SHARE",
    "MEMORY_ENV",
    "ORDER_ENV",
    "VISIBLE_ENV",
    "apply_memory_limit",
    "check_memory_limit",
    "format_bytes",
    "gpu_handle",
    "limit_note",
    "load_nvml",
    "machine_memory",
    "parse_size",
    "pci_bus_order",
    "startup_address_space",
    "too_small",
    "visible_entries",
    "worker_device",
    "worker_env",
    "worker_memory_limit",
]

MEMORY_ENV = "AUTOTUNE_WORKER_MEMORY"
# Of the machine's memory, what a CPU worker may map by default.
DEFAULT_SHARE = 0.75

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str, name: str = MEMORY_ENV) -> int:
    """``8G`` → 8 GiB in bytes; ``512M``, ``16GiB``, ``1.5g`` and plain bytes too; ``0`` is 0.

    Raises:
        SpecError: naming ``name``, the value and the forms that work.

    Example:
        >>> parse_size("8G"), parse_size("512MiB"), parse_size("0")
        (8589934592, 536870912, 0)
    """
    match = _SIZE.match(text.strip())
    if match is None:
        raise SpecError(
            f"{name} must be a size like 8G, 512M or 16GiB (or 0 for no limit), got {name}={text!r}"
        )
    return int(float(match[1]) * _UNITS[match[2].lower()])


def format_bytes(size: int) -> str:
    """``6442450944`` → ``'6.0 GiB'``."""
    return f"{size / 2**30:,.1f} GiB"


def machine_memory() -> int | None:
    """The machine's memory in bytes (``MemTotal``); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def worker_memory_limit(device: str) -> int | None:
    """The address-space limit in bytes for a worker on ``device``; None for no limit.

    Args:
        device: the worker's device; only ``cpu`` gets a limit (see the module's note on CUDA),
            and ``auto``, whose worker applies it where it finds no GPU.

    Raises:
        SpecError: ``AUTOTUNE_WORKER_MEMORY`` is not a size.

    Example:
        >>> worker_memory_limit("cuda:0") is None
        True
    """
    text = os.environ.get(MEMORY_ENV, "").strip()
    # Parsed whatever the device, so a typo is refused on every machine alike.
    size = parse_size(text) if text else None
    # CPU only: CUDA maps far more address space than it uses, and RLIMIT_AS (or RLIMIT_DATA)
    # would make it fail to initialise; a GPU's memory is bounded by the device itself.
    if not device.strip().lower().startswith(("cpu", "auto")):
        return None
    if size is not None:
        return size or None
    total = machine_memory()
    return int(total * DEFAULT_SHARE) if total else None


def apply_memory_limit(limit: int | None) -> None:
    """Limit this process's address space to ``limit`` bytes (the soft limit; None: none).

    Called by the worker itself, first thing: an allocation past it fails (``can't allocate
    memory``) and the probe ends as ``oom``, where the machine would otherwise swap or kill.
    """
    if not limit:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def limit_note(limit: int) -> str:
    """What a reason adds when a worker under ``limit`` ran out of memory.

    Example:
        >>> limit_note(6 * 2**30)
        'the worker may map at most 6.0 GiB (AUTOTUNE_WORKER_MEMORY; raise it, or 0 for no limit)'
    """
    return (
        f"the worker may map at most {format_bytes(limit)} ({MEMORY_ENV}; raise it, or 0 for "
        "no limit)"
    )


# Imports torch and runs what a first probe's start does (a matrix product starts the BLAS
# threads and their buffers), then prints the address space it took at its peak.
_STARTUP = (
    "import torch; torch.ones(64, 64) @ torch.ones(64, 64); "
    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak:')))"
)


def startup_address_space() -> int | None:
    """Bytes of address space a worker here maps to start torch, measured in a fresh process
    without a limit; None when it cannot be measured."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _STARTUP],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        return int(proc.stdout.split()[-1]) * 2**10 if proc.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def too_small(limit: int, how: str, need: int | None = None) -> str:
    """The message for a limit a worker cannot start under: ``how`` it showed (its death and
    last words, :func:`~autotune.execution.output.last_words`), and a limit that would work,
    from ``need``, the bytes a worker here maps to start (measured when not given)."""
    need = need or startup_address_space()
    hint = ""
    if need:
        enough = math.ceil(need * 1.5 / 2**30)
        hint = (
            f"; a worker here maps {format_bytes(need)} just to start torch, so give it at least "
            f"{MEMORY_ENV}={enough}G"
        )
    return (
        f"{MEMORY_ENV}={format_bytes(limit)} is too small for the probe worker to start: "
        f"{how}{hint} (or {MEMORY_ENV}=0 for no limit)"
    )


def check_memory_limit(devices: list[str]) -> None:
    """Refuse, at start, a memory limit set too small for a CPU worker to start torch (measured
    here, in a fresh process); nothing when none of ``devices`` runs under it.

    Raises:
        SpecError: naming the variable, the size a worker needs to start and one that works.
    """
    limits = [worker_memory_limit(d) for d in devices]
    limit = min((x for x in limits if x), default=None)
    if limit is None or not os.environ.get(MEMORY_ENV, "").strip():
        return
    need = startup_address_space()
    if need and limit < need * 1.1:
        raise SpecError(too_small(limit, "torch would not start under it", need))


# ---- the one GPU a worker sees ---------------------------------------------------------------

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"
_PCI = "PCI_BUS_ID"

_nvml_lock = threading.Lock()
_nvml_ready = False
_warned_order = False


def load_nvml() -> Any:
    """The initialised ``pynvml`` module (initialised once per process); raises when NVML is
    missing (no package, no driver library). It opens no CUDA context."""
    global _nvml_ready
    import pynvml

    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True
    return pynvml


def pci_bus_order() -> None:
    """Number GPUs in PCI bus order in this process, as autotune does: sets
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` where it is unset (call it before CUDA starts). Where the
    user chose another order, it stays, with a warning: autotune's ``cuda:N`` is still the N-th
    GPU in PCI bus order."""
    _warn_order(os.environ.setdefault(ORDER_ENV, _PCI))


def _warn_order(order: str) -> None:
    global _warned_order
    if order.strip().upper() != _PCI and not _warned_order:
        _warned_order = True
        logger.warning(
            "{}={} is set; autotune numbers GPUs in PCI bus order, so its cuda:N may be another "
            "GPU than this process's cuda:N; set {}={} or name GPUs by UUID in {}",
            ORDER_ENV,
            order,
            ORDER_ENV,
            _PCI,
            VISIBLE_ENV,
        )


def visible_entries(visible: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value that CUDA uses, in order: GPU indices
    and UUIDs (``GPU-…``, ``MIG-…``). CUDA stops at the first entry it cannot read (``-1``, an
    empty one): what follows is not visible.

    Example:
        >>> visible_entries("GPU-5d1e, 2,-1,0")
        ['GPU-5d1e', '2']
    """
    out = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.upper().startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def _entry(index: int, environ: Mapping[str, str]) -> str:
    """The GPU that ``cuda:index`` is: its ``CUDA_VISIBLE_DEVICES`` entry (a UUID, or an index
    in PCI bus order), or ``index`` itself where the variable is unset."""
    visible = environ.get(VISIBLE_ENV)
    if visible is None:
        return str(index)
    entries = visible_entries(visible)
    if index >= len(entries):
        raise DeviceError(
            f"device cuda:{index} does not exist: {VISIBLE_ENV}={visible!r} shows "
            f"{len(entries)} GPU(s)"
        )
    return entries[index]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handles(nvml: Any) -> list[Any]:
    """Every GPU's NVML handle, in NVML's order; a GPU this process may not open (another
    job's, behind a cgroup) is left out: CUDA cannot use it either."""
    out = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            out.append(nvml.nvmlDeviceGetHandleByIndex(i))
        except nvml.NVMLError:
            continue
    return out


def _by_pci_bus(nvml: Any) -> list[Any]:
    """Every GPU's NVML handle, in PCI bus order (NVML's own order where it cannot tell)."""
    handles = _handles(nvml)
    try:
        keys = [nvml.nvmlDeviceGetPciInfo(h) for h in handles]
        order = sorted(
            range(len(handles)), key=lambda i: (keys[i].domain, keys[i].bus, keys[i].device)
        )
    except nvml.NVMLError:
        return handles
    return [handles[i] for i in order]


def gpu_handle(nvml: Any, index: int, environ: Mapping[str, str] | None = None) -> Any:
    """The NVML handle of ``cuda:index`` as autotune numbers GPUs (see the module's note).

    Args:
        nvml: the ``pynvml`` module (:func:`load_nvml`).
        index: the N of ``cuda:N``.
        environ: where ``CUDA_VISIBLE_DEVICES`` is read; this process's environment by default.

    Raises:
        DeviceError: no such GPU (the entry, or the index, names none).
    """
    entry = _entry(index, os.environ if environ is None else environ)
    if entry.isdigit():
        if not hasattr(nvml, "nvmlDeviceGetPciInfo"):  # a binding without bus ids: NVML's order
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        handles = _by_pci_bus(nvml)
        if int(entry) >= len(handles):
            named = f" ({VISIBLE_ENV} entry {entry})" if entry != str(index) else ""
            raise DeviceError(
                f"device cuda:{index}{named} does not exist: this machine has {len(handles)} GPU(s)"
            )
        return handles[int(entry)]
    try:
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    except nvml.NVMLError:
        pass
    # CUDA also takes a unique prefix of a UUID.
    found = [h for h in _handles(nvml) if _text(nvml.nvmlDeviceGetUUID(h)).startswith(entry)]
    if len(found) != 1:
        raise DeviceError(
            f"device cuda:{index} is {VISIBLE_ENV} entry {entry!r}, which names "
            f"{'no GPU' if not found else 'more than one GPU'} on this machine"
        )
    return found[0]


def worker_env(
    device: str,
    nvml: Callable[[], Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What a probe worker for ``device`` adds to its environment: for ``cuda`` and ``cuda:N``,
    ``CUDA_VISIBLE_DEVICES`` naming that one GPU by its UUID and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (the worker then sees it as ``cuda:0``); for ``auto``, the same for the first GPU where there
    is one; nothing for ``cpu``.

    Without NVML the GPU is named by its index in PCI bus order (said in a debug line).

    Args:
        device: the worker's device, as the caller names it.
        nvml: returns the ``pynvml`` module (:func:`load_nvml` by default); may raise when NVML
            is missing.
        environ: the caller's environment; this process's by default.

    Raises:
        DeviceError: the GPU does not exist.

    Example:
        >>> worker_env("cpu")
        {}
    """
    name = device.strip().lower()
    if name == "auto":  # auto runs on the first GPU where there is one: it sees that one only
        try:
            return worker_env("cuda:0", nvml, environ)
        except DeviceError:
            return {}
    if not name.startswith("cuda"):
        return {}
    environ = os.environ if environ is None else environ
    _warn_order(environ.get(ORDER_ENV, _PCI))
    index = int(name.partition(":")[2] or 0)
    entry = _entry(index, environ)
    if not entry.isdigit():  # already a UUID: CUDA reads it the same in any order
        return {VISIBLE_ENV: entry, ORDER_ENV: _PCI}
    try:
        lib = (nvml or load_nvml)()
        uuid = _text(lib.nvmlDeviceGetUUID(gpu_handle(lib, index, environ)))
    except DeviceError:
        raise
    except Exception as exc:  # no NVML: the index, in PCI bus order, names the same GPU
        logger.debug(
            "NVML cannot name GPU {} ({}): the worker for {} sees it by its index in PCI bus "
            "order, not by its UUID",
            entry,
            exc,
            device,
        )
        return {VISIBLE_ENV: entry, ORDER_ENV: _PCI}
    return {VISIBLE_ENV: uuid, ORDER_ENV: _PCI}


def worker_device(device: str, environ: Mapping[str, str] | None = None) -> str:
    """The name a worker uses, inside, for ``device``: ``cuda:0`` for a CUDA device when it sees
    one GPU only (started with :func:`worker_env`), ``device`` otherwise.

    Example:
        >>> worker_device("cuda:3", {"CUDA_VISIBLE_DEVICES": "GPU-5d1e"})
        'cuda:0'
    """
    environ = os.environ if environ is None else environ
    one = len(visible_entries(environ.get(VISIBLE_ENV, ""))) == 1
    return "cuda:0" if one and device.strip().lower().startswith("cuda") else device
