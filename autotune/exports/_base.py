"""What every export holds: the :class:`Export` itself, :class:`Elsewhere`, and the notes all
targets share. The targets (``_lightning``, ``_hf``, ``_accelerate``) fill them in."""

from __future__ import annotations

import importlib
import json
import math
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.errors import DeviceError, SpecError
from autotune.exports._optimizer import build_optimizer, tuned_schedule
from autotune.measure.knobs import knob_notes
from autotune.measure.precision import apply_backend_flags, get_mode
from autotune.schema.config import TunedConfig

TARGETS: tuple[str, ...] = ("lightning", "hf", "accelerate")
FORMATS: tuple[str, ...] = ("json", "yaml", "args")

LIBRARY = {"lightning": "Lightning", "hf": "Hugging Face's Trainer", "accelerate": "accelerate"}
# The package each target's objects come from, and what to install for it.
_PACKAGE = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}


@dataclass(frozen=True)
class Obj:
    """An object of a library's class, described: built for ``kwargs``, written as LightningCLI's
    ``class_path``/``init_args`` in a file."""

    class_path: str
    init_args: dict[str, Any]

    def build(self) -> Any:
        module, _, name = self.class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)(**walk(self.init_args, Obj.build))

    def described(self) -> dict[str, Any]:
        return {"class_path": self.class_path, "init_args": walk(self.init_args, Obj.described)}


def walk(value: Any, leaf: Any) -> Any:
    """``value`` with every :class:`Obj` in it (in dicts and lists) replaced by ``leaf(obj)``."""
    if isinstance(value, Obj):
        return leaf(value)
    if isinstance(value, dict):
        return {k: walk(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [walk(v, leaf) for v in value]
    return value


@dataclass(frozen=True)
class Elsewhere:
    """What a library's constructor does not take, and where it goes.

    Attributes:
        precision: the config's mode (what :meth:`set_backend_flags` sets the flags for).
        batch_size: your DataLoader's ``batch_size``, per device.
        learning_rate: your optimizer's ``lr`` at that batch size.
        optimizer: the optimizer class the lr was tuned for (``"SGD"``, ``"AdamW"``); None when
            the config does not record it.
        lr_scaling: how the lr follows the batch: ``linear``, ``sqrt`` or ``none``.
        float32_matmul_precision: ``torch.set_float32_matmul_precision``'s value: ``"high"``
            (TF32) for tf32, ``"highest"`` (IEEE fp32) otherwise.
        cudnn_tf32: TF32 for cuDNN convolutions and RNNs (``torch.backends.cudnn.allow_tf32``).
        cudnn_benchmark: ``torch.backends.cudnn.benchmark``, which the probes measured with.
        channels_last: call ``model.to(memory_format=torch.channels_last)`` before training.
        compile_mode: the mode to compile the model's forward in before training; None: not
            compiled.
        fp32_modules: the modules to keep in fp32 (``autotune.diagnose.keep_in_fp32``).
        optimizer_kwargs: the optimizer's other settings (momentum, betas, weight_decay, ...);
            None when the config does not record them.
        lr_schedule: the lr schedule the lr was tuned under, for your loop to step:
            ``constant`` (also for a config that does not record it), ``linear``, ...
    """

    precision: str
    batch_size: int
    learning_rate: float
    optimizer: str | None
    lr_scaling: str
    float32_matmul_precision: str
    cudnn_tf32: bool
    cudnn_benchmark: bool = True
    channels_last: bool = False
    compile_mode: str | None = None
    fp32_modules: tuple[str, ...] = ()
    optimizer_kwargs: dict[str, Any] | None = None
    lr_schedule: str = "constant"

    def set_backend_flags(self) -> None:
        """Set TF32 (CUDA matmul, cuDNN conv and RNN, in torch's new and legacy settings alike)
        and ``cudnn.benchmark`` as tuned, for the rest of the process.

        Example:
            >>> from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags
            >>> saved = snapshot_backend_flags()
            >>> Elsewhere("bf16", 64, 0.1, "SGD", "linear", "highest", False).set_backend_flags()
            >>> torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
            ('highest', True)
            >>> restore_backend_flags(saved)
        """
        apply_backend_flags(get_mode(self.precision), cudnn_benchmark=self.cudnn_benchmark)

    def learning_rate_for(self, batch_size: int) -> float:
        """The learning rate for another (e.g. total, across devices) batch size, by the rule.

        Example:
            >>> Elsewhere("bf16", 64, 0.1, "SGD", "linear", "highest", False).learning_rate_for(256)
            0.4
        """
        if batch_size <= 0:
            raise SpecError(f"batch_size must be positive, got batch_size={batch_size}")
        ratio = batch_size / self.batch_size
        if self.lr_scaling == "linear":
            return self.learning_rate * ratio
        if self.lr_scaling == "sqrt":
            return self.learning_rate * math.sqrt(ratio)
        return self.learning_rate

    def build_optimizer(
        self, params: Iterable[Any], *, lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer the lr was tuned for, with its recorded settings, over ``params``.

        Args:
            params: what the optimizer takes: ``model.parameters()`` or parameter groups.
            lr: another learning rate (e.g. ``learning_rate_for(total)``); the tuned one by
                default.

        Returns:
            A ``torch.optim`` optimizer: ``SGD(params, lr=0.4, momentum=0.9, ...)`` as the
            search built it.

        Raises:
            ExportError: the config does not record the optimizer or its settings (written
                before autotune recorded them), or it is not a ``torch.optim`` class.

        Example:
            >>> ex = Elsewhere("bf16", 64, 0.1, "SGD", "linear", "highest", False,
            ...                optimizer_kwargs={"momentum": 0.9})
            >>> opt = ex.build_optimizer([torch.nn.Parameter(torch.zeros(1))])
            >>> type(opt).__name__, opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
            ('SGD', 0.1, 0.9)
        """
        rate = self.learning_rate if lr is None else lr
        return build_optimizer(self.optimizer, self.optimizer_kwargs, rate, params)


@dataclass(frozen=True)
class Export:
    """One export: ``kwargs`` for the library's constructor, ``elsewhere`` for the rest.

    Attributes:
        target: ``lightning``, ``hf`` or ``accelerate``.
        precision: the config's mode.
        device: ``cpu`` or ``cuda``: the device kind the export is for.
        elsewhere: what the constructor does not take (:class:`Elsewhere`).
        notes: what a person must know, in words (the CLI prints them on stderr).
        model_kwargs: Lightning: the tuned values your LightningModule's ``__init__`` takes
            (``lr`` or ``learning_rate``, maybe ``batch_size``), found in its signature.
        datamodule_kwargs: Lightning: the same for your LightningDataModule (``batch_size``).
    """

    target: str
    precision: str
    device: str
    elsewhere: Elsewhere
    notes: tuple[str, ...] = ()
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    datamodule_kwargs: dict[str, Any] = field(default_factory=dict)
    _kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    _file: dict[str, Any] = field(default_factory=dict, repr=False)
    _args: tuple[str, ...] = field(default=(), repr=False)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The constructor's keyword arguments, with real objects: ``Trainer(**ex.kwargs)``
        (Lightning), ``TrainingArguments(**ex.kwargs)``, ``Accelerator(**ex.kwargs)``. Built anew
        on each access, so two trainers never share a GradScaler.

        Raises:
            ImportError: the library is not installed (it is only needed here, not to render).
        """
        try:
            return walk(self._kwargs, Obj.build)
        except ModuleNotFoundError as exc:
            package = _PACKAGE[self.target]
            raise ImportError(
                f"export to {self.target} builds {package}'s objects, and {exc.name!r} is not "
                f"installed: pip install {package} (or 'autotune[integrations]')"
            ) from None

    def render(self, fmt: str = "json") -> str:
        """The export as a file or command line the library's own tools read.

        ``json`` / ``yaml``: a LightningCLI ``--config`` file, a file ``HfArgumentParser``
        parses into ``TrainingArguments``, or an ``accelerate launch --config_file`` file.
        ``args``: the same as LightningCLI, ``HfArgumentParser`` or ``accelerate launch`` flags.
        What has no place there is in :attr:`notes`.

        Args:
            fmt: ``json``, ``yaml`` or ``args``.

        Returns:
            The text, without a trailing newline.

        Raises:
            SpecError: an unknown format.

        Example:
            >>> export(cfg, "hf").render("args")  # doctest: +SKIP
            '--bf16 true --fp16 false --use_cpu true --per_device_train_batch_size 256 ...'
        """
        if fmt == "json":
            return json.dumps(self._file, indent=2)
        if fmt == "yaml":
            import yaml

            return yaml.safe_dump(self._file, sort_keys=False).rstrip("\n")
        if fmt == "args":
            return " ".join(shlex.quote(a) for a in self._args)
        raise SpecError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")


def _arg(value: Any) -> str:
    # HfArgumentParser and jsonargparse read booleans as true/false; objects go as JSON.
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def flags(prefix: str, settings: dict[str, Any]) -> tuple[str, ...]:
    """``--{prefix}{key} value`` for each setting, as the libraries' parsers read them."""
    out: list[str] = []
    for key, value in settings.items():
        out += [f"--{prefix}{key}", _arg(value)]
    return tuple(out)


# ---- what every target says ---------------------------------------------------------------


def elsewhere_of(cfg: TunedConfig) -> Elsewhere:
    mode = get_mode(cfg.precision)
    return Elsewhere(
        precision=cfg.precision,
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        optimizer=cfg.optimizer,
        lr_scaling=cfg.evidence.lr_scaling,
        float32_matmul_precision="high" if mode.tf32 else "highest",
        cudnn_tf32=mode.tf32,
        channels_last=cfg.channels_last,
        compile_mode=cfg.compile_mode if cfg.compile else None,
        fp32_modules=tuple(cfg.fp32_modules),
        optimizer_kwargs=None if cfg.optimizer_kwargs is None else dict(cfg.optimizer_kwargs),
        lr_schedule=tuned_schedule(cfg),
    )


def tuned_scaler(cfg: TunedConfig) -> dict[str, Any] | None:
    """The fp16 GradScaler's tuned arguments, or None for the modes without one."""
    if not cfg.grad_scaler.enabled:
        return None
    return {
        "init_scale": cfg.grad_scaler.init_scale,
        "growth_interval": cfg.grad_scaler.growth_interval,
    }


def scaler_text(scaler: dict[str, Any]) -> str:
    return f"init_scale={scaler['init_scale']:g}, growth_interval={scaler['growth_interval']}"


def optimizer_text(cfg: TunedConfig) -> str:
    """``SGD(momentum=0.9, weight_decay=0.0005)``: the optimizer and its settings, in words."""
    if cfg.optimizer is None:
        return "the workload's optimizer"
    if not cfg.optimizer_kwargs:
        return f"the {cfg.optimizer} optimizer"
    settings = ", ".join(f"{k}={v!r}" for k, v in cfg.optimizer_kwargs.items())
    return f"{cfg.optimizer}({settings})"


def lr_note(cfg: TunedConfig, where: str) -> str:
    rule, ev = cfg.evidence.lr_scaling, cfg.evidence
    schedule = tuned_schedule(cfg)
    rate = (
        "at a constant rate"
        if schedule == "constant"
        else f"as the base lr of the {schedule} schedule"
    )
    text = (
        f"learning_rate={cfg.learning_rate:g} ({where}) was tuned for {optimizer_text(cfg)} at "
        f"batch_size={cfg.batch_size} on one device, {rate}"
    )
    if rule in ("linear", "sqrt"):
        factor = f"total/{cfg.batch_size}" if rule == "linear" else f"sqrt(total/{cfg.batch_size})"
        text += (
            f"; for a larger total batch scale it by the {rule} rule (lr × {factor}; "
            "Export.elsewhere.learning_rate_for(total))"
        )
    if ev.base_learning_rate and ev.base_batch_size:
        text += f"; the workload's base: lr={ev.base_learning_rate:g} at batch_size={ev.base_batch_size}"
    return text


def common_notes(
    cfg: TunedConfig, device: str, target: str, *, compiles: bool = False
) -> list[str]:
    """Notes every target shares; ``compiles``: the library takes the compile setting itself."""
    compile_mode = cfg.compile_mode if cfg.compile and not compiles else None
    notes = knob_notes(cfg.fp32_modules, compile_mode, LIBRARY[target])
    if cfg.compile and compiles and cfg.precision in ("fp16", "bf16"):
        notes.append(
            f"{LIBRARY[target]} compiles the model itself: set "
            "torch._functorch.config.backward_pass_autocast = 'off' before training, so the "
            "compiled backward runs outside autocast as the search measured it (torch's default "
            "traces it under the forward's autocast, where an fp32 module's backward overflows)"
        )
    ex = elsewhere_of(cfg)
    if device == "cuda":
        tf32 = str(ex.cudnn_tf32)
        notes.append(
            "set TF32 and cudnn as the probes measured, before training: "
            f'torch.set_float32_matmul_precision("{ex.float32_matmul_precision}"), '
            f"torch.backends.cudnn.allow_tf32 = {tf32}, torch.backends.cudnn.benchmark = True "
            "(Export.elsewhere.set_backend_flags() sets them, cuDNN RNNs too)"
        )
    if cfg.channels_last:
        notes.append(
            "tuned with channels_last: call model.to(memory_format=torch.channels_last) "
            "before training; no trainer argument sets it"
        )
    if not cfg.evidence.validated:
        notes.append(
            f"this config is the fp32 fallback, not a validated speedup: "
            f"{cfg.evidence.validation_note}"
        )
    return notes


def refuse_mode(cfg: TunedConfig, target: str, device: str) -> None:
    """Refuse a mode the library would silently train as another on this device."""
    library = LIBRARY[target]
    if cfg.precision == "tf32" and device != "cuda":
        raise DeviceError(
            f"precision 'tf32' cannot run on {device}: TF32 is a CUDA matmul mode, so "
            f"{library} would train plain fp32; export for the CUDA device it was tuned for "
            "(--device cuda), or tune for this device with `autotune search --device cpu`"
        )
    if cfg.precision == "fp16" and device == "cpu" and target in ("hf", "accelerate"):
        raise DeviceError(
            f"precision 'fp16' on cpu: {library} trains fp16 on a CPU in fp32, without autocast "
            "or a GradScaler, and says nothing; export for a CUDA device (--device cuda), export "
            "to lightning (it runs fp16 autocast on a CPU), or tune bf16 for this CPU"
        )


def make_export(  # noqa: PLR0913 - an Export's parts, in the order each exporter has them
    target: str,
    cfg: TunedConfig,
    device: str,
    notes: list[str],
    kwargs: dict[str, Any],
    file: dict[str, Any],
    args: Iterable[str],
    **placed: dict[str, Any],
) -> Export:
    return Export(
        target,
        cfg.precision,
        device,
        elsewhere_of(cfg),
        tuple(notes),
        _kwargs=kwargs,
        _file=file,
        _args=tuple(args),
        **placed,
    )
