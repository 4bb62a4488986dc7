"""The accelerate export: ``Accelerator`` arguments, and the ``accelerate launch`` file and
flags."""

from __future__ import annotations

from typing import Any

from autotune.exports._base import (
    Export,
    Obj,
    common_notes,
    lr_note,
    make_export,
    optimizer_text,
    scaler_text,
    tuned_scaler,
)
from autotune.exports._optimizer import tuned_schedule
from autotune.schema.config import TunedConfig

__all__ = ["accelerate"]

# accelerate Accelerator(mixed_precision=...) and `accelerate launch --mixed_precision`.
_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16"}
_GRAD_SCALER_KWARGS = "accelerate.utils.GradScalerKwargs"
_DYNAMO = "accelerate.utils.TorchDynamoPlugin"


def accelerate(cfg: TunedConfig, device: str) -> tuple[Export, list[str]]:
    """The export; nothing is left uncarried that the script does not build itself."""
    mixed = _PRECISION[cfg.precision]
    kwargs: dict[str, Any] = {"mixed_precision": mixed}
    if device == "cpu":
        kwargs["cpu"] = True
    scaler = tuned_scaler(cfg)
    if scaler is not None:
        kwargs["kwargs_handlers"] = [Obj(_GRAD_SCALER_KWARGS, dict(scaler))]
    if cfg.compile:
        kwargs["dynamo_plugin"] = Obj(_DYNAMO, {"backend": "inductor", "mode": cfg.compile_mode})
    # What `accelerate config` writes for one process on one machine.
    file = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO",
        "mixed_precision": mixed,
        "use_cpu": device == "cpu",
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "debug": False,
    }
    args = ["--mixed_precision", mixed, "--num_processes", "1", "--num_machines", "1"]
    if device == "cpu":
        args.append("--cpu")
    if cfg.compile:
        file["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_mode": cfg.compile_mode}
        args += ["--dynamo_backend", "inductor", "--dynamo_mode", cfg.compile_mode]
    notes = [
        f"batch_size={cfg.batch_size} goes to your DataLoader, learning_rate to your optimizer: "
        f"{optimizer_text(cfg)}, which Export.elsewhere.build_optimizer(model.parameters()) "
        "builds; accelerate's file and flags carry neither",
        lr_note(cfg, "your optimizer's lr"),
    ]
    schedule = tuned_schedule(cfg)
    if schedule != "constant":
        notes.append(
            f"the lr was tuned under the {schedule} schedule (Export.elsewhere.lr_schedule): "
            "build that scheduler over the optimizer as your workload built it, pass it to "
            "accelerator.prepare too and step it as the workload did (scheduler.step() after "
            "each optimizer.step() for a per-step one); accelerate steps no schedule itself"
        )
    if scaler is not None:
        notes.append(
            "accelerate's config file and launch flags have no GradScaler setting: in your "
            f"script pass kwargs_handlers=[GradScalerKwargs({scaler_text(scaler)})] "
            "(accelerate.utils) to Accelerator, as Export.kwargs does"
        )
    notes += common_notes(cfg, device, "accelerate", compiles=True)
    return make_export("accelerate", cfg, device, notes, kwargs, file, args), []
