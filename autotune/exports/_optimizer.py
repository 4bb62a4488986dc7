"""The optimizer a config's lr was tuned for: rebuilt with torch, or said the way Hugging Face's
``TrainingArguments`` say it (``optim``, ``optim_args`` and its own fields)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.errors import ExportError
from autotune.schema.config import TunedConfig

__all__ = ["HfOptimizer", "build_optimizer", "hf_optimizer", "torch_optimizer", "tuned_schedule"]

_RESEARCH = "write the config again with this version's `autotune search`"


def tuned_schedule(cfg: TunedConfig) -> str:
    """The lr schedule the config was tuned under; ``constant`` for a config that predates it."""
    return cfg.lr_schedule or "constant"


def torch_optimizer(name: str | None) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class a config names.

    Raises:
        ExportError: the config names none, or a class ``torch.optim`` does not have.
    """
    if name is None:
        raise ExportError(
            "the config does not record the optimizer its learning_rate was tuned for (it was "
            f"written before autotune recorded it): {_RESEARCH}, or build it yourself"
        )
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ExportError(
            f"optimizer={name!r} is not a torch.optim class, so an export cannot build it: "
            f"build {name} yourself at the config's learning_rate"
        )
    return cls


def build_optimizer(
    name: str | None, kwargs: dict[str, Any] | None, lr: float, params: Iterable[Any]
) -> torch.optim.Optimizer:
    """``torch.optim.<name>(params, lr=lr, **kwargs)``, refusing what the config cannot say."""
    # A concrete optimizer's constructor: it takes lr and its own settings, which the base
    # class's (params, defaults) does not.
    cls: Callable[..., torch.optim.Optimizer] = torch_optimizer(name)
    if kwargs is None:
        raise ExportError(
            f"the config records the optimizer ({name}) but not its settings (momentum, betas, "
            f"weight_decay, ...), and {name} at torch's defaults is not what was tuned: "
            f"{_RESEARCH}, or build {name} yourself with the workload's settings"
        )
    return cls(
        params, lr=lr, **{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    )


# ---- Hugging Face's Trainer ------------------------------------------------------------------

# Each torch optimizer the Trainer builds by name, and where its settings go: a TrainingArguments
# field, or optim_args (which the Trainer parses for these optimizers only). weight_decay is a
# field for all of them: the Trainer puts it on the parameter groups, over any optim_args value.
_HF: dict[str, tuple[str, dict[str, str | tuple[str, str]]]] = {
    "SGD": ("sgd", {"momentum": "optim_args", "dampening": "optim_args", "nesterov": "optim_args"}),
    "AdamW": ("adamw_torch", {"betas": ("adam_beta1", "adam_beta2"), "eps": "adam_epsilon"}),
    "Adagrad": ("adagrad", {"lr_decay": "optim_args", "eps": "optim_args"}),
    "RMSprop": (
        "rmsprop",
        {
            "momentum": "optim_args",
            "alpha": "optim_args",
            "eps": "optim_args",
            "centered": "optim_args",
        },
    ),
}


@dataclass
class HfOptimizer:
    """The TrainingArguments fields that make the Trainer build the tuned optimizer."""

    fields: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    # Said as an ExportWarning too: the Trainer trains something a little other than was tuned.
    warnings: list[str] = field(default_factory=list)


def _unsupported(name: str, why: str, cfg: TunedConfig) -> ExportError:
    settings = {"lr": cfg.learning_rate, **(cfg.optimizer_kwargs or {})}
    return ExportError(
        f"Hugging Face's Trainer cannot build the optimizer learning_rate={cfg.learning_rate:g} "
        f"was tuned for: {why}. Build TrainingArguments without the export's optim fields and "
        f"pass Trainer(..., optimizer_cls_and_kwargs=(torch.optim.{name}, {settings!r})) "
        f"with lr_scheduler_type={tuned_schedule(cfg)!r}, "
        "or export to lightning or accelerate, whose scripts build it "
        "(Export.elsewhere.build_optimizer)"
    )


def hf_optimizer(cfg: TunedConfig) -> HfOptimizer:
    """``optim``, ``optim_args``, ``weight_decay`` and Adam's fields for the config's optimizer.

    Raises:
        ExportError: the config names no optimizer (the Trainer would pick AdamW), one the
            Trainer cannot build by name, or a setting it cannot take (``amsgrad=True``).
    """
    name = cfg.optimizer
    if name is None:
        raise ExportError(
            "the config does not record the optimizer its learning_rate was tuned for (it was "
            "written before autotune recorded it), and Hugging Face's Trainer would train AdamW "
            f"at it: {_RESEARCH}"
        )
    settings = cfg.optimizer_kwargs
    # Adam without weight decay takes the very steps AdamW without weight decay takes.
    key = "AdamW" if name == "Adam" and not (settings or {}).get("weight_decay") else name
    if key not in _HF:
        raise _unsupported(name, f"its optim names no {name}", cfg)
    optim, places = _HF[key]
    out = HfOptimizer({"optim": optim})
    if key != name:
        out.notes.append(
            f"{name} without weight decay goes as optim={optim!r} with weight_decay=0: "
            "the same update"
        )
    if settings is None:
        out.warnings.append(
            f"the config records the optimizer ({name}) but not its settings (momentum, betas, "
            f"weight_decay, ...): the Trainer builds {name} with its own defaults, which may not "
            f"be what was tuned; {_RESEARCH}"
        )
        return out
    defaults = _place_settings(cfg, out, name=name, optim=optim, places=places)
    # Not recorded (a hand-written config): the optimizer's own default, not the Trainer's 0.
    out.fields.setdefault("weight_decay", float(defaults.get("weight_decay", 0.0)))
    if out.fields["weight_decay"]:
        out.notes.append(
            f"the Trainer applies weight_decay={out.fields['weight_decay']:g} to weights only, "
            "not to biases and LayerNorm parameters; the search decayed every parameter"
        )
    return out


def _place_settings(
    cfg: TunedConfig,
    out: HfOptimizer,
    *,
    name: str,
    optim: str,
    places: dict[str, str | tuple[str, str]],
) -> dict[str, Any]:
    """Each recorded setting where the Trainer reads it (a field, or optim_args); one it has
    no place for passes only at the optimizer's default.

    Returns:
        The optimizer's own defaults.
    """
    defaults = {
        k: p.default
        for k, p in inspect.signature(torch_optimizer(name)).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    optim_args: list[str] = []
    for arg, value in (cfg.optimizer_kwargs or {}).items():
        place = "weight_decay" if arg == "weight_decay" else places.get(arg)
        if place is not None and not _fits(place, value):
            raise _unsupported(name, f"{arg}={value!r} is not what its {place} takes", cfg)
        if place == "optim_args":
            optim_args.append(f"{arg}={value}")
        elif isinstance(place, tuple):
            out.fields.update(zip(place, value, strict=True))
        elif place is not None:
            out.fields[place] = float(value)
        elif value != _plain(defaults.get(arg, value)):
            raise _unsupported(name, f"its {optim!r} takes no {arg}={value!r}", cfg)
    if optim_args:
        out.fields["optim_args"] = ",".join(optim_args)
    return defaults


def _fits(place: str | tuple[str, ...], value: Any) -> bool:
    """Whether a setting's value goes where the Trainer reads it: a number, a pair of numbers
    (Adam's betas), or a flag in optim_args."""
    number = isinstance(value, (int, float))
    if isinstance(place, tuple):
        return isinstance(value, list) and len(value) == len(place)
    return number or (place == "optim_args" and isinstance(value, bool))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
