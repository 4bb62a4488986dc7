"""Small memory helpers for a training run: sync, free, tell an OOM, measure a peak, and keep the
spec's memory margin free."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from autotune.measure.oom import MARGIN_TAKEN, OOM_MESSAGES

__all__ = [
    "OOM_MESSAGES",
    "OOM_TYPES",
    "CpuPeakMemory",
    "MarginTaken",
    "PeakMemory",
    "check_margin_free",
    "clear_device_cache",
    "is_oom",
    "memory_cap",
    "memory_fraction",
    "oom_message",
    "release_memory",
    "restart_peak",
    "sync",
]

# What counts as running out of memory. torch's own allocators raise OutOfMemoryError; memory a
# library allocates by itself fails as a plain RuntimeError whose message names the failure
# (OOM_MESSAGES, in autotune.measure.oom: the search's parent reads reasons with them).
OOM_TYPES: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory (see ``OOM_TYPES``, ``OOM_MESSAGES``).

    Args:
        exc: the exception a training step raised.

    Returns:
        True for an out-of-memory error, in whichever form the library that allocated raised it.

    Example:
        >>> is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
        True
        >>> is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(exc, OOM_TYPES):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


def oom_message(exc: BaseException) -> str:
    """The first line of an OOM error, at most 200 characters: what a reason quotes.

    Example:
        >>> oom_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\\nmore"))
        'CUDA out of memory. Tried to allocate 2.00 GiB'
    """
    text = str(exc)
    return text.splitlines()[0][:200] if text.strip() else "out of memory"


def sync(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (a no-op on a CPU).

    Example:
        >>> sync(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clear_device_cache(device: torch.device) -> None:
    """Hand memory that is free but kept for reuse back, so the next run's peak is its own.

    On CUDA that is the caching allocator's unused blocks: without it a run's peak *reserved*
    memory would start at the largest earlier run's reserve. On a CPU, glibc keeps freed memory
    for reuse, and a second run would grow its resident memory by almost nothing;
    ``malloc_trim(0)`` hands the free pages back.

    Args:
        device: the run's device.

    Example:
        >>> clear_device_cache(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    # Not glibc (macOS, musl): no trim, and a second run's growth may be understated.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def release_memory(device: torch.device) -> None:
    """Collect garbage, then clear the device cache: what is left after the references to a
    run's tensors are dropped (after an OOM, before a measured run).

    Call it outside an ``except`` block: the exception's traceback keeps the frames, and with
    them the tensors, alive.

    Example:
        >>> release_memory(torch.device("cpu"))
    """
    gc.collect()
    clear_device_cache(device)


class CpuPeakMemory:
    """Peak resident-memory growth of this process on Linux: VmHWM, reset through clear_refs.

    Example:
        >>> mem = CpuPeakMemory()
        >>> mem.start()
        >>> block = bytearray(32 * 2**20)
        >>> growth = mem.peak_growth()
        >>> growth is None or growth >= 0
        True
    """

    def __init__(self) -> None:
        self.base = 0
        self.resettable = False

    @staticmethod
    def _status(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start(self) -> None:
        """Reset the peak to the present resident size and remember it."""
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5 resets the peak RSS (VmHWM)
            self.resettable = True
        except OSError:
            self.resettable = False
        self.base = self._status("VmRSS") or 0

    def peak_growth(self) -> int | None:
        """Bytes the peak resident size grew since :meth:`start`; None where it cannot be read."""
        peak = self._status("VmHWM") if self.resettable else None
        return None if peak is None else max(0, peak - self.base)


class PeakMemory:
    """The peak memory of one run on its device.

    :meth:`start` clears the device cache and resets the peak statistics, so the figures are
    this run's own, not an earlier run's left-over reserve.

    Args:
        device: the run's device.

    Example:
        >>> peak = PeakMemory(torch.device("cpu"))
        >>> peak.start()
        >>> peak.source in ("cpu_rss", "unavailable")
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start_allocated = 0
        self._cpu = CpuPeakMemory()

    def start(self) -> None:
        """Clear the device cache and reset the peaks: what follows is measured."""
        clear_device_cache(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_allocated = torch.cuda.memory_allocated(self.device)
        else:
            self._cpu.start()

    @property
    def source(self) -> Literal["cuda_allocated", "cpu_rss", "unavailable"]:
        """Where the figures come from."""
        if self.device.type == "cuda":
            return "cuda_allocated"
        return "cpu_rss" if self._cpu.resettable else "unavailable"

    def allocated(self) -> int | None:
        """CUDA: the allocator's peak of live tensors (absolute). CPU: the resident growth."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._cpu.peak_growth()

    def reserved(self) -> int | None:
        """CUDA: the caching allocator's peak reserve (what the device gave up). CPU: None."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return None

    def growth(self) -> int | None:
        """The peak above what was allocated at :meth:`start`: the run's own tensors."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.start_allocated
        return self._cpu.peak_growth()


def restart_peak(device: torch.device) -> None:
    """Hand the cached free memory back and start the CUDA peak statistics again at what is
    live now; a no-op on a CPU (and before CUDA is in use).

    After a run's first step: with ``cudnn.benchmark`` cuDNN tries its algorithms there, each
    with as large a workspace as it can get, and the compiler autotunes its kernels. Those
    allocations are freed to the cache after the step, and a peak that counted them (or the
    reserve they leave) would make a batch look larger than it is. The model, the optimizer
    state and everything else still live stay counted.

    Example:
        >>> restart_peak(torch.device("cpu"))
    """
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def memory_fraction(
    margin: float, free: int, total: int, reserved: int = 0, prior: float = 1.0
) -> float:
    """The share of a device's memory this process's allocator may hold so that ``margin`` of
    the device stays free.

    Args:
        margin: the share of the device's memory to keep free (the spec's ``memory_margin``).
        free: bytes free on the device now (other processes' memory is not).
        total: the device's bytes in all.
        reserved: bytes this process's allocator holds now: they are its own to reuse.
        prior: the process's present limit: the result never lifts it.

    Returns:
        A fraction in ``[0, prior]``; 0 when the margin is not free even now.

    Example:
        >>> GiB = 2**30
        >>> memory_fraction(0.1, free=60 * GiB, total=80 * GiB, reserved=4 * GiB)
        0.7
        >>> memory_fraction(0.1, free=4 * GiB, total=80 * GiB)
        0.0
        >>> memory_fraction(0.1, free=80 * GiB, total=80 * GiB, prior=0.25)
        0.25
    """
    if total <= 0:
        return prior
    allowed = (free + reserved - margin * total) / total
    return max(0.0, min(prior, allowed))


class MarginTaken(torch.OutOfMemoryError):
    """Before a run began, other processes already held the memory margin: it has no room at
    all. An out-of-memory outcome whose reason starts with ``MARGIN_TAKEN``, which says nothing
    about the run's batch size (no ceiling is stored from it)."""


def check_margin_free(margin: float, free: int, total: int) -> None:
    """Raise :class:`MarginTaken` when ``margin`` of the device is not free even now (a cap
    would then be 0: every allocation of the run would fail, whatever its batch size).

    Example:
        >>> GiB = 2**30
        >>> check_margin_free(0.1, free=60 * GiB, total=80 * GiB)
        >>> check_margin_free(0.1, free=4 * GiB, total=80 * GiB)
        Traceback (most recent call last):
        ...
        autotune.measure.memory.MarginTaken: other processes hold the memory margin: 4.0 GiB free of 80.0 GiB, and memory_margin=0.1 keeps 8.0 GiB free, so nothing is left for this run (wait for them to finish, or lower memory_margin)
    """
    if total > 0 and free <= margin * total:
        gib = 2**30
        raise MarginTaken(
            f"{MARGIN_TAKEN}: {free / gib:.1f} GiB free of {total / gib:.1f} GiB, and "
            f"memory_margin={margin:g} keeps {margin * total / gib:.1f} GiB free, so nothing is "
            "left for this run (wait for them to finish, or lower memory_margin)"
        )


@contextlib.contextmanager
def memory_cap(device: torch.device, margin: float | None) -> Iterator[float | None]:
    """Keep ``margin`` of a CUDA device free while the block runs: the process's allocator may
    hold at most :func:`memory_fraction` of it, and runs out of memory (an OOM outcome) rather
    than grow into what other processes on a shared GPU need. The process's own limit is put
    back afterwards, also on error. A no-op on a CPU, or with no margin.

    Args:
        device: the run's device.
        margin: the share of the device's memory to keep free; None: no cap.

    Yields:
        The fraction set, or None when nothing was capped.

    Raises:
        MarginTaken: the margin is not free even now (other processes hold it), before any
            limit is set.

    Example:
        >>> with memory_cap(torch.device("cpu"), 0.1) as fraction:
        ...     fraction is None
        True
    """
    if margin is None or device.type != "cuda" or not torch.cuda.is_available():
        yield None
        return
    # The limit's setter wants an index: ``cuda`` alone means the current device.
    index = torch.cuda.current_device() if device.index is None else device.index
    prior = torch.cuda.get_per_process_memory_fraction(index)
    free, total = torch.cuda.mem_get_info(index)
    check_margin_free(margin, free, total)
    fraction = memory_fraction(margin, free, total, torch.cuda.memory_reserved(index), prior)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    try:
        yield fraction
    except BaseException:
        # Putting the limit back must not hide the error (a broken CUDA context fails it too).
        with contextlib.suppress(Exception):
            torch.cuda.set_per_process_memory_fraction(prior, index)
        raise
    torch.cuda.set_per_process_memory_fraction(prior, index)
