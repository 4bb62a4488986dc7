"""A scripted device for tests: a small landscape, changed field by field."""

from __future__ import annotations

from typing import Any

from autotune.sim import Landscape

WORKLOAD = "autotune.workloads:resnet18"
GiB = 2**30


def landscape(workload: str = WORKLOAD, **changes: Any) -> Landscape:
    """A small GPU: fp16 and bf16 about twice fp32 at large batch; ``changes`` by dotted path."""
    data: dict[str, Any] = {
        "name": "test-gpu",
        "kind": "recorded",
        "device": "Test GPU",
        "device_type": "cuda",
        "capability": [8, 0],
        "memory_total_bytes": 16 * GiB,
        "workload": workload,
        "facts": {"base_lr": 0.1, "base_batch_size": 64, "lr_scaling": "linear"},
        "modes": {
            mode: {
                "throughput": {16: 2000 * k, 64: 6000 * k, 256: 9000 * k * k, 1024: 10000 * k * k},
                "memory_fixed_bytes": 300 * 2**20,
                "memory_per_sample_bytes": (20 if mode == "fp32" else 11) * 2**20,
            }
            for mode, k in (("fp32", 1.0), ("bf16", 1.4), ("fp16", 1.5))
        },
        "parity": {"gap_per_batch_ratio": 0.004},
        "loss": {"seed_spread": 0.003},
    }
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return Landscape.model_validate(data)
