"""A simulated diagnosis: what :func:`autotune.diagnose.diagnose` would say of a candidate on a
landscape, read from its divergence figures and the few steps a simulated engine ran."""

from __future__ import annotations

import math

import torch

from autotune.diagnose import NEAR_LIMIT, Diagnosis, LayerStats, Recommendation
from autotune.measure.precision import get_mode
from autotune.schema.spec import Candidate
from autotune.sim._landscape import Landscape

__all__ = ["DIAGNOSIS_SLOWDOWN", "simulated_diagnosis"]

# A diagnosed step runs an fp32 shadow pass, then the real one, with hooks that read every
# module's output: about three probe steps.
DIAGNOSIS_SLOWDOWN = 3.0
# A module that overflows only later already carries outsized activations in the first steps
# (an unnormalised residual, a growing logit): within the real diagnosis' near-limit band.
_LATE_RATIO = 2 * NEAR_LIMIT


def simulated_diagnosis(  # noqa: PLR0913 - the run's figures, keyword-only, from the runner
    land: Landscape,
    cand: Candidate,
    *,
    device: str,
    losses: list[float],
    scales: list[float],
    skipped: int,
    failure: str | None = None,
) -> Diagnosis:
    """The diagnosis of ``cand`` after the steps whose ``losses`` (and GradScaler ``scales``)
    a simulated engine ran; ``failure``: why the run could not be made (inconclusive)."""
    dtype = get_mode(cand.precision).autocast_dtype or torch.float32
    info = torch.finfo(dtype)
    layers, recs, verdict = _findings(land, cand, len(losses), info.max)
    if failure is not None:
        layers, verdict = [], "inconclusive"
        recs = [Recommendation(kind="retry", evidence=failure, action="diagnose other settings")]
    head = {"fails": "fails", "at_risk": "at risk"}.get(verdict, verdict)
    return Diagnosis(
        workload=land.workload,
        candidate=cand,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        limit=info.max,
        smallest_subnormal=info.smallest_normal * info.eps,
        steps=len(losses),
        losses=losses,
        scales=scales if get_mode(cand.precision).scales_loss else [],
        skipped_steps=skipped,
        layers=layers,
        first_nonfinite=next((x.name for x in layers if x.made_nonfinite), None),
        first_nonfinite_step=next(
            (x.first_nonfinite_step for x in layers if x.made_nonfinite), None
        ),
        first_nonfinite_pass="forward" if any(x.made_nonfinite for x in layers) else None,
        verdict=verdict,
        reason=f"{head}: {recs[0].evidence}" if failure is None else f"inconclusive: {failure}",
        recommendations=recs,
    )


def _findings(
    land: Landscape, cand: Candidate, steps: int, limit: float
) -> tuple[list[LayerStats], list[Recommendation], str]:
    """The layers a diagnosis would flag, its recommendations and its verdict, by what makes
    the candidate diverge: an lr past the stable one, fp16's overflow in modules (the
    islands) or between them, or lasting skips; else the scale it wastes steps at, or safe."""
    at = land.overflow_step(cand)
    if land.lr_blows_up(cand):
        rec = Recommendation(
            kind="lower_lr",
            evidence=f"the loss is non-finite in fp32 too (lr {land.lr_multiplier(cand):g}x "
            "the workload's rule)",
            action="this is not a precision problem: lower the learning rate",
        )
        return [], [rec], "fails"
    if at is not None:
        return _overflow(land, cand, at, steps, limit)
    if land.scale_collapses(cand):
        rec = Recommendation(
            kind="use_bf16",
            evidence=f"gradients overflow fp16 in {land.fp16.skip_rate:.1%} of steps at every "
            "scale the GradScaler tried",
            action="no single loss scale fits: use bf16, which has fp32's range",
        )
        return [], [rec], "at_risk"
    recs = [
        Recommendation(
            kind="safe",
            evidence=f"no module near {cand.precision}'s limit",
            action=f"nothing near the limits: {cand.precision} is safe here",
        )
    ]
    safe = land.fp16.safe_init_scale
    if get_mode(cand.precision).scales_loss and cand.init_scale > safe:
        scale = 2.0 ** math.floor(math.log2(safe))
        recs.append(
            Recommendation(
                kind="lower_init_scale",
                init_scale=scale,
                evidence=f"at init_scale {cand.init_scale:g} the largest gradient overflows "
                "fp16: the GradScaler skipped steps while it backed off",
                action=f"start at init_scale {scale:g} to save those steps (the scaler backs "
                "off by itself; this is not a failure)",
            )
        )
    return [], recs, "safe"


def _overflow(
    land: Landscape, cand: Candidate, at: int, steps: int, limit: float
) -> tuple[list[LayerStats], list[Recommendation], str]:
    """fp16's activations overflow at step ``at``: in the landscape's islands, or (none
    named) in functional code between modules."""
    made = at < steps  # the steps run are 0 .. steps - 1
    verdict = "fails" if made else "at_risk"
    when = f"at step {at}" if made else f"near fp16's limit {limit:,.0f} (it overflows later)"
    islands = land.fp16.islands
    if not islands:
        rec = Recommendation(
            kind="find_op",
            evidence=f"the loss is non-finite {when} while every module's output was finite",
            action="the overflow is in the loss or in functional code between modules: "
            "compute it in fp32, or use bf16, which has fp32's range",
        )
        return [], [rec], verdict
    ratio = 1.0 if made else _LATE_RATIO
    layers = [
        LayerStats(
            name=name,
            type="simulated",
            order=i,
            dtype="float16",
            act_max=ratio * limit,
            act_limit_ratio=ratio,
            act_nonfinite=1 if made else 0,
            made_nonfinite=made,
            first_nonfinite_step=at if made else None,
        )
        for i, name in enumerate(islands)
    ]
    rec = Recommendation(
        kind="keep_fp32",
        layers=list(islands),
        evidence=f"{', '.join(islands)}: activations {when}",
        action="run them in fp32, or use bf16, which has fp32's range",
    )
    return layers, [rec], verdict
