"""LightningModules and DataModules that test the Lightning adapter's edges, referenced by name
(``_lightning_objects:NoLr``) as a user's package would be.

Importing this module costs nothing (pytest imports every module here to look for doctests);
the first class asked for imports Lightning and defines them all."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def _points(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=gen)
    return TensorDataset(x, (x.sum(1) > 0).long())


@functools.cache
def _classes() -> dict[str, type]:
    import lightning as L

    class Points(L.LightningDataModule):
        """64 points (4 batches of 16 a pass); the batch size kept as a plain attribute."""

        def __init__(self, batch_size: int = 16, samples: int = 64) -> None:
            super().__init__()
            self.batch_size, self.samples = batch_size, samples

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_points(self.samples), batch_size=self.batch_size, shuffle=True)

    class FixedBatch(L.LightningDataModule):
        """Keeps no batch size: autotune cannot try others through it."""

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_points(64), batch_size=16)

    class NoLr(L.LightningModule):
        """Keeps no lr: it is written into configure_optimizers; a StepLR steps each epoch."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            self.log_dict({"step": float(self.trainer.global_step)})
            return {"loss": loss}

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    class NoSchedule(NoLr):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class ReadsStrategy(NoLr):
        """Reads what the stand-in trainer does not answer."""

        def training_step(self, batch, batch_idx):
            self.trainer.strategy.barrier()
            return super().training_step(batch, batch_idx)

    class TwoOptimizers(NoLr):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())

    class Manual(NoLr):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    class Broken(NoLr):
        def __init__(self, width: int = 8) -> None:
            raise ValueError(f"no weights for width={width}")

    classes = {
        c.__name__: c
        for c in (
            Points,
            FixedBatch,
            NoLr,
            NoSchedule,
            ReadsStrategy,
            TwoOptimizers,
            Manual,
            Broken,
        )
    }
    assert classes.keys() == _NAMES, "list a new class in _NAMES too"
    return classes


_NAMES = frozenset(
    (
        "Points",
        "FixedBatch",
        "NoLr",
        "NoSchedule",
        "ReadsStrategy",
        "TwoOptimizers",
        "Manual",
        "Broken",
    )
)


def __getattr__(name: str) -> Any:
    # Only the classes' own names load lightning: the suite's collection imports this module
    # and asks it for other attributes (``pytest_plugins``), and lightning takes seconds.
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _classes()[name]
