"""Precision modes: one table, the backend flags each sets, and what a device really supports."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autotune.errors import SpecError
from autotune.infra.devices import device_capability, resolve_device

__all__ = [
    "MODES",
    "PrecisionMode",
    "apply_backend_flags",
    "autocast",
    "backend_flags",
    "check_autocast",
    "device_capability",
    "float32_matmul_precision",
    "get_mode",
    "make_scaler",
    "resolve_device",
    "skip_defect",
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


# torch keeps TF32 twice. The new API holds a value per (backend, op): "ieee", "tf32" or "none"
# (inherit from the parent: op -> its backend's "all" -> "generic"); setting a parent also sets
# its children. The legacy API holds its own two values: the float32 matmul precision
# (torch.set_float32_matmul_precision) and cudnn's allow_tf32 flag. The legacy getters
# (get_float32_matmul_precision, cuda.matmul.allow_tf32, cudnn.allow_tf32, cudnn.flags())
# raise when the two views disagree (pytorch#179445), so a session sets both, in step.
# Parents come before their children: restoring a parent would overwrite its children.
_FP32_PRECISION: dict[str, tuple[str, str]] = {
    "generic.fp32_precision": ("generic", "all"),
    "cuda.fp32_precision": ("cuda", "all"),
    "mkldnn.fp32_precision": ("mkldnn", "all"),
    "matmul.fp32_precision": ("cuda", "matmul"),
    "cudnn.conv.fp32_precision": ("cuda", "conv"),
    "cudnn.rnn.fp32_precision": ("cuda", "rnn"),
    "mkldnn.matmul.fp32_precision": ("mkldnn", "matmul"),
    "mkldnn.conv.fp32_precision": ("mkldnn", "conv"),
    "mkldnn.rnn.fp32_precision": ("mkldnn", "rnn"),
}


def _holder(backend: str, op: str) -> Any:
    """The torch.backends object whose ``fp32_precision`` is this (backend, op)."""
    b = torch.backends
    parent = {"generic": b, "cuda": b.cudnn, "mkldnn": b.mkldnn}[backend]
    if op == "all":
        return parent
    return b.cuda.matmul if (backend, op) == ("cuda", "matmul") else getattr(parent, op)


def _fp32_precision(backend: str, op: str) -> str:
    return _holder(backend, op).fp32_precision


def _effective(backend: str, op: str) -> str:
    """What torch resolves a "none" to: the backend's "all", then "generic"."""
    for b, o in ((backend, op), (backend, "all"), ("generic", "all")):
        value = _fp32_precision(b, o)
        if value != "none":
            return value
    return "none"


def float32_matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``'s value, also where torch refuses to report it
    (TF32 set through the new API: the one value that makes the two views disagree is the
    legacy one). Read it here, never through torch's getter.

    Example:
        >>> float32_matmul_precision() in ("highest", "high", "medium")
        True
    """
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        pass
    cuda_tf32 = _effective("cuda", "matmul") == "tf32"
    try:
        legacy_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        legacy_tf32 = not cuda_tf32
    if not legacy_tf32:
        return "highest"
    # "high" and "medium" both allow TF32; the mkldnn matmul value they disagree with says which.
    return "medium" if _effective("mkldnn", "matmul") == "tf32" else "high"


def _legacy_cudnn_tf32() -> bool:
    """cudnn's legacy allow_tf32, also where torch refuses to report it."""
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        rnn = _effective("cuda", "rnn") == "tf32"
        conv = _effective("cuda", "conv") == "tf32"
        # With conv == rnn the getter raised because the legacy flag is the other value.
        return not conv if conv == rnn else True


def snapshot_backend_flags() -> dict[str, Any]:
    """Every global backend setting a probe or a session may change, both TF32 views included.

    Example:
        >>> flags = snapshot_backend_flags()
        >>> flags["cudnn.benchmark"] in (True, False)
        True
    """
    flags: dict[str, Any] = {"cudnn.benchmark": torch.backends.cudnn.benchmark}
    if _new_api():
        flags["float32_matmul_precision"] = float32_matmul_precision()
        flags["cudnn.allow_tf32"] = _legacy_cudnn_tf32()
        for key, (backend, op) in _FP32_PRECISION.items():
            flags[key] = _fp32_precision(backend, op)
    else:  # pragma: no cover - torch < 2.9
        flags["matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        flags["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return flags


def restore_backend_flags(flags: dict[str, Any]) -> None:
    """Put back what :func:`snapshot_backend_flags` saw, exactly (both TF32 views)."""
    torch.backends.cudnn.benchmark = flags["cudnn.benchmark"]
    if "matmul.fp32_precision" in flags:
        # The legacy setters also write new-API values; the new values then go back on top.
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
        torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]
        for key, (backend, op) in _FP32_PRECISION.items():
            _holder(backend, op).fp32_precision = flags[key]
    else:  # pragma: no cover - torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul.allow_tf32"]
        torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]


def apply_backend_flags(mode: PrecisionMode, *, cudnn_benchmark: bool = True) -> None:
    """Set TF32 on or off as the mode says for CUDA matmul, cuDNN conv and cuDNN RNN, in the
    new API and the legacy one alike, and cudnn autotuning.

    Afterwards every getter answers, and agrees: ``torch.get_float32_matmul_precision()`` is
    ``"high"`` for tf32 and ``"highest"`` otherwise, ``torch.backends.cuda.matmul.allow_tf32``
    and ``torch.backends.cudnn.allow_tf32`` are the mode's TF32, ``cudnn.flags()`` enters.

    Example:
        >>> saved = snapshot_backend_flags()
        >>> apply_backend_flags(get_mode("fp32"))
        >>> torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
        ('highest', False)
        >>> restore_backend_flags(saved)
    """
    torch.backends.cudnn.benchmark = cudnn_benchmark
    if _new_api():
        value = "tf32" if mode.tf32 else "ieee"
        # 1. The legacy values; these setters also write cuda+mkldnn matmul and cudnn conv+rnn.
        torch.set_float32_matmul_precision("high" if mode.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = mode.tf32
        # 2. Explicit new values: the legacy cudnn setter writes "none" for off, which would
        # inherit a "tf32" a user set on cudnn or generic.
        torch.backends.cuda.matmul.fp32_precision = value
        # torch swaps cudnn for a CudnnModule at import; its stubs list neither property.
        torch.backends.cudnn.conv.fp32_precision = value  # type: ignore[attr-defined]
        torch.backends.cudnn.rnn.fp32_precision = value  # type: ignore[attr-defined]
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


def skip_defect(optimizer: torch.optim.Optimizer, mode: PrecisionMode) -> str | None:
    """Why this optimizer mistrains on the steps GradScaler skips under this mode, or None.

    torch's fused SGD takes GradScaler's inf check inside its kernel, yet a skipped first step
    still creates the momentum buffer, uninitialized (``empty_like``), and the next applied step
    adds it in as momentum. On a CPU that memory happens to hold tiny values; on a GPU it is
    reused memory, and fp16 training diverges though the mode is safe: on an H200 (torch 2.11)
    every fp16 run of the fused-SGD ResNet-18 whose scale started above the gradients' range
    went to NaN within five steps, and GradScaler's default 65536 skips the first steps often.
    Fused Adam and AdamW leave their state untouched on a skipped step.
    """
    if not mode.scales_loss or not isinstance(optimizer, torch.optim.SGD):
        return None
    if not any(g.get("fused") and g.get("momentum") for g in optimizer.param_groups):
        return None
    return (
        "the workload's optimizer is SGD with momentum and fused=True, whose kernel writes the "
        "momentum buffer on the steps GradScaler skips, so fp16 training diverges; build the "
        "SGD with fused=False"
    )


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
