"""What the examples' training steps really run, read back inside each step (as
test_integrations.py reads its tiny models'): a forward pre-hook on a module the step calls under
the library's autocast sees the batch, the autocast state and the optimizer's lr as that step
runs them."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import autotune
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags

# What autocast a mode trains under on a CPU (the tests' searches choose among these).
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Step:
    """One training step, as a forward pre-hook inside it saw it."""

    lr: float
    batch: int
    autocast: torch.dtype | None


class StepReader:
    """Records a :class:`Step` for each forward of the module it is attached to."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._optimizer: Any = None

    def attach(self, module: nn.Module, optimizer: Any) -> None:
        """Read each forward of ``module``; the lr from ``optimizer``'s first param group."""
        self._optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs = args[0] if args else kwargs["input_ids"]
        enabled = torch.is_autocast_enabled("cpu")
        self.steps.append(
            Step(
                lr=float(self._optimizer.param_groups[0]["lr"]),
                batch=inputs.shape[0],
                autocast=torch.get_autocast_dtype("cpu") if enabled else None,
            )
        )


def linear(lr: float, steps: int) -> list[float]:
    """Each step's lr under a linear decay to 0 over ``steps``, no warm-up."""
    return [lr * (1 - i / steps) for i in range(steps)]


def cosine(lr: float, steps: int) -> list[float]:
    """Each step's lr under CosineAnnealingLR with ``T_max=steps``."""
    return [lr * (1 + math.cos(math.pi * i / steps)) / 2 for i in range(steps)]


def assert_trained_as_tuned(
    steps: list[Step], cfg: autotune.TunedConfig, schedule: list[float]
) -> None:
    """Every step on the tuned batch size under the tuned mode's autocast, its lr the tuned one
    at the first step, then as the schedule decays it."""
    assert len(steps) == len(schedule), steps
    assert {(s.batch, s.autocast) for s in steps} == {(cfg.batch_size, AUTOCAST[cfg.precision])}
    assert steps[0].lr == pytest.approx(cfg.learning_rate, rel=1e-6)
    assert [s.lr for s in steps] == pytest.approx(schedule, rel=1e-6)
    assert steps[-1].lr < steps[0].lr  # the schedule is really applied


@contextmanager
def training_process() -> Iterator[None]:
    """Around a training script run in the test's process: what it sets for the rest of a
    training process (the backend flags, accelerate's one process-wide state) is undone after."""
    saved = snapshot_backend_flags()
    try:
        yield
    finally:
        restore_backend_flags(saved)
        state = sys.modules.get("accelerate.state")
        if state is not None:
            state.AcceleratorState._reset_state(True)
