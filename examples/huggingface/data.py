"""Synthetic token sequences a small model can learn to classify: each sequence counts up from a
random start with a stride of 1 to 4 (mod the vocabulary), and its label is the stride."""

from __future__ import annotations

import torch

from examples.huggingface.model import CLASSES, CONTEXT, VOCAB


def train_set(samples: int = 4096) -> list[dict[str, torch.Tensor]]:
    """A map-style dataset of dicts, as ``Trainer`` takes it: ``input_ids`` and ``labels``."""
    gen = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (samples, 1), generator=gen)
    labels = torch.randint(0, CLASSES, (samples,), generator=gen)
    ids = (start + (labels[:, None] + 1) * torch.arange(CONTEXT)) % VOCAB
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels, strict=True)]
