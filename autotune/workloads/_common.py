"""What the Lightning, Hugging Face and plain-loop adapters share."""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from autotune.errors import WorkloadError
from autotune.infra.devices import prepare_batch

__all__ = [
    "Built",
    "batch_length",
    "default_of",
    "display_name",
    "endless",
    "group_lrs",
    "lr_rule",
    "optimizer_like",
    "scale_lrs",
    "seed_loader",
]

# Optimizers whose step follows the gradient's scale-free direction (Adam and its kin): their
# lr grows with the square root of the batch; plain SGD-like ones grow linearly.
_SQRT_OPTIMIZERS = ("adam", "lamb", "adafactor", "adagrad", "rmsprop", "lion", "sophia")
# Param-group keys that hold a learning rate a scheduler reads.
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def lr_rule(optimizer: Any) -> Literal["linear", "sqrt"]:
    """How the lr follows the batch size for this optimizer (an instance or its class).

    Example:
        >>> lr_rule(torch.optim.AdamW), lr_rule(torch.optim.SGD)
        ('sqrt', 'linear')
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__.lower()
    return "sqrt" if any(k in name for k in _SQRT_OPTIMIZERS) else "linear"


def display_name(obj: Any) -> str:
    """What a user calls a class, function or object: ``LitClassifier`` for the class, a
    ``functools.partial`` of it, or an instance of it.

    Example:
        >>> import functools
        >>> display_name(functools.partial(nn.Linear, 4)), display_name(nn.Linear(2, 2))
        ('Linear', 'Linear')
    """
    while hasattr(obj, "func") and callable(obj.func):  # functools.partial
        obj = obj.func
    name = (
        getattr(obj, "__name__", None) if callable(obj) and not isinstance(obj, nn.Module) else None
    )
    return name if isinstance(name, str) else type(obj).__name__


def default_of(fn: Any, name: str) -> Any:
    """The default of ``fn``'s parameter ``name``, or None when it has none (or no such
    parameter, or no signature).

    Example:
        >>> default_of(lambda batch_size=64: None, "batch_size")
        64
    """
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default


class Built:
    """The models an adapter built, held weakly, so ``build_optimizer(params, lr)`` can find
    the model the parameters belong to (a LightningModule's own ``configure_optimizers``, the
    Trainer's weight-decay groups need the model, not just its parameters)."""

    def __init__(self) -> None:
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def add(self, model: nn.Module) -> nn.Module:
        self._models.add(model)
        return model

    def owner(self, params: list[Any]) -> nn.Module | None:
        """The built model whose parameters these are; None for anyone else's."""
        if not params or not isinstance(params[0], torch.Tensor):
            return None
        ids = {id(p) for p in params}
        for model in list(self._models):
            own = {id(p) for p in model.parameters()}
            if ids <= own:
                return model
        return None


def optimizer_like(example: torch.optim.Optimizer, params: Iterable[Any], lr: float) -> Any:
    """An optimizer of ``example``'s class and settings over other parameters, at ``lr``.

    What an adapter returns for parameters that are not its model's: the question is then
    which optimizer the lr belongs to (autotune's facts ask it that way), not the model's own
    parameter groups.
    """
    # A concrete optimizer: its constructor takes lr, which the base class's does not.
    cls: Callable[..., torch.optim.Optimizer] = type(example)
    accepted: Mapping[str, inspect.Parameter]
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {
        k: v
        for k, v in example.defaults.items()
        if k not in ("params", "lr") and (k in accepted or takes_any)
    }
    return cls(params, lr=lr, **kwargs)


def scale_lrs(optimizer: torch.optim.Optimizer, schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate of the optimizer's groups, and the schedulers' own copies
    of them, by ``factor``: the optimizer and its schedule, moved to another lr as a whole.

    Example:
        >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        >>> scale_lrs(opt, [sched], 2.0)
        >>> opt.param_groups[0]["lr"], sched.base_lrs
        (0.2, [0.2])
    """
    if math.isclose(factor, 1.0, rel_tol=1e-9):
        return
    for group in optimizer.param_groups:
        for key in _LR_KEYS:
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * factor
    for scheduler in schedulers:
        for attr in ("base_lrs", "max_lrs", "_last_lr"):
            values = getattr(scheduler, attr, None)
            if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
                setattr(scheduler, attr, [v * factor for v in values])


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each group's lr before its scheduler touched it (``initial_lr`` where one set it)."""
    return [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]


def batch_length(batch: Any) -> int | None:
    """The batch dimension of the first tensor in a batch (a tensor, or a tuple, list or
    mapping of them); None when it holds no tensor.

    Example:
        >>> batch_length({"input_ids": torch.zeros(8, 16), "labels": torch.zeros(8, 16)})
        8
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for value in batch:
            found = batch_length(value)
            if found is not None:
                return found
    return None


def seed_loader(loader: Any, generator: torch.Generator) -> None:
    """Make a DataLoader's shuffling (and its workers' seeds) follow ``generator``, the probe's
    seeded generator, without rebuilding it."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return
    loader.generator = generator
    sampler = loader.sampler
    if isinstance(sampler, torch.utils.data.RandomSampler):
        sampler.generator = generator
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if isinstance(inner, torch.utils.data.RandomSampler):
        inner.generator = generator


def endless(
    loader: Iterable[Any],
    batch_size: int,
    device: torch.device,
    what: str,
    *,
    transfer: Callable[[Any, torch.device], Any] | None = None,
) -> Iterator[Any]:
    """The loader's batches of exactly ``batch_size``, on the device, pass after pass.

    A short last batch is skipped: a probe counts ``batch_size`` samples a step. ``transfer``
    moves a batch (a data module's own hooks); :func:`~autotune.infra.devices.prepare_batch` by
    default.
    """
    move = transfer or (lambda batch, dev: prepare_batch(batch, dev, False))
    while True:
        full = 0
        for batch in loader:
            if batch_length(batch) not in (batch_size, None):
                continue
            full += 1
            yield move(batch, device)
        if not full:
            raise WorkloadError(
                f"{what} gave no batch of {batch_size} samples; it needs at least that many "
                "samples, or a smaller space.batch_size"
            )
