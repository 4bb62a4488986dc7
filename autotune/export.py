"""Exports: a tuned config as what Lightning, Hugging Face and accelerate take, passed whole.

``autotune.export(cfg, target)`` returns an :class:`Export` for the device the config was tuned
on (or ``device=``): ``kwargs``, exactly the keyword arguments of the library's constructor with
the real plugin and handler objects in them (the tuned GradScaler included), and ``elsewhere``,
what that constructor does not take (batch size and lr for your DataLoader and optimizer, the
optimizer the lr was tuned for and its rescaling rule, the TF32 settings and
``cudnn.benchmark=True`` the probes measured with, the fp32 modules no library can express,
torch.compile where the library has no setting for it: Hugging Face's ``torch_compile`` and
accelerate's dynamo plugin take it, Lightning does not)::

    ex = autotune.export(cfg, "lightning")
    ex.elsewhere.set_backend_flags()             # TF32 as tuned, cudnn.benchmark=True
    trainer = lightning.Trainer(**ex.kwargs, max_epochs=10)
    loader = DataLoader(dataset, batch_size=ex.elsewhere.batch_size)

target      ``kwargs`` for                      ``render("json" | "yaml" | "args")`` for
lightning   ``lightning.Trainer``                ``LightningCLI`` (``--config``, ``--trainer.*``)
hf          ``transformers.TrainingArguments``   ``HfArgumentParser``
accelerate  ``accelerate.Accelerator``           ``accelerate launch`` (``--config_file``, flags)

An export never trains in a mode other than the config's without saying so: where a library
would silently change it (fp16 on a CPU runs as fp32 in Hugging Face's Trainer and accelerate;
TF32 has no CPU mode), :func:`export` refuses with a :class:`~autotune.errors.DeviceError` naming
the mode and the device. Lightning runs fp16 autocast on a CPU when the plugin says so.
"""

from __future__ import annotations

import importlib
import json
import math
import shlex
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.config import TunedConfig
from autotune.errors import DeviceError, SpecError
from autotune.knobs import knob_notes
from autotune.precision import apply_backend_flags, get_mode

__all__ = ["FORMATS", "TARGETS", "Elsewhere", "Export", "export"]

TARGETS: tuple[str, ...] = ("lightning", "hf", "accelerate")
FORMATS: tuple[str, ...] = ("json", "yaml", "args")

_LIBRARY = {"lightning": "Lightning", "hf": "Hugging Face's Trainer", "accelerate": "accelerate"}
# The package each target's objects come from, and what to install for it.
_PACKAGE = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}
# Lightning Trainer(precision=...) for the modes without a scaler; fp16 goes as a plugin.
_LIGHTNING_PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed"}
# accelerate Accelerator(mixed_precision=...) and `accelerate launch --mixed_precision`.
_ACCELERATE_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16"}
# torch's GradScaler defaults: where a library takes no scaler, only a tuned one is worth a note.
_DEFAULT_SCALER = {"init_scale": 2.0**16, "growth_interval": 2000}
_MIXED_PRECISION = "lightning.pytorch.plugins.precision.MixedPrecision"
_GRAD_SCALER = "torch.amp.GradScaler"
_GRAD_SCALER_KWARGS = "accelerate.utils.GradScalerKwargs"
_DYNAMO = "accelerate.utils.TorchDynamoPlugin"


@dataclass(frozen=True)
class _Obj:
    """An object of a library's class, described: built for ``kwargs``, written as LightningCLI's
    ``class_path``/``init_args`` in a file."""

    class_path: str
    init_args: dict[str, Any]

    def build(self) -> Any:
        module, _, name = self.class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)(**_walk(self.init_args, _Obj.build))

    def described(self) -> dict[str, Any]:
        return {"class_path": self.class_path, "init_args": _walk(self.init_args, _Obj.described)}


def _walk(value: Any, leaf: Any) -> Any:
    """``value`` with every :class:`_Obj` in it (in dicts and lists) replaced by ``leaf(obj)``."""
    if isinstance(value, _Obj):
        return leaf(value)
    if isinstance(value, dict):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, leaf) for v in value]
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
        compile_mode: ``model.compile(mode=...)`` before training; None: not compiled.
        fp32_modules: the modules to keep in fp32 (``autotune.diagnose.keep_in_fp32``).
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

    def set_backend_flags(self) -> None:
        """Set TF32 (CUDA matmul, cuDNN conv and RNN, in torch's new and legacy settings alike)
        and ``cudnn.benchmark`` as tuned, for the rest of the process.

        Example:
            >>> from autotune.precision import restore_backend_flags, snapshot_backend_flags
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


@dataclass(frozen=True)
class Export:
    """One export: ``kwargs`` for the library's constructor, ``elsewhere`` for the rest.

    Attributes:
        target: ``lightning``, ``hf`` or ``accelerate``.
        precision: the config's mode.
        device: ``cpu`` or ``cuda``: the device kind the export is for.
        elsewhere: what the constructor does not take (:class:`Elsewhere`).
        notes: what a person must know, in words (the CLI prints them on stderr).
    """

    target: str
    precision: str
    device: str
    elsewhere: Elsewhere
    notes: tuple[str, ...] = ()
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
            return _walk(self._kwargs, _Obj.build)
        except ModuleNotFoundError as exc:
            package = _PACKAGE[self.target]
            raise ImportError(
                f"export to {self.target} builds {package}'s objects, and {exc.name!r} is not "
                f"installed: pip install {package} (or 'autotune[integrations]')"
            ) from None

    def render(self, fmt: str = "json") -> str:
        """The export as a file or command line the library's own tools read.

        ``json`` / ``yaml``: a LightningCLI ``--config`` file (the ``trainer:`` section), a file
        ``HfArgumentParser`` parses into ``TrainingArguments``, or an ``accelerate launch
        --config_file`` file. ``args``: the same as LightningCLI, ``HfArgumentParser`` or
        ``accelerate launch`` flags. What has no place there is in :attr:`notes`.

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


def _flags(prefix: str, settings: dict[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    for key, value in settings.items():
        out += [f"--{prefix}{key}", _arg(value)]
    return tuple(out)


# ---- what every target says ---------------------------------------------------------------


def _elsewhere(cfg: TunedConfig) -> Elsewhere:
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
    )


def _tuned_scaler(cfg: TunedConfig) -> dict[str, Any] | None:
    """The fp16 GradScaler's tuned arguments, or None for the modes without one."""
    if not cfg.grad_scaler.enabled:
        return None
    return {
        "init_scale": cfg.grad_scaler.init_scale,
        "growth_interval": cfg.grad_scaler.growth_interval,
    }


def _scaler_text(scaler: dict[str, Any]) -> str:
    return f"init_scale={scaler['init_scale']:g}, growth_interval={scaler['growth_interval']}"


def _lr_note(cfg: TunedConfig, where: str) -> str:
    rule, ev = cfg.evidence.lr_scaling, cfg.evidence
    tuned_for = f"the {cfg.optimizer} optimizer" if cfg.optimizer else "the workload's optimizer"
    text = (
        f"learning_rate={cfg.learning_rate:g} ({where}) was tuned for {tuned_for} at "
        f"batch_size={cfg.batch_size} on one device"
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


def _common_notes(
    cfg: TunedConfig, device: str, target: str, *, compiles: bool = False
) -> list[str]:
    """Notes every target shares; ``compiles``: the library takes the compile setting itself."""
    compile_mode = cfg.compile_mode if cfg.compile and not compiles else None
    notes = knob_notes(cfg.fp32_modules, compile_mode, _LIBRARY[target])
    ex = _elsewhere(cfg)
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


def _refuse(cfg: TunedConfig, target: str, device: str) -> None:
    """Refuse a mode the library would silently train as another on this device."""
    library = _LIBRARY[target]
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


# ---- the targets -----------------------------------------------------------------------------


def _export(
    target: str,
    cfg: TunedConfig,
    device: str,
    notes: list[str],
    kwargs: dict[str, Any],
    file: dict[str, Any],
    args: tuple[str, ...] | list[str],
) -> Export:
    elsewhere = _elsewhere(cfg)
    return Export(target, cfg.precision, device, elsewhere, tuple(notes), kwargs, file, tuple(args))


def _lightning(cfg: TunedConfig, device: str) -> Export:
    accelerator = "cuda" if device == "cuda" else "cpu"
    kwargs: dict[str, Any] = {"accelerator": accelerator, "benchmark": True}
    scaler = _tuned_scaler(cfg)
    if scaler is not None:
        # The plugin, not precision="16-mixed": Lightning turns that into bf16 on a CPU, and
        # only the plugin carries the tuned scaler.
        kwargs["plugins"] = [
            _Obj(
                _MIXED_PRECISION,
                {
                    "precision": "16-mixed",
                    "device": device,
                    "scaler": _Obj(_GRAD_SCALER, {"device": device, **scaler}),
                },
            )
        ]
    else:
        kwargs["precision"] = _LIGHTNING_PRECISION[cfg.precision]
    described = _walk(kwargs, _Obj.described)
    notes = [
        f"batch_size={cfg.batch_size} goes to your DataLoader (LightningDataModule), "
        "learning_rate to configure_optimizers",
        _lr_note(cfg, "configure_optimizers"),
        *_common_notes(cfg, device, "lightning"),
    ]
    file = {"trainer": described}
    return _export("lightning", cfg, device, notes, kwargs, file, _flags("trainer.", described))


def _hf(cfg: TunedConfig, device: str) -> Export:
    # Only TrainingArguments fields, so TrainingArguments(output_dir=..., **kwargs) works.
    kwargs: dict[str, Any] = {
        "bf16": cfg.precision == "bf16",
        "fp16": cfg.precision == "fp16",
    }
    if device == "cuda":
        # False, not None: the search measured IEEE fp32 matmuls outside tf32 mode.
        kwargs["tf32"] = cfg.precision == "tf32"
    else:
        # Without it the Trainer refuses bf16 on a CPU ("You need to assign use_cpu").
        kwargs["use_cpu"] = True
    kwargs["per_device_train_batch_size"] = cfg.batch_size
    kwargs["learning_rate"] = cfg.learning_rate
    if cfg.compile:
        kwargs["torch_compile"] = True
        kwargs["torch_compile_mode"] = cfg.compile_mode
    notes = []
    if cfg.optimizer != "AdamW":
        opt = cfg.optimizer or "the workload's own optimizer"
        notes.append(
            f"the Trainer trains with AdamW (optim='adamw_torch') and a linearly decaying lr by "
            f"default, but learning_rate={cfg.learning_rate:g} was tuned for {opt} at a constant "
            f"rate: pass yours, Trainer(..., optimizers=(optimizer, None))"
        )
    notes.append(_lr_note(cfg, "TrainingArguments.learning_rate"))
    scaler = _tuned_scaler(cfg)
    if scaler is not None and scaler != _DEFAULT_SCALER:
        notes.append(
            "TrainingArguments has no GradScaler setting: the Trainer starts fp16 at torch's "
            f"default init_scale 65536, not the tuned {scaler['init_scale']:g}"
        )
    if device == "cuda":
        notes.append(
            "TrainingArguments(tf32=...) sets torch's new TF32 API only, after which "
            "torch.backends.cudnn.allow_tf32 raises: call Export.elsewhere.set_backend_flags() "
            "after TrainingArguments(...)"
        )
    notes += _common_notes(cfg, device, "hf", compiles=True)
    return _export("hf", cfg, device, notes, kwargs, dict(kwargs), _flags("", kwargs))


def _accelerate(cfg: TunedConfig, device: str) -> Export:
    mixed = _ACCELERATE_PRECISION[cfg.precision]
    kwargs: dict[str, Any] = {"mixed_precision": mixed}
    if device == "cpu":
        kwargs["cpu"] = True
    scaler = _tuned_scaler(cfg)
    if scaler is not None:
        kwargs["kwargs_handlers"] = [_Obj(_GRAD_SCALER_KWARGS, dict(scaler))]
    if cfg.compile:
        kwargs["dynamo_plugin"] = _Obj(_DYNAMO, {"backend": "inductor", "mode": cfg.compile_mode})
    # What `accelerate config` writes for one process on one machine.
    file = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO",
        "mixed_precision": mixed,
        "use_cpu": device == "cpu",
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "debug": False,
    }
    args = ["--mixed_precision", mixed, "--num_processes", "1", "--num_machines", "1"]
    if device == "cpu":
        args.append("--cpu")
    if cfg.compile:
        file["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_mode": cfg.compile_mode}
        args += ["--dynamo_backend", "inductor", "--dynamo_mode", cfg.compile_mode]
    notes = [
        f"batch_size={cfg.batch_size} goes to your DataLoader, learning_rate to your optimizer",
        _lr_note(cfg, "your optimizer's lr"),
    ]
    if scaler is not None:
        notes.append(
            "accelerate's config file and launch flags have no GradScaler setting: in your "
            f"script pass kwargs_handlers=[GradScalerKwargs({_scaler_text(scaler)})] "
            "(accelerate.utils) to Accelerator, as Export.kwargs does"
        )
    notes += _common_notes(cfg, device, "accelerate", compiles=True)
    return _export("accelerate", cfg, device, notes, kwargs, file, args)


_BUILDERS = {"lightning": _lightning, "hf": _hf, "accelerate": _accelerate}


def _device_kind(cfg: TunedConfig, device: str | torch.device | None) -> str:
    if device is None:
        # The config records a compute capability exactly when it was tuned on a CUDA device.
        return "cuda" if cfg.environment.capability is not None else "cpu"
    text = str(device).strip().lower()
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = text
    if kind not in ("cpu", "cuda"):
        raise DeviceError(
            f"an export is for a cpu or cuda device, got device={str(device)!r}; "
            "use --device cpu or --device cuda"
        )
    return kind


def export(cfg: TunedConfig, target: str, *, device: str | torch.device | None = None) -> Export:
    """A tuned config as a trainer's arguments, for the device it will run on.

    Args:
        cfg: the tuned config.
        target: ``lightning``, ``hf`` (Hugging Face ``TrainingArguments``) or ``accelerate``.
        device: ``cpu``, ``cuda`` or ``cuda:N``; by default the kind the config was tuned on.
            Nothing is checked against this machine: an export may be written anywhere.

    Returns:
        The :class:`Export`: ``kwargs`` for the constructor, ``elsewhere`` for the rest,
        ``notes``, and ``render(fmt)`` for the library's own config files and flags.

    Raises:
        SpecError: an unknown target, naming the known ones.
        DeviceError: the library would silently train another mode on this device (fp16 on a
            CPU in Hugging Face and accelerate, tf32 off CUDA), or an unknown device.

    Example:
        >>> export(cfg, "lightning").kwargs["precision"]  # doctest: +SKIP
        'bf16-mixed'
    """
    key = target.strip().lower()
    if key not in _BUILDERS:
        raise SpecError(
            f"unknown export target {target!r}; use one of {', '.join(TARGETS)}, "
            "e.g. --to lightning"
        )
    kind = _device_kind(cfg, device)
    _refuse(cfg, key, kind)
    return _BUILDERS[key](cfg, kind)
