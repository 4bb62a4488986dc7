"""Say *why* a precision fails: per-layer numerics of a few instrumented training steps.

:func:`diagnose` trains a workload for a few steps under one candidate with hooks on every leaf
module and records, per layer, how close its activations and gradients come to the limits of
the precision's dtype, which layer first produced a non-finite value, and what to do about it.
It is the probe's training step with instruments on: slower, never timed. ``run_probe``
installs no hooks.

Each step runs two passes on the same batch and the same weights:

1. a **shadow pass** in fp32 (no autocast, loss not scaled) shows the true size of every
   activation and gradient: an fp16 value past 65 504 is just ``inf``, only fp32 can say it
   would have been 71 000. Its gradients, multiplied by the GradScaler's scale and cast to the
   dtype, count exactly how many values that dtype would flush to zero;
2. the **real pass**, as the probe does it (autocast, scaled loss, ``scaler.step``), shows
   which layers produce non-finite values, in which dtype and in which order.

fp32 and tf32 have nothing to compare against, so they run the real pass only.

Example:
    >>> from autotune.spec import Candidate
    >>> from autotune.workloads import load_workload
    >>> d = diagnose(load_workload("autotune.workloads.testing:fp16_overflow"),
    ...              Candidate(precision="fp16", batch_size=64, learning_rate=1e-3), "cpu")
    >>> d.verdict, d.first_nonfinite
    ('fails', 'amplify')
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from autotune.errors import SpecError, WorkloadError
from autotune.precision import (
    PrecisionMode,
    apply_backend_flags,
    autocast,
    get_mode,
    make_scaler,
    resolve_device,
    unsupported_modes,
)
from autotune.probe import leave_no_trace
from autotune.spec import Candidate, ProbeSettings
from autotune.step import check_loss, prepare_batch
from autotune.workloads import Workload

__all__ = [
    "DEFAULT_STEPS",
    "Diagnosis",
    "LayerStats",
    "Recommendation",
    "diagnose",
    "fp32_modules",
    "keep_in_fp32",
    "trial_candidate",
    "worst_diverged_trial",
]

# Enough for an overflow at initialization to show and the GradScaler to back off a few times;
# every step is two passes, so a diagnosis costs about ten probe steps.
DEFAULT_STEPS = 5
# An activation within 10x of the limit in the first steps has little room: they grow in training.
NEAR_LIMIT = 0.1
# Past this share of a layer's nonzero gradient values lost to underflow, its updates are wrong.
UNDERFLOW_SHARE = 0.01
# The init_scale advice keeps at least this share of each flagged layer's gradient values
# at or above the dtype's smallest subnormal.
_KEEP_SHARE = 0.99
# frexp exponents of nonzero finite fp32 values lie in [-148, 128]; bin 0 collects zeros.
_EXP_OFFSET, _EXP_BINS = 160, 300

Verdict = Literal["safe", "at_risk", "fails", "inconclusive"]
Pass = Literal["forward", "loss", "backward"]
Kind = Literal[
    "keep_fp32",
    "find_op",
    "lower_lr",
    "use_bf16",
    "raise_init_scale",
    "lower_init_scale",
    "safe",
    "retry",
]


class LayerStats(BaseModel):
    """What one leaf module did over the diagnosed steps.

    Magnitudes are of finite values only; non-finite ones are counted instead. Where a shadow
    fp32 pass ran, ``act_max`` and ``grad_max`` are its true sizes, which may exceed the limit.
    """

    model_config = ConfigDict(extra="forbid")

    name: str  # as in model.named_modules(); "" is the model itself
    type: str
    order: int  # execution order of its first forward call
    dtype: str  # dtype of its output in the real pass
    act_max: float  # largest |output|
    act_limit_ratio: float  # act_max / the dtype's largest finite value
    act_nonfinite: int  # non-finite output values in the real pass, all steps
    # Its output was non-finite while its inputs were finite: it made them, not passed them on.
    made_nonfinite: bool = False
    fp32_nonfinite: int = 0  # non-finite outputs in the fp32 shadow pass: not a precision problem
    grad_max: float | None = None  # largest |d loss / d output|, unscaled; None: none reached it
    grad_nonfinite: int = 0  # non-finite values in the real (scaled) backward pass
    # Share of its nonzero fp32 gradient values (output and own parameters) the dtype flushes to
    # zero at the GradScaler's scale. 0 for layers that compute in fp32 under autocast; None
    # without a shadow pass (fp32, tf32).
    grad_underflow: float | None = None
    first_nonfinite_step: int | None = None

    @property
    def label(self) -> str:
        """The name as a person reads it: ``(model)`` for the root module."""
        return self.name or "(model)"


class Recommendation(BaseModel):
    """One thing to do, with the numbers that call for it."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    evidence: str
    action: str
    layers: list[str] = Field(default_factory=list)
    # For raise_init_scale / lower_init_scale: the GradScaler init_scale to use.
    init_scale: float | None = None

    def __str__(self) -> str:
        return f"{self.evidence}: {self.action}"


class Diagnosis(BaseModel):
    """The per-layer numerics of a few training steps, a verdict and what to do.

    ``verdict``: ``fails`` (non-finite values that loss scaling cannot explain), ``at_risk``
    (activations near the limit, or gradients lost to underflow), ``safe``, or ``inconclusive``
    (the run could not be made: unsupported mode, out of memory, the workload raised).
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    workload: str
    candidate: Candidate
    device: str
    dtype: str
    limit: float  # the dtype's largest finite value
    smallest_subnormal: float
    steps: int  # steps run
    losses: list[float] = Field(default_factory=list)
    scales: list[float] = Field(default_factory=list)  # GradScaler scale at each step
    skipped_steps: int = 0
    layers: list[LayerStats] = Field(default_factory=list)  # in execution order
    first_nonfinite: str | None = None
    first_nonfinite_step: int | None = None
    first_nonfinite_pass: Pass | None = None
    verdict: Verdict
    reason: str
    recommendations: list[Recommendation] = Field(default_factory=list)
    wall_seconds: float = 0.0

    def worst(self, n: int = 10) -> list[LayerStats]:
        """The ``n`` layers nearest to failing: those that made non-finite values, those that
        passed them on, those near the limit, the most underflowing, then by size."""

        def badness(s: LayerStats) -> tuple[bool, bool, bool, float, float]:
            under = s.grad_underflow or 0.0
            return (
                s.made_nonfinite,
                s.act_nonfinite > 0,
                s.act_limit_ratio >= NEAR_LIMIT,
                under if under >= UNDERFLOW_SHARE else 0.0,
                s.act_limit_ratio,
            )

        return sorted(self.layers, key=badness, reverse=True)[:n]


def diagnose(
    workload: Workload,
    candidate: Candidate,
    device: str | torch.device = "auto",
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
) -> Diagnosis:
    """Train a few instrumented steps and say which layers break the precision, and the fix.

    Divergence, an unsupported mode, running out of memory and an exception inside the
    workload's own code are all results (verdicts), never exceptions.

    Args:
        workload: the workload to train.
        candidate: precision, batch size, learning rate and GradScaler settings.
        device: ``cpu``, ``cuda:N`` or ``auto``.
        steps: training steps to instrument (each is an fp32 shadow pass plus the real one).
        seed: seeds torch and Python's RNGs, as a probe's seed does.

    Returns:
        A Diagnosis: per-layer stats in execution order, the first non-finite layer, a verdict
        and recommendations.

    Raises:
        SpecError: ``steps`` is below 1.
        DeviceError: the device does not exist.
        WorkloadError: the workload breaks its contract (its loss is not a scalar tensor).

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> d = diagnose(tiny_mlp(), Candidate(precision="bf16", batch_size=64, learning_rate=0.05),
        ...              "cpu", steps=2)
        >>> d.verdict
        'safe'
    """
    if steps < 1:
        raise SpecError(f"steps must be at least 1, got steps={steps}; try steps={DEFAULT_STEPS}")
    started = time.perf_counter()
    dev = resolve_device(device)
    mode = get_mode(candidate.precision)
    dtype = mode.autocast_dtype or torch.float32
    info = torch.finfo(dtype)
    run = _Run(workload, candidate, dev, mode, dtype)
    failure: tuple[str, str] | None = None
    unsupported = unsupported_modes(dev).get(mode.name)
    if unsupported is not None:
        failure = (unsupported, "diagnose another --precision, or run it on a device that has it")
    else:
        with leave_no_trace():
            torch.set_grad_enabled(True)
            torch.manual_seed(seed)
            random.seed(seed)
            # Not timed: cudnn autotuning would only add its own warmup to a short run.
            apply_backend_flags(mode, cudnn_benchmark=False)
            failure = run.train(steps, seed)
    out = run.summary(failure)
    diag = Diagnosis(
        workload=workload.reference or workload.name,
        candidate=candidate,
        device=str(dev),
        dtype=str(dtype).removeprefix("torch."),
        limit=info.max,
        smallest_subnormal=info.smallest_normal * info.eps,
        **out,
        wall_seconds=time.perf_counter() - started,
    )
    logger.debug("diagnose {}: {}", diag.workload, diag.reason)
    return diag


# ---- the instruments -------------------------------------------------------------------------


@dataclass
class _Layer:
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


def _floats(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point tensors in a module's inputs or outputs (tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel():
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _floats(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _floats(item, depth + 1)


def _peaks(tensors: Iterable[torch.Tensor]) -> tuple[float, int]:
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


class _Hooks:
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
        self.layers = [_Layer(n, type(m).__name__) for n, m in self.modules]
        self.step, self.scale, self.shadow, self.seen = 0, 1.0, False, 0
        # (layer index or -1 for the loss, step, pass, the layer's inputs were already bad)
        self.first: tuple[int, int, Pass, bool] | None = None
        self.fp32_grad_now: dict[int, float] = {}  # this step's shadow gradient peaks
        self.handles = [
            m.register_forward_hook(functools.partial(self._forward, i))
            for i, (_, m) in enumerate(self.modules)
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

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
        outs = list(_floats(output))
        if not outs:
            return
        layer = self.layers[i]
        if layer.order is None:
            layer.order, self.seen = self.seen, self.seen + 1
        peak, bad = _peaks(outs)
        layer.act_max = max(layer.act_max, peak)
        if self.shadow:
            layer.fp32_nonfinite += bad
        else:
            layer.dtype = str(outs[0].dtype).removeprefix("torch.")
            if bad:
                inputs_bad = _peaks(_floats(args))[1] > 0
                layer.act_nonfinite += bad
                layer.made_nonfinite |= not inputs_bad
                self._bad(i, "forward", inputs_bad)
        for t in outs:
            if t.requires_grad:
                t.register_hook(functools.partial(self._grad, i))

    def _grad(self, i: int, grad: torch.Tensor) -> None:
        layer = self.layers[i]
        peak, bad = _peaks([grad])
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
                    layer.param_grad_max = max(layer.param_grad_max, _peaks([p.grad])[0])
                    self._underflow(layer, p.grad)

    def _underflow(self, layer: _Layer, grad: torch.Tensor) -> None:
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
        exps = torch.frexp(g).exponent.long() + _EXP_OFFSET
        bins = torch.where(nonzero, exps.clamp(1, _EXP_BINS - 1), 0)
        hist = torch.bincount(bins, minlength=_EXP_BINS)
        layer.hist = hist if layer.hist is None else layer.hist + hist


# ---- the run ---------------------------------------------------------------------------------


class _Run:
    """One diagnosis: the training steps, then the summary."""

    def __init__(
        self,
        workload: Workload,
        candidate: Candidate,
        dev: torch.device,
        mode: PrecisionMode,
        dtype: torch.dtype,
    ) -> None:
        self.workload, self.candidate, self.dev, self.mode = workload, candidate, dev, mode
        self.limit = torch.finfo(dtype).max
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.hooks: _Hooks | None = None
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.skipped = 0

    @property
    def first(self) -> tuple[int, int, Pass, bool] | None:
        """Where the first non-finite value came from; see ``_Hooks.first``."""
        return self.hooks.first if self.hooks is not None else None

    def train(self, steps: int, seed: int) -> tuple[str, str] | None:
        """Run the steps; return why the run could not be made and what to do, or None."""
        oom: str | None = None
        crash: str | None = None
        state: dict[str, Any] = {}
        try:
            self._loop(steps, seed, state)
        except WorkloadError:
            raise
        except torch.OutOfMemoryError as exc:
            oom = str(exc).splitlines()[0][:200] if str(exc) else "out of memory"
        except Exception as exc:  # the workload's own code raised: a result, like a crash
            logger.opt(exception=exc).debug("diagnose: the workload raised")
            crash = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        finally:
            if self.hooks is not None:
                self.hooks.remove()
        # Recover outside the except block: its traceback would keep the tensors alive.
        state.clear()
        if oom is not None:
            gc.collect()
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            return (
                f"out of memory at batch_size={self.candidate.batch_size} after "
                f"{len(self.losses)} steps ({oom})",
                "the fp32 shadow pass and the hooks need more memory than a probe: diagnose a "
                "smaller batch (--batch-size)",
            )
        if crash is not None:
            return (
                f"the workload raised {crash} at step {len(self.losses)}",
                "fix the workload's code, or diagnose other settings",
            )
        return None

    def _loop(self, steps: int, seed: int, state: dict[str, Any]) -> None:
        wl, cand, dev, mode = self.workload, self.candidate, self.dev, self.mode
        channels_last = wl.channels_last if cand.channels_last is None else cand.channels_last
        model = wl.build_model().to(dev)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model.train()
        opt = wl.build_optimizer(model.parameters(), cand.learning_rate)
        scaler = make_scaler(
            mode, dev, init_scale=cand.init_scale, growth_interval=cand.growth_interval
        )
        batches = wl.make_batches(cand.batch_size, dev, torch.Generator().manual_seed(seed))
        state.update(model=model, opt=opt, scaler=scaler, batches=batches)
        self.hooks = hooks = _Hooks(model, mode, self.limit)
        for step in range(steps):
            batch = prepare_batch(next(batches), dev, channels_last)
            scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
            hooks.begin(step, scale)
            if mode.autocast_dtype is not None:  # 1. the fp32 shadow pass: true sizes
                hooks.shadow = True
                opt.zero_grad(set_to_none=True)
                loss = wl.loss(model, batch)
                if step == 0:
                    check_loss(loss, wl)
                loss.float().backward()
                hooks.shadow_param_grads()
                hooks.shadow = False
            opt.zero_grad(set_to_none=True)  # 2. the real pass, as the probe runs it
            with autocast(mode, dev):
                loss = wl.loss(model, batch)
            if step == 0:
                check_loss(loss, wl)
            self.losses.append(float(loss.detach().float()))
            if hooks.first is None and not math.isfinite(self.losses[-1]):
                hooks.first = (-1, step, "loss", False)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            after = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
            # GradScaler backs off exactly when it found inf/NaN gradients and skipped the step.
            self.skipped += after < scale
            self.scales.append(scale)
            if not mode.scales_loss and hooks.first is not None:
                break  # without a scaler the bad step was applied: what follows is NaN noise

    # ---- summary -----------------------------------------------------------------------------

    def summary(self, failure: tuple[str, str] | None) -> dict[str, Any]:
        """The Diagnosis fields that depend on the run: stats, verdict, recommendations."""
        layers = self.hooks.layers if self.hooks else []
        ran = sorted((x for x in layers if x.order is not None), key=lambda x: x.order or 0)
        stats = [self._stats(x) for x in ran]
        out: dict[str, Any] = {
            "steps": len(self.losses),
            "losses": self.losses,
            "scales": self.scales if self.mode.scales_loss else [],
            "skipped_steps": self.skipped,
            "layers": stats,
        }
        if self.first is not None:
            index, step, where, _ = self.first
            out["first_nonfinite"] = layers[index].name if index >= 0 else None
            out["first_nonfinite_step"], out["first_nonfinite_pass"] = step, where
        if failure is not None:
            why, advice = failure
            out.update(
                verdict="inconclusive",
                reason=f"inconclusive: {why}",
                recommendations=[Recommendation(kind="retry", evidence=why, action=advice)],
            )
            return out
        recs, verdict = _advise(self, ran, stats)
        out.update(verdict=verdict, reason=_reason(verdict, recs), recommendations=recs)
        return out

    def _stats(self, x: _Layer) -> LayerStats:
        shadowed = self.mode.autocast_dtype is not None
        if not shadowed:
            underflow = None
        elif x.dtype != self.dtype_name or not x.nonzero:
            underflow = 0.0
        else:
            underflow = x.flushed / x.nonzero
        return LayerStats(
            name=x.name,
            type=x.type,
            order=x.order or 0,
            dtype=x.dtype,
            act_max=x.act_max,
            act_limit_ratio=x.act_max / self.limit,
            act_nonfinite=x.act_nonfinite,
            made_nonfinite=x.made_nonfinite,
            fp32_nonfinite=x.fp32_nonfinite,
            grad_max=x.grad_max,
            grad_nonfinite=x.grad_nonfinite,
            grad_underflow=underflow,
            first_nonfinite_step=x.first_bad_step,
        )


# ---- advice ----------------------------------------------------------------------------------


def _num(x: float) -> str:
    """71000 → ``71,000``; 5.63 → ``5.63``; 1.2e-13 → ``1.2e-13``."""
    return f"{x:,.0f}" if 1000 <= abs(x) < 1e7 else f"{x:.3g}"


def _pow2(x: float) -> str:
    k = math.log2(x) if x > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{x:g}"


def _scales(run: _Run) -> str:
    """The GradScaler scales the steps ran at: ``scale 2^16`` or ``scales 2^13 to 2^16``."""
    lo, hi = min(run.scales or [1.0]), max(run.scales or [1.0])
    return f"scale {_pow2(hi)}" if lo == hi else f"scales {_pow2(lo)} to {_pow2(hi)}"


def _tick(name: str) -> str:
    return f"`{name or '(model)'}`"


def _names(names: Iterable[str]) -> str:
    return ", ".join(_tick(n) for n in names)


def _advise(
    run: _Run, ran: list[_Layer], stats: list[LayerStats]
) -> tuple[list[Recommendation], Verdict]:
    """Turn the figures into recommendations, each with its evidence, and a verdict."""
    dt, limit, mode = run.dtype_name, run.limit, run.mode
    fp32_range = limit >= torch.finfo(torch.float32).max  # bf16 has fp32's range
    alt = "lower the learning rate" if fp32_range else "use bf16, which has fp32's range"
    fp32_how = "with `torch.autocast(device_type, enabled=False)` and inputs cast with `.float()`"
    fp32_ctx = f"{fp32_how} (autotune.diagnose.keep_in_fp32 does both)"
    recs: list[Recommendation] = []
    failed = run.first is not None
    covered: set[str] = set()

    # 1. The first non-finite value: where, and what made it.
    if run.first is not None:
        index, step, where, inputs_bad = run.first
        at = f"at step {step}"
        if where == "forward":
            x = run.hooks.layers[index]  # type: ignore[union-attr]
            covered.add(x.name)
            size = (
                f"reaches {_num(x.act_max)} in fp32, past {dt}'s limit {_num(limit)}"
                if x.act_max > limit
                else f"overflows {dt} (limit {_num(limit)}) inside the op; its fp32 output peaks "
                f"at {_num(x.act_max)}"
            )
            if x.fp32_nonfinite:
                recs.append(
                    Recommendation(
                        kind="lower_lr",
                        layers=[x.name],
                        evidence=f"layer {_tick(x.name)} ({x.type}) is non-finite {at} in fp32 too",
                        action="this is not a precision problem: the model itself diverges; lower the "
                        "learning rate or check the layer",
                    )
                )
            elif inputs_bad:
                recs.append(
                    Recommendation(
                        kind="find_op",
                        layers=[x.name],
                        evidence=f"{_tick(x.name)} ({x.type}) is the first module with a non-finite "
                        f"output ({at}), but its inputs were already non-finite",
                        action="the overflow is in functional code before it (an op between modules): run "
                        f"that code {fp32_how}, wrap it in a module so diagnose can "
                        f"name it, or {alt}",
                    )
                )
            else:
                grew = (
                    " It was finite at step 0: a lower learning rate may also help." if step else ""
                )
                recs.append(
                    Recommendation(
                        kind="keep_fp32",
                        layers=[x.name],
                        evidence=f"layer {_tick(x.name)} ({x.type}) {size}: {at} its {dt} "
                        f"output had {x.act_nonfinite:,} non-finite values from finite inputs",
                        action=f"run it in fp32 {fp32_ctx}, or {alt}.{grew}",
                    )
                )
        elif where == "loss":
            recs.append(
                Recommendation(
                    kind="find_op",
                    evidence=f"the loss is non-finite {at} while every module's output was finite",
                    action="the overflow is in the loss or in functional code after the last module: "
                    "compute the loss in fp32 (`logits.float()`), or " + alt,
                )
            )
        else:
            x = run.hooks.layers[index]  # type: ignore[union-attr]
            covered.add(x.name)
            g = f"largest unscaled gradient {_num(x.grad_max)}, " if x.grad_max else ""
            recs.append(
                Recommendation(
                    kind="use_bf16" if not fp32_range else "lower_lr",
                    layers=[x.name],
                    evidence=f"gradients reaching {_tick(x.name)} are non-finite in {dt} {at} "
                    f"({g}limit {_num(limit)}) without loss scaling to blame",
                    action=alt if not fp32_range else "lower the learning rate or clip gradients",
                )
            )

    # 2. A loss that blows up with every value finite: the learning rate, not the precision.
    finite = [v for v in run.losses if math.isfinite(v)]
    factor = ProbeSettings().loss_blowup_factor
    if run.first is None and finite and finite[0] > 0 and max(finite) > factor * finite[0]:
        failed = True
        recs.append(
            Recommendation(
                kind="lower_lr",
                evidence=f"the loss grew from {_num(finite[0])} to {_num(max(finite))} in "
                f"{len(run.losses)} steps (the probe calls over {factor:g}x divergence) with no "
                f"non-finite value in {dt}",
                action=f"that is the learning rate, not the precision: lower it from "
                f"lr={run.candidate.learning_rate:g}",
            )
        )

    # 3. Activations near the limit, not already named.
    near = [s for s in stats if s.act_limit_ratio >= NEAR_LIMIT and s.name not in covered]
    near.sort(key=lambda s: s.act_limit_ratio, reverse=True)
    if near:
        top = near[:5]
        sizes = ", ".join(f"`{s.label}` {_num(s.act_max)} ({s.act_limit_ratio:.0%})" for s in top)
        recs.append(
            Recommendation(
                kind="keep_fp32",
                layers=[s.name for s in top],
                evidence=f"activations near {dt}'s limit {_num(limit)}: {sizes}",
                action=f"run {'them' if len(top) > 1 else 'it'} in fp32 {fp32_ctx}, or {alt}; "
                "they grow as training goes on",
            )
        )

    # 4. Gradient underflow, and the loss scale that keeps the gradients.
    low, high, biggest = _scale_window(run, ran)
    under = [s for s in stats if (s.grad_underflow or 0.0) >= UNDERFLOW_SHARE]
    if under:
        under.sort(key=lambda s: s.grad_underflow or 0.0, reverse=True)
        worst = under[0].grad_underflow or 0.0
        evidence = (
            f"gradients underflow in {_names(s.name for s in under[:5])} (up to {worst:.0%} of "
            f"nonzero values flush to zero in {dt} at {_scales(run)})"
        )
        if not mode.scales_loss:
            recs.append(
                Recommendation(
                    kind="keep_fp32",
                    layers=[s.name for s in under[:5]],
                    evidence=evidence,
                    action="this mode has no loss scaling: use fp32, or fp16 with a GradScaler",
                )
            )
        elif low is not None and (high is None or low <= high):
            recs.append(
                Recommendation(
                    kind="raise_init_scale",
                    layers=[s.name for s in under[:5]],
                    evidence=evidence,
                    init_scale=2.0**low,
                    action=f"raise init_scale to {_pow2(2.0**low)}: {_KEEP_SHARE:.0%} of each "
                    f"layer's gradient values then stay at or above {dt}'s smallest subnormal",
                )
            )
        else:
            recs.append(
                Recommendation(
                    kind="use_bf16",
                    layers=[s.name for s in under[:5]],
                    evidence=evidence,
                    action=f"no single loss scale fits: the largest gradients need at most "
                    f"{_pow2(2.0 ** (high or 0))} and the smallest at least {_pow2(2.0 ** (low or 0))}; "
                    "use bf16",
                )
            )

    # 5. A starting scale so high that the first steps are skipped (harmless, but wasted).
    scale_high = high is not None and 2.0**high < run.candidate.init_scale
    if mode.scales_loss and run.skipped and not under and scale_high:
        recs.append(
            Recommendation(
                kind="lower_init_scale",
                init_scale=2.0**high,
                evidence=f"the GradScaler skipped {run.skipped} of {len(run.losses)} steps: at "
                f"init_scale {_pow2(run.candidate.init_scale)} the largest gradient, {_num(biggest)} "
                f"unscaled, overflows {dt}'s {_num(limit)}",
                action=f"start at init_scale {_pow2(2.0**high)} to save those steps (the scaler "
                "backs off by itself; this is not a failure)",
            )
        )

    if failed:
        return recs, "fails"
    if near or under:
        return recs, "at_risk"
    recs.insert(0, _safe(run, stats))
    return recs, "safe"


def _scale_window(run: _Run, ran: list[_Layer]) -> tuple[int | None, int | None, float]:
    """The powers of two ``(low, high)`` a loss scale 2^k should lie between, and the largest
    unscaled gradient that sets ``high``.

    ``low``: the smallest k that keeps ``_KEEP_SHARE`` of every flagged layer's nonzero gradient
    values at or above the smallest subnormal 2^s. A value in exponent bin e lies in
    [2^(e-1), 2^e). Let e* be the highest bin such that the bins up to it hold at most
    1 - keep of the values; every value above them is at least 2^e*, so k >= s - e* lifts
    them all to 2^s or more.
    ``high``: the largest k that keeps the largest gradient (outputs and parameters) under the
    limit. None where there is nothing to bound.
    """
    if run.mode.autocast_dtype is None:
        return None, None, 0.0
    info = torch.finfo(run.mode.autocast_dtype)
    s = round(math.log2(info.smallest_normal * info.eps))
    needs: list[int] = []
    for x in ran:
        if x.hist is None or not x.nonzero or x.flushed / x.nonzero < UNDERFLOW_SHARE:
            continue
        cum = torch.cumsum(x.hist[1:].double().cpu(), 0)  # cum[j] counts bins 1..j+1
        within = (cum <= (1 - _KEEP_SHARE) * float(cum[-1])).nonzero()
        # Bin 1 (exponent -159) is always empty for fp32 values, so `within` is never empty.
        e_star = int(within[-1]) + 1 - _EXP_OFFSET
        needs.append(s - e_star)
    low = max(needs) if needs else None
    biggest = max(
        (max(x.grad_max or 0.0, x.param_grad_max) for x in ran if x.dtype == run.dtype_name),
        default=0.0,
    )
    high = math.floor(math.log2(run.limit / biggest)) if biggest > 0 else None
    return low, high, biggest


def _safe(run: _Run, stats: list[LayerStats]) -> Recommendation:
    dt = run.dtype_name
    if not stats:
        return Recommendation(
            kind="safe", evidence="no module produced an output", action="nothing to check"
        )
    top = max(stats, key=lambda s: s.act_limit_ratio)
    parts = [
        f"largest activation {_num(top.act_max)} in {_tick(top.name)} "
        f"({top.act_limit_ratio:.2%} of {dt}'s limit {_num(run.limit)})"
    ]
    shares = [s.grad_underflow for s in stats if s.grad_underflow is not None]
    if shares:
        scale = f" at {_scales(run)}" if run.mode.scales_loss else ""
        parts.append(f"gradient underflow at most {max(shares):.2%}{scale}")
    return Recommendation(
        kind="safe",
        evidence="; ".join(parts),
        action=f"nothing near the limits: {run.mode.name} is safe here",
    )


def _reason(verdict: Verdict, recs: list[Recommendation]) -> str:
    head = {"fails": "fails", "at_risk": "at risk", "safe": "safe"}.get(verdict, verdict)
    return f"{head}: {recs[0].evidence}" if recs else head


# ---- using a diagnosis -------------------------------------------------------------------------


def fp32_modules(diagnosis: Diagnosis) -> list[str]:
    """The module names a diagnosis says to run in fp32, in execution order.

    Args:
        diagnosis: a Diagnosis from :func:`diagnose`.

    Returns:
        The layers of its ``keep_fp32`` recommendations (overflowing or near the limit);
        empty when there is nothing to keep in fp32.

    Example:
        >>> fp32_modules(d)  # doctest: +SKIP
        ['amplify']
    """
    wanted = {n for r in diagnosis.recommendations if r.kind == "keep_fp32" for n in r.layers}
    return [s.name for s in diagnosis.layers if s.name in wanted]


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_fp32(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_fp32(v) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def keep_in_fp32(
    model: nn.Module, names: Iterable[str], *, device_type: str | None = None
) -> Iterator[nn.Module]:
    """Run the named submodules in fp32 inside an autocast region, for the block.

    Each named module's forward runs with autocast disabled and its floating inputs cast to
    fp32, so its output is fp32; the ops after it are autocast again. Restored on exit.

    Args:
        model: the model; ``names`` are as in ``model.named_modules()`` (``""`` is the model).
        names: the modules to keep in fp32, e.g. ``fp32_modules(diagnosis)``.
        device_type: the autocast device type; the model's parameters' device type by default.

    Returns:
        A context manager yielding the model.

    Raises:
        SpecError: a name that is not a module of the model, listing some that are.

    Example:
        >>> with keep_in_fp32(model, ["amplify"]), torch.autocast("cpu", torch.float16):  # doctest: +SKIP
        ...     loss = model(x).sum()
    """
    modules = dict(model.named_modules())
    names = list(dict.fromkeys(names))
    for name in names:
        if name not in modules:
            known = ", ".join(repr(n) for n in list(modules)[1:9])
            raise SpecError(
                f"module {name!r} is not in the model; use names from model.named_modules(), "
                f"e.g. {known}"
            )
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
    # (module, its own instance-level forward if it had one): what to put back.
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in names:
            module = modules[name]
            patched.append((module, vars(module).get("forward")))
            module.forward = _fp32_forward(module.forward, device_type)  # type: ignore[method-assign]
        yield model
    finally:
        for module, own in reversed(patched):
            if own is not None:
                module.forward = own  # type: ignore[method-assign]
            else:
                del module.forward


def _fp32_forward(inner: Any, device_type: str) -> Any:
    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return inner(*_to_fp32(args), **_to_fp32(kwargs))

    return forward


# ---- from a study --------------------------------------------------------------------------------


def worst_diverged_trial(trials: Iterable[Any], precision: str = "fp16") -> Any | None:
    """The diverged trial of a precision that broke soonest, or None.

    "Worst" is the earliest divergence (fewest finite losses recorded), then the highest
    learning rate. Works on Optuna ``FrozenTrial`` objects (anything with ``params`` and
    ``user_attrs``).

    Args:
        trials: the study's trials.
        precision: which precision's trials to consider.

    Returns:
        The trial, or None when no trial of that precision diverged.

    Example:
        >>> worst_diverged_trial(study.trials)  # doctest: +SKIP
    """

    def key(t: Any) -> tuple[int, float]:
        losses = t.user_attrs.get("losses") or []
        finite = next((n for n, v in enumerate(losses) if v is None), len(losses))
        return finite, -float(t.user_attrs.get("learning_rate") or 0.0)

    diverged = [
        t
        for t in trials
        if t.params.get("precision") == precision and t.user_attrs.get("outcome") == "diverged"
    ]
    return min(diverged, key=key) if diverged else None


def trial_candidate(trial: Any, workload: Workload) -> Candidate:
    """The Candidate a stored search trial ran: its params and its recorded learning rate.

    Args:
        trial: an Optuna trial of an autotune study (params precision, batch_size and, for
            fp16, init_scale; user attr learning_rate).
        workload: its workload, for the base batch size and lr when a trial lacks them.

    Returns:
        The Candidate.

    Example:
        >>> diagnose(wl, trial_candidate(worst_diverged_trial(study.trials), wl))  # doctest: +SKIP
    """
    params, attrs = trial.params, trial.user_attrs
    return Candidate(
        precision=params.get("precision", "fp16"),
        batch_size=int(params.get("batch_size", workload.base_batch_size)),
        learning_rate=float(attrs.get("learning_rate") or workload.base_lr),
        init_scale=float(params.get("init_scale", 2.0**16)),
    )
