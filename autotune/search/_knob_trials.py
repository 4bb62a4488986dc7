"""What the search tries beyond the sampler's proposals: fp16 with fp32 islands after an fp16
divergence, and each searched on/off knob turned the other way on the leader."""

from __future__ import annotations

import statistics
from typing import Any, cast

from loguru import logger
from optuna.trial import TrialState

from autotune.schema.enums import Outcome, Phase, Role
from autotune.search._budget import TRIAL_SHARE, WRITE_RESERVE
from autotune.search._ceiling_moves import raise_ceiling
from autotune.search._context import SearchContext
from autotune.search._risk import kept_lr, safe_scale
from autotune.search._space import ISLANDS_CHOICES
from autotune.study.store import StudyStore
from autotune.study.trials import (
    TrialRecord,
    candidate,
    feasible_trials,
    record,
    worst_diverged,
)

__all__ = [
    "after_trial",
    "diagnose_failures",
    "enqueue_diagnosed_islands",
    "islands_plan",
]


def islands_plan(found: dict[str, Any]) -> tuple[list[str], str]:
    """The modules a diagnosis (its JSON) says to keep in fp32, and in words what the search
    does with them: try them, or why a module list cannot help.

    Example:
        >>> islands_plan({"layers": [{"name": "amplify"}], "recommendations": [
        ...     {"kind": "keep_fp32", "layers": ["amplify"]}]})[0]
        ['amplify']
        >>> islands_plan({"layers": [], "recommendations": [{"kind": "find_op", "layers": []}]})
        ([], 'not tried: the overflow is in functional code between modules (an op outside any submodule, or the loss): a module list cannot keep it in fp32; run that code in fp32 by hand or use bf16')
    """
    recs = found.get("recommendations") or []
    kinds = {r.get("kind") for r in recs}
    if "find_op" in kinds:
        return [], (
            "not tried: the overflow is in functional code between modules (an op outside any "
            "submodule, or the loss): a module list cannot keep it in fp32; run that code in "
            "fp32 by hand or use bf16"
        )
    if "lower_lr" in kinds and found.get("verdict") == "fails":
        return [], "not tried: the values leave the range in fp32 too: not a precision problem"
    wanted = {n for r in recs if r.get("kind") == "keep_fp32" for n in r.get("layers") or []}
    # The root module in fp32 is the whole model in fp32: that is the reference, not an island.
    modules = [x["name"] for x in found.get("layers") or [] if x["name"] in wanted and x["name"]]
    if not modules:
        return [], "not tried: the diagnosis names no module to keep in fp32"
    return modules, f"tried: fp16 with {', '.join(modules)} kept in fp32"


def _trial_estimate(ctx: SearchContext) -> float:
    """Seconds one more search trial takes: the typical one, at most a trial's time limit."""
    if ctx.found.trial_seconds:
        return statistics.median(ctx.found.trial_seconds[-10:])
    return min(ctx.typical_probe(default=5.0), max(3.0, TRIAL_SHARE * ctx.budget.total))


def diagnose_failures(
    ctx: SearchContext,
    store: StudyStore,
    trial: Any = None,
    *,
    spare: float | None = None,
    then: float = 0.0,
) -> dict[str, Any] | None:
    """Diagnose a diverged fp16 trial layer by layer, once per study: ``trial``, or the worst
    diverged one. Its cost is about twice the diverged probe's (two passes a step, hooks);
    skipped when the budget (or ``spare``) cannot spare that, ``then`` seconds more, and what a
    worker's restart takes (one stopped at its limit costs it).

    Returns:
        The stored summary (with ``fp32_modules`` and the ``islands`` decision), or None when
        there was nothing to diagnose, no time, or the diagnosis could not run.
    """
    if store.diagnosis() is not None:
        return None
    if trial is None:
        trial = worst_diverged(store.trials(), "fp16")
    if trial is None:
        return None
    left = ctx.budget.left() - WRITE_RESERVE if spare is None else spare
    cost = max(1.0, 2 * (record(trial).probe_seconds or ctx.typical_probe(default=5.0)))
    # A diagnosis stopped at its limit costs the worker's restart too, about what its start
    # took: that much is kept for it (half of what was spare, kept before, skipped diagnoses
    # that fit, and a search of fp16 only fell back where its islands ran 1.8x).
    keep = max(1.0, ctx.found.spent.get(Phase.START, 0.0))
    if spare is not None and "bf16" not in ctx.space.precisions:
        # In the search phase, the time after it (validation's) takes the restart first.
        keep = max(0.0, keep - (ctx.budget.left() - WRITE_RESERVE - spare))
    room = left - then - keep
    if room < cost:
        return None
    # The numerics of the precision itself: uncompiled, no islands.
    cand = candidate(trial).model_copy(update={"compile": False, "fp32_modules": []})
    if ctx.gate is not None:
        with ctx.budget.paused():
            ctx.gate(cand)
    with ctx.clock(Phase.DIAGNOSIS):
        # Twice its cost or up to a minute, never past the room the restart leaves.
        timeout = min(room, max(2.0 * cost, min(60.0, room)))
        found = ctx.runner.diagnose(ctx.workload, cand, steps=3, timeout=timeout)
    if found is None:
        return None
    modules, islands = islands_plan(found)
    summary = {
        "trial": trial.number,
        "candidate": found["candidate"],
        "verdict": found["verdict"],
        "reason": found["reason"],
        "first_nonfinite": found.get("first_nonfinite"),
        "recommendations": [
            f"{r['evidence']}: {r['action']}" for r in found.get("recommendations", [])
        ],
        "fp32_modules": modules,
        "islands": islands,
    }
    store.set_diagnosis(summary)
    logger.info(
        "fp16 diagnosis of trial {}: {} (first non-finite: {}); fp32 islands {}",
        trial.number,
        found["verdict"],
        found.get("first_nonfinite"),
        islands,
    )
    return summary


def _enqueue_islands(ctx: SearchContext, store: StudyStore, trial: Any, modules: list[str]) -> None:
    """fp16 with the modules in fp32: at the diverged trial's point, at the ladder's next
    batch above it, then at fp16's ceiling. The next batch up before the ceiling: fp16's
    verdict runs to its overflow horizon, which a larger batch's slower steps take longer to
    reach, and a larger batch carries the larger lasting gap (fp16 with its islands at 8x the
    base batch, measured alone, was refused for the 24 s its 500 steps would take and left an
    fp32 fallback where 2x was safe at 1.7x)."""
    points = [{**trial.params, "fp32_islands": ISLANDS_CHOICES[1]}]
    fitting = [b for b in ctx.space.ladder if b <= ctx.found.ceilings.get("fp16", 0)]
    at = trial.params.get("batch_size", 0)
    up = next((b for b in fitting if b > at), None)
    for batch in dict.fromkeys(b for b in (up, max(fitting, default=None)) if b and b != at):
        points.append({**ctx.space.params("fp16", batch), "fp32_islands": ISLANDS_CHOICES[1]})
    for i, params in enumerate(points):
        # The diverged trial's own point keeps its lr (a kept one too); the others' are new.
        if i == 0:
            rec = record(trial).settings(fp32_modules=modules, role=Role.FP32_ISLANDS)
        else:
            rec = TrialRecord(fp32_modules=modules)
        store.enqueue(params, rec, skip_if_exists=True)
    logger.info("enqueued fp16 with {} in fp32 at {} point(s)", ", ".join(modules), len(points))


def enqueue_diagnosed_islands(ctx: SearchContext, store: StudyStore, modes: list[str]) -> None:
    """A study diagnosed before (a resumed run, another worker, or a diagnosis that came too
    late for the search phase): its islands are enqueued now, unless they already were."""
    found = store.diagnosis()
    if found is None or not ctx.spec.space.fp32_islands or "fp16" not in modes:
        return
    modules = found.get("fp32_modules") or []
    trials = store.trials()
    if any("fp32_islands" in t.params or record(t).fp32_modules for t in trials):
        return
    trial = next((t for t in trials if t.number == found["trial"]), None)
    if modules and trial is not None:
        _enqueue_islands(ctx, store, trial, modules)


def _flip_leader(ctx: SearchContext, store: StudyStore, trial: Any) -> None:
    """When ``trial`` is the best feasible trial now, enqueue it with each knob flipped."""
    done = feasible_trials(store.trials((TrialState.COMPLETE,)))
    if not done:
        return
    pick = max if ctx.maximize else min
    best = pick(done, key=lambda t: cast(float, t.value))  # COMPLETE, so valued
    if best.number != trial.number:
        return
    settings = record(best).settings()
    for params in ctx.space.knob_flips(dict(best.params)):
        store.enqueue(params, settings, skip_if_exists=True)


def _try_safe_scale(ctx: SearchContext, store: StudyStore, trial: Any) -> None:
    """A GradScaler divergence names the scale the scaler backed off to: the same point at
    that init_scale is tried next (once), instead of waiting for the sampler to find it."""
    scale = safe_scale(trial, ctx.space.scales, blowup=ctx.spec.probe.loss_blowup_factor)
    if scale is None or "init_scale" not in trial.params:
        return
    rec = record(trial)
    store.enqueue({**trial.params, "init_scale": scale}, rec.settings(), skip_if_exists=True)
    logger.info(
        "trial {} backed off to scale {:g}: enqueued the same point at init_scale={:g}",
        trial.number,
        rec.scales[-1][1],
        scale,
    )


def _try_kept_lr(ctx: SearchContext, store: StudyStore, trial: Any) -> None:
    """A loss that blew up at the larger lr the rule gives a larger batch: the same point at
    the largest lr seen to train is tried next (once), where the spec leaves the lr rule to
    the workload (``lr_scaling: auto``)."""
    if ctx.spec.space.lr_scaling != "auto":
        return
    trials = store.trials()
    mult = kept_lr(trial, trials, ctx.space, blowup=ctx.spec.probe.loss_blowup_factor)
    if mult is None:
        return
    store.enqueue(
        {**trial.params, "lr_multiplier": mult},
        record(trial).settings(kept_lr=mult),
        skip_if_exists=True,
    )
    bs = int(trial.params["batch_size"])
    logger.info(
        "trial {} diverged at the {} rule's lr {:.3g} (bs={}): enqueued the same point at lr {:.3g}",
        trial.number,
        ctx.space.rule,
        ctx.space.lr(bs, float(trial.params.get("lr_multiplier", 1.0))),
        bs,
        ctx.space.lr(bs, mult),
    )


def after_trial(ctx: SearchContext, store: StudyStore, trial: Any, *, spare: float) -> None:
    """What a finished trial sets off: the fp16 diagnosis and the islands after a divergence,
    a trial at the scale a GradScaler divergence names, one at a kept lr after a larger
    batch's blow-up, the knob flips after a new best. ``spare``: seconds the search phase has
    left."""
    rec = record(trial)
    if rec.outcome == Outcome.DIVERGED and trial.params.get("precision") == "fp16":
        _try_safe_scale(ctx, store, trial)
    if rec.outcome == Outcome.DIVERGED and rec.duplicate_of is None:
        _try_kept_lr(ctx, store, trial)
    if (
        rec.outcome == Outcome.DIVERGED
        and trial.params.get("precision") == "fp16"
        and rec.losses  # it ran: one pruned for an lr that blew up elsewhere has none
        and not rec.fp32_modules
        and ctx.spec.space.fp32_islands
    ):
        # Only while an islands trial would still fit after it.
        summary = diagnose_failures(ctx, store, trial, spare=spare, then=_trial_estimate(ctx))
        if summary is not None and summary["fp32_modules"]:
            _enqueue_islands(ctx, store, trial, summary["fp32_modules"])
    elif rec.outcome == Outcome.COMPLETED and rec.duplicate_of is None:
        _flip_leader(ctx, store, trial)
    if rec.peak_memory_bytes and rec.duplicate_of is None:
        # A larger ceiling: its top is tried next, as the second wave tries each ceiling.
        top = raise_ceiling(ctx, store, trial)
        if top is not None:
            params = ctx.space.params(str(trial.params["precision"]), top)
            store.enqueue(params, skip_if_exists=True)
