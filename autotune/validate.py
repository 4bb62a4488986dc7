"""Validation: re-run the best candidates longer, with a fresh seed, beside the fp32 reference.

A candidate is accepted only if its rerun
1. completes without diverging,
2. keeps loss parity with the reference rerun (same samples seen, within the tolerance), and
3. reproduces its search throughput within ``validation.throughput_tolerance``.

The fastest accepted candidate becomes the config. If none passes, the config falls back to the
fp32 reference settings, and says so: an unvalidated candidate is never emitted as validated.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import optuna
from loguru import logger
from optuna.trial import FrozenTrial, TrialState

from autotune.config import (
    Evidence,
    GradScalerSettings,
    TrialCounts,
    TunedConfig,
    current_environment,
)
from autotune.parity import parity_gap
from autotune.result import ProbeResult
from autotune.search import reference_factor
from autotune.spec import Candidate

if TYPE_CHECKING:
    from autotune.search import _Search

__all__ = ["candidate_of", "feasible_best", "rejection_summary", "validate_and_build"]


def candidate_of(trial: FrozenTrial) -> Candidate:
    """The Candidate a trial ran."""
    return Candidate(
        precision=trial.params["precision"],
        batch_size=trial.params["batch_size"],
        learning_rate=trial.user_attrs["learning_rate"],
        init_scale=trial.params.get("init_scale", 2.0**16),
    )


def _label(trial: FrozenTrial) -> str:
    p = trial.params
    text = f"{p.get('precision')} bs={p.get('batch_size')} lr×{p.get('lr_multiplier', 1):.3g}"
    if "init_scale" in p:
        text += f" init_scale={p['init_scale']:g}"
    return text


def rejection_summary(study: optuna.Study) -> list[str]:
    """Why candidates were rejected, grouped by mode and outcome, most common first.

    Example: ``["fp16: 3 diverged (e.g. loss=nan at step 0)", "bf16: 1 infeasible (parity: ...)"]``
    """
    groups: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("duplicate_of") is not None:
            continue
        outcome = t.user_attrs.get("outcome", t.state.name.lower())
        if t.state == TrialState.COMPLETE:
            if all(v <= 0 for v in t.constraints.values()):
                continue
            outcome = "infeasible"
        elif t.state not in (TrialState.PRUNED, TrialState.FAIL):
            continue
        key = (str(t.params.get("precision", "?")), outcome)
        groups[key] += 1
        example.setdefault(key, t.user_attrs.get("reason", ""))
    return [
        f"{mode}: {n} {outcome}"
        + (f" (e.g. {example[(mode, outcome)]})" if example[(mode, outcome)] else "")
        for (mode, outcome), n in groups.most_common()
    ]


def _counts(study: optuna.Study) -> TrialCounts:
    states = Counter(t.state for t in study.get_trials(deepcopy=False))
    return TrialCounts(
        complete=states[TrialState.COMPLETE],
        pruned=states[TrialState.PRUNED],
        failed=states[TrialState.FAIL],
    )


def feasible_best(study: optuna.Study, maximize: bool, k: int) -> list[FrozenTrial]:
    trials = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if all(v <= 0 for v in t.constraints.values()) and t.user_attrs.get("duplicate_of") is None
    ]
    trials.sort(key=lambda t: t.value, reverse=maximize)
    seen: set[tuple] = set()
    out = []
    for t in trials:
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out[:k]


def _baseline(trial: FrozenTrial | None) -> dict[str, Any]:
    if trial is None:
        return {"outcome": "not run"}
    attrs = trial.user_attrs
    return {
        "label": _label(trial),
        "outcome": attrs.get("outcome", trial.state.name.lower()),
        "reason": attrs.get("reason", ""),
        "throughput": attrs.get("throughput") if trial.state == TrialState.COMPLETE else None,
        "peak_memory_bytes": attrs.get("peak_memory_bytes"),
        "loss": attrs.get("loss"),
        "state": trial.state.name,
    }


def validate_and_build(
    search: _Search, study: optuna.Study, end_at: float
) -> tuple[TunedConfig, dict[str, dict[str, Any]], list[str]]:
    """Validate the best feasible trials and build the TunedConfig.

    Args:
        search: the running search (spec, runner, budget, ceilings, cut modes).
        study: the study with the search's trials.
        end_at: elapsed-seconds mark by which validation must be done.

    Returns:
        ``(config, baselines, rejected)``: the config, the reference and AMP-recipe figures, and
        the main reasons candidates were rejected.
    """
    spec = search.spec
    val = spec.validation
    maximize = spec.objective == "throughput"
    roles = {
        t.user_attrs.get("role"): t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("role")
    }
    ref_trial = search.reference(study)
    amp_trial = roles.get("amp_recipe")
    baselines = {"reference": _baseline(ref_trial), "amp_recipe": _baseline(amp_trial)}
    rejected = rejection_summary(study)
    ranked = feasible_best(study, maximize, 10**6)
    # Only candidates that beat the reference are worth validating: if none does, the fastest
    # safe setting measured is the reference itself.
    if ref_trial is not None and ref_trial.value is not None:
        edge = val.min_speedup
        better = (
            (lambda v: v > ref_trial.value * edge)
            if maximize
            else (lambda v: v < ref_trial.value / edge)
        )
        ranked = [t for t in ranked if t.number != ref_trial.number and better(t.value)]
    best = ranked[: val.top_k]
    # The fastest candidates often sit at the edge of the parity tolerance, where a fresh seed
    # can tip them over: also validate the fastest one with a clear margin, if it is not in.
    margin = [
        t
        for t in ranked[val.top_k :]
        if t.user_attrs.get("parity_gap") is not None
        and t.user_attrs["parity_gap"] <= spec.parity_tolerance / 2
    ]
    if margin and not any(
        (t.user_attrs.get("parity_gap") or 0.0) <= spec.parity_tolerance / 2 for t in best
    ):
        best.append(margin[0])
    settings = spec.probe.model_copy(update={"steps": val.steps, "seed": spec.probe.seed + 1})
    ref_cand = Candidate(
        precision="fp32",
        batch_size=search.workload.base_batch_size,
        learning_rate=search.workload.base_lr,
    )

    pending = [len(best)]

    def run(cand: Candidate, factor: int = 1, reference: bool = False) -> ProbeResult | None:
        """One rerun in its slice of the time left: the reference gets 40%, each candidate an
        equal share of the rest. A run cut short by its slice is still compared, at the
        samples both runs saw."""
        left = end_at - search.budget.elapsed()
        if left < 1.0:
            return None
        share = 0.4 if reference else 1.0 / max(1, pending[0])
        if not reference:
            pending[0] -= 1
        limit = max(1.0, min(left * share, spec.probe.time_limit * 2 * factor))
        update = {"time_limit": limit, "steps": settings.steps * factor}
        return search.run_probe(cand, settings.model_copy(update=update))

    accepted: list[tuple[FrozenTrial, ProbeResult, tuple[float, float, float] | None]] = []
    notes: list[str] = []
    # The reference rerun covers as many samples as the largest candidate's rerun.
    factor = reference_factor(
        max((t.params["batch_size"] for t in best), default=1), ref_cand.batch_size
    )
    ref_run = run(ref_cand, factor, reference=True) if best else None
    if ref_run is not None and not ref_run.ok:
        notes.append(f"fp32 reference rerun {ref_run.outcome}: {ref_run.reason}")
        ref_run = None
    # A fresh seed moves a loss curve by itself: the two fp32 reference runs (search and
    # validation, same settings, different seeds) measure by how much, and a candidate's rerun
    # is allowed that much on top of the tolerance.
    noise = 0.0
    if ref_run is not None and ref_trial is not None:
        ref_losses = [v for v in ref_trial.user_attrs.get("losses", []) if v is not None]
        seed_gap = parity_gap(ref_run.losses, ref_run.batch_size, ref_losses, ref_cand.batch_size)
        noise = min(abs(seed_gap[0]), spec.parity_tolerance) if seed_gap else 0.0
    tolerance = spec.parity_tolerance + noise
    for trial in best if ref_run is not None else []:
        # The reference itself is never among them: only trials that beat it are.
        rerun = run(candidate_of(trial))
        label = _label(trial)
        if rerun is None:
            notes.append(f"{label}: no time left to validate")
            continue
        if not rerun.ok:
            rejected.append(f"{label}: failed validation: {rerun.outcome}: {rerun.reason}")
            continue
        gap = parity_gap(rerun.losses, rerun.batch_size, ref_run.losses, ref_run.batch_size)
        if gap is None or gap[0] > tolerance:
            shown = "not comparable" if gap is None else f"{gap[0]:+.1%}"
            rejected.append(
                f"{label}: failed validation: loss parity {shown} vs the fp32 reference "
                f"(tolerance {spec.parity_tolerance:.0%} + seed noise {noise:.1%})"
            )
            continue
        # Reproduce the *speedup* over the reference, measured side by side: a machine that is
        # busier now than during the search slows both runs, and that is not the candidate's.
        searched = float(trial.user_attrs.get("throughput") or 0.0)
        ref_searched = float(ref_trial.user_attrs.get("throughput") or 0.0) if ref_trial else 0.0
        if searched > 0 and ref_searched > 0 and ref_run.throughput > 0:
            then, now = searched / ref_searched, rerun.throughput / ref_run.throughput
            if now < (1 - val.throughput_tolerance) * then:
                rejected.append(
                    f"{label}: failed validation: {now:.2f}x the fp32 reference's throughput side "
                    f"by side, against {then:.2f}x in the search (tolerance "
                    f"{val.throughput_tolerance:.0%})"
                )
                continue
        logger.info(
            "validated {}: {:.1f} samples/s, parity {:+.1%}", label, rerun.throughput, gap[0]
        )
        accepted.append((trial, rerun, gap))

    counts = _counts(study)
    env = current_environment(search.device)
    common: dict[str, Any] = {
        "parity_tolerance": spec.parity_tolerance,
        "trials": counts,
        "lr_scaling": search.rule,
        "base_learning_rate": search.workload.base_lr,
        "base_batch_size": search.workload.base_batch_size,
        "rejected": rejected[:10],
        "cut": search.cut,
        "ceilings": search.ceilings,
        "fp16_diagnosis": study.user_attrs.get("fp16_diagnosis"),
    }
    amp_tp = baselines["amp_recipe"].get("throughput")
    if accepted:
        accepted.sort(key=lambda a: a[1].throughput, reverse=True)
        trial, rerun, gap = accepted[0]
        assert ref_run is not None
        cand = candidate_of(trial)
        searched_tp = float(trial.user_attrs.get("throughput") or 0.0)
        evidence = Evidence(
            throughput=rerun.throughput,
            baseline_throughput=ref_run.throughput,
            speedup=rerun.throughput / ref_run.throughput if ref_run.throughput else 0.0,
            amp_throughput=amp_tp,
            speedup_vs_amp=(searched_tp / amp_tp) if amp_tp else None,
            peak_memory_bytes=rerun.peak_memory,
            baseline_peak_memory_bytes=ref_run.peak_memory,
            memory_saving=_saving(rerun.peak_memory, ref_run.peak_memory),
            loss=gap[1] if gap else None,
            baseline_loss=gap[2] if gap else None,
            parity_gap=gap[0] if gap else None,
            skipped_steps=rerun.skipped_steps,
            validated=True,
            validation_note="; ".join(notes)
            or (
                f"validated with {val.steps} steps, seed {settings.seed}, beside the fp32 "
                f"reference (parity tolerance {spec.parity_tolerance:.0%} + seed noise {noise:.1%})"
            ),
            **common,
        )
    else:
        cand = ref_cand
        why = (
            f"no feasible candidate measured {val.min_speedup:.2f}x or more the fp32 reference"
            if not best
            else "no candidate passed validation"
        )
        if notes:
            why += " (" + "; ".join(notes) + ")"
        logger.warning("{}: falling back to the fp32 reference settings", why)
        tp = (
            ref_run.throughput
            if ref_run
            else float(baselines["reference"].get("throughput") or 0.0)
        )
        evidence = Evidence(
            throughput=tp,
            baseline_throughput=tp,
            speedup=1.0 if tp else 0.0,
            amp_throughput=amp_tp,
            speedup_vs_amp=(tp / amp_tp) if (amp_tp and tp) else None,
            peak_memory_bytes=ref_run.peak_memory if ref_run else None,
            baseline_peak_memory_bytes=ref_run.peak_memory if ref_run else None,
            validated=False,
            validation_note=f"{why}: falling back to the fp32 reference, the safe mode",
            **common,
        )
    mode_scales = cand.precision == "fp16"
    config = TunedConfig(
        study=spec.name,
        workload=search.ref,
        precision=cand.precision,
        batch_size=cand.batch_size,
        learning_rate=cand.learning_rate,
        grad_scaler=GradScalerSettings(
            enabled=mode_scales, init_scale=cand.init_scale, growth_interval=cand.growth_interval
        ),
        channels_last=search.workload.channels_last,
        evidence=evidence,
        environment=env,
    )
    return config, baselines, rejected


def _saving(peak: int | None, base: int | None) -> float | None:
    if not peak or not base:
        return None
    return 1 - peak / base
