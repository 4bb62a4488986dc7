"""The callback a Lightning export gives the Trainer: the run trains what the config was tuned
with (optimizer, lr, batch size), or says so as it starts."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from autotune.errors import ExportError, ExportWarning

__all__ = ["TunedSettingsCheck"]  # noqa: F822  (made on first use, by __getattr__)


def _leading_dim(batch: Any) -> int | None:
    """The batch size of a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    for item in batch if isinstance(batch, (list, tuple)) else ():
        size = _leading_dim(item)
        if size is not None:
            return size
    return None


class _TunedSettings:
    """Refuse another optimizer than the config's; warn on another lr or batch size.

    Args:
        optimizer: the optimizer class the lr was tuned for (``"SGD"``); None: not recorded.
        learning_rate: the tuned lr, at ``batch_size`` on one device.
        batch_size: the tuned batch size, per device.
        lr_scaling: ``linear``, ``sqrt`` or ``none``: an lr rescaled by it for the run's total
            batch (devices × accumulation) counts as the tuned one.
    """

    def __init__(
        self,
        optimizer: str | None = None,
        learning_rate: float = 0.0,
        batch_size: int = 0,
        lr_scaling: str = "none",
    ) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.lr_scaling = lr_scaling
        self._batch_seen = False

    def _learning_rates(self, trainer: Any) -> list[float]:
        total = self.batch_size * trainer.world_size * trainer.accumulate_grad_batches
        ratio = total / self.batch_size if self.batch_size else 1.0
        scaled = {"linear": ratio, "sqrt": math.sqrt(ratio)}.get(self.lr_scaling, 1.0)
        return [self.learning_rate, self.learning_rate * scaled]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        module = type(pl_module).__name__
        names = [type(o).__name__ for o in trainer.optimizers]
        if self.optimizer is not None and self.optimizer not in names:
            raise ExportError(
                f"learning_rate={self.learning_rate:g} was tuned for {self.optimizer}, but "
                f"{module}.configure_optimizers builds {', '.join(names) or 'no optimizer'}: "
                f"build {self.optimizer} there (Export.elsewhere.build_optimizer(self.parameters())"
                " builds the tuned one), or tune with the optimizer you train with"
            )
        tuned = [o for o in trainer.optimizers if type(o).__name__ == self.optimizer]
        # A scheduler keeps the lr it started from as initial_lr: a warmup is not a wrong lr.
        rates = {
            float(group.get("initial_lr", group["lr"]))
            for opt in tuned or trainer.optimizers
            for group in opt.param_groups
        }
        wanted = self._learning_rates(trainer)
        off = sorted(r for r in rates if not any(math.isclose(r, w, rel_tol=1e-6) for w in wanted))
        if off:
            warnings.warn(
                f"{module} trains at lr={', '.join(f'{r:g}' for r in off)}, not the tuned "
                f"learning_rate={self.learning_rate:g}: pass Export.model_kwargs to {module}(...)"
                ", or the lr to the optimizer configure_optimizers builds",
                ExportWarning,
                stacklevel=2,
            )

    def on_train_batch_start(
        self,
        trainer: Any,
        pl_module: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._batch_seen:
            return
        self._batch_seen = True
        size = _leading_dim(batch)
        if size is not None and size != self.batch_size:
            warnings.warn(
                f"the first training batch holds {size} samples, not the tuned "
                f"batch_size={self.batch_size}: pass Export.datamodule_kwargs to your "
                "DataModule, or Export.elsewhere.batch_size to your DataLoader",
                ExportWarning,
                stacklevel=2,
            )


def __getattr__(name: str) -> Any:
    if name != "TunedSettingsCheck":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning.pytorch import Callback

    cls = type(
        name,
        (_TunedSettings, Callback),
        {"__module__": __name__, "__qualname__": name, "__doc__": _TunedSettings.__doc__},
    )
    globals()[name] = cls  # once: every later use finds the same class
    return cls
