"""A user's own model and data, as autotune takes them: ``mypkg.train:workload``.

The model is a small residual MLP classifier; the data is a fixed in-memory dataset behind a
plain ``DataLoader``, as a real project would have it. ``workload()`` hands autotune the pieces
it needs to tune and to train: a model factory, batches for a batch size, a loss, an optimizer
factory and the learning rate and batch size the model was developed at.

Tune it, then train with the result (from the repository root; ``PYTHONPATH=examples`` puts
``mypkg`` on the import path, which a package in the working directory does not need)::

    PYTHONPATH=examples autotune search studies/mypkg.yaml
    PYTHONPATH=examples autotune train --config studies/mypkg/best.json --compare fp32
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import autotune

FEATURES, CLASSES, SAMPLES = 48, 6, 16384


def make_dataset(seed: int = 0) -> TensorDataset:
    """Noisy points around one centre per class: learnable, but not in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=gen)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    points = centres[labels] + 3.0 * torch.randn(SAMPLES, FEATURES, generator=gen)
    return TensorDataset(points, labels)


class Classifier(nn.Module):
    """Two residual MLP blocks with LayerNorm, then a linear head."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


_DATASET = make_dataset()


def batches(
    batch_size: int, device: torch.device, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches from the DataLoader, moved to the device.

    autotune asks for as many batches as a probe or a run needs, so the iterator starts a new
    pass over the data whenever one ends; ``generator`` makes the order reproducible.
    """
    loader = DataLoader(
        _DATASET, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator
    )
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def workload() -> autotune.Workload:
    """The workload autotune loads from ``mypkg.train:workload``."""
    return autotune.Workload(
        name="mypkg",
        build_model=Classifier,
        make_batches=batches,
        build_optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        # What the model was developed at: the search scales the lr from here.
        base_lr=1e-3,
        base_batch_size=64,
        lr_scaling="sqrt",  # Adam-like optimizer
        accuracy=accuracy,
        description="residual MLP on 48 features, 6 classes, DataLoader over an in-memory dataset",
    )
