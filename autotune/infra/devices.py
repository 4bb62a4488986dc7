"""Devices: ``auto``/``cpu``/``cuda:N`` as a device that exists here, and its compute capability.

The lowest layer next to the config: the config's environment check resolves a device too, and
the config knows no precision mode.
"""

from __future__ import annotations

from typing import Any

import torch

from autotune.errors import DeviceError

__all__ = ["device_capability", "prepare_batch", "resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N`` into a device that exists here.

    Only counts devices (``is_available``, ``device_count``): it never opens a CUDA context,
    so the CLI and the service may call it in their own process.

    Raises:
        DeviceError: the device does not exist on this machine.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    text = str(device).strip().lower()
    if text == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # current_device() would open a context; without one it is 0 anyway.
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return torch.device("cuda", index)
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"device {text!r} is not a device; use auto, cpu or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(f"device {text!r} is not supported; use auto, cpu or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {text!r} does not exist: no CUDA device is visible; use --device cpu"
        )
    index = 0 if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device {text!r} does not exist: {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability, or None for the CPU."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def prepare_batch(batch: Any, device: torch.device, channels_last: bool) -> Any:
    """Move a batch (a tensor, or a tuple/list/dict of them) to the device; 4-d tensors become
    channels_last when asked. A tensor already there is not copied; anything else passes.

    Example:
        >>> x, y = prepare_batch((torch.ones(2, 3, 4, 4), torch.zeros(2)), torch.device("cpu"), True)
        >>> x.is_contiguous(memory_format=torch.channels_last), tuple(y.shape)
        (True, (2,))
    """
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.dim() == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, dict):
        return {k: prepare_batch(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [prepare_batch(v, device, channels_last) for v in batch]
        if hasattr(batch, "_fields"):  # a namedtuple keeps its type
            return type(batch)(*moved)
        return type(batch)(moved)
    return batch
