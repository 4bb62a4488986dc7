"""The Hugging Face export: ``TrainingArguments`` fields that train as the search measured, with
the optimizer, schedule and clipping the search trained under."""

from __future__ import annotations

from typing import Any

from autotune.errors import ExportError
from autotune.exports._base import (
    Export,
    common_notes,
    flags,
    lr_note,
    make_export,
    tuned_scaler,
)
from autotune.exports._optimizer import hf_optimizer, tuned_schedule
from autotune.schema.config import TunedConfig

__all__ = ["hf"]

# torch's GradScaler defaults: where a library takes no scaler, only a tuned one is worth a note.
_DEFAULT_SCALER = {"init_scale": 2.0**16, "growth_interval": 2000}
# transformers' SchedulerType values, what lr_scheduler_type takes (4.4x to 5.x); a name not
# here is looked up in the installed transformers, so the export needs it only then.
_TRAINER_SCHEDULES = (
    "constant",
    "constant_with_warmup",
    "cosine",
    "cosine_warmup_with_min_lr",
    "cosine_with_min_lr",
    "cosine_with_restarts",
    "inverse_sqrt",
    "linear",
    "polynomial",
    "reduce_lr_on_plateau",
    "warmup_stable_decay",
)


def _trainer_schedule(cfg: TunedConfig) -> str:
    """The ``lr_scheduler_type`` that trains under the schedule the lr was tuned under.

    Raises:
        ExportError: the Trainer has no such schedule (a LightningModule's scheduler class).
    """
    schedule = tuned_schedule(cfg)
    if schedule in _TRAINER_SCHEDULES:
        return schedule
    try:
        from transformers import SchedulerType

        if schedule in {s.value for s in SchedulerType}:
            return schedule
    except ImportError:
        pass
    raise ExportError(
        f"learning_rate={cfg.learning_rate:g} was tuned under the {schedule} lr schedule, which "
        "Hugging Face's Trainer cannot name (its lr_scheduler_type takes "
        f"{', '.join(_TRAINER_SCHEDULES)}): build the scheduler over "
        "optimizer = Export.elsewhere.build_optimizer(model.parameters()) as your workload "
        "built it and pass Trainer(..., optimizers=(optimizer, scheduler)), or export to "
        "lightning, whose configure_optimizers builds it"
    )


def hf(cfg: TunedConfig, device: str) -> tuple[Export, list[str]]:
    """The export, and what it could not carry (for an ExportWarning).

    Raises:
        ExportError: the Trainer cannot build the optimizer the lr was tuned for.
    """
    schedule = _trainer_schedule(cfg)
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
    # The search trains under the workload's schedule (a constant lr unless it brought one),
    # unclipped; the Trainer's defaults are a linear decay to zero (step 1 of 3 at two thirds
    # of the lr) and clipping at norm 1.0.
    kwargs["lr_scheduler_type"] = schedule
    kwargs["max_grad_norm"] = 0.0
    kwargs.update(optimizer.fields)
    if cfg.compile:
        kwargs["torch_compile"] = True
        kwargs["torch_compile_mode"] = cfg.compile_mode
    notes = [lr_note(cfg, "TrainingArguments.learning_rate"), *optimizer.notes]
    if schedule != "constant":
        notes.append(
            f"lr_scheduler_type={schedule!r} is the schedule the lr was tuned under, with the "
            "warm-up and lr_scheduler_kwargs of the workload's TrainingArguments: lay these "
            "fields over those arguments (dataclasses.replace(args, **Export.kwargs)) to keep them"
        )
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
