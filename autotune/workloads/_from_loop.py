"""A Workload from the pieces of a plain PyTorch loop: a model, a data factory, an optimizer
factory and a loss."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autotune.errors import WorkloadError
from autotune.workloads._base import Workload
from autotune.workloads._common import default_of, display_name, endless, lr_rule, seed_loader
from autotune.workloads._objects import build, call

__all__ = ["loop_workload"]


def _name(obj: Any) -> str:
    return display_name(obj)


class _Loop:
    def __init__(self, model: Any, data: Any, optimizer: Any, loss: Any, model_args: dict) -> None:
        self.model, self.model_args, self.data, self.optimizer = model, model_args, data, optimizer
        if loss is None:
            loss = F.cross_entropy
        elif inspect.isclass(loss) and issubclass(loss, nn.Module):
            loss = build("loop.loss", loss)  # nn.CrossEntropyLoss, named as its class
        self.loss_fn = loss
        params = inspect.signature(data).parameters if callable(data) else {}
        self.takes_generator = "generator" in params

    def build_model(self) -> nn.Module:
        if isinstance(self.model, nn.Module):
            return copy.deepcopy(self.model)
        model = build("loop.model", self.model, self.model_args)
        if not isinstance(model, nn.Module):
            raise WorkloadError(
                f"loop.model: {_name(self.model)}() returned a {type(model).__name__}, not an "
                "nn.Module; name the model's class or a function returning it"
            )
        return model

    def build_optimizer(self, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        what = f"loop.optimizer {_name(self.optimizer)}(params, lr={lr:g})"
        made = call(what, self.optimizer, params, lr=lr)
        if not isinstance(made, torch.optim.Optimizer):
            raise WorkloadError(
                f"loop.optimizer: {_name(self.optimizer)}(params, lr) returned a "
                f"{type(made).__name__}, not a torch optimizer"
            )
        return made

    def make_batches(
        self, batch_size: int, device: torch.device, generator: torch.Generator
    ) -> Iterator[Any]:
        what = f"loop.data {_name(self.data)}(batch_size={batch_size})"
        extra = {"generator": generator} if self.takes_generator else {}
        loader = call(what, self.data, batch_size, **extra)
        made = getattr(loader, "batch_size", batch_size)
        if made is not None and made != batch_size:
            raise WorkloadError(
                f"{what} made batches of {made}; build the DataLoader with the batch_size it is given"
            )
        seed_loader(loader, generator)
        return endless(loader, batch_size, device, what)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping) or not isinstance(batch, (list, tuple)) or len(batch) < 2:
            raise WorkloadError(
                f"loop.data {_name(self.data)}: a batch must be (inputs, targets), got a "
                f"{type(batch).__name__}; for other batches write a workload function "
                "returning autotune.Workload with its own loss"
            )
        return self.loss_fn(model(batch[0]), batch[1])


def loop_workload(  # noqa: PLR0913 - public API: the loop's four parts, then keyword-only options
    model: Any,
    data: Any,
    optimizer: Any,
    loss: Any = None,
    *,
    model_args: Mapping[str, Any] | None = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
) -> Workload:
    """A Workload from a model factory, a DataLoader factory, an optimizer factory and a loss.

    Args:
        model: an ``nn.Module`` class (built with ``model_args``), a function returning a
            model, or a model (copied for each probe).
        data: ``data(batch_size)`` (or ``data(batch_size, generator=...)``) returning a
            DataLoader, or any iterable of ``(inputs, targets)`` batches.
        optimizer: ``optimizer(params, lr=...)`` returning a torch optimizer; an optimizer
            class (``torch.optim.AdamW``) is one.
        loss: ``loss(outputs, targets)``, or an ``nn.Module`` loss class; cross entropy when
            None.
        model_args: init args of the model's class or factory.
        base_lr: the lr at the base batch size; by default the default of the optimizer
            factory's ``lr``.
        base_batch_size: by default the default of the data factory's ``batch_size``.

    Returns:
        The Workload; its lr rule follows the optimizer (square root for Adam-like).

    Raises:
        WorkloadError: a base lr or batch size that nothing says, or a piece that cannot be
            built.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
        >>> def loader(batch_size=32):
        ...     return DataLoader(data, batch_size=batch_size, shuffle=True)
        >>> def sgd(params, lr=0.1):
        ...     return torch.optim.SGD(params, lr=lr, momentum=0.9)
        >>> wl = loop_workload(lambda: nn.Linear(8, 2), loader, sgd)
        >>> wl.base_lr, wl.base_batch_size, wl.lr_scaling
        (0.1, 32, 'linear')
    """
    loop = _Loop(model, data, optimizer, loss, dict(model_args or {}))
    lr = base_lr or default_of(optimizer, "lr")
    batch = base_batch_size or default_of(data, "batch_size")
    for value, field, what, example in (
        (lr, "base_lr", f"loop.optimizer {_name(optimizer)}", "lr=0.1"),
        (batch, "base_batch_size", f"loop.data {_name(data)}", "batch_size=64"),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise WorkloadError(
                f"{what} says no default {example.split('=')[0]} (got {value!r}); give it one "
                f"({example}) or set workload.loop.{field}"
            )
    probe = loop.build_optimizer([nn.Parameter(torch.zeros(1))], float(lr))
    model_name = display_name(model)
    return Workload(
        name=model_name,
        build_model=loop.build_model,
        make_batches=loop.make_batches,
        build_optimizer=loop.build_optimizer,
        base_lr=float(lr),
        base_batch_size=int(batch),
        loss=loop.loss,
        lr_scaling=lr_rule(probe),
        description=f"{model_name}: {type(probe).__name__}, {_name(loop.loss_fn)} (plain loop)",
    )
