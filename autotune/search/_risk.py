"""What one failure implies for the rest of the space, how long an fp16 verdict must run, and
what a compiled trial cannot be given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import optuna
from optuna.trial import FrozenTrial

from autotune.measure.stats import HOPELESS
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate
from autotune.search._context import SearchContext
from autotune.search._space import Space
from autotune.study.trials import DEFAULT_INIT_SCALE, record

__all__ = [
    "RuledOut",
    "cannot_compile",
    "cannot_step",
    "carries_risk",
    "fp16_horizon",
    "overflow_step",
    "safe_scale",
    "settings_key",
    "steps_run",
    "unproven",
    "verdict_horizon",
]


def carries_risk(params: Mapping[str, object]) -> bool:
    """Does a candidate carry a risk a short probe cannot rule out: fp16 (its overflow may
    start late) or compiling (paid again before its first step)? The others are safe picks."""
    return params.get("precision") == "fp16" or bool(params.get("compile", False))


def steps_run(trial: FrozenTrial) -> int:
    """Steps a trial's run took (warm-up and timed): its recorded loss curve's length."""
    return len(record(trial).losses)


def _first_nonfinite(trial: FrozenTrial | optuna.Trial) -> int | None:
    losses = record(trial).losses
    return next((i for i, v in enumerate(losses) if v is None), None)


def _overflows(trials: Iterable[FrozenTrial]) -> list[tuple[int, float | None]]:
    """Each fp16 run whose loss turned non-finite (its range ran out) among ``trials``: the
    step it did, and the run's learning rate."""
    return [
        (at, record(t).learning_rate)
        for t in trials
        if t.params.get("precision") == "fp16"
        and record(t).outcome == Outcome.DIVERGED
        and (at := _first_nonfinite(t)) is not None
    ]


def overflow_step(trials: Iterable[FrozenTrial]) -> int | None:
    """The earliest step at which an fp16 run's loss turned non-finite (its range ran out),
    among ``trials``; None when none did."""
    return min((at for at, _ in _overflows(trials)), default=None)


def fp16_horizon(min_steps: int, trials: Iterable[FrozenTrial], lr: float | None) -> int:
    """Steps an fp16 candidate at ``lr`` must run for its verdict: ``min_steps``, or twice the
    latest step any overflow seen would come at in it (an overflow at step 50 in one run comes
    at 60 in the next; the weights, and the activations they make, grow with the updates
    taken, so at a smaller lr the same overflow comes at least as much later: one at step 204
    with lr 0.2 came at step 524 with lr 0.1)."""
    later = [at * max(1.0, seen / lr if seen and lr else 1.0) for at, seen in _overflows(trials)]
    return max(min_steps, round(2 * max(later, default=0.0)))


def verdict_horizon(ctx: SearchContext, trials: list[FrozenTrial], trial: FrozenTrial) -> int:
    """:func:`fp16_horizon` for ``trial``: the spec's least, and its lr."""
    return fp16_horizon(ctx.spec.validation.fp16_steps, trials, record(trial).learning_rate)


def unproven(trial: FrozenTrial, overflow: int | None) -> bool:
    """An fp16 trial that ended before the step where fp16 has been seen to overflow: its
    figures say nothing about whether it would (it must not set the bar others are stopped
    by, and validation runs it past that step first)."""
    return (
        overflow is not None
        and trial.params.get("precision") == "fp16"
        and steps_run(trial) <= overflow
    )


def _rose_past(losses: list[float | None], blowup: float) -> bool:
    """Whether the finite losses rose past ``blowup`` times the first."""
    finite = [v for v in losses if v is not None]
    return bool(finite) and finite[0] > 0 and max(finite) > blowup * finite[0]


def safe_scale(
    trial: FrozenTrial | optuna.Trial, scales: Iterable[float], *, blowup: float
) -> float | None:
    """The init_scale a GradScaler divergence names: the scale the trial's scaler had backed
    off to when it was stopped for skipping too many steps, as the largest of ``scales`` not
    above it; None when the trial did not diverge that way, or it ran at that scale already.

    A loss that ran out of range, or that rose past ``blowup`` times its first value, is not
    the scaler's: a skipped step changes no weight, so a lower scale cannot bring it down (on
    an H200, fp16 at a batch whose linear-rule lr diverged in fp32 too was retried at six
    lower scales, a quarter of the search's trials)."""
    rec = record(trial)
    if trial.params.get("precision") != "fp16" or rec.outcome != Outcome.DIVERGED:
        return None
    if _first_nonfinite(trial) is not None or not rec.scales:
        return None  # the loss itself ran out of range: no scale helps
    if _rose_past(rec.losses, blowup):
        return None  # the updates that were applied drove it up: the lr's, not the scale's
    reached = rec.scales[-1][1]
    init = float(trial.params.get("init_scale", DEFAULT_INIT_SCALE))
    fitting = [s for s in scales if 1 <= s <= reached and s < init]
    return max(fitting) if fitting else None


def settings_key(trial: FrozenTrial) -> tuple[object, ...]:
    """What a candidate is, for validation, apart from its init_scale: one batch at two
    init_scales is one candidate (the scale only shifts its first steps)."""
    p = trial.params
    return tuple(sorted((k, v) for k, v in p.items() if k != "init_scale")) + (
        tuple(record(trial).fp32_modules),
    )


@dataclass
class RuledOut:
    """What failed validation rules out beyond itself: an fp16 run whose loss overflowed rules
    out fp16 with the same fp32 modules at that lr multiplier and above (any batch, any
    scale); one stopped for skipping steps rules out its init_scale and above at that lr and
    above; anything else rules out its own settings."""

    settings: set[tuple[object, ...]] = field(default_factory=set)
    # (fp32 modules, lr multiplier at and above which, init_scale at and above which)
    fp16: list[tuple[tuple[str, ...], float, float]] = field(default_factory=list)

    def add(self, trial: FrozenTrial, outcome: str, losses_overflowed: bool) -> None:
        self.settings.add(settings_key(trial))
        p = trial.params
        if p.get("precision") != "fp16" or outcome != Outcome.DIVERGED:
            return
        lr = float(p.get("lr_multiplier", 1.0))
        scale = 0.0 if losses_overflowed else float(p.get("init_scale", DEFAULT_INIT_SCALE))
        self.fp16.append((tuple(record(trial).fp32_modules), lr, scale))

    def __contains__(self, trial: object) -> bool:
        assert isinstance(trial, FrozenTrial)
        if settings_key(trial) in self.settings:
            return True
        p = trial.params
        if p.get("precision") != "fp16":
            return False
        lr = float(p.get("lr_multiplier", 1.0))
        scale = float(p.get("init_scale", DEFAULT_INIT_SCALE))
        modules = tuple(record(trial).fp32_modules)
        return any(
            modules == m and lr >= at_lr * (1 - 1e-9) and scale >= at_scale
            for m, at_lr, at_scale in self.fp16
        )


def cannot_step(trials: list[FrozenTrial], cand: Candidate, left: float) -> str | None:
    """Why ``cand`` is not worth a probe: its mode's fastest measured rate says two steps at its
    batch take longer than ``left`` seconds (a CPU's fp16 at 7 samples/s was started with 5 s
    left at bs=256 and killed at its hard limit, the run ending past its budget), or that rate,
    at a batch no smaller, was under ``1/HOPELESS`` of the best's; None when nothing says."""
    # The mode's fastest measured rate, and the batch it was measured at.
    mine = [
        (rate, int(t.params.get("batch_size", 0)))
        for t in trials
        if t.params.get("precision") == cand.precision and (rate := record(t).throughput or 0.0) > 0
    ]
    if not mine:
        return None
    best_rate, at = max(mine)
    # Far slower than the best at a batch at least this one's: a smaller batch runs no faster
    # a sample (a CPU's fp16 at 7 samples/s beside bf16's 647 was tried again at half the
    # batch, 18 s of a 3-minute budget).
    fastest = max((record(t).throughput or 0.0 for t in trials), default=0.0)
    if cand.batch_size <= at and best_rate * HOPELESS < fastest:
        return (
            f"{cand.precision} ran at {best_rate:,.1f} samples/s at batch_size={at}, under "
            f"1/{HOPELESS:g} of the best's {fastest:,.0f} samples/s: a smaller batch runs no faster"
        )
    step = cand.batch_size / best_rate
    # Two steps at the least: the first, with its first-use costs, and one that is timed.
    if 2 * step <= left:
        return None
    return (
        f"{cand.precision} ran at {best_rate:,.1f} samples/s at best here: a step at "
        f"batch_size={cand.batch_size} takes about {step:.0f}s, and two of them (the first, "
        f"and one timed) more than the {left:.0f}s left"
    )


def cannot_compile(ctx: SearchContext, cand: Candidate, left: float) -> str | None:
    """Why a compiled candidate cannot be measured in ``left`` seconds: its compile mode took
    longer here (cut while compiling, it would measure nothing); None when it can."""
    seen = ctx.found.compile_seconds.get(cand.compile_mode) if cand.compile else None
    if not seen or min(seen) < left:
        return None
    return (
        f"compiling in mode {cand.compile_mode!r} took {min(seen):.0f}s here, more than the "
        f"{left:.0f}s left for this trial"
    )


# The least share of the rule's lr a kept lr may be (see kept_lr).
KEPT_LR_FLOOR = 0.5
# Outcomes of runs that took steps without the loss blowing up.
_TRAINED = (Outcome.COMPLETED, Outcome.INFEASIBLE, Outcome.SLOWER, Outcome.OFF_PARITY)


def kept_lr(
    trial: FrozenTrial, trials: Iterable[FrozenTrial], space: Space, *, blowup: float
) -> float | None:
    """The lr multiplier to try ``trial``'s point at again when its loss blew up at an lr the
    workload's rule scaled up with the batch: the one that gives the largest lr seen to train
    (any mode, any batch) below the trial's, else the base lr (the reference trains at it).

    Without a warm-up the rule's larger lr diverges from some batch on while a kept lr trains
    there: on an H200 and on a CPU, resnet18's lr 0.2 at bs=256 blew up in fp32, bf16 and fp16
    where 0.1 trained, and the search ended at fp32 beside a bf16 that ran 1.9x at bs=256.
    None: the loss did not blow up (fp16's scaler skipping steps has its own retry), the lr was
    not above the base lr, fp16's loss ran out of range as early at the base lr (its range's,
    not the lr's), or the multiplier it needs lies outside the spec's lr range or more than one
    halving below the trial's."""
    rec = record(trial)
    p = trial.params
    if rec.outcome != Outcome.DIVERGED or "batch_size" not in p:
        return None
    fp16 = p.get("precision") == "fp16"
    if fp16 and _first_nonfinite(trial) is None and not _rose_past(rec.losses, blowup):
        return None  # skipped steps: the scaler's, not the lr's
    mult = float(p.get("lr_multiplier", 1.0))
    lr = space.lr(int(p["batch_size"]), mult)
    if lr <= space.base_lr * (1 + 1e-9):
        return None
    trials = list(trials)
    if fp16 and _range_at_base_lr(trial, trials, space):
        return None  # fp16 ran out of range at the base lr as early: the range's, not the lr's
    trained = [
        space.lr(int(t.params["batch_size"]), float(t.params.get("lr_multiplier", 1.0)))
        for t in trials
        if "batch_size" in t.params and record(t).outcome in _TRAINED
    ]
    below = [x for x in trained if x < lr * (1 - 1e-9)]
    target = max(below, default=space.base_lr)
    new = mult * target / lr
    if space.lr_choices is not None:
        fits = [c for c in space.lr_choices if c <= new * (1 + 1e-9)]
        new = max(fits, default=0.0)
    elif space.lr_range[0] < space.lr_range[1]:
        new = max(new, space.lr_range[0])
    # One halving at most: an lr further below the rule's learns so much less a sample that
    # parity refuses it, and its probe and validation would take the safe candidates' time.
    # A spec that searches no lr multiplier (the default) still gets this one point.
    return new if mult * KEPT_LR_FLOOR * (1 - 1e-9) <= new < mult * (1 - 1e-9) else None


def _range_at_base_lr(trial: FrozenTrial, trials: list[FrozenTrial], space: Space) -> bool:
    """Whether an fp16 run at an lr not above the base lr ran out of range (a non-finite loss)
    no later than ``trial`` did: then ``trial``'s overflow is fp16's range, which a lower lr
    does not widen (an lr retry would only meet it again at the same step)."""
    at = _first_nonfinite(trial)
    if at is None:
        return False
    for t in trials:
        if t.params.get("precision") != "fp16" or "batch_size" not in t.params:
            continue
        lr = space.lr(int(t.params["batch_size"]), float(t.params.get("lr_multiplier", 1.0)))
        first = _first_nonfinite(t)
        if lr <= space.base_lr * (1 + 1e-9) and first is not None and first <= at:
            return True
    return False


def past_blown_lr(trials: Iterable[FrozenTrial], cand: Candidate, space: Space) -> str | None:
    """Why ``cand`` is not worth a probe: its lr is at or above one whose loss already blew up
    above the base lr, in fp32 or tf32 (any mode then: full precision rules rounding out) or in
    its own mode; None when nothing says. A larger batch does not steady an lr past the stable
    one: on this CPU, after bf16 and fp32 blew up at lr 0.2 (bs=256), their ceilings' lr 1.6
    (bs=2048) blew up at step 1 too, 33 s of a 3-minute search. fp16's divergences say nothing
    here: an overflow is its range's, not the lr's."""
    for t in trials:
        mode = t.params.get("precision")
        if record(t).outcome != Outcome.DIVERGED or "batch_size" not in t.params:
            continue
        # fp32's and tf32's blow-ups speak for every mode; a 16-bit one for its own mode,
        # but fp16's never (an overflow is its range's, not the lr's).
        if mode == "fp16" or (mode not in ("fp32", "tf32") and mode != cand.precision):
            continue
        lr = space.lr(int(t.params["batch_size"]), float(t.params.get("lr_multiplier", 1.0)))
        if space.base_lr * (1 + 1e-9) < lr <= cand.learning_rate * (1 + 1e-9):
            return (
                f"not run: lr {cand.learning_rate:.3g} is at or above {lr:.3g}, whose loss blew up "
                f"in {mode} at batch_size={t.params['batch_size']} (trial {t.number}: "
                f"{record(t).reason or 'diverged'})"
            )
    return None


def not_worth(
    trials: list[FrozenTrial], cand: Candidate, left: float, space: Space
) -> tuple[Outcome, str] | None:
    """Why ``cand`` is not worth a probe, as the outcome it is pruned with: too slow to step
    (:func:`cannot_step`), or past an lr that blew up (:func:`past_blown_lr`); None: it is."""
    if (why := cannot_step(trials, cand, left)) is not None:
        return Outcome.TOO_SLOW, why
    if (why := past_blown_lr(trials, cand, space)) is not None:
        return Outcome.DIVERGED, why
    return None
