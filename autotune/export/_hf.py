"""The Hugging Face export: ``TrainingArguments`` fields that train as the search measured.

Besides the mode, the batch size and the lr, the Trainer must not bring its own training
recipe: it picks AdamW, decays the lr linearly to zero and clips gradients at 1.0 by default,
where the search trained the workload's optimizer at a constant lr without clipping.
"""

from __future__ import annotations

from typing import Any

from autotune.config import TunedConfig
from autotune.export._base import (
    Export,
    common_notes,
    flags,
    lr_note,
    make_export,
    tuned_scaler,
)
from autotune.export._optimizer import hf_optimizer

__all__ = ["hf"]

# torch's GradScaler defaults: where a library takes no scaler, only a tuned one is worth a note.
_DEFAULT_SCALER = {"init_scale": 2.0**16, "growth_interval": 2000}


def hf(cfg: TunedConfig, device: str) -> tuple[Export, list[str]]:
    """The export, and what it could not carry (for an ExportWarning).

    Raises:
        ExportError: the Trainer cannot build the optimizer the lr was tuned for.
    """
    optimizer = hf_optimizer(cfg)
    # Only TrainingArguments fields, so TrainingArguments(output_dir=..., **kwargs) works.
    kwargs: dict[str, Any] = {
        "bf16": cfg.precision == "bf16",
        "fp16": cfg.precision == "fp16",
    }
    if device == "cuda":
        # False, not None: the search measured IEEE fp32 matmuls outside tf32 mode.
        kwargs["tf32"] = cfg.precision == "tf32"
    else:
        # Without it the Trainer refuses bf16 on a CPU ("You need to assign use_cpu").
        kwargs["use_cpu"] = True
    kwargs["per_device_train_batch_size"] = cfg.batch_size
    kwargs["learning_rate"] = cfg.learning_rate
    # The search trains at a constant lr, unclipped; the Trainer's defaults are a linear decay
    # to zero (step 1 of 3 at two thirds of the lr) and clipping at norm 1.0.
    kwargs["lr_scheduler_type"] = "constant"
    kwargs["max_grad_norm"] = 0.0
    kwargs.update(optimizer.fields)
    if cfg.compile:
        kwargs["torch_compile"] = True
        kwargs["torch_compile_mode"] = cfg.compile_mode
    notes = [lr_note(cfg, "TrainingArguments.learning_rate"), *optimizer.notes]
    scaler = tuned_scaler(cfg)
    if scaler is not None and scaler != _DEFAULT_SCALER:
        notes.append(
            "TrainingArguments has no GradScaler setting: the Trainer starts fp16 at torch's "
            f"default init_scale 65536, not the tuned {scaler['init_scale']:g}"
        )
    if device == "cuda":
        notes.append(
            "TrainingArguments(tf32=...) sets torch's new TF32 API only, after which "
            "torch.backends.cudnn.allow_tf32 raises: call Export.elsewhere.set_backend_flags() "
            "after TrainingArguments(...)"
        )
    notes += common_notes(cfg, device, "hf", compiles=True)
    ex = make_export("hf", cfg, device, notes, kwargs, dict(kwargs), flags("", kwargs))
    return ex, optimizer.warnings
