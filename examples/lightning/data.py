"""A LightningDataModule over a synthetic CIFAR-like dataset (nothing is downloaded).

autotune sets ``batch_size`` (kept by ``save_hyperparameters``) to each candidate's batch size
before it calls ``train_dataloader()``, and shuffles with its own seeded generator.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L


class CIFARData(L.LightningDataModule):
    """Images drawn around one fixed prototype per class: learnable, but not in a few steps.

    Args:
        batch_size: the batch size the model was developed at; autotune tunes it.
        samples: images in the training set.
        size: image height and width.
        classes: number of classes.
    """

    def __init__(
        self, batch_size: int = 32, samples: int = 4096, size: int = 16, classes: int = 10
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        gen = torch.Generator().manual_seed(1234)
        prototypes = 0.5 * torch.randn(hp.classes, 3, hp.size, hp.size, generator=gen)
        labels = torch.randint(0, hp.classes, (hp.samples,), generator=gen)
        images = prototypes[labels] + torch.randn(hp.samples, 3, hp.size, hp.size, generator=gen)
        self.train_set = TensorDataset(images, labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)
