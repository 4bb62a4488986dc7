"""The instruments: a forward hook on every leaf module, tensor hooks on its outputs, and the
running figures of each layer they fill in."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.diagnose._models import Pass
from autotune.measure.precision import PrecisionMode

__all__ = ["EXP_BINS", "EXP_OFFSET", "First", "Hooks", "LayerFigures", "floats", "peaks"]

# frexp exponents of nonzero finite fp32 values lie in [-148, 128]; bin 0 collects zeros.
EXP_OFFSET, EXP_BINS = 160, 300

# Where the first non-finite value came from: (layer index, or -1 for the loss; step; pass;
# whether that layer's inputs were already non-finite).
First = tuple[int, int, Pass, bool]


@dataclass
class LayerFigures:
    """Running figures of one leaf module."""

    name: str
    type: str
    order: int | None = None
    dtype: str = ""
    act_max: float = 0.0
    act_nonfinite: int = 0
    made_nonfinite: bool = False
    fp32_nonfinite: int = 0
    first_bad_step: int | None = None
    grad_max: float | None = None
    grad_nonfinite: int = 0
    param_grad_max: float = 0.0  # fp32 shadow, unscaled: bounds the usable loss scale
    nonzero: int = 0
    flushed: int = 0
    hist: torch.Tensor | None = None  # counts of nonzero |grad| by frexp exponent


def floats(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point tensors in a module's inputs or outputs (tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel():
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from floats(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from floats(item, depth + 1)


def peaks(tensors: Iterable[torch.Tensor]) -> tuple[float, int]:
    """The largest finite |value| and the number of non-finite values.

    ``amax`` propagates NaN and inf, so one reduction answers the common all-finite case; only
    a non-finite tensor is read again to count and to skip its bad values.
    """
    peak, bad = 0.0, 0
    for t in tensors:
        t = t.detach()
        top = float(t.abs().amax())
        if not math.isfinite(top):
            finite = torch.isfinite(t)
            bad += int((~finite).sum())
            top = float(torch.where(finite, t, 0).abs().amax())
        peak = max(peak, top)
    return peak, bad


class Hooks:
    """A forward hook on every leaf module; hooks on its output tensors catch its gradient.

    Tensor hooks rather than ``register_full_backward_hook``: full backward hooks refuse modules
    whose output is then modified in place (ResNet's ``ReLU(inplace=True)`` after BatchNorm).
    Figures are read to the host as they come: a diagnosis is not timed, and the host sync
    this costs on a GPU is small next to the shadow pass.
    """

    def __init__(self, model: nn.Module, mode: PrecisionMode, limit: float) -> None:
        self.low = mode.autocast_dtype  # None: no shadow pass, no underflow count
        self.low_name = "" if self.low is None else str(self.low).removeprefix("torch.")
        self.scales_loss, self.limit = mode.scales_loss, limit
        self.modules = [
            (n, m) for n, m in model.named_modules() if next(m.children(), None) is None
        ]
        self.layers = [LayerFigures(n, type(m).__name__) for n, m in self.modules]
        self.step, self.scale, self.shadow, self.seen = 0, 1.0, False, 0
        self.first: First | None = None
        self.fp32_grad_now: dict[int, float] = {}  # this step's shadow gradient peaks
        self.handles = [
            m.register_forward_hook(functools.partial(self._forward, i))
            for i, (_, m) in enumerate(self.modules)
        ]

    def remove(self) -> None:
        """Take the hooks off, and let go of the modules (the figures stay)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.modules = []

    def begin(self, step: int, scale: float) -> None:
        self.step, self.scale = step, scale
        self.fp32_grad_now.clear()

    def _bad(self, i: int, where: Pass, inputs_bad: bool = False) -> None:
        layer = self.layers[i]
        if layer.first_bad_step is None:
            layer.first_bad_step = self.step
        if self.first is None:
            self.first = (i, self.step, where, inputs_bad)

    def _forward(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        outs = list(floats(output))
        if not outs:
            return
        layer = self.layers[i]
        if layer.order is None:
            layer.order, self.seen = self.seen, self.seen + 1
        peak, bad = peaks(outs)
        layer.act_max = max(layer.act_max, peak)
        if self.shadow:
            layer.fp32_nonfinite += bad
        else:
            layer.dtype = str(outs[0].dtype).removeprefix("torch.")
            if bad:
                inputs_bad = peaks(floats(args))[1] > 0
                layer.act_nonfinite += bad
                layer.made_nonfinite |= not inputs_bad
                self._bad(i, "forward", inputs_bad)
        for t in outs:
            if t.requires_grad:
                t.register_hook(functools.partial(self._grad, i))

    def _grad(self, i: int, grad: torch.Tensor) -> None:
        layer = self.layers[i]
        peak, bad = peaks([grad])
        if self.shadow:
            layer.grad_max = max(layer.grad_max or 0.0, peak)
            self.fp32_grad_now[i] = max(self.fp32_grad_now.get(i, 0.0), peak)
            self._underflow(layer, grad)
            return
        layer.grad_max = max(layer.grad_max or 0.0, peak / self.scale)
        if bad:
            layer.grad_nonfinite += bad
            # An inf gradient at a scale above 1 is GradScaler calibrating (it skips the step
            # and halves the scale), unless the unscaled fp32 gradient is past the limit too.
            unscaled = self.fp32_grad_now.get(i, 0.0) > self.limit
            if not self.scales_loss or self.scale <= 1 or unscaled:
                self._bad(i, "backward")

    def shadow_param_grads(self) -> None:
        """After the shadow backward: the layers' own parameter gradients count too."""
        for layer, (_, module) in zip(self.layers, self.modules, strict=True):
            for p in module.parameters(recurse=False):
                if p.grad is not None and p.grad.numel():
                    layer.param_grad_max = max(layer.param_grad_max, peaks([p.grad])[0])
                    self._underflow(layer, p.grad)

    def _underflow(self, layer: LayerFigures, grad: torch.Tensor) -> None:
        if self.low is None or (layer.dtype and layer.dtype != self.low_name):
            return  # a layer that computes in fp32 under autocast loses nothing
        g = grad.detach().float().flatten()
        nonzero = (g != 0) & torch.isfinite(g)
        # Exact by construction: a value is lost when its scaled value casts to 0 in the dtype.
        # Round-to-nearest-even makes that |g * scale| <= 2^-25 for fp16, half its smallest
        # subnormal 2^-24 (6e-8): values between the two round up to 2^-24 and survive.
        flushed = nonzero & ((g * self.scale).to(self.low) == 0)
        counts = torch.stack([nonzero.sum(), flushed.sum()]).tolist()
        layer.nonzero += int(counts[0])
        layer.flushed += int(counts[1])
        # A histogram of exponents (|g| in [2^(e-1), 2^e)) answers "which scale keeps 99%?"
        # without keeping the gradients; bincount without weights is deterministic on CUDA too.
        exps = torch.frexp(g).exponent.long() + EXP_OFFSET
        bins = torch.where(nonzero, exps.clamp(1, EXP_BINS - 1), 0)
        hist = torch.bincount(bins, minlength=EXP_BINS)
        layer.hist = hist if layer.hist is None else layer.hist + hist
