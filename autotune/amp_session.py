"""What training code uses: an AMP session built from a tuned config.

The usual AMP loop, with the tuned settings in one object::

    cfg = autotune.load_config("studies/resnet18/best.json")
    with autotune.session(cfg, "cuda") as amp:  # backend flags set here, restored at the end
        model = amp.prepare(model)            # device, fp32 modules, channels_last, compile
        opt = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
        for x, y in loader:                   # DataLoader(..., batch_size=cfg.batch_size)
            x, y = amp.prepare_batch((x, y))
            opt.zero_grad()
            with amp.autocast():
                loss = loss_fn(model(x), y)
            amp.backward(loss)                # scaler.scale(loss).backward()
            amp.step(opt)                     # scaler.step(opt); scaler.update()

Opening a session is all or nothing: the device and the mode are checked before any global
setting changes, and a failure while setting the backend flags puts them back.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from autotune.errors import AutotuneWarning, DeviceError
from autotune.infra.devices import prepare_batch
from autotune.measure.knobs import apply_knobs, mark_batch_dynamic
from autotune.measure.precision import (
    PrecisionMode,
    apply_backend_flags,
    autocast,
    check_autocast,
    device_capability,
    get_mode,
    make_scaler,
    resolve_device,
    restore_backend_flags,
    snapshot_backend_flags,
)
from autotune.schema.config import TunedConfig, warn_if_environment_differs
from autotune.schema.spec import Candidate

__all__ = ["AmpSession", "check_supported", "session"]


# (mode, device) already warned about as running below its compute capability.
_SLOW: set[tuple[str, torch.device]] = set()


def check_supported(precision: str, device: str | torch.device) -> torch.device:
    """Check that ``device`` exists and really runs ``precision``; change nothing.

    A mode below its compute capability (bf16 emulated on a 7.5 GPU, fp16 without tensor cores)
    still runs, only slowly: that is a warning, not an error.

    Args:
        precision: ``fp32``, ``tf32``, ``fp16`` or ``bf16``.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Returns:
        The resolved device.

    Raises:
        SpecError: the precision is unknown.
        DeviceError: the device does not exist, or cannot run the mode at all (TF32 off CUDA,
            an autocast dtype this torch build silently runs as fp32).

    Example:
        >>> check_supported("bf16", "cpu")
        device(type='cpu')
    """
    mode = get_mode(precision)
    dev = resolve_device(device)
    if mode.cuda_only and dev.type != "cuda":
        raise DeviceError(
            f"precision {mode.name!r} needs a CUDA device (TF32 is a CUDA matmul mode), got "
            f"device {str(dev)!r}; train on cuda:N, or tune for this device with "
            f"`autotune search --device {dev}`"
        )
    if mode.autocast_dtype is not None:
        # torch only warns when autocast cannot use a dtype and then runs fp32.
        got = check_autocast(dev, mode.autocast_dtype)
        if got != mode.autocast_dtype:
            raise DeviceError(
                f"precision {mode.name!r}: autocast on {dev} runs {got} instead of "
                f"{mode.autocast_dtype}, so training would silently run in fp32; use another "
                f"device, or tune for this one with `autotune search --device {dev}`"
            )
    capability = device_capability(dev)
    if (
        capability is not None
        and capability < mode.min_capability
        and (mode.name, dev) not in _SLOW
    ):
        _SLOW.add((mode.name, dev))
        need = ".".join(map(str, mode.min_capability))
        have = ".".join(map(str, capability))
        warnings.warn(
            f"precision {mode.name!r} needs compute capability {need}+ to run natively; "
            f"{dev} has {have}, so it runs emulated or without tensor cores, likely slower than fp32",
            AutotuneWarning,
            stacklevel=2,
        )
    return dev


class AmpSession:
    """The tuned precision for a plain PyTorch loop: autocast, a GradScaler, backend flags.

    Opening the session sets the mode's backend flags (TF32 on or off for CUDA matmul, cuDNN conv
    and cuDNN RNN, in torch's new and legacy settings alike, and cudnn autotuning) as the search
    measured them; :meth:`close` (or leaving the ``with`` block) puts
    back what was there before. Opening fails before anything changes when the device cannot
    run the mode.

    Args:
        candidate: the settings (a config's are ``cfg.candidate()``); ``channels_last=None``
            means no.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        cudnn_benchmark: let cudnn pick the fastest conv algorithms, as the search did.
        fresh_compile: drop torch's in-process compile caches before compiling a model, so
            compiling costs what it costs a new process (``autotune train`` measures it so).

    Raises:
        SpecError: the precision is unknown.
        DeviceError: the device does not exist or cannot run the precision.

    Example:
        >>> from autotune.schema.spec import Candidate
        >>> with AmpSession(Candidate(precision="bf16", batch_size=64, learning_rate=0.1), "cpu") as amp:
        ...     with amp.autocast():
        ...         (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """

    def __init__(
        self,
        candidate: Candidate,
        device: str | torch.device = "auto",
        *,
        cudnn_benchmark: bool = True,
        fresh_compile: bool = False,
    ) -> None:
        # 1. Everything that can fail and changes nothing global.
        self.device: torch.device = check_supported(candidate.precision, device)
        self.mode: PrecisionMode = get_mode(candidate.precision)
        self.candidate = candidate
        self.channels_last = bool(candidate.channels_last)
        self.scaler: torch.amp.GradScaler = make_scaler(
            self.mode,
            self.device,
            init_scale=candidate.init_scale,
            growth_interval=candidate.growth_interval,
        )
        self._cudnn_benchmark = cudnn_benchmark
        self._fresh_compile = fresh_compile
        # Undoes the fp32 islands at close; models already prepared are not prepared twice.
        self._knobs = contextlib.ExitStack()
        self._prepared: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # 2. The global part, all or nothing.
        self._saved: dict[str, Any] | None = snapshot_backend_flags()
        try:
            apply_backend_flags(self.mode, cudnn_benchmark=cudnn_benchmark)
        except BaseException:
            restore_backend_flags(self._saved)
            self._saved = None
            raise

    @classmethod
    def from_config(
        cls, config: TunedConfig, device: str | torch.device = "auto", **options: Any
    ) -> AmpSession:
        """A session with a config's settings; warns once if this device is not the config's.

        Args:
            config: the tuned config.
            device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
            **options: keyword options of :class:`AmpSession`.

        Returns:
            The open session.

        Raises:
            DeviceError: the device does not exist or cannot run the config's precision.

        Example:
            >>> amp = AmpSession.from_config(cfg, "cuda")  # doctest: +SKIP
        """
        opened = cls(config.candidate(), device, **options)
        warn_if_environment_differs(config, opened.device, stacklevel=3)
        return opened

    # ---- what the loop calls ------------------------------------------------------------

    @property
    def precision(self) -> str:
        """The mode's name: ``fp32``, ``tf32``, ``fp16`` or ``bf16``."""
        return self.mode.name

    @property
    def batch_size(self) -> int:
        return self.candidate.batch_size

    @property
    def learning_rate(self) -> float:
        return self.candidate.learning_rate

    @property
    def closed(self) -> bool:
        """True once the backend flags are put back."""
        return self._saved is None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast region for the forward pass and loss (a no-op for fp32 and tf32)."""
        return autocast(self.mode, self.device)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Move a model to the device with the tuned knobs, and set the backend flags.

        The knobs, as the search measured them: the config's ``fp32_modules`` run in fp32
        inside the autocast region (until :meth:`close`), channels_last when tuned so, and
        the model's ``forward`` compiled when tuned compiled (in place; it compiles at the first
        step and stays compiled). The session set the flags when it opened; they are set again
        here in case code in between (a library, ``torch.set_float32_matmul_precision``) changed
        them. ``close()`` still restores what was there before the session.

        Args:
            model: the model, on any device.

        Returns:
            The same model, moved and prepared (a second call only moves it and sets the flags).

        Raises:
            SpecError: an ``fp32_modules`` name that is not a module of this model.
        """
        if not self.closed:
            apply_backend_flags(self.mode, cudnn_benchmark=self._cudnn_benchmark)
        if model in self._prepared:
            return model.to(self.device)
        model = apply_knobs(
            model,
            self.candidate,
            self.device,
            self._knobs,
            channels_last=self.channels_last,
            fresh_compile=self._fresh_compile,
        )
        self._prepared.add(model)
        return model

    def prepare_batch(self, batch: Any) -> Any:
        """Move a tensor, or a tuple/list/dict of them, to the device; 4-d tensors become
        channels_last when tuned so, and the batch dimension is marked dynamic for a compiled
        model (one graph for every batch size, as measured). Anything else passes through."""
        batch = prepare_batch(batch, self.device, self.channels_last)
        return mark_batch_dynamic(batch) if self.candidate.compile else batch

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scaler.scale(loss).backward()``: scaled for fp16, a plain backward otherwise."""
        self.scaler.scale(loss).backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.step(optimizer)`` then ``scaler.update()``.

        For fp16 the step is skipped when the gradients hold inf/NaN and the scale backs off;
        to clip gradients, call ``amp.scaler.unscale_(optimizer)`` before clipping and this.
        """
        self.scaler.step(optimizer)
        self.scaler.update()

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Put the backend flags back as they were before the session, and the fp32 modules'
        own forward methods; safe to call twice."""
        self._knobs.close()
        if self._saved is not None:
            restore_backend_flags(self._saved)
            self._saved = None

    def __enter__(self) -> AmpSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.candidate
        parts = [
            f"{self.precision} on {self.device}",
            f"bs={c.batch_size}",
            f"lr={c.learning_rate:g}",
        ]
        if self.scaler.is_enabled():
            parts.append(f"init_scale={c.init_scale:g}")
        if self.channels_last:
            parts.append("channels_last")
        if c.compile:
            parts.append(f"compile={c.compile_mode}")
        if c.fp32_modules:
            parts.append(f"fp32_modules={c.fp32_modules}")
        if self.closed:
            parts.append("closed")
        return f"AmpSession({', '.join(parts)})"


def session(config: TunedConfig, device: str | torch.device = "auto", **options: Any) -> AmpSession:
    """Open an AMP session with a tuned config's settings, for a plain PyTorch training loop.

    ``autotune.session(cfg, device)``: sets the mode's backend flags now and restores them when
    the session closes; warns once when this device is not the one the config was tuned on.

    Args:
        config: the tuned config (:func:`autotune.load_config`).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        **options: keyword options of :class:`AmpSession` (``cudnn_benchmark``).

    Returns:
        The open session: ``autocast()``, ``scaler``, ``prepare(model)``,
        ``prepare_batch(batch)``, ``backward(loss)``, ``step(optimizer)``, ``close()``.

    Raises:
        DeviceError: the device does not exist or cannot run the config's precision.

    Example:
        >>> import autotune
        >>> cfg = autotune.load_config("studies/tiny/best.json")  # doctest: +SKIP
        >>> with autotune.session(cfg, "cpu") as amp:  # doctest: +SKIP
        ...     model = amp.prepare(model)
    """
    return AmpSession.from_config(config, device, **options)
