"""TunedConfig: the artifact a search emits and training loads.

It records the winning settings, the evidence behind them and the environment they hold for,
so every config knows how it was made.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotune.errors import ConfigError, format_validation_error
from autotune.spec import Candidate, PrecisionName

__all__ = [
    "SCHEMA_VERSION",
    "Environment",
    "Evidence",
    "GradScalerSettings",
    "TrialCounts",
    "TunedConfig",
    "current_environment",
    "load_config",
]

SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GradScalerSettings(_Model):
    enabled: bool
    init_scale: float = Field(default=2.0**16, gt=0, allow_inf_nan=False)
    growth_interval: int = Field(default=2000, gt=0)


class TrialCounts(_Model):
    complete: int = Field(default=0, ge=0)
    pruned: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)


class Evidence(_Model):
    """What the search and the validation measured for the winner and the baselines."""

    # samples/s of the winner's validation run, and of the fp32 reference run beside it
    throughput: float = Field(ge=0)
    baseline_throughput: float = Field(ge=0)
    speedup: float = Field(ge=0)
    # the plain AMP recipe (fp16, default GradScaler, base batch and lr), from the search probes
    amp_throughput: float | None = Field(default=None, ge=0)
    speedup_vs_amp: float | None = Field(default=None, ge=0)
    peak_memory_bytes: int | None = Field(default=None, ge=0)
    baseline_peak_memory_bytes: int | None = Field(default=None, ge=0)
    # 1 - winner/baseline peak memory; negative when the winner uses more (a larger batch)
    memory_saving: float | None = None
    loss: float | None = None
    baseline_loss: float | None = None
    parity_gap: float | None = None
    parity_tolerance: float = Field(ge=0)
    skipped_steps: int = Field(default=0, ge=0)
    trials: TrialCounts = Field(default_factory=TrialCounts)
    validated: bool = False
    validation_note: str = ""
    lr_scaling: str = "linear"
    base_learning_rate: float | None = None
    base_batch_size: int | None = None
    rejected: list[str] = Field(default_factory=list)
    cut: dict[str, str] = Field(default_factory=dict)
    ceilings: dict[str, int] = Field(default_factory=dict)


class Environment(_Model):
    device: str
    capability: list[int] | None = None
    torch: str
    cuda: str | None = None
    autotune: str
    python: str = ""


class TunedConfig(_Model):
    """The validated settings for one workload on one kind of device.

    Example:
        >>> cfg = load_config("studies/tiny/best.json")  # doctest: +SKIP
        >>> cfg.precision, cfg.batch_size
        ('bf16', 256)
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    study: str
    workload: str
    precision: PrecisionName
    batch_size: int = Field(gt=0)
    learning_rate: float = Field(gt=0, allow_inf_nan=False)
    grad_scaler: GradScalerSettings
    channels_last: bool = False
    evidence: Evidence
    environment: Environment
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    def candidate(self) -> Candidate:
        """The config's settings as a Candidate (what a probe or a training run takes)."""
        return Candidate(
            precision=self.precision,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            init_scale=self.grad_scaler.init_scale,
            growth_interval=self.grad_scaler.growth_interval,
            channels_last=self.channels_last,
        )

    def save(self, path: str | Path) -> Path:
        """Write the config as indented JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path


def current_environment(device: torch.device) -> Environment:
    """Describe this machine: device name and capability, torch, CUDA and autotune versions."""
    from autotune import __version__

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = list(torch.cuda.get_device_capability(device))
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
        capability = None
    return Environment(
        device=name,
        capability=capability,
        torch=torch.__version__.split("+")[0],
        cuda=torch.version.cuda,
        autotune=__version__,
        python=platform.python_version(),
    )


def load_config(path: str | Path) -> TunedConfig:
    """Read and validate a TunedConfig file.

    Args:
        path: the JSON file a search wrote, e.g. ``studies/resnet18/best.json``.

    Returns:
        The validated TunedConfig.

    Raises:
        ConfigError: the file is missing, is not JSON, has another schema version, or a field is
            out of range; the message names the field and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist; run `autotune search` to write one"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not valid JSON ({exc}); it may be truncated: "
            "write it again with `autotune search`"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}"
        )
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"config file {str(path)!r} has schema_version={version!r}, this autotune reads "
            f"schema_version={SCHEMA_VERSION}; write it again with this version's `autotune search`"
        )
    try:
        return TunedConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"config file {str(path)!r}")) from None
