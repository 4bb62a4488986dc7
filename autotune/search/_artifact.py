"""Building the artifact: a TunedConfig from what validation selected, or the fp32 reference when
nothing cleared it, with evidence that describes what was really measured."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.measure.knobs import break_even_steps
from autotune.measure.parity import samples_seen
from autotune.measure.result import PairedResult
from autotune.measure.stats import CLAIM_FLOOR, claimable
from autotune.schema.config import Evidence, GradScalerSettings, TrialCounts, TunedConfig
from autotune.schema.spec import Candidate, StudySpec
from autotune.search._context import SearchContext
from autotune.search._validate import Rerun, Selection, parity_terms, speedup_of
from autotune.study.reference import ReferenceRecord
from autotune.study.trials import (
    Rejection,
    candidate,
    feasible_trials,
    label,
    record,
    trial_counts,
)

__all__ = ["baseline", "build_config", "compile_evidence", "counts"]


# How a fallback's note ends.
FALLING_BACK = "falling back to the fp32 reference, the safe mode"


def counts(trials: Iterable[FrozenTrial]) -> TrialCounts:
    """The trials the search measured, by state, as every surface counts them
    (:func:`~autotune.study.trials.trial_counts`): not the configs an earlier run crowned, not
    a twin that reused an earlier trial's measurement, not one queued and never run."""
    c = trial_counts(trials)
    return TrialCounts(complete=c["complete"], pruned=c["pruned"], failed=c["failed"])


def baseline(trial: FrozenTrial | None) -> dict[str, Any]:
    """A baseline trial (the plain AMP recipe) as the summary shows it."""
    if trial is None:
        return {"outcome": "not run"}
    rec = record(trial)
    return {
        "label": label(trial.params),
        "outcome": rec.outcome or trial.state.name.lower(),
        "reason": rec.reason,
        "throughput": rec.throughput if trial.state == TrialState.COMPLETE else None,
        "speedup": rec.speedup if trial.state == TrialState.COMPLETE else None,
        "peak_memory_bytes": rec.peak_memory_bytes,
        "loss": rec.loss,
        "state": trial.state.name,
    }


def compile_evidence(
    winner: FrozenTrial, cand: Candidate, trials: list[FrozenTrial], validated: float | None
) -> dict[str, Any]:
    """A compiled winner's compile cost (the longer of its search and its validation compile),
    the same mode, batch and knobs measured uncompiled in the search, and the steps after which
    compiling pays off (each figure None when unknown)."""
    rec = record(winner)
    seconds = max((x for x in (rec.compile_seconds, validated) if x is not None), default=None)
    out: dict[str, Any] = {"compile_seconds": seconds}
    same = {k: v for k, v in winner.params.items() if k not in ("compile", "compile_mode")}
    eager = [
        t
        for t in feasible_trials(trials)
        if not t.params.get("compile")
        and {k: v for k, v in t.params.items() if k not in ("compile", "compile_mode")} == same
    ]
    if not eager or seconds is None:
        return out
    twin = record(max(eager, key=lambda t: record(t).speedup or 0.0))
    out["uncompiled_throughput"] = twin.throughput
    if twin.speedup and rec.speedup and rec.reference_throughput:
        # Speedups, not raw throughputs: each divides by a reference measured close in time.
        out["compile_break_even_steps"] = break_even_steps(
            seconds, cand.batch_size, rec.reference_throughput, twin.speedup, rec.speedup
        )
    return out


def _saving(peak: int | None, base: int | None) -> float | None:
    if not peak or not base:
        return None
    return 1 - peak / base


def build_config(  # noqa: PLR0913 - what the phases found, each named at the one call site
    ctx: SearchContext,
    *,
    selection: Selection | None,
    reference: ReferenceRecord,
    reference_run: PairedResult | None,
    amp_recipe: FrozenTrial | None,
    trials: list[FrozenTrial],
    rejected: list[Rejection],
    seed_noise: float,
    fp16_diagnosis: dict[str, Any] | None,
) -> TunedConfig:
    """The TunedConfig of a finished search.

    Args:
        ctx: the search's context: the spec, the facts (the environment comes from there),
            the space (its lr rule), what the device cut and each mode's batch ceiling.
        selection: what validation decided; None when there was nothing to validate.
        reference: the fp32 reference of this machine and device.
        reference_run: a paired rerun whose reference arm describes the reference best (the
            winner's, or any completed one); None when validation measured none.
        amp_recipe: the plain AMP recipe's trial, when it ran.
        trials: every trial of the study.
        rejected: why candidates were rejected, search and validation.
        seed_noise: the reference's seed-to-seed loss gap validation allowed.
        fp16_diagnosis: the per-layer diagnosis of the worst diverged fp16 trial, if any.
    """
    spec, facts = ctx.spec, ctx.facts
    amp = baseline(amp_recipe)
    common: dict[str, Any] = {
        "parity_tolerance": spec.parity_tolerance,
        "trials": counts(trials),
        "lr_scaling": ctx.space.rule,
        "base_learning_rate": facts.base_lr,
        "base_batch_size": facts.base_batch_size,
        "rejected": [str(r) for r in rejected[:10]],
        "cut": ctx.found.cut,
        "ceilings": ctx.found.ceilings,
        "fp16_diagnosis": fp16_diagnosis,
        "amp_throughput": amp.get("throughput"),
        "others_cores": _rounded(ctx.found.contention.others_cores()),
    }
    winner = selection.winner if selection is not None else None
    if winner is not None and winner.paired is not None:
        cand = candidate(winner.trial)
        if cand.compile:
            common.update(
                compile_evidence(
                    winner.trial, cand, trials, winner.paired.candidate.compile_seconds
                )
            )
        # How the winner was validated, then what validation did not measure (a note about
        # another candidate alone read as the validated config's own).
        notes = selection.notes if selection is not None else []
        steadiest = selection.steadiest if selection is not None else None
        note = "; ".join([_winner_note(spec, winner, seed_noise, steadiest), *dict.fromkeys(notes)])
        evidence = _winner_evidence(winner, reference, amp, common, note=note)
    else:
        cand = reference.candidate()
        evidence = _fallback_evidence(spec, selection, reference, reference_run, amp, common)
    return TunedConfig(
        study=spec.name,
        workload=facts.workload,
        precision=cand.precision,
        batch_size=cand.batch_size,
        learning_rate=cand.learning_rate,
        grad_scaler=GradScalerSettings(
            enabled=cand.precision == "fp16",
            init_scale=cand.init_scale,
            growth_interval=cand.growth_interval,
        ),
        channels_last=facts.channels_last if cand.channels_last is None else cand.channels_last,
        compile=cand.compile,
        compile_mode=cand.compile_mode,
        fp32_modules=list(cand.fp32_modules),
        optimizer=facts.optimizer,
        optimizer_kwargs=facts.optimizer_kwargs,
        lr_schedule=facts.lr_schedule,
        evidence=evidence,
        environment=facts.environment,
    )


def _winner_note(
    spec: StudySpec, winner: Rerun, seed_noise: float, steadiest: Rerun | None = None
) -> str:
    """How the winner was validated, and why it won: the best lower bound, or (``steadiest``
    its holder) a figure more than a run-to-run change above that one's."""
    paired = winner.paired
    assert paired is not None
    c = paired.candidate
    projected = winner.projected[0] if winner.projected else None
    seen = samples_seen(winner.gap_samples, winner.run_samples, projected)
    runs = f" over {winner.runs} paired runs" if winner.runs > 1 else ""
    bar = f"{spec.validation.min_speedup:.2f}x"
    why = f"the winner has the best lower bound of those that cleared {bar}"
    if steadiest is not None and steadiest.paired is not None:
        s = steadiest.paired
        why = (
            f"the winner measured {speedup_of(winner):.2f}x, more than {CLAIM_FLOOR:.0%} above "
            f"the {speedup_of(steadiest):.2f}x ({s.speedup_low:.2f}–{s.speedup_high:.2f}) of "
            f"{label(steadiest.trial.params)}, which has the best lower bound of those that "
            f"cleared {bar}"
        )
    return (
        f"{paired.pairs} timed blocks interleaved with the fp32 reference's{runs}, seed "
        f"{c.seed}, {c.timed_steps} steps (parity{seen}: "
        f"{parity_terms(spec.parity_tolerance, seed_noise)}); {why}"
    )


def _winner_evidence(
    winner: Rerun,
    reference: ReferenceRecord,
    amp: dict[str, Any],
    common: dict[str, Any],
    *,
    note: str,
) -> Evidence:
    """The validated winner's evidence, from its paired rerun against the reference."""
    paired = winner.paired
    assert paired is not None and paired.speedup is not None
    c, r = paired.candidate, paired.reference
    searched = record(winner.trial).speedup
    gap = winner.gap
    amp_speedup = amp.get("speedup")
    return Evidence(
        throughput=c.throughput,
        throughput_low=c.throughput_low,
        throughput_high=c.throughput_high,
        baseline_throughput=r.throughput,
        speedup=paired.speedup,
        speedup_low=paired.speedup_low,
        speedup_high=paired.speedup_high,
        paired_blocks=paired.pairs,
        search_speedup=searched,
        search_optimism=(searched / paired.speedup - 1) if searched else None,
        noise=reference.timing_noise(r.spread),
        speedup_vs_amp=(paired.speedup / amp_speedup) if amp_speedup else None,
        peak_memory_bytes=c.peak_memory,
        baseline_peak_memory_bytes=r.peak_memory,
        memory_saving=_saving(c.peak_memory, r.peak_memory),
        loss=gap[1] if gap else None,
        baseline_loss=gap[2] if gap else None,
        parity_gap=gap[0] if gap else None,
        parity_samples=winner.gap_samples if gap else None,
        run_samples=winner.run_samples or None,
        parity_projected=winner.projected[0] if winner.projected else None,
        skipped_steps=c.skipped_steps,
        validated=True,
        validation_note=note,
        **common,
    )


def _fallback_evidence(
    spec: StudySpec,
    selection: Selection | None,
    reference: ReferenceRecord,
    reference_run: PairedResult | None,
    amp: dict[str, Any],
    common: dict[str, Any],
) -> Evidence:
    """The fp32 reference's evidence, when nothing cleared validation: why, and the reference
    describing itself (one throughput, its own interval, 1.00x)."""
    min_speedup = spec.validation.min_speedup
    if selection is None:
        why = (
            f"no feasible candidate's speedup reached {claimable(min_speedup):.2f}x the fp32 "
            f"reference in the search (a claim is never tighter than ±{CLAIM_FLOOR:.0%}: below "
            f"that, no lower bound clears {min_speedup:.2f}x)"
        )
    else:
        why = f"no candidate's validated lower bound cleared {min_speedup:.2f}x"
    # What validation measured and refused, then what it could not measure: the reasons.
    notes = []
    if selection is not None:
        notes = [f"{r.label}: {r.detail}" for r in selection.rejected] + selection.notes
    if notes:
        why += " (" + "; ".join(dict.fromkeys(notes)) + ")"
    # The reference's latest measurement, as every surface shows the reference: one setting,
    # one figure (a validation pair's reference arm here, beside the latest measurement in the
    # reference's row, read as two speeds both called 1.00x). A pair's arm stands in only
    # where the reference has no measurement of its own.
    latest = reference.latest()
    low: float | None
    high: float | None
    peak: int | None
    if latest is not None and latest.throughput > 0:
        timed = latest.blocks > 0
        tp, peak = latest.throughput, None
        low, high = (latest.low, latest.high) if timed else (None, None)
        noise = reference.timing_noise(latest.spread if timed else None)
    elif (
        reference_run is not None
        and reference_run.reference.ok
        and reference_run.reference.throughput > 0
    ):
        r = reference_run.reference
        tp, low, high, peak = r.throughput, r.throughput_low, r.throughput_high, r.peak_memory
        noise = reference.timing_noise(r.spread)
    else:
        tp, low, high, peak, noise = 0.0, None, None, None, reference.timing_noise()
    peak = peak if peak is not None else reference.peak_memory_bytes
    return Evidence(
        throughput=tp,
        throughput_low=low,
        throughput_high=high,
        baseline_throughput=tp,
        speedup=1.0 if tp else 0.0,
        noise=noise,
        speedup_vs_amp=(1.0 / amp["speedup"]) if amp.get("speedup") else None,
        peak_memory_bytes=peak,
        baseline_peak_memory_bytes=peak,
        memory_saving=0.0 if peak else None,
        validated=False,
        validation_note=f"{why}: {FALLING_BACK}",
        **common,
    )


def _rounded(cores: float | None) -> float | None:
    return round(cores, 2) if cores is not None else None
