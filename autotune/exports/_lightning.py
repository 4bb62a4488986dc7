"""The Lightning export: ``Trainer`` arguments, the tuned values your module and DataModule take,
and the LightningCLI file and flags."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from autotune.errors import ExportError, SpecError
from autotune.exports._base import (
    Export,
    Obj,
    common_notes,
    flags,
    lr_note,
    make_export,
    tuned_scaler,
    walk,
)
from autotune.exports._optimizer import torch_optimizer, tuned_schedule
from autotune.schema.config import TunedConfig

__all__ = ["lightning", "resolve_class"]

# Lightning Trainer(precision=...) for the modes without a scaler; fp16 goes as a plugin.
_PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed"}
_MIXED_PRECISION = "lightning.pytorch.plugins.precision.MixedPrecision"
_GRAD_SCALER = "torch.amp.GradScaler"
_CHECK = "autotune.exports.lightning_check.TunedSettingsCheck"
# The init arguments a module names its learning rate with, in the order looked for.
_LR_NAMES = ("lr", "learning_rate")


def resolve_class(value: Any, role: str) -> type | None:
    """A LightningModule or LightningDataModule class, or ``package.module:Name`` imported.

    Raises:
        SpecError: an instance (its init arguments are already spent), or a name that does not
            import.
    """
    if value is None or isinstance(value, type):
        return value
    if isinstance(value, str):
        module, _, name = value.partition(":")
        try:
            found = getattr(importlib.import_module(module), name) if name else None
        except (ImportError, AttributeError) as exc:
            raise SpecError(f"{role}={value!r} does not import: {exc}") from None
        if not isinstance(found, type):
            raise SpecError(
                f"{role}={value!r} is not a class; use package.module:ClassName, "
                f"e.g. {role}='mypkg.train:LitModel'"
            )
        return found
    raise SpecError(
        f"{role}= takes the class ({type(value).__name__}), not an instance: the export places "
        "the tuned values in its __init__ arguments, which an instance has already taken"
    )


def _init_args(cls: type | None) -> set[str]:
    if cls is None:
        return set()
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # a class whose signature cannot be read: nothing found
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in named}


def _place(
    cfg: TunedConfig, model: type | None, datamodule: type | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """``(model_kwargs, datamodule_kwargs, {value left unplaced: why})``."""
    model_args, data_args = _init_args(model), _init_args(datamodule)
    model_kwargs: dict[str, Any] = {}
    data_kwargs: dict[str, Any] = {}
    missing: dict[str, str] = {}
    lr_name = next((n for n in _LR_NAMES if n in model_args), None)
    if lr_name is not None:
        model_kwargs[lr_name] = cfg.learning_rate
    elif model is None:
        missing["learning_rate"] = (
            "no LightningModule class was given (model=LitModel puts it in its lr or "
            "learning_rate argument)"
        )
    else:
        missing["learning_rate"] = f"{model.__name__}.__init__ takes neither lr nor learning_rate"
    # A DataModule builds the loaders; a module that builds its own takes the batch size itself.
    if "batch_size" in data_args:
        data_kwargs["batch_size"] = cfg.batch_size
    elif "batch_size" in model_args:
        model_kwargs["batch_size"] = cfg.batch_size
    elif datamodule is None and model is None:
        missing["batch_size"] = (
            "no LightningDataModule class was given (datamodule=LitData puts it in its "
            "batch_size argument)"
        )
    else:
        names = [f"{c.__name__}.__init__" for c in (datamodule, model) if c is not None]
        missing["batch_size"] = (
            f"neither {names[0]} nor {names[1]} takes batch_size"
            if len(names) == 2
            else f"{names[0]} takes no batch_size"
        )
    return model_kwargs, data_kwargs, missing


def _optimizer_section(cfg: TunedConfig) -> dict[str, Any] | None:
    """LightningCLI's ``optimizer:`` for the tuned optimizer; None when it cannot be built."""
    try:
        cls = torch_optimizer(cfg.optimizer)
    except ExportError:
        return None
    if cfg.optimizer_kwargs is None:
        return None
    init = {"lr": cfg.learning_rate, **cfg.optimizer_kwargs}
    return {"class_path": f"torch.optim.{cls.__name__}", "init_args": init}


def _unplaced(cfg: TunedConfig, missing: dict[str, str], in_file: bool) -> list[str]:
    """One warning per value the export could not place, with where it goes instead."""
    out = []
    if "learning_rate" in missing:
        text = (
            f"learning_rate={cfg.learning_rate:g} was placed nowhere: {missing['learning_rate']}. "
            "Set it where configure_optimizers builds the optimizer "
            "(Export.elsewhere.build_optimizer(self.parameters()) builds the tuned one)"
        )
        if in_file:
            text += (
                "; the LightningCLI file carries it as an optimizer: section, which replaces "
                "configure_optimizers"
            )
            schedule = tuned_schedule(cfg)
            if schedule != "constant":
                text += (
                    f" and with it the {schedule} lr schedule the lr was tuned under (add an "
                    "lr_scheduler: section for it)"
                )
        out.append(text)
    if "batch_size" in missing:
        out.append(
            f"batch_size={cfg.batch_size} was placed nowhere: {missing['batch_size']}. Pass "
            "Export.elsewhere.batch_size to your DataLoader"
        )
    return out


def _trainer_kwargs(cfg: TunedConfig, device: str) -> dict[str, Any]:
    """The Trainer's arguments: the mode (fp16 with the tuned GradScaler), and the callback
    that checks the tuned settings as training starts."""
    accelerator = "cuda" if device == "cuda" else "cpu"
    kwargs: dict[str, Any] = {"accelerator": accelerator, "benchmark": True}
    scaler = tuned_scaler(cfg)
    if scaler is not None:
        # The plugin, not precision="16-mixed": Lightning turns that into bf16 on a CPU, and
        # only the plugin carries the tuned scaler.
        kwargs["plugins"] = [
            Obj(
                _MIXED_PRECISION,
                {
                    "precision": "16-mixed",
                    "device": device,
                    "scaler": Obj(_GRAD_SCALER, {"device": device, **scaler}),
                },
            )
        ]
    else:
        kwargs["precision"] = _PRECISION[cfg.precision]
    check = {
        "optimizer": cfg.optimizer,
        "learning_rate": cfg.learning_rate,
        "batch_size": cfg.batch_size,
        "lr_scaling": cfg.evidence.lr_scaling,
    }
    kwargs["callbacks"] = [Obj(_CHECK, check)]
    return kwargs


def _notes(cfg: TunedConfig, device: str) -> list[str]:
    """What a person is told: where the lr goes, what the check callback does, and the lr
    schedule the lr was tuned under."""
    notes = [
        lr_note(cfg, "the optimizer configure_optimizers builds"),
        "the Trainer's TunedSettingsCheck callback refuses another optimizer than the lr was "
        "tuned for, and warns when the first step's lr or batch size is not the tuned one",
        *common_notes(cfg, device, "lightning"),
    ]
    schedule = tuned_schedule(cfg)
    if schedule != "constant":
        notes.insert(
            1,
            f"the lr was tuned under the {schedule} lr schedule: configure_optimizers returns "
            "that scheduler with the optimizer, as the tuned LightningModule's does (for a "
            "Hugging Face schedule name, transformers.get_scheduler builds it)",
        )
    return notes


def lightning(
    cfg: TunedConfig, device: str, model: type | None, datamodule: type | None
) -> tuple[Export, list[str]]:
    """The export, and a warning for each tuned value it could not place."""
    kwargs = _trainer_kwargs(cfg, device)
    model_kwargs, data_kwargs, missing = _place(cfg, model, datamodule)
    trainer = walk(kwargs, Obj.described)  # LightningCLI's class_path and init_args
    file: dict[str, Any] = {"trainer": trainer}
    args = list(flags("trainer.", trainer))
    if model_kwargs:
        file["model"] = model_kwargs
        args += flags("model.", model_kwargs)
    if data_kwargs:
        file["data"] = data_kwargs
        args += flags("data.", data_kwargs)
    # Where no module argument takes the lr, LightningCLI's optimizer: section does, with the
    # optimizer it was tuned for; a module that takes it keeps its own configure_optimizers.
    optimizer = _optimizer_section(cfg) if "learning_rate" in missing else None
    if optimizer is not None:
        file["optimizer"] = optimizer
        args += flags("", {"optimizer": optimizer})
    ex = make_export(
        "lightning",
        cfg,
        device,
        _notes(cfg, device),
        kwargs,
        file,
        args,
        model_kwargs=model_kwargs,
        datamodule_kwargs=data_kwargs,
    )
    return ex, _unplaced(cfg, missing, optimizer is not None)
