"""The search space: the batch-size ladder, the learning-rate rule, the init_scale grid, the
knobs, and an Optuna trial's suggestions turned into a Candidate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import optuna

from autotune.schema.spec import Candidate, StudySpec
from autotune.study.trials import DEFAULT_INIT_SCALE, record

__all__ = ["ISLANDS_CHOICES", "Space", "batch_ladder", "lr_for", "reference_factor"]

# The fp32_islands parameter's fixed choices: the module list itself lives in the trial record.
ISLANDS_CHOICES = ["none", "diagnosed"]

# The fp32 reference runs up to this many times the probe length (see reference_factor).
_MAX_REFERENCE_FACTOR = 8


def reference_factor(largest_batch: int, base_batch: int) -> int:
    """How many times longer the reference probe runs, so it sees as many samples as a probe of
    the largest batch size does (capped at 8).

    Example:
        >>> reference_factor(1024, 128)
        8
    """
    return max(1, min(_MAX_REFERENCE_FACTOR, math.ceil(largest_batch / base_batch)))


def batch_ladder(lo: int, hi: int, base: int) -> list[int]:
    """Powers of two in ``[lo, hi]``, plus ``lo``, ``hi`` and the workload's base batch size.

    Example:
        >>> batch_ladder(16, 1000, 128)
        [16, 32, 64, 128, 256, 512, 1000]
    """
    sizes = {2**k for k in range(0, 31) if lo <= 2**k <= hi} | {lo, hi, base}
    return sorted(sizes)


def lr_for(rule: str, base_lr: float, base_batch: int, batch_size: int, multiplier: float) -> float:
    """The learning rate for a batch size: the scaling rule, times the sampled multiplier.

    ``linear``: lr ∝ batch (SGD-like); ``sqrt``: lr ∝ √batch (Adam-like); ``none``: lr fixed.

    Example:
        >>> lr_for("linear", 0.1, 128, 512, 1.0)
        0.4
    """
    ratio = batch_size / base_batch
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]
    return base_lr * factor * multiplier


def _powers_of_two(lo: float, hi: float) -> list[float]:
    out = [2.0**k for k in range(0, 40) if lo <= 2.0**k <= hi]
    return sorted(set(out) | {DEFAULT_INIT_SCALE})


@dataclass(frozen=True)
class Space:
    """What the sampler may choose, for one spec and one workload.

    Args:
        precisions: the fixed precision choices (the same for every worker of the study).
        ladder: the batch sizes.
        lr_choices: explicit lr multipliers, or None for the continuous ``lr_range``.
        lr_range: the multiplier's log-uniform range (1.0, the rule itself, always inside).
        scales: fp16's GradScaler init_scale choices.
        rule: the lr scaling rule (``linear``, ``sqrt`` or ``none``).
        base_lr: the workload's lr at ``base_batch``.
        base_batch: the workload's base batch size.
        compile: torch.compile's choices (``(False,)``: no parameter).
        compile_modes: the compile modes (``("default",)``: no parameter).
        channels_last: channels_last's choices; None: no parameter, the workload's preference.
        channels_last_default: the workload's preference (what baselines run with).
    """

    precisions: tuple[str, ...]
    ladder: tuple[int, ...]
    lr_choices: tuple[float, ...] | None
    lr_range: tuple[float, float]
    scales: tuple[float, ...]
    rule: str
    base_lr: float
    base_batch: int
    compile: tuple[bool, ...] = (False,)
    compile_modes: tuple[str, ...] = ("default",)
    channels_last: tuple[bool, ...] | None = None
    channels_last_default: bool = False

    @classmethod
    def of(
        cls,
        spec: StudySpec,
        precisions: list[str],
        *,
        rule: str,
        base_lr: float,
        base_batch: int,
        channels_last: bool = False,
    ) -> Space:
        """The space a spec describes for a workload with this base lr, batch, lr rule and
        memory-format preference."""
        space = spec.space
        if space.batch_sizes:
            ladder = sorted(set(space.batch_sizes) | {base_batch})
        else:
            ladder = batch_ladder(space.batch_size.min, space.batch_size.max, base_batch)
        choices = tuple(sorted(set(space.lr_multipliers) | {1.0})) if space.lr_multipliers else None
        return cls(
            precisions=tuple(precisions),
            ladder=tuple(ladder),
            lr_choices=choices,
            lr_range=(min(space.lr_multiplier.min, 1.0), max(space.lr_multiplier.max, 1.0)),
            scales=tuple(_powers_of_two(space.init_scale.min, space.init_scale.max)),
            rule=rule,
            base_lr=base_lr,
            base_batch=base_batch,
            compile=tuple(space.compile),
            compile_modes=tuple(space.compile_modes),
            channels_last=tuple(space.channels_last) if space.channels_last else None,
            channels_last_default=channels_last,
        )

    def lr(self, batch_size: int, multiplier: float) -> float:
        """The learning rate at a batch size and multiplier, by the space's rule."""
        return lr_for(self.rule, self.base_lr, self.base_batch, batch_size, multiplier)

    def candidate(
        self,
        precision: str,
        batch_size: int,
        multiplier: float = 1.0,
        init_scale: float = 0.0,
        **knobs: object,
    ) -> Candidate:
        """The Candidate for a point of the space (``init_scale`` 0: GradScaler's default;
        ``knobs``: ``compile``, ``compile_mode``, ``channels_last``, ``fp32_modules``)."""
        return Candidate(
            precision=precision,
            batch_size=batch_size,
            learning_rate=self.lr(batch_size, multiplier),
            init_scale=init_scale or DEFAULT_INIT_SCALE,
            **knobs,
        )

    def suggest(self, trial: optuna.Trial) -> Candidate:
        """Ask the trial for a point of the space (enqueued trials get their fixed params)."""
        precision = trial.suggest_categorical("precision", list(self.precisions))
        batch_size = trial.suggest_categorical("batch_size", list(self.ladder))
        if self.lr_choices is not None:
            multiplier = trial.suggest_categorical("lr_multiplier", list(self.lr_choices))
        else:
            # A kept lr after a larger batch's blow-up (enqueued) may lie below the spec's
            # range (by default the one point 1): its trial's range reaches down to it, so
            # the study stores a value its distribution holds; the sampler never draws one.
            lo, hi = self.lr_range
            kept = record(trial).kept_lr
            if kept is not None:
                lo = min(lo, kept)
            multiplier = trial.suggest_float("lr_multiplier", lo, hi, log=True)
        init_scale = DEFAULT_INIT_SCALE
        if precision == "fp16":
            init_scale = trial.suggest_categorical("init_scale", list(self.scales))
        knobs: dict[str, object] = {}
        if self.compile != (False,):
            knobs["compile"] = trial.suggest_categorical("compile", list(self.compile))
            if knobs["compile"] and self.compile_modes != ("default",):
                modes = list(self.compile_modes)
                knobs["compile_mode"] = trial.suggest_categorical("compile_mode", modes)
        if self.channels_last is not None:
            choices = list(self.channels_last)
            knobs["channels_last"] = trial.suggest_categorical("channels_last", choices)
        # Only a trial enqueued with the diagnosed modules asks: the sampler never does.
        modules = record(trial).fp32_modules if precision == "fp16" else []
        if modules and trial.suggest_categorical("fp32_islands", ISLANDS_CHOICES) == "diagnosed":
            knobs["fp32_modules"] = list(modules)
        return self.candidate(precision, batch_size, multiplier, init_scale, **knobs)

    def params(self, precision: str, batch_size: int, multiplier: float = 1.0) -> dict[str, object]:
        """The Optuna params of a point, for ``enqueue_trial``: fp16 with the default scale,
        uncompiled and in the workload's memory format where the space allows it."""
        out: dict[str, object] = {
            "precision": precision,
            "batch_size": batch_size,
            "lr_multiplier": multiplier,
        }
        if precision == "fp16":
            out["init_scale"] = DEFAULT_INIT_SCALE
        if self.compile != (False,):
            out["compile"] = False not in self.compile
            if out["compile"] and self.compile_modes != ("default",):
                out["compile_mode"] = self.compile_modes[0]
        if self.channels_last is not None:
            own = self.channels_last_default
            out["channels_last"] = own if own in self.channels_last else self.channels_last[0]
        return out

    def knob_flips(self, params: dict[str, object]) -> list[dict[str, object]]:
        """The same point with one searched on/off knob turned the other way (compile,
        channels_last): what the knob brings, measured at the same mode and batch."""
        out = []
        if set(self.compile) == {False, True} and "compile" in params:
            flip = {k: v for k, v in params.items() if k != "compile_mode"}
            flip["compile"] = not params["compile"]
            if flip["compile"] and self.compile_modes != ("default",):
                flip["compile_mode"] = self.compile_modes[0]
            out.append(flip)
        both = self.channels_last is not None and set(self.channels_last) == {False, True}
        if both and "channels_last" in params:
            out.append({**params, "channels_last": not params["channels_last"]})
        return out
