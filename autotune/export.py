"""Exports: a tuned config as the arguments of the trainers people already use.

Each export is a flat dict whose keys are the library's own names where the library has one
(``precision`` for Lightning's ``Trainer``, ``TrainingArguments`` fields for Hugging Face,
``mixed_precision`` for accelerate), plus ``batch_size`` and ``learning_rate`` where the library
leaves them to your code, and notes for what has no argument (channels_last, a tuned GradScaler
where the library cannot take one).

mode   Lightning ``precision``   HF ``TrainingArguments``        accelerate ``mixed_precision``
fp32   ``32-true``               bf16=False fp16=False tf32=False ``no``
tf32   ``32-true`` + matmul high  bf16=False fp16=False tf32=True  ``no`` + matmul high
fp16   ``16-mixed``              fp16=True                         ``fp16``
bf16   ``bf16-mixed``            bf16=True                         ``bf16``

The values are the ones those libraries document: Lightning's ``_PRECISION_INPUT_STR``
(``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, ...), ``TrainingArguments``' boolean
``bf16``/``fp16``/``tf32`` fields, and accelerate's ``'no','fp16','bf16' or 'fp8'``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import SpecError

if TYPE_CHECKING:
    from autotune.config import TunedConfig

__all__ = ["FORMATS", "TARGETS", "Export", "export"]

TARGETS: tuple[str, ...] = ("lightning", "hf", "accelerate")
FORMATS: tuple[str, ...] = ("json", "yaml", "args")

# Lightning Trainer(precision=...): TF32 is not a precision there, it is a matmul setting.
_LIGHTNING_PRECISION = {
    "fp32": "32-true",
    "tf32": "32-true",
    "fp16": "16-mixed",
    "bf16": "bf16-mixed",
}
# accelerate Accelerator(mixed_precision=...) and `accelerate launch --mixed_precision`.
_ACCELERATE_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16"}
# torch.set_float32_matmul_precision: "highest" keeps IEEE fp32 matmuls, "high" allows TF32.
_MATMUL_PRECISION = {"fp32": "highest", "tf32": "high", "fp16": "highest", "bf16": "highest"}
# torch.amp.GradScaler's defaults: a note is only worth it when the tuned values differ.
_DEFAULT_SCALER = {"init_scale": 2.0**16, "growth_interval": 2000}
# `--format args`: the command-line flag for each exported key; None: not a flag (a note says).
_FLAGS: dict[str, dict[str, str | None]] = {
    # LightningCLI names; batch size and lr are LightningCLI's when your LightningDataModule
    # takes `batch_size` and your LightningModule `learning_rate`.
    "lightning": {
        "precision": "--trainer.precision",
        "batch_size": "--data.batch_size",
        "learning_rate": "--model.learning_rate",
    },
    # HfArgumentParser flags are the TrainingArguments field names.
    "hf": {
        "bf16": "--bf16",
        "fp16": "--fp16",
        "tf32": "--tf32",
        "per_device_train_batch_size": "--per_device_train_batch_size",
        "learning_rate": "--learning_rate",
    },
    # `accelerate launch` flags.
    "accelerate": {"mixed_precision": "--mixed_precision"},
}


@dataclass(frozen=True)
class Export:
    """One export: the settings, keyed as the target library names them, and notes."""

    target: str
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def render(self, fmt: str = "json") -> str:
        """The settings as ``json``, ``yaml`` or command-line ``args`` for the target.

        Args:
            fmt: ``json``, ``yaml`` or ``args`` (LightningCLI, HfArgumentParser or
                ``accelerate launch`` flags; keys without a flag are left to the notes).

        Returns:
            The text, without a trailing newline.

        Raises:
            SpecError: an unknown format.

        Example:
            >>> export(cfg, "hf").render("args")  # doctest: +SKIP
            '--bf16 true --fp16 false --tf32 false --per_device_train_batch_size 256 ...'
        """
        if fmt == "json":
            return json.dumps(self.settings, indent=2)
        if fmt == "yaml":
            import yaml

            return yaml.safe_dump(self.settings, sort_keys=False).rstrip("\n")
        if fmt == "args":
            flags = _FLAGS[self.target]
            return " ".join(
                f"{flags[key]} {_arg(value)}"
                for key, value in self.settings.items()
                if flags.get(key) is not None
            )
        raise SpecError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")


def _arg(value: Any) -> str:
    # HfArgumentParser reads booleans with string_to_bool: true/false.
    return str(value).lower() if isinstance(value, bool) else str(value)


def _common_notes(cfg: TunedConfig, batch_key: str) -> list[str]:
    ev = cfg.evidence
    notes = []
    if ev.base_batch_size and ev.base_learning_rate:
        notes.append(
            f"learning_rate={cfg.learning_rate:g} is tuned for {batch_key}={cfg.batch_size} on one "
            f"device ({ev.lr_scaling} lr scaling); with more devices, scale it the same way"
        )
    if cfg.channels_last:
        notes.append(
            "tuned with channels_last: call model.to(memory_format=torch.channels_last) "
            "before training; no trainer argument sets it"
        )
    if not ev.validated:
        notes.append(
            f"this config is the fp32 fallback, not a validated speedup: {ev.validation_note}"
        )
    return notes


def _scaler_kwargs(cfg: TunedConfig) -> dict[str, Any]:
    return {
        "init_scale": cfg.grad_scaler.init_scale,
        "growth_interval": cfg.grad_scaler.growth_interval,
    }


def _tuned_scaler(cfg: TunedConfig) -> bool:
    """True when fp16 was tuned away from torch's GradScaler defaults."""
    return cfg.grad_scaler.enabled and _scaler_kwargs(cfg) != _DEFAULT_SCALER


def _matmul_note(cfg: TunedConfig) -> list[str]:
    if cfg.precision == "tf32":
        return [
            'TF32 is not a precision flag: call torch.set_float32_matmul_precision("high") '
            "before training (float32_matmul_precision)"
        ]
    if cfg.precision == "fp32":
        return [
            "tuned as IEEE fp32: torch lets cudnn convolutions use TF32 by default; set "
            "torch.backends.cudnn.allow_tf32 = False to train exactly what was measured"
        ]
    return []


def _lightning(cfg: TunedConfig) -> Export:
    settings: dict[str, Any] = {
        "precision": _LIGHTNING_PRECISION[cfg.precision],
        "float32_matmul_precision": _MATMUL_PRECISION[cfg.precision],
        "batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
    }
    notes = [
        f'Trainer(precision="{settings["precision"]}"); batch_size goes to your DataLoader and '
        "learning_rate to configure_optimizers (as LightningCLI flags --data.batch_size and "
        "--model.learning_rate: rename them to your own init arguments)",
        *_matmul_note(cfg),
    ]
    if cfg.grad_scaler.enabled:
        settings["grad_scaler_kwargs"] = _scaler_kwargs(cfg)
    if _tuned_scaler(cfg):
        kw = _scaler_kwargs(cfg)
        notes.append(
            'for the tuned GradScaler, pass plugins=[MixedPrecision("16-mixed", "cuda", '
            f'scaler=torch.amp.GradScaler("cuda", init_scale={kw["init_scale"]:g}, '
            f"growth_interval={kw['growth_interval']}))] (lightning.pytorch.plugins) instead of "
            "precision="
        )
    return Export("lightning", settings, notes + _common_notes(cfg, "batch_size"))


def _hf(cfg: TunedConfig) -> Export:
    # Only TrainingArguments fields, so TrainingArguments(output_dir=..., **settings) works.
    settings: dict[str, Any] = {
        "bf16": cfg.precision == "bf16",
        "fp16": cfg.precision == "fp16",
        # False, not None: the search measured IEEE fp32 matmuls outside tf32 mode.
        "tf32": cfg.precision == "tf32",
        "per_device_train_batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
    }
    notes = ["TrainingArguments(output_dir=..., **settings)"]
    if _tuned_scaler(cfg):
        notes.append(
            "TrainingArguments has no GradScaler setting: the Trainer starts fp16 at torch's "
            f"default init_scale 65536, not the tuned {cfg.grad_scaler.init_scale:g}"
        )
    if cfg.precision == "fp32":
        notes.extend(_matmul_note(cfg))
    return Export("hf", settings, notes + _common_notes(cfg, "per_device_train_batch_size"))


def _accelerate(cfg: TunedConfig) -> Export:
    settings: dict[str, Any] = {
        "mixed_precision": _ACCELERATE_PRECISION[cfg.precision],
        "float32_matmul_precision": _MATMUL_PRECISION[cfg.precision],
        "batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
    }
    notes = [
        f'Accelerator(mixed_precision="{settings["mixed_precision"]}") or `accelerate launch '
        f"--mixed_precision {settings['mixed_precision']}`; batch_size goes to your DataLoader, "
        "learning_rate to your optimizer",
        *_matmul_note(cfg),
    ]
    if cfg.grad_scaler.enabled:
        # The field names of accelerate.utils.GradScalerKwargs.
        settings["grad_scaler_kwargs"] = _scaler_kwargs(cfg)
    if _tuned_scaler(cfg):
        notes.append(
            "for the tuned GradScaler, pass "
            "kwargs_handlers=[GradScalerKwargs(**grad_scaler_kwargs)] (accelerate.utils) to "
            "Accelerator"
        )
    return Export("accelerate", settings, notes + _common_notes(cfg, "batch_size"))


_BUILDERS = {"lightning": _lightning, "hf": _hf, "accelerate": _accelerate}


def export(cfg: TunedConfig, target: str) -> Export:
    """A tuned config as a trainer's arguments.

    Args:
        cfg: the tuned config.
        target: ``lightning``, ``hf`` (Hugging Face ``TrainingArguments``) or ``accelerate``.

    Returns:
        The Export: ``settings`` (a plain dict) and ``notes`` for what has no argument.

    Raises:
        SpecError: an unknown target, naming the known ones.

    Example:
        >>> export(cfg, "lightning").settings["precision"]  # doctest: +SKIP
        'bf16-mixed'
    """
    key = target.strip().lower()
    if key not in _BUILDERS:
        raise SpecError(
            f"unknown export target {target!r}; use one of {', '.join(TARGETS)}, "
            "e.g. --to lightning"
        )
    return _BUILDERS[key](cfg)
