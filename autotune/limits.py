"""The probe worker's memory limit: a workload that allocates without bound fails in its own
process, as an out-of-memory probe, instead of taking the shared machine's memory.

``AUTOTUNE_WORKER_MEMORY`` sets the limit: a size (``8G``, ``512M``, ``16GiB``, a number of
bytes) or ``0`` for none. The default is 75% of the machine's memory (``MemTotal``): room for
any probe a CPU can run, and a quarter left for everyone else on the box.

It is an address-space limit (``RLIMIT_AS``), and only for a worker whose device is the CPU:
CUDA reserves address space far beyond the memory it uses (a unified address space spanning
the host's and every GPU's memory), so an address-space limit makes CUDA fail to initialise.
``RLIMIT_DATA`` is no way out: recent kernels count those private mappings in it too. A GPU
worker's device memory is bounded by the device itself; its host memory is not limited.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

from autotune.errors import SpecError

__all__ = [
    "DEFAULT_SHARE",
    "MEMORY_ENV",
    "apply_memory_limit",
    "format_bytes",
    "limit_note",
    "machine_memory",
    "parse_size",
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
        device: the worker's device; only ``cpu`` gets a limit (see the module's note on CUDA).

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
    if not device.strip().lower().startswith("cpu"):
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
