"""TunedConfigs for tests, built directly: a search takes seconds, these take nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.schema.config import (
    Evidence,
    GradScalerSettings,
    TunedConfig,
    current_environment,
)
from autotune.workloads import Batch, Workload, synthetic_batches

FAST = "_configs:fast_mlp"


def fast_mlp() -> Workload:
    """tiny_mlp's shape with a 512-sample data pool: CLI tests pay for steps, not for data."""
    protos = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))

    def make(batch_size: int, gen: torch.Generator) -> Batch:
        y = torch.randint(0, 10, (batch_size,), generator=gen)
        return protos[y] + torch.randn(batch_size, 32, generator=gen), y

    def accuracy(model: nn.Module, batch: Batch) -> float:
        with torch.no_grad():
            return (model(batch[0]).argmax(-1) == batch[1]).float().mean().item()

    return Workload(
        name="fast_mlp",
        build_model=lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen, samples=512),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
        base_lr=0.05,
        base_batch_size=64,
        accuracy=accuracy,
    )


def make_config(
    precision: str = "bf16",
    *,
    workload: str = "autotune.workloads:tiny_mlp",
    batch_size: int = 128,
    learning_rate: float = 0.1,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    channels_last: bool = False,
    **fields: Any,
) -> TunedConfig:
    """A valid config for this machine's CPU (so loading it does not warn)."""
    return TunedConfig(
        study="test",
        workload=workload,
        precision=precision,
        batch_size=batch_size,
        learning_rate=learning_rate,
        grad_scaler=GradScalerSettings(
            enabled=precision == "fp16", init_scale=init_scale, growth_interval=growth_interval
        ),
        channels_last=channels_last,
        evidence=Evidence(
            throughput=2000.0,
            baseline_throughput=1000.0,
            speedup=2.0,
            parity_tolerance=0.05,
            validated=True,
            lr_scaling="linear",
            base_learning_rate=0.05,
            base_batch_size=64,
        ),
        environment=current_environment(torch.device("cpu")),
        **fields,
    )


def write_config(path: Path, config: TunedConfig | dict[str, Any]) -> Path:
    """Write a config (or a raw, possibly tampered, dict) as JSON."""
    data = config.model_dump(mode="json") if isinstance(config, TunedConfig) else config
    path.write_text(json.dumps(data, indent=2))
    return path
