"""The Workload interface: everything a probe needs to train a model for a few steps (no torch
here)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Batch", "Workload", "cross_entropy_loss", "synthetic_batches"]

Batch = tuple[Any, ...]


def cross_entropy_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The default loss: ``cross_entropy(model(inputs), targets)``."""
    # Only when a model trains, which loaded torch long before.
    from torch.nn import functional as F

    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class Workload:
    """A model, its data and its optimizer, as a probe and a training run need them.

    Args:
        name: a short name for logs and reports.
        build_model: makes a fresh model on the CPU (the probe moves it).
        make_batches: ``(batch_size, device, generator) -> iterator of batches``; each batch is a
            tuple of tensors already on the device (synthetic tensors, or a DataLoader's output
            moved there). The iterator must not end before the probe does.
        build_optimizer: ``(params, lr) -> optimizer``.
        base_lr: the learning rate the workload was tuned at, at ``base_batch_size``.
        base_batch_size: the batch size ``base_lr`` belongs to.
        loss: ``(model, batch) -> scalar loss tensor``; cross entropy on ``model(batch[0])`` by
            default.
        channels_last: whether 4-d inputs and the model should use channels_last memory format.
        lr_scaling: how the learning rate follows the batch size: ``linear`` for SGD-like
            optimizers, ``sqrt`` for Adam-like ones.
        accuracy: optional ``(model, batch) -> share correct`` for training reports.
        lr_schedule: the lr schedule training runs under, recorded in the config so an export
            trains under it too: ``constant`` (a probe steps only the optimizer
            ``build_optimizer`` returns), a transformers ``lr_scheduler_type`` (``linear``) or
            a scheduler's class name (``CosineAnnealingLR``) for a ``build_optimizer`` that
            steps one after each optimizer step (as the adapters do).

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> wl = tiny_mlp()
        >>> wl.base_batch_size
        64
    """

    name: str
    build_model: Callable[[], nn.Module]
    make_batches: Callable[[int, torch.device, torch.Generator], Iterator[Batch]]
    build_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
    base_lr: float
    base_batch_size: int
    loss: Callable[[nn.Module, Batch], torch.Tensor] = cross_entropy_loss
    channels_last: bool = False
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    accuracy: Callable[[nn.Module, Batch], float] | None = None
    description: str = ""
    lr_schedule: str = "constant"
    # Set by the loader: the reference this workload was loaded from.
    reference: str = field(default="", compare=False)


# Samples drawn per call of a workload's batch maker (any batch size is cut from them).
_CHUNK = 256


def synthetic_batches(
    make_batch: Callable[[int, torch.Generator], Batch],
    batch_size: int,
    device: torch.device,
    generator: torch.Generator,
    *,
    samples: int = 8192,
) -> Iterator[Batch]:
    """Cycle through a pool of batches made up front and moved to the device.

    Making the pool before the first step keeps data generation and host-to-device copies out
    of the timed window, which is what a DataLoader with prefetching looks like at steady state.
    The pool holds about ``samples`` distinct samples (at least 4 batches), so a probe does not
    see the same batch again before it has seen that many: short runs learn, not memorize.

    The samples are drawn in chunks of a fixed size and cut into batches afterwards, so every
    batch size sees the same samples in the same order: two runs compared at equal samples
    seen (the parity check) differ in their batch, not in their data.

    Example:
        >>> import torch
        >>> make = lambda n, g: (torch.randn(n, 2, generator=g),)
        >>> small = synthetic_batches(make, 2, torch.device("cpu"), torch.Generator().manual_seed(0))
        >>> large = synthetic_batches(make, 4, torch.device("cpu"), torch.Generator().manual_seed(0))
        >>> torch.equal(torch.cat([next(small)[0], next(small)[0]]), next(large)[0])
        True
    """
    import torch  # only where a workload trains, which loaded it long before

    pool = max(4, -(-samples // batch_size))
    drawn = [make_batch(_CHUNK, generator) for _ in range(-(-pool * batch_size // _CHUNK))]
    fields = [torch.cat(parts) for parts in zip(*drawn, strict=True)]
    del drawn
    batches = [
        tuple(
            f[i * batch_size : (i + 1) * batch_size].to(device, non_blocking=True) for f in fields
        )
        for i in range(pool)
    ]
    del fields
    while True:
        yield from batches
