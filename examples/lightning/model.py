"""A small convnet classifier as a LightningModule: the lr is a hyperparameter, the optimizer
and its schedule come from ``configure_optimizers``, and the step logs as usual.

autotune finds the learning rate in ``self.hparams.lr`` (saved by ``save_hyperparameters``) and
sets it there for each candidate, so the optimizer and the scheduler are built at that lr.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import lightning as L


class LitClassifier(L.LightningModule):
    """Two conv blocks and a linear head over 3-channel images.

    Args:
        channels: width of the first conv block (the second has twice as many).
        classes: number of classes.
        lr: SGD's learning rate at the data module's batch size; autotune tunes it.
    """

    def __init__(self, channels: int = 16, classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * channels, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        # Cosine decay over the whole run, stepped every batch.
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
