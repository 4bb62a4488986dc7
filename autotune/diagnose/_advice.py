"""The advice: the figures of an instrumented run turned into recommendations and a verdict."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from autotune.diagnose._hooks import EXP_OFFSET, First, LayerFigures
from autotune.diagnose._models import (
    NEAR_LIMIT,
    UNDERFLOW_SHARE,
    LayerStats,
    Recommendation,
    Verdict,
)
from autotune.measure.precision import PrecisionMode
from autotune.schema.spec import Candidate, ProbeSettings

__all__ = ["Observations", "advise", "reason_line"]

# The init_scale advice keeps at least this share of each flagged layer's gradient values
# at or above the dtype's smallest subnormal.
_KEEP_SHARE = 0.99


@dataclass
class Observations:
    """What an instrumented run saw, as the advice reads it."""

    candidate: Candidate
    mode: PrecisionMode
    dtype_name: str  # the dtype the mode computes in: float16, bfloat16, float32
    limit: float  # its largest finite value
    layers: list[LayerFigures]  # every hooked leaf module; ``first`` indexes into it
    first: First | None
    losses: list[float]
    scales: list[float]
    skipped: int


def _num(x: float) -> str:
    """71000 → ``71,000``; 5.63 → ``5.63``; 1.2e-13 → ``1.2e-13``."""
    return f"{x:,.0f}" if 1000 <= abs(x) < 1e7 else f"{x:.3g}"


def _pow2(x: float) -> str:
    k = math.log2(x) if x > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{x:g}"


def _scales(ev: Observations) -> str:
    """The GradScaler scales the steps ran at: ``scale 2^16`` or ``scales 2^13 to 2^16``."""
    lo, hi = min(ev.scales or [1.0]), max(ev.scales or [1.0])
    return f"scale {_pow2(hi)}" if lo == hi else f"scales {_pow2(lo)} to {_pow2(hi)}"


def _tick(name: str) -> str:
    return f"`{name or '(model)'}`"


def _names(names: Iterable[str]) -> str:
    return ", ".join(_tick(n) for n in names)


@dataclass
class _Words:
    """What every rule's wording shares, fixed by the dtype the mode computes in."""

    dt: str  # the dtype's name
    limit: float  # its largest finite value
    fp32_range: bool  # bf16 has fp32's range: overflow is then the model's, not the dtype's
    alt: str  # the way out when a layer overflows
    fp32_how: str
    fp32_ctx: str

    @classmethod
    def of(cls, ev: Observations) -> _Words:
        fp32_range = ev.limit >= torch.finfo(torch.float32).max
        fp32_how = (
            "with `torch.autocast(device_type, enabled=False)` and inputs cast with `.float()`"
        )
        return cls(
            dt=ev.dtype_name,
            limit=ev.limit,
            fp32_range=fp32_range,
            alt="lower the learning rate" if fp32_range else "use bf16, which has fp32's range",
            fp32_how=fp32_how,
            fp32_ctx=f"{fp32_how} (autotune.diagnose.keep_in_fp32 does both)",
        )


def advise(
    ev: Observations, ran: list[LayerFigures], stats: list[LayerStats]
) -> tuple[list[Recommendation], Verdict]:
    """Turn the figures into recommendations, each with its evidence, and a verdict: five
    rules, each one recommendation or none; the first two say it fails, the next two that it
    is at risk."""
    w = _Words.of(ev)
    first, covered = _first_nonfinite(ev, w)
    blowup = _loss_blowup(ev, w)
    near = _near_limit(w, stats, covered)
    low, high, biggest = _scale_window(ev, ran)
    under = _underflow(ev, w, stats, low, high)
    wasted = None if under is not None else _wasted_steps(ev, w, high, biggest)
    recs = [r for r in (first, blowup, near, under, wasted) if r is not None]
    if first is not None or blowup is not None:
        return recs, "fails"
    if near is not None or under is not None:
        return recs, "at_risk"
    recs.insert(0, _safe(ev, stats))
    return recs, "safe"


def _first_nonfinite(ev: Observations, w: _Words) -> tuple[Recommendation | None, set[str]]:
    """1. The first non-finite value: where, and what made it.

    Returns:
        The recommendation, and the layer it names (rule 3 does not name it again).
    """
    if ev.first is None:
        return None, set()
    index, step, where, inputs_bad = ev.first
    at = f"at step {step}"
    if where == "forward":
        x = ev.layers[index]
        return _forward_nonfinite(x, w, step=step, inputs_bad=inputs_bad), {x.name}
    if where == "loss":
        rec = Recommendation(
            kind="find_op",
            evidence=f"the loss is non-finite {at} while every module's output was finite",
            action="the overflow is in the loss or in functional code after the last module: "
            "compute the loss in fp32 (`logits.float()`), or " + w.alt,
        )
        return rec, set()
    x = ev.layers[index]
    g = f"largest unscaled gradient {_num(x.grad_max)}, " if x.grad_max else ""
    rec = Recommendation(
        kind="use_bf16" if not w.fp32_range else "lower_lr",
        layers=[x.name],
        evidence=f"gradients reaching {_tick(x.name)} are non-finite in {w.dt} {at} "
        f"({g}limit {_num(w.limit)}) without loss scaling to blame",
        action=w.alt if not w.fp32_range else "lower the learning rate or clip gradients",
    )
    return rec, {x.name}


def _forward_nonfinite(
    x: LayerFigures, w: _Words, *, step: int, inputs_bad: bool
) -> Recommendation:
    """Rule 1 when a module's output went non-finite first: the model, the code before the
    module, or the module itself overflowing the dtype."""
    at, dt, limit = f"at step {step}", w.dt, w.limit
    if x.fp32_nonfinite:
        return Recommendation(
            kind="lower_lr",
            layers=[x.name],
            evidence=f"layer {_tick(x.name)} ({x.type}) is non-finite {at} in fp32 too",
            action="this is not a precision problem: the model itself diverges; lower the "
            "learning rate or check the layer",
        )
    if inputs_bad:
        return Recommendation(
            kind="find_op",
            layers=[x.name],
            evidence=f"{_tick(x.name)} ({x.type}) is the first module with a non-finite "
            f"output ({at}), but its inputs were already non-finite",
            action="the overflow is in functional code before it (an op between modules): run "
            f"that code {w.fp32_how}, wrap it in a module so diagnose can "
            f"name it, or {w.alt}",
        )
    size = (
        f"reaches {_num(x.act_max)} in fp32, past {dt}'s limit {_num(limit)}"
        if x.act_max > limit
        else f"overflows {dt} (limit {_num(limit)}) inside the op; its fp32 output peaks "
        f"at {_num(x.act_max)}"
    )
    grew = " It was finite at step 0: a lower learning rate may also help." if step else ""
    return Recommendation(
        kind="keep_fp32",
        layers=[x.name],
        evidence=f"layer {_tick(x.name)} ({x.type}) {size}: {at} its {dt} "
        f"output had {x.act_nonfinite:,} non-finite values from finite inputs",
        action=f"run it in fp32 {w.fp32_ctx}, or {w.alt}.{grew}",
    )


def _loss_blowup(ev: Observations, w: _Words) -> Recommendation | None:
    """2. A loss that blows up with every value finite: the learning rate, not the precision."""
    finite = [v for v in ev.losses if math.isfinite(v)]
    factor = ProbeSettings().loss_blowup_factor
    if ev.first is not None or not finite or finite[0] <= 0 or max(finite) <= factor * finite[0]:
        return None
    return Recommendation(
        kind="lower_lr",
        evidence=f"the loss grew from {_num(finite[0])} to {_num(max(finite))} in "
        f"{len(ev.losses)} steps (the probe calls over {factor:g}x divergence) with no "
        f"non-finite value in {w.dt}",
        action=f"that is the learning rate, not the precision: lower it from "
        f"lr={ev.candidate.learning_rate:g}",
    )


def _near_limit(w: _Words, stats: list[LayerStats], covered: set[str]) -> Recommendation | None:
    """3. Activations near the limit, not already named."""
    near = [s for s in stats if s.act_limit_ratio >= NEAR_LIMIT and s.name not in covered]
    if not near:
        return None
    near.sort(key=lambda s: s.act_limit_ratio, reverse=True)
    top = near[:5]
    sizes = ", ".join(f"`{s.label}` {_num(s.act_max)} ({s.act_limit_ratio:.0%})" for s in top)
    return Recommendation(
        kind="keep_fp32",
        layers=[s.name for s in top],
        evidence=f"activations near {w.dt}'s limit {_num(w.limit)}: {sizes}",
        action=f"run {'them' if len(top) > 1 else 'it'} in fp32 {w.fp32_ctx}, or {w.alt}; "
        "they grow as training goes on",
    )


def _underflow(
    ev: Observations, w: _Words, stats: list[LayerStats], low: int | None, high: int | None
) -> Recommendation | None:
    """4. Gradient underflow, and the loss scale that keeps the gradients (between 2^low and
    2^high, see :func:`_scale_window`)."""
    under = [s for s in stats if (s.grad_underflow or 0.0) >= UNDERFLOW_SHARE]
    if not under:
        return None
    under.sort(key=lambda s: s.grad_underflow or 0.0, reverse=True)
    worst = under[0].grad_underflow or 0.0
    layers = [s.name for s in under[:5]]
    evidence = (
        f"gradients underflow in {_names(s.name for s in under[:5])} (up to {worst:.0%} of "
        f"nonzero values flush to zero in {w.dt} at {_scales(ev)})"
    )
    if not ev.mode.scales_loss:
        return Recommendation(
            kind="keep_fp32",
            layers=layers,
            evidence=evidence,
            action="this mode has no loss scaling: use fp32, or fp16 with a GradScaler",
        )
    if low is not None and (high is None or low <= high):
        return Recommendation(
            kind="raise_init_scale",
            layers=layers,
            evidence=evidence,
            init_scale=2.0**low,
            action=f"raise init_scale to {_pow2(2.0**low)}: {_KEEP_SHARE:.0%} of each "
            f"layer's gradient values then stay at or above {w.dt}'s smallest subnormal",
        )
    return Recommendation(
        kind="use_bf16",
        layers=layers,
        evidence=evidence,
        action=f"no single loss scale fits: the largest gradients need at most "
        f"{_pow2(2.0 ** (high or 0))} and the smallest at least {_pow2(2.0 ** (low or 0))}; "
        "use bf16",
    )


def _wasted_steps(
    ev: Observations, w: _Words, high: int | None, biggest: float
) -> Recommendation | None:
    """5. A starting scale so high that the first steps are skipped (harmless, but wasted);
    asked only where no gradient underflows."""
    if not (ev.mode.scales_loss and ev.skipped):
        return None
    if high is None or 2.0**high >= ev.candidate.init_scale:
        return None
    return Recommendation(
        kind="lower_init_scale",
        init_scale=2.0**high,
        evidence=f"the GradScaler skipped {ev.skipped} of {len(ev.losses)} steps: at "
        f"init_scale {_pow2(ev.candidate.init_scale)} the largest gradient, {_num(biggest)} "
        f"unscaled, overflows {w.dt}'s {_num(w.limit)}",
        action=f"start at init_scale {_pow2(2.0**high)} to save those steps (the scaler "
        "backs off by itself; this is not a failure)",
    )


def _scale_window(
    ev: Observations, ran: list[LayerFigures]
) -> tuple[int | None, int | None, float]:
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
    if ev.mode.autocast_dtype is None:
        return None, None, 0.0
    info = torch.finfo(ev.mode.autocast_dtype)
    s = round(math.log2(info.smallest_normal * info.eps))
    needs: list[int] = []
    for x in ran:
        if x.hist is None or not x.nonzero or x.flushed / x.nonzero < UNDERFLOW_SHARE:
            continue
        cum = torch.cumsum(x.hist[1:].double().cpu(), 0)  # cum[j] counts bins 1..j+1
        within = (cum <= (1 - _KEEP_SHARE) * float(cum[-1])).nonzero()
        # Bin 1 (exponent -159) is always empty for fp32 values, so `within` is never empty.
        e_star = int(within[-1]) + 1 - EXP_OFFSET
        needs.append(s - e_star)
    low = max(needs) if needs else None
    biggest = max(
        (max(x.grad_max or 0.0, x.param_grad_max) for x in ran if x.dtype == ev.dtype_name),
        default=0.0,
    )
    high = math.floor(math.log2(ev.limit / biggest)) if biggest > 0 else None
    return low, high, biggest


def _safe(ev: Observations, stats: list[LayerStats]) -> Recommendation:
    dt = ev.dtype_name
    if not stats:
        return Recommendation(
            kind="safe", evidence="no module produced an output", action="nothing to check"
        )
    top = max(stats, key=lambda s: s.act_limit_ratio)
    parts = [
        f"largest activation {_num(top.act_max)} in {_tick(top.name)} "
        f"({top.act_limit_ratio:.2%} of {dt}'s limit {_num(ev.limit)})"
    ]
    shares = [s.grad_underflow for s in stats if s.grad_underflow is not None]
    if shares:
        scale = f" at {_scales(ev)}" if ev.mode.scales_loss else ""
        parts.append(f"gradient underflow at most {max(shares):.2%}{scale}")
    return Recommendation(
        kind="safe",
        evidence="; ".join(parts),
        action=f"nothing near the limits: {ev.mode.name} is safe here",
    )


def reason_line(verdict: Verdict, recs: list[Recommendation]) -> str:
    head = {"fails": "fails", "at_risk": "at risk", "safe": "safe"}.get(verdict, verdict)
    return f"{head}: {recs[0].evidence}" if recs else head
