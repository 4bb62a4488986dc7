"""One ask/tell step of the search: a trial from the sampler, probed and told."""

from __future__ import annotations

import math
import statistics
from typing import cast

import optuna
from loguru import logger
from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import clearly_off, parity_gap, time_to_loss
from autotune.measure.result import ProbeResult
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings
from autotune.search._budget import SearchStopped
from autotune.search._ceiling_moves import lower_ceiling
from autotune.search._context import SearchContext
from autotune.search._events import Standing, TrialFinished, TrialStarted
from autotune.search._probe_settings import trial_settings
from autotune.search._reference_keeper import ReferenceKeeper
from autotune.search._risk import cannot_compile, carries_risk, not_worth
from autotune.search._shortlist import slower_bar
from autotune.search._validation_time import setup_seconds
from autotune.study import study_keys
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord
from autotune.study.storage import owner_id
from autotune.study.store import StudyStore
from autotune.study.trials import (
    TrialRecord,
    feasible_trials,
    measurement_name,
    name_measurement,
    objective_value,
    record,
    set_constraints,
    write_attrs,
)

__all__ = ["TrialStep", "standing"]

# Objective value of a time_to_loss trial that never reached the reference's loss: far worse
# than any real time, and finite (storage never holds inf).
_NEVER = 1e9


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def standing(store: StudyStore, reference: ReferenceMeasurement | None) -> Standing:
    """The best feasible measured trial so far, for progress."""
    best_trials = feasible_trials(store.trials((TrialState.COMPLETE,)))
    ref_tp = reference.throughput if reference else None
    if not best_trials:
        return Standing(reference_throughput=ref_tp)
    pick = max if store.maximize else min
    best = pick(best_trials, key=lambda t: cast(float, t.value))  # COMPLETE, so valued
    rec = record(best)
    return Standing(
        best=best.value,
        best_params=dict(best.params),
        best_throughput=rec.throughput,
        best_speedup=rec.speedup,
        reference_throughput=ref_tp,
    )


class TrialStep:
    """Runs trials of one search: probe, record, tell."""

    def __init__(self, ctx: SearchContext, store: StudyStore, refs: ReferenceKeeper) -> None:
        self.ctx = ctx
        self.store = store
        self.refs = refs
        # Trials in a row whose candidate was measured already (see EXHAUSTED).
        self.twins_in_row = 0
        # The opening pairs' candidate arms, in order, until their trials take them as probes.
        self._openings = [pair.candidate for pair in ctx.found.openings]

    @property
    def opening_waits(self) -> bool:
        """Does an opening pair's arm still wait for its trial (which costs no time)?"""
        return bool(self._openings)

    # ---- the step ------------------------------------------------------------------------------

    def run(self, trial: optuna.Trial, modes: list[str], left: float) -> None:
        """Probe one trial and tell the study how it went."""
        ctx = self.ctx
        cand = ctx.space.suggest(trial)
        # The opening arms stand for the first trials asked (queued first, in their order) or
        # for none: the search waits for no other.
        opening = self._openings.pop(0) if self._openings else None
        if opening is not None and opening.candidate != cand:
            opening, self._openings = None, []
        role = record(trial).role
        TrialRecord(
            learning_rate=cand.learning_rate, lr_scaling=ctx.space.rule, worker=owner_id()
        ).write(trial)
        ctx.emit(TrialStarted(number=trial.number, candidate=cand))
        twin = self._twin(trial)
        if twin is not None:
            self.twins_in_row += 1
            self._copy(trial, twin)
            return
        self.twins_in_row = 0
        if self._prune_if_unrunnable(trial, cand, modes, role):
            return
        if (why := cannot_compile(self.ctx, cand, left)) is not None:
            self.prune(trial, Outcome.TOO_SLOW, why)
            return
        done = self.store.trials((TrialState.COMPLETE, TrialState.PRUNED))
        if (no := not_worth(done, cand, left, ctx.space)) is not None:
            self.prune(trial, *no)
            return
        before = ctx.budget.elapsed()
        reference = self.refs.current()
        if self._is_reference(cand):
            # The reference itself, listed as a candidate: its measurement is the reference's.
            self._complete_as_reference(trial, reference)
            return
        # A re-measurement of the reference just now took its time from this trial's (a trial
        # sized before it ran past the budget's end).
        left -= ctx.budget.elapsed() - before
        result = self._probe(cand, left, reference, role, opening)
        logger.info("trial {}: {}", trial.number, result.summary())
        self._record_result(trial, result)
        self._tell(trial, cand, result, reference)

    def _prune_if_unrunnable(
        self, trial: optuna.Trial, cand: Candidate, modes: list[str], role: str | None
    ) -> bool:
        """Prune a candidate no probe can run: a mode cut on this device, or a batch above the
        mode's ceiling (a baseline runs there anyway). True when it was pruned."""
        if cand.precision not in modes:
            why = self.ctx.found.cut.get(cand.precision, f"{cand.precision} was cut on this device")
            self.prune(trial, Outcome.UNSUPPORTED, why)
            return True
        ceiling = self.ctx.found.ceilings.get(cand.precision, 0)
        if cand.batch_size > ceiling and role is None:
            unmeasured = self.ctx.found.cut.get(f"{cand.precision} batch>{ceiling}")  # out of time
            why = f"batch_size={cand.batch_size} is above the {cand.precision} ceiling {ceiling}"
            self.prune(trial, Outcome.ABOVE_CEILING, f"{why} ({unmeasured})" if unmeasured else why)
            return True
        return False

    def _probe(
        self,
        cand: Candidate,
        left: float,
        reference: ReferenceMeasurement,
        role: str | None = None,
        opening: ProbeResult | None = None,
    ) -> ProbeResult:
        """Probe the candidate within what is left of the budget (``opening``: the opening
        pair's arm, the probe where it measured this candidate).

        Raises:
            SearchStopped: the probe crashed because the search was asked to stop.
        """
        ctx = self.ctx
        if opening is not None and opening.candidate == cand:
            # Measured in the opening pair, beside the reference: its arm is the probe (its
            # wall time the pair's: what a run of it costs, at most).
            return opening
        ref = self.refs.record
        step = ref.batch_size / reference.throughput if ref and reference.throughput else 0.0
        trials = self.store.trials()
        settings = trial_settings(ctx, trials, left, cand, role, reference_step=step)
        result = ctx.run_probe(
            cand,
            settings,
            early_stop=self._early_stop(cand, settings, reference) if settings.early_stop else None,
            within=left,
        )
        if result.outcome == Outcome.CRASHED and ctx.should_stop():
            # The probe was cut short by the stop itself (Ctrl-C kills the worker's probe).
            raise SearchStopped(f"study {ctx.spec.name!r} was asked to stop")
        return result

    def _tell(
        self,
        trial: optuna.Trial,
        cand: Candidate,
        result: ProbeResult,
        reference: ReferenceMeasurement,
    ) -> None:
        """Tell the study what the probe found: completed, failed (and retried), or pruned."""
        ctx = self.ctx
        # What the trial measured for; its compiling is no measure of how long trials take.
        measured = result.wall_seconds - (result.compile_seconds or 0.0)
        if result.outcome == Outcome.COMPLETED:
            ctx.found.trial_seconds.append(measured)
            self._complete(trial, result, reference)
        elif result.outcome == Outcome.CRASHED:
            if result.timed_out:
                # Far too slow to finish one step in time: a measurement, not a crash.
                why = result.reason
                if cand.compile:
                    why += " (compiling included: torch.compile's first step is the slow one)"
                self.prune(trial, Outcome.TOO_SLOW, why)
                return
            self.fail(trial, Outcome.CRASHED, result.reason)
            self.retry(trial)
        else:
            if result.outcome == Outcome.OOM:
                lower_ceiling(ctx, self.store, cand.precision, cand.batch_size)
            elif result.outcome in (Outcome.SLOWER, Outcome.OFF_PARITY):
                ctx.found.trial_seconds.append(measured)
                decided = (
                    f"speed after {len(result.blocks)} blocks"
                    if result.outcome == Outcome.SLOWER
                    else f"parity at {result.parity_samples:,} samples"
                )
                TrialRecord(decided_by=decided, parity_samples=result.parity_samples).write(trial)
            self.prune(trial, result.outcome, result.reason)

    def _same_work(self, cand: Candidate) -> bool:
        """The reference's precision and batch, with no knob that changes its kernels: the
        reference's steps (at any lr), so its speed."""
        ref = self.refs.record
        return (
            ref is not None
            and cand.precision == ref.precision
            and cand.batch_size == ref.batch_size
            and not cand.compile
            and not cand.fp32_modules
            and cand.channels_last in (None, self.ctx.facts.channels_last)
        )

    def _is_reference(self, cand: Candidate) -> bool:
        ref = self.refs.record
        return (
            ref is not None
            and self._same_work(cand)
            and math.isclose(cand.learning_rate, ref.learning_rate, rel_tol=1e-9)
        )

    def _early_stop(
        self, cand: Candidate, settings: ProbeSettings, reference: ReferenceMeasurement
    ) -> EarlyStop:
        """When this trial's probe may stop early: once its throughput's interval lies below
        the best feasible candidate's lower bound (in samples/s now), or once its loss is
        clearly off the reference's, at half the probe's horizon."""
        ref = self.refs.record
        assert ref is not None
        below = None
        best = standing(self.store, reference)
        if best.best_params is not None and self.ctx.maximize:
            best_trial = slower_bar(
                self.store.trials(),
                risky=carries_risk(dict(cand)),
                batch=cand.batch_size,
                parity_tolerance=self.ctx.spec.parity_tolerance,
            )
            low = record(best_trial).speedup_low if best_trial is not None else None
            if low and low > 0:  # an interval wider than the value has no lower bound
                below = low * reference.throughput
        horizon = (settings.warmup_steps + settings.steps) * cand.batch_size
        tol = self.ctx.spec.parity_tolerance
        return EarlyStop(
            below=below,
            first_use=first_use(
                self.ctx, self.store.trials((TrialState.COMPLETE, TrialState.PRUNED))
            ),
            parity_gap=clearly_off(tol, cand.batch_size / ref.batch_size) + ref.seed_noise(tol),
            parity_samples=horizon // 2,
            reference_losses=ref.finite_losses,
            reference_batch_size=ref.batch_size,
        )

    # ---- telling ---------------------------------------------------------------------------------

    def _record_result(self, trial: optuna.Trial, result: ProbeResult) -> None:
        TrialRecord(
            outcome=result.outcome,
            reason=result.reason,
            throughput=result.throughput,
            throughput_low=result.throughput_low,
            throughput_high=result.throughput_high,
            blocks=len(result.blocks),
            peak_memory_bytes=result.peak_memory,
            skipped_steps=result.skipped_steps,
            timed_steps=result.timed_steps,
            truncated=result.truncated,
            probe_seconds=round(result.wall_seconds, 3),
            compile_seconds=result.compile_seconds,
            losses=_finite(result.losses),
            scales=[(s, v) for s, v in result.scales],
            seed=result.seed,
            output=result.output or None,
            output_bytes=result.output_bytes or None,
        ).write(trial)

    def _complete(
        self, trial: optuna.Trial, result: ProbeResult, reference: ReferenceMeasurement
    ) -> None:
        """Store a completed probe's speedup, parity and objective, and tell the study."""
        ctx = self.ctx
        ref = self.refs.record
        assert ref is not None
        if reference.throughput > 0 and result.throughput > 0:
            cand = result.candidate
            reference = self.refs.divisor(
                cand, result.throughput, reference, same_work=self._same_work(cand)
            )
        name_measurement(trial, self.refs.name(reference))
        rec = TrialRecord(reference_throughput=reference.throughput)
        if reference.throughput > 0:
            rec.speedup = result.throughput / reference.throughput
            rec.speedup_low, rec.speedup_high = _ratio_interval(
                rec.speedup,
                _half_width(result.throughput, result.throughput_low, result.throughput_high),
                _half_width(reference.throughput, reference.low, reference.high),
            )
        constraints = {"parity": self._parity(rec, result, ref)}
        value = self._objective(rec, result, ref, constraints)
        feasible = all(v <= 0 for v in constraints.values())
        if not feasible:
            rec.outcome = Outcome.INFEASIBLE
        rec.write(trial)
        set_constraints(trial, constraints)
        self.store.tell(trial, objective_value(value, constraints, maximize=ctx.maximize))
        ctx.emit(
            TrialFinished(
                number=trial.number,
                outcome=Outcome.COMPLETED if feasible else Outcome.INFEASIBLE,
                reason=rec.reason,
                throughput=result.throughput,
                speedup=rec.speedup,
                gap=rec.parity_gap,
                standing=standing(self.store, reference),
            )
        )

    def _parity(self, rec: TrialRecord, result: ProbeResult, ref: ReferenceRecord) -> float:
        """The loss-parity constraint (feasible at 0 or below), its figures written on ``rec``:
        the gap may be the tolerance plus the reference's own seed-to-seed spread."""
        tol = self.ctx.spec.parity_tolerance
        # A fresh seed alone moves a loss curve: the reference's repeats say by how much.
        noise = ref.seed_noise(tol)
        measured = parity_gap(result.losses, result.batch_size, ref.finite_losses, ref.batch_size)
        rec.decided_by = "full probe"
        rec.parity_samples = min(
            len(result.losses) * result.batch_size, len(ref.finite_losses) * ref.batch_size
        )
        if measured is None:
            rec.reason = "parity: loss curve not comparable"
            return 1.0
        gap, loss, ref_loss = measured
        constraint = gap - (tol + noise)
        rec.loss, rec.ref_loss, rec.parity_gap = loss, ref_loss, gap
        if constraint > 0:
            rec.reason = (
                f"parity: loss {loss:.4g} is {gap:+.1%} vs the fp32 reference's "
                f"{ref_loss:.4g} (tolerance {tol:.0%} + seed noise {noise:.1%})"
            )
        return constraint

    def _objective(
        self,
        rec: TrialRecord,
        result: ProbeResult,
        ref: ReferenceRecord,
        constraints: dict[str, float],
    ) -> float:
        """The trial's objective: its speedup, or its time to the reference's loss (a run that
        never reaches it adds a failed constraint to ``constraints``)."""
        if self.ctx.spec.objective != "time_to_loss":
            return rec.speedup or 0.0
        target = statistics.fmean(ref.finite_losses[-3:]) if ref.finite_losses else math.inf
        seconds = time_to_loss(result.losses, result.batch_size, result.throughput, target)
        if seconds is None:
            constraints["reaches_reference_loss"] = 1.0
            seconds = _NEVER
        return seconds

    def _complete_as_reference(self, trial: optuna.Trial, reference: ReferenceMeasurement) -> None:
        ref = self.refs.record
        assert ref is not None
        TrialRecord(
            outcome=Outcome.COMPLETED,
            reason="the fp32 reference's own settings: its measurement is the reference's",
            throughput=reference.throughput,
            throughput_low=reference.low,
            throughput_high=reference.high,
            reference_throughput=reference.throughput,
            speedup=1.0,
            speedup_low=reference.low / reference.throughput,
            speedup_high=reference.high / reference.throughput,
            peak_memory_bytes=ref.peak_memory_bytes,
            losses=list(ref.losses),
            parity_gap=0.0,
        ).write(trial)
        name_measurement(trial, self.refs.name(reference))
        set_constraints(trial, {"parity": -self.ctx.spec.parity_tolerance})
        value = 1.0
        if self.ctx.spec.objective == "time_to_loss":
            value = _NEVER
            set_constraints(trial, {"reaches_reference_loss": 0.0})
        self.store.tell(trial, value)
        self.ctx.emit(
            TrialFinished(
                number=trial.number,
                outcome=Outcome.COMPLETED,
                throughput=reference.throughput,
                speedup=1.0,
                gap=0.0,
                standing=standing(self.store, reference),
            )
        )

    def prune(self, trial: optuna.Trial, outcome: Outcome, reason: str) -> None:
        TrialRecord(outcome=outcome, reason=reason).write(trial)
        self.store.tell(trial, state=TrialState.PRUNED)
        logger.info("trial {} pruned: {}: {}", trial.number, outcome, reason)
        self.ctx.emit(
            TrialFinished(
                number=trial.number,
                outcome=outcome,
                reason=reason,
                standing=standing(self.store, self._latest()),
            )
        )

    def fail(self, trial: optuna.Trial, outcome: Outcome, reason: str) -> None:
        TrialRecord(outcome=outcome, reason=reason).write(trial)
        self.store.tell(trial, state=TrialState.FAIL)
        logger.warning("trial {} failed: {}", trial.number, reason)
        self.ctx.emit(
            TrialFinished(
                number=trial.number,
                outcome=outcome,
                reason=reason,
                standing=standing(self.store, self._latest()),
            )
        )

    def retry(self, trial: optuna.Trial) -> None:
        """A crashed or interrupted trial runs once more (a crash may be the worker, not the
        candidate); a retry that fails too stays failed."""
        rec = record(trial)
        if rec.retry_of is not None or not trial.params:
            return
        retry = rec.settings(role=rec.role, retry_of=trial.number)
        self.store.enqueue(trial.params, retry)
        logger.info("trial {} will be retried once", trial.number)

    def _latest(self) -> ReferenceMeasurement | None:
        ref = self.refs.record
        return ref.latest() if ref is not None else None

    # ---- twins -----------------------------------------------------------------------------------

    def _twin(self, trial: optuna.Trial) -> FrozenTrial | None:
        params = trial.params
        for t in self.store.trials((TrialState.COMPLETE, TrialState.PRUNED)):
            if t.number != trial.number and t.params == params and record(t).outcome:
                return t
        return None

    def _copy(self, trial: optuna.Trial, twin: FrozenTrial) -> None:
        """Same parameters as a finished trial: reuse its measurement, spend no budget."""
        # The twin's measurement, not its bookkeeping: this trial is no baseline and no retry,
        # and it ran in this worker.
        attrs = {
            k: v
            for k, v in record(twin).to_attrs().items()
            if k not in ("role", "retry_of", "worker")
        }
        attrs["duplicate_of"] = twin.number
        if (named := measurement_name(twin)) is not None:
            attrs[study_keys.MEASUREMENT] = named
        write_attrs(trial.storage, trial._trial_id, attrs)
        if twin.state == TrialState.COMPLETE:
            set_constraints(trial, twin.constraints)
            self.store.tell(trial, twin.value)
        else:
            self.store.tell(trial, state=TrialState.PRUNED)
        self.ctx.emit(
            TrialFinished(
                number=trial.number,
                outcome=Outcome.REUSED,
                reason=f"same parameters as trial {twin.number}: its measurement is reused",
                standing=standing(self.store, self._latest()),
            )
        )


def _ratio_interval(ratio: float, a: float, b: float) -> tuple[float, float]:
    """The interval of a ratio of two measurements with relative half-widths ``a`` and ``b``
    (combined in quadrature, on the log scale so the bounds stay positive).

    Example:
        >>> low, high = _ratio_interval(2.0, 0.03, 0.04)
        >>> round(low, 3), round(high, 3)
        (1.905, 2.1)
    """
    rel = math.log1p(math.hypot(a, b))
    return ratio * math.exp(-rel), ratio * math.exp(rel)


def _half_width(value: float, low: float | None, high: float | None) -> float:
    """Relative half-width of an interval (0 when unknown)."""
    if not value or low is None or high is None:
        return 0.0
    return max(0.0, (high - low) / 2 / value)


def first_use(ctx: SearchContext, trials: list[FrozenTrial]) -> float | None:
    """The first-use costs a first step may carry before it is judged as a step: twice the most
    any measured trial spent before its steps, and a second (a CPU's fp16 ResNet-18: 24 s for
    its first step, as long for the next). None before any was measured, and off a CPU: a
    GPU's first step in a mode may load and tune that mode's own kernels for seconds."""
    if not ctx.device.startswith("cpu"):
        return None
    setups = [setup_seconds(t) for t in trials if record(t).throughput]
    return 2 * max(setups) + 1.0 if setups else None
