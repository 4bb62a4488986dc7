"""Exports: a tuned config as what Lightning, Hugging Face and accelerate take, passed whole:
``autotune.export(cfg, target)`` returns an :class:`Export`, the library constructor's
``kwargs`` and, ``elsewhere``, what that constructor does not take."""

from __future__ import annotations

import warnings

import torch

from autotune.errors import DeviceError, ExportWarning, SpecError
from autotune.exports._accelerate import accelerate
from autotune.exports._base import FORMATS, TARGETS, Elsewhere, Export, refuse_mode
from autotune.exports._hf import hf
from autotune.exports._lightning import lightning, resolve_class
from autotune.schema.config import TunedConfig

__all__ = ["FORMATS", "TARGETS", "Elsewhere", "Export", "export"]


def _device_kind(cfg: TunedConfig, device: str | torch.device | None) -> str:
    if device is None:
        # The config records a compute capability exactly when it was tuned on a CUDA device.
        return "cuda" if cfg.environment.capability is not None else "cpu"
    text = str(device).strip().lower()
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = text
    if kind not in ("cpu", "cuda"):
        raise DeviceError(
            f"an export is for a cpu or cuda device, got device={str(device)!r}; "
            "use --device cpu or --device cuda"
        )
    return kind


def export(
    cfg: TunedConfig,
    target: str,
    *,
    device: str | torch.device | None = None,
    model: type | str | None = None,
    datamodule: type | str | None = None,
) -> Export:
    """A tuned config as a trainer's arguments, for the device it will run on.

    Args:
        cfg: the tuned config.
        target: ``lightning``, ``hf`` (Hugging Face ``TrainingArguments``) or ``accelerate``.
        device: ``cpu``, ``cuda`` or ``cuda:N``; by default the kind the config was tuned on.
            Nothing is checked against this machine: an export may be written anywhere.
        model: Lightning only: your LightningModule class (or ``package.module:Name``); the
            lr goes to its ``lr`` or ``learning_rate`` init argument (:attr:`Export.model_kwargs`).
        datamodule: Lightning only: your LightningDataModule class (or ``package.module:Name``);
            the batch size goes to its ``batch_size`` (:attr:`Export.datamodule_kwargs`), or to
            the module's when it has none.

    Returns:
        The :class:`Export`: ``kwargs`` for the constructor, ``elsewhere`` for the rest,
        ``model_kwargs`` and ``datamodule_kwargs`` (Lightning), ``notes``, and ``render(fmt)``
        for the library's own config files and flags.

    Raises:
        SpecError: an unknown target, naming the known ones; ``model=`` or ``datamodule=``
            for another target than lightning, an instance, or a name that does not import.
        DeviceError: the library would silently train another mode on this device (fp16 on a
            CPU in Hugging Face and accelerate, tf32 off CUDA), or an unknown device.
        ExportError: Hugging Face's Trainer cannot build the optimizer the lr was tuned for.

    Warns:
        ExportWarning: a tuned value the export could not place (Lightning's lr or batch size
            without a module or DataModule argument for it; an optimizer whose settings the
            config does not record).

    Example:
        >>> export(cfg, "lightning", model=LitModel).model_kwargs  # doctest: +SKIP
        {'learning_rate': 0.4}
    """
    key = target.strip().lower()
    if key not in TARGETS:
        raise SpecError(
            f"unknown export target {target!r}; use one of {', '.join(TARGETS)}, "
            "e.g. --to lightning"
        )
    if key != "lightning" and (model is not None or datamodule is not None):
        raise SpecError(
            f"model= and datamodule= are for the lightning export, got them for target={key!r}: "
            f"{key}'s own arguments take the batch size and lr"
        )
    kind = _device_kind(cfg, device)
    refuse_mode(cfg, key, kind)
    built: tuple[Export, list[str]]
    if key == "lightning":
        module = resolve_class(model, "model")
        data = resolve_class(datamodule, "datamodule")
        built = lightning(cfg, kind, module, data)
    else:
        built = hf(cfg, kind) if key == "hf" else accelerate(cfg, kind)
    ex, left = built
    for message in left:
        warnings.warn(message, ExportWarning, stacklevel=2)
    return ex
