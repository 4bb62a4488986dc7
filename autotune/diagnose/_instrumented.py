"""The instrumented run: the step engine's training step with hooks on every leaf module and,
for the autocast modes, an fp32 shadow pass on the same batch before it."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch
from loguru import logger

from autotune.diagnose._advice import Observations, advise, reason_line
from autotune.diagnose._hooks import First, Hooks, LayerFigures
from autotune.diagnose._models import DEFAULT_STEPS, Diagnosis, LayerStats, Recommendation
from autotune.errors import SpecError, WorkloadError
from autotune.measure.precision import (
    PrecisionMode,
    apply_backend_flags,
    get_mode,
    resolve_device,
    unsupported_modes,
)
from autotune.measure.probe import leave_no_trace
from autotune.measure.step import StepEngine, check_loss
from autotune.schema.spec import Candidate
from autotune.workloads import Workload

__all__ = ["InstrumentedRun", "diagnose"]


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
        >>> from autotune.workloads import load_workload
        >>> d = diagnose(load_workload("autotune.testing.workloads:fp16_overflow"),
        ...              Candidate(precision="fp16", batch_size=64, learning_rate=1e-3), "cpu")
        >>> d.verdict, d.first_nonfinite
        ('fails', 'amplify')
    """
    if steps < 1:
        raise SpecError(f"steps must be at least 1, got steps={steps}; try steps={DEFAULT_STEPS}")
    started = time.perf_counter()
    dev = resolve_device(device)
    mode = get_mode(candidate.precision)
    dtype = mode.autocast_dtype or torch.float32
    info = torch.finfo(dtype)
    run = InstrumentedRun(workload, candidate, dev, mode, dtype)
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


# ---- the run ---------------------------------------------------------------------------------


class InstrumentedRun:
    """One diagnosis: the instrumented steps over a :class:`~autotune.measure.step.StepEngine`, then
    the summary."""

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
        self.hooks: Hooks | None = None
        self.engine: StepEngine | None = None
        self.scales: list[float] = []  # the GradScaler's scale at each step, before it

    @property
    def first(self) -> First | None:
        """Where the first non-finite value came from; see ``Hooks.first``."""
        return self.hooks.first if self.hooks is not None else None

    @property
    def losses(self) -> list[float]:
        return self.engine.losses if self.engine is not None else []

    @property
    def skipped(self) -> int:
        return self.engine.skipped if self.engine is not None else 0

    def train(self, steps: int, seed: int) -> tuple[str, str] | None:
        """Run the steps; return why the run could not be made and what to do, or None."""
        crash: str | None = None
        oom: str | None = None
        # The hooks watch eager modules: compiling changes the speed, not what a dtype can hold.
        eager = self.candidate.model_copy(update={"compile": False})
        self.engine = engine = StepEngine(self.workload, eager, self.dev, seed=seed)
        try:
            with engine:
                oom = engine.run(lambda e: self._loop(e, steps))
        except WorkloadError:
            raise
        except Exception as exc:  # the workload's own code raised: a result, like a crash
            logger.opt(exception=exc).debug("diagnose: the workload raised")
            text = str(exc)
            crash = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
        if oom is not None:
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

    def _loop(self, engine: StepEngine, steps: int) -> None:
        """The diagnosis' policy over the engine: per step, the shadow pass, then the real one."""
        engine.build()
        model, opt, mode = engine.model, engine.optimizer, self.mode
        assert model is not None and opt is not None
        self.hooks = hooks = Hooks(model, mode, self.limit)
        try:
            for step in range(steps):
                batch = engine.next_batch()
                scale = engine.scale()
                hooks.begin(step, scale)
                if mode.autocast_dtype is not None:  # 1. the fp32 shadow pass: true sizes
                    hooks.shadow = True
                    opt.zero_grad(set_to_none=True)
                    loss = self.workload.loss(model, batch)
                    if step == 0:
                        check_loss(loss, self.workload)
                    loss.float().backward()
                    hooks.shadow_param_grads()
                    hooks.shadow = False
                engine.step(batch)  # 2. the real pass, as the probe runs it
                (value,) = engine.read_losses()
                self.scales.append(scale)
                # A non-finite loss while every module's output was finite: the loss made it.
                # It came before this step's backward pass, which may have been flagged since.
                before = hooks.first is None or hooks.first[1:3] == (step, "backward")
                if before and not math.isfinite(value):
                    hooks.first = (-1, step, "loss", False)
                if not mode.scales_loss and hooks.first is not None:
                    break  # without a scaler the bad step was applied: what follows is NaN noise
        finally:
            # Before the engine frees an OOM's memory: the hooks hold the model's modules.
            hooks.remove()

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
        evidence = Observations(
            candidate=self.candidate,
            mode=self.mode,
            dtype_name=self.dtype_name,
            limit=self.limit,
            layers=layers,
            first=self.first,
            losses=self.losses,
            scales=self.scales,
            skipped=self.skipped,
        )
        recs, verdict = advise(evidence, ran, stats)
        out.update(verdict=verdict, reason=reason_line(verdict, recs), recommendations=recs)
        return out

    def _stats(self, x: LayerFigures) -> LayerStats:
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
