"""Precision modes: one table, the backend flags each sets, and what a device really supports.

mode   autocast dtype   GradScaler   TF32 matmul/conv   where
fp32   —                no           off (IEEE)          everywhere
tf32   —                no           on                  CUDA, capability 8.0+
fp16   float16          yes          off                 CUDA 7.0+ (tensor cores), CPU
bf16   bfloat16         no           off                 CUDA 8.0+ (native), CPU
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autotune.errors import DeviceError, SpecError

__all__ = [
    "MODES",
    "PrecisionMode",
    "autocast",
    "backend_flags",
    "check_autocast",
    "device_capability",
    "get_mode",
    "make_scaler",
    "resolve_device",
    "snapshot_backend_flags",
    "restore_backend_flags",
    "unsupported_modes",
]


@dataclass(frozen=True)
class PrecisionMode:
    """What one precision mode does to a training step."""

    name: str
    autocast_dtype: torch.dtype | None
    scales_loss: bool
    tf32: bool
    # Minimum CUDA compute capability for real (not emulated) support.
    min_capability: tuple[int, int]
    cuda_only: bool = False
    description: str = ""


MODES: dict[str, PrecisionMode] = {
    m.name: m
    for m in (
        PrecisionMode("fp32", None, False, False, (0, 0), description="IEEE fp32, TF32 off"),
        PrecisionMode(
            "tf32",
            None,
            False,
            True,
            (8, 0),
            cuda_only=True,
            description="fp32 weights, TF32 matmul and conv",
        ),
        # fp16 below 7.0 runs without tensor cores: slower than fp32, never worth a trial.
        PrecisionMode(
            "fp16",
            torch.float16,
            True,
            False,
            (7, 0),
            description="autocast float16 with GradScaler",
        ),
        # is_bf16_supported() says yes on 7.5 by emulation; native bf16 needs Ampere.
        PrecisionMode(
            "bf16", torch.bfloat16, False, False, (8, 0), description="autocast bfloat16, no scaler"
        ),
    )
}


def get_mode(name: str) -> PrecisionMode:
    """Look a mode up by name.

    Raises:
        SpecError: for an unknown name, listing the known ones.
    """
    try:
        return MODES[name]
    except KeyError:
        raise SpecError(f"unknown precision {name!r}; use one of {', '.join(MODES)}") from None


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


def check_autocast(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Run a tiny matmul inside autocast and return the dtype it really produced.

    torch only *warns* when autocast cannot use a dtype and then runs fp32, so the output dtype
    is the only trustworthy answer.
    """
    a = torch.ones(4, 4, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device.type, dtype=dtype):
            return (a @ a).dtype


def unsupported_modes(
    device: torch.device, capability: tuple[int, int] | None = None, *, probe: bool = True
) -> dict[str, str]:
    """Which modes this device cannot really run, each with the reason.

    Args:
        device: the resolved device.
        capability: override the CUDA compute capability (tests fake it); read from the device
            when None.
        probe: also check that autocast really produces the mode's dtype on this device.

    Returns:
        ``{mode: reason}`` for every unsupported mode; modes absent from it are supported.

    Example:
        >>> unsupported_modes(torch.device("cpu"))
        {'tf32': 'tf32 is a CUDA feature: CPU matmuls have no TF32 mode'}
    """
    out: dict[str, str] = {}
    if device.type == "cuda" and capability is None:
        capability = device_capability(device)
    for mode in MODES.values():
        if device.type != "cuda":
            if mode.cuda_only:
                out[mode.name] = f"{mode.name} is a CUDA feature: CPU matmuls have no TF32 mode"
                continue
        elif capability is not None and tuple(capability) < mode.min_capability:
            need = ".".join(map(str, mode.min_capability))
            have = ".".join(map(str, capability))
            out[mode.name] = f"{mode.name} needs compute capability {need}+, this device has {have}"
            continue
        if probe and mode.autocast_dtype is not None:
            got = check_autocast(device, mode.autocast_dtype)
            if got != mode.autocast_dtype:
                out[mode.name] = (
                    f"autocast on {device.type} ran {mode.name} as {got}: the mode is not supported "
                    "by this torch build"
                )
    return out


def _new_api() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def snapshot_backend_flags() -> dict[str, Any]:
    """Every global backend setting a probe or a session may change."""
    flags: dict[str, Any] = {"cudnn.benchmark": torch.backends.cudnn.benchmark}
    if _new_api():
        flags["matmul.fp32_precision"] = torch.backends.cuda.matmul.fp32_precision
        flags["cudnn.conv.fp32_precision"] = torch.backends.cudnn.conv.fp32_precision
        # torch.set_float32_matmul_precision (leave_no_trace restores it) also sets this one.
        flags["mkldnn.matmul.fp32_precision"] = torch.backends.mkldnn.matmul.fp32_precision
    else:  # pragma: no cover - torch < 2.9
        flags["matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        flags["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return flags


def restore_backend_flags(flags: dict[str, Any]) -> None:
    """Put back what :func:`snapshot_backend_flags` saw."""
    torch.backends.cudnn.benchmark = flags["cudnn.benchmark"]
    if "matmul.fp32_precision" in flags:
        torch.backends.cuda.matmul.fp32_precision = flags["matmul.fp32_precision"]
        torch.backends.cudnn.conv.fp32_precision = flags["cudnn.conv.fp32_precision"]
        torch.backends.mkldnn.matmul.fp32_precision = flags["mkldnn.matmul.fp32_precision"]
    else:  # pragma: no cover - torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul.allow_tf32"]
        torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]


def apply_backend_flags(mode: PrecisionMode, *, cudnn_benchmark: bool = True) -> None:
    """Set TF32 on or off for matmul and conv as the mode says, and cudnn autotuning."""
    torch.backends.cudnn.benchmark = cudnn_benchmark
    if _new_api():
        value = "tf32" if mode.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = value
        torch.backends.cudnn.conv.fp32_precision = value
    else:  # pragma: no cover - torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = mode.tf32
        torch.backends.cudnn.allow_tf32 = mode.tf32


@contextlib.contextmanager
def backend_flags(mode: PrecisionMode, *, cudnn_benchmark: bool = True) -> Iterator[None]:
    """Set the mode's backend flags for the block and always restore them afterwards."""
    saved = snapshot_backend_flags()
    try:
        apply_backend_flags(mode, cudnn_benchmark=cudnn_benchmark)
        yield
    finally:
        restore_backend_flags(saved)


def autocast(mode: PrecisionMode, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast region for a mode: a real ``torch.autocast`` or a no-op for fp32/tf32."""
    if mode.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=mode.autocast_dtype)


def make_scaler(
    mode: PrecisionMode,
    device: torch.device,
    *,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for the device, enabled only for modes that scale the loss."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=init_scale,
        growth_interval=growth_interval,
        enabled=mode.scales_loss,
    )
