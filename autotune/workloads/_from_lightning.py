"""A Workload from a LightningModule and a LightningDataModule, as Lightning would train them
(without a ``Trainer``: autotune times its own AMP step)."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from autotune.errors import WorkloadError
from autotune.workloads._base import Workload
from autotune.workloads._common import (
    Built,
    batch_length,
    display_name,
    endless,
    group_lrs,
    lr_rule,
    optimizer_like,
    scale_lrs,
    seed_loader,
)
from autotune.workloads._objects import build, call

__all__ = ["lightning_workload"]

# Where a LightningModule keeps its lr, and a data module its batch size, in the order
# Lightning's own tuner looks.
_LR_NAMES = ("lr", "learning_rate")
# A LightningDataModule's hooks around moving a batch to the device, in the order fit calls them.
_TRANSFER_HOOKS = (
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)
# Lightning's Trainer trains this many epochs when neither max_epochs nor max_steps is given.
_DEFAULT_MAX_EPOCHS = 1000


def _holders(obj: Any, name: str) -> list[Any]:
    """Where ``obj`` keeps ``name``: itself (a plain attribute) and/or its ``hparams``."""
    out: list[Any] = []
    prop = getattr(type(obj), name, None)
    if name in getattr(obj, "__dict__", {}) or (
        isinstance(prop, property) and prop.fset is not None
    ):
        out.append(obj)
    hparams = getattr(obj, "hparams", None)
    if isinstance(hparams, Mapping) and name in hparams:
        out.append(hparams)
    return out


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, Mapping) else getattr(holder, name)


def _set(holders: list[Any], name: str, value: Any) -> None:
    for holder in holders:
        if isinstance(holder, Mapping):
            holder[name] = value  # type: ignore[index]
        else:
            setattr(holder, name, value)


def _record_nothing(*args: Any, **kwargs: Any) -> None:
    """``self.log`` in a probe: the value stays where it is, nothing is read back."""


class _ProbeTrainer:
    """The ``trainer`` a LightningModule sees during a probe: the run's real step and epoch."""

    # What a training step may read, with a single device's answers.
    is_global_zero = True
    global_rank = local_rank = node_rank = 0
    world_size = num_devices = num_nodes = 1
    training = True
    sanity_checking = validating = testing = predicting = False
    accumulate_grad_batches = 1
    max_steps = -1
    max_epochs = _DEFAULT_MAX_EPOCHS
    logger = None
    log_every_n_steps = 50
    fast_dev_run = False

    def __init__(self, adapter: _Lightning) -> None:
        self._adapter = adapter
        self.datamodule = adapter.datamodule
        self.loggers: list[Any] = []
        self.callback_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, Any] = {}
        self.progress_bar_metrics: dict[str, Any] = {}
        self.default_root_dir = os.getcwd()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[dict[str, Any]] = []
        self.global_step = 0
        self.current_epoch = 0
        self.batch_idx = 0
        self.batch_size: int | None = None

    @property
    def num_training_batches(self) -> int:
        return self._adapter.batches_per_epoch(self.batch_size or self._adapter.base_batch)

    @property
    def estimated_stepping_batches(self) -> int:
        return self.max_epochs * self.num_training_batches

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"self.trainer.{name} is not available while autotune probes training_step: it runs "
            "outside a Trainer's fit loop, with a stand-in that answers global_step, "
            "current_epoch, max_epochs, estimated_stepping_batches, datamodule and "
            "is_global_zero; read it elsewhere (e.g. on_fit_start) or guard it"
        )

    def _step(self, kind: str) -> None:
        for config in self.lr_scheduler_configs:
            if config["interval"] != kind or config["monitor"]:
                continue
            count = self.global_step if kind == "step" else self.current_epoch
            if count % config["frequency"] == 0:
                config["scheduler"].step()

    def before_batch(self, batch: Any) -> int:
        """The step's ``batch_idx``; a pass over the data that just ended ends an epoch."""
        self.batch_size = batch_length(batch) or self.batch_size
        if self.batch_idx >= max(1, self.num_training_batches):
            self.batch_idx = 0
            self.current_epoch += 1
            self._step("epoch")
        index = self.batch_idx
        self.batch_idx += 1
        return index

    def after_optimizer_step(self, *args: Any) -> None:
        self.global_step += 1
        self._step("step")


def _scheduler_config(item: Any) -> dict[str, Any]:
    """A scheduler as ``configure_optimizers`` returned it, with Lightning's defaults filled in."""
    conf = dict(item) if isinstance(item, Mapping) else {"scheduler": item}
    if "scheduler" not in conf:
        raise WorkloadError(
            "configure_optimizers returned an lr_scheduler dict without 'scheduler'; "
            "write {'scheduler': ..., 'interval': 'step'}"
        )
    plateau = isinstance(conf["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau)
    return {
        "scheduler": conf["scheduler"],
        "interval": conf.get("interval", "epoch"),
        "frequency": int(conf.get("frequency", 1)),
        "monitor": conf.get("monitor") or ("val_loss" if plateau else None),
    }


def _parse(conf: Any, owner: str) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """One optimizer and its scheduler configs, from any form ``configure_optimizers`` may
    return: an optimizer, a list of them, ``([optimizers], [schedulers])``, a dict with
    ``optimizer`` and ``lr_scheduler``, or a list of such dicts."""
    opts: list[Any] = []
    scheds: list[Any] = []
    pair = isinstance(conf, (list, tuple)) and len(conf) == 2
    if pair and all(isinstance(c, (list, tuple)) for c in conf):
        opts, scheds = list(conf[0]), list(conf[1])
    else:
        for item in conf if isinstance(conf, (list, tuple)) else [conf]:
            if isinstance(item, Mapping):
                opts.append(item.get("optimizer"))
                if item.get("lr_scheduler") is not None:
                    scheds.append(item["lr_scheduler"])
            else:
                opts.append(item)
    if len(opts) != 1 or not isinstance(opts[0], torch.optim.Optimizer):
        got = (
            "nothing"
            if conf is None
            else f"{len(opts)} optimizers"
            if len(opts) != 1
            else type(opts[0]).__name__
        )
        raise WorkloadError(
            f"lightning.module {owner}: configure_optimizers() returned {got}; autotune tunes "
            "one optimizer: return it (with its scheduler, if any)"
        )
    return opts[0], [_scheduler_config(s) for s in scheds]


class _Lightning:
    base_lr: float  # set by lightning_workload, from inspect()

    def __init__(
        self, module: Any, datamodule: Any, module_args: dict, datamodule_args: dict
    ) -> None:
        self.module, self.module_args = module, dict(module_args)
        self.dm_factory, self.dm_args = datamodule, dict(datamodule_args)
        self.name = display_name(module)
        self.built = Built()
        self.datamodule = self._datamodule()
        self._rebuild_dm = False
        self.base_batch = self._base_batch()
        self._epoch_samples: int | None = None
        self._loader(self.base_batch)  # how many samples an epoch holds
        self.example: torch.optim.Optimizer | None = None

    # ---- the data module and its batches ----------------------------------------------------

    def _datamodule(self, **more: Any) -> Any:
        given = self.dm_factory
        if isinstance(given, type) or not hasattr(given, "train_dataloader"):
            dm = build("lightning.datamodule", given, self.dm_args, **more)
        else:
            dm = given
        if not callable(getattr(dm, "train_dataloader", None)):
            raise WorkloadError(
                f"lightning.datamodule: {type(dm).__name__} has no train_dataloader(); name a "
                "LightningDataModule class or a function returning one"
            )
        for hook, args in (("prepare_data", ()), ("setup", ("fit",))):
            fn = getattr(dm, hook, None)
            if callable(fn):
                call(f"lightning.datamodule {type(dm).__name__}.{hook}{args}", fn, *args)
        return dm

    def _base_batch(self) -> int:
        holders = _holders(self.datamodule, "batch_size")
        if holders:
            return int(_get(holders[-1], "batch_size"))
        factory = self.dm_factory if callable(self.dm_factory) else None
        takes = factory is not None and "batch_size" in _parameters(factory)
        if not takes:
            raise WorkloadError(
                f"lightning.datamodule {type(self.datamodule).__name__} keeps no batch_size: "
                "autotune tries batch sizes through it; take batch_size as an init arg, keep it "
                "(self.batch_size or save_hyperparameters()) and use it in train_dataloader()"
            )
        self._rebuild_dm = True
        given = self.dm_args.get("batch_size", _parameters(factory)["batch_size"].default)
        if given is inspect.Parameter.empty:
            raise WorkloadError(
                "lightning.datamodule: batch_size has no default; give it in datamodule_args"
            )
        return int(given)

    def _loader(self, batch_size: int) -> Any:
        if self._rebuild_dm:
            dm = self._datamodule(batch_size=batch_size)
        else:
            dm = self.datamodule
            _set(_holders(dm, "batch_size"), "batch_size", batch_size)
        loader = call(
            f"lightning.datamodule {type(dm).__name__}.train_dataloader()", dm.train_dataloader
        )
        made = getattr(loader, "batch_size", batch_size)
        if made is not None and made != batch_size:
            raise WorkloadError(
                f"lightning.datamodule {type(dm).__name__}.train_dataloader() made batches of "
                f"{made} when batch_size was set to {batch_size}; build its DataLoader with "
                "batch_size=self.batch_size (or self.hparams.batch_size)"
            )
        dataset = getattr(loader, "dataset", None)
        try:
            self._epoch_samples = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            self._epoch_samples = None
        return dm, loader

    def batches_per_epoch(self, batch_size: int) -> int:
        """Full batches in one pass over the data; "endless" for data of unknown length."""
        return (self._epoch_samples or 0) // batch_size or 1 << 30

    def make_batches(
        self, batch_size: int, device: torch.device, generator: torch.Generator
    ) -> Iterator[Any]:
        # The loader is made now, not at the first batch: another run may set another size.
        dm, loader = self._loader(batch_size)
        seed_loader(loader, generator)

        def transfer(batch: Any, dev: torch.device) -> Any:
            batch = dm.on_before_batch_transfer(batch, 0)
            batch = dm.transfer_batch_to_device(batch, dev, 0)
            return dm.on_after_batch_transfer(batch, 0)

        hooks = all(callable(getattr(dm, h, None)) for h in _TRANSFER_HOOKS)
        what = f"lightning.datamodule {type(dm).__name__}.train_dataloader()"
        return endless(loader, batch_size, device, what, transfer=transfer if hooks else None)

    # ---- the module, its optimizer and its step ---------------------------------------------

    def build_model(self) -> nn.Module:
        if isinstance(self.module, nn.Module):
            module = copy.deepcopy(self.module)
        else:
            module = build("lightning.module", self.module, self.module_args)
        if not callable(getattr(module, "training_step", None)) or not isinstance(
            module, nn.Module
        ):
            raise WorkloadError(
                f"lightning.module {self.name}: built a {type(module).__name__}, not a "
                "LightningModule with training_step; name its class or a function returning one"
            )
        if not getattr(module, "automatic_optimization", True):
            raise WorkloadError(
                f"lightning.module {self.name} uses manual optimization (it steps its own "
                "optimizer); autotune times its own AMP step and needs automatic optimization"
            )
        # A LightningModule: trainer and log are its own, not nn.Module attributes.
        lit: Any = module
        lit.trainer = _ProbeTrainer(self)
        lit.log = _record_nothing
        lit.log_dict = _record_nothing
        for hook, args in (("setup", ("fit",)), ("configure_model", ())):
            fn = getattr(module, hook, None)
            if callable(fn):
                call(f"lightning.module {self.name}.{hook}{args}", fn, *args)
        return self.built.add(module)

    def configure(self, module: nn.Module, lr: float | None) -> tuple[torch.optim.Optimizer, list]:
        """The module's optimizer and schedulers, its lr set to ``lr`` (None: its own)."""
        if lr is not None:
            for name in _LR_NAMES:
                _set(_holders(module, name), name, lr)
        conf = call(
            f"lightning.module {self.name}.configure_optimizers()", module.configure_optimizers
        )
        return _parse(conf, self.name)

    def inspect(self, base_lr: float | None) -> float:
        """Build one module and look: its own lr (hparam, else its optimizer's), its optimizer
        and schedulers at that lr. Returns the workload's base lr."""
        module = self.build_model()
        own = next((_get(h[-1], n) for n in _LR_NAMES if (h := _holders(module, n))), None)
        self.example, scheds = self.configure(module, None)
        self.base_groups = group_lrs(self.example)
        self.own_lr = float(own) if isinstance(own, (int, float)) else self.base_groups[0]
        self.schedulers = [
            f"{type(c['scheduler']).__name__} (interval={c['interval']}"
            + (", held: it watches a logged metric)" if c["monitor"] else ")")
            for c in scheds
        ]
        self.schedule = "+".join(type(c["scheduler"]).__name__ for c in scheds) or "constant"
        return base_lr or self.own_lr

    def build_optimizer(self, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        params = list(params)
        module = self.built.owner(params)
        if module is None:  # someone else's parameters: the optimizer the lr belongs to
            assert self.example is not None
            return optimizer_like(self.example, params, lr)
        optimizer, scheds = self.configure(module, lr * self.own_lr / self.base_lr)
        # Where the module keeps no lr (or ignores it), move the whole schedule to the lr.
        want, got = self.base_groups[0] * lr / self.base_lr, group_lrs(optimizer)[0]
        scale_lrs(optimizer, [c["scheduler"] for c in scheds], want / got if got else 1.0)
        trainer = cast(_ProbeTrainer, module.trainer)  # build_model's
        trainer.optimizers = [optimizer]
        trainer.lr_scheduler_configs = scheds
        optimizer.register_step_post_hook(trainer.after_optimizer_step)
        return optimizer

    def loss(self, module: nn.Module, batch: Any) -> torch.Tensor:
        lit: Any = module  # a LightningModule, with build_model's trainer
        trainer = lit.trainer
        out = lit.training_step(batch, trainer.before_batch(batch))
        if isinstance(out, Mapping):
            out = out.get("loss")
        if out is None:
            raise WorkloadError(
                f"lightning.module {self.name}.training_step returned no loss (None skips the "
                "batch in Lightning); a probe needs a loss every step"
            )
        return out


def _parameters(fn: Any) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def lightning_workload(
    module: Any,
    datamodule: Any,
    *,
    module_args: Mapping[str, Any] | None = None,
    datamodule_args: Mapping[str, Any] | None = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
) -> Workload:
    """A Workload from a LightningModule and a LightningDataModule (see the module's notes).

    Args:
        module: a LightningModule class (built with ``module_args``), a function returning
            one, or a module (copied for each probe).
        datamodule: a LightningDataModule class (built with ``datamodule_args``), a function
            returning one, or a data module; it must keep a ``batch_size`` (attribute or
            hparam) or take one as an init arg.
        module_args: init args of the module's class or factory.
        datamodule_args: init args of the data module's class or factory.
        base_lr: the lr at the base batch size; by default the module's ``lr`` or
            ``learning_rate`` hparam, else its optimizer's lr.
        base_batch_size: by default the data module's ``batch_size``.

    Returns:
        The Workload; its lr rule follows the module's optimizer (square root for Adam-like).

    Raises:
        WorkloadError: one line naming what cannot be built or used, and why.

    Example:
        >>> wl = lightning_workload(LitClassifier, CIFARData, module_args={"channels": 32})  # doctest: +SKIP
        >>> wl.base_lr, wl.base_batch_size, wl.lr_scaling  # doctest: +SKIP
        (0.05, 64, 'linear')
    """
    adapter = _Lightning(module, datamodule, dict(module_args or {}), dict(datamodule_args or {}))
    if base_batch_size is not None:
        adapter.base_batch = base_batch_size
    adapter.base_lr = adapter.inspect(base_lr)
    assert adapter.example is not None
    scheduled = f", then {', '.join(adapter.schedulers)}" if adapter.schedulers else ""
    return Workload(
        name=adapter.name,
        build_model=adapter.build_model,
        make_batches=adapter.make_batches,
        build_optimizer=adapter.build_optimizer,
        base_lr=adapter.base_lr,
        base_batch_size=adapter.base_batch,
        loss=adapter.loss,
        lr_scaling=lr_rule(adapter.example),
        lr_schedule=adapter.schedule,
        description=(
            f"{adapter.name} on {type(adapter.datamodule).__name__} (Lightning): "
            f"{type(adapter.example).__name__} from configure_optimizers{scheduled}"
        ),
    )
