"""The fp32 reference: measured first (long enough for the parity curve), then again as the
search goes, so every trial's speedup divides by a reference measured close to it in time."""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence

from loguru import logger

from autotune.errors import DeviceError
from autotune.infra import clock
from autotune.measure.parity import parity_gap
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.enums import Outcome, Phase
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.search._budget import (
    OPENING_PLAN,
    REFERENCE_FLOOR,
    SAFE_PLAN,
    WRITE_RESERVE,
    BudgetTooShort,
)
from autotune.search._context import SearchContext
from autotune.search._events import PhaseStarted
from autotune.search._space import reference_factor
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.study_keys import reference_key

__all__ = ["ReferenceKeeper", "ReferenceUnavailable", "establish"]

# The long first run takes at most this share of the budget ...
_CURVE_SHARE = 0.15
# ... and at least REFERENCE_FLOOR seconds (or the probe's own time limit, if shorter).
# An opening pair takes at most this share of what is left: it ends once its candidate ran its
# steps (fp16's overflow horizon) and the pairs' ratio is tight; the rest goes to other trials.
# (At 0.85 an AMP recipe's candidate stopped at 233 of its 500 steps with 2.8 s of a 14 s
# budget unspent; at all of what is left, less a second, a pair that ran past its limit was
# stopped at the budget's end having measured nothing: no config.)
_OPENING_SHARE = 0.92
# Seconds a reference run alone is started with at the least (a cold run that times no block
# in them ends the search as a budget too short).
_LEAST = 1.0
# ... and what it keeps after its time limit: the config's writing, and a second for a worker
# stopped at its hard limit (one second past the time limit).
_AFTER = WRITE_RESERVE + 1.0
# Seconds a reference run alone needs after it: its floor, the config's writing, a second.
_ALONE = REFERENCE_FLOOR + WRITE_RESERVE + 1.0
# Re-measure when the last measurement is older than this many typical trials ...
_REFRESH_TRIALS = 8
# ... but never more often than this (seconds), and at least this often.
_REFRESH_MIN = 15.0
_REFRESH_MAX = 120.0
# A re-measurement is shorter than a probe: it needs a throughput, and a probe's steps of loss
# curve (for the seed-to-seed gap), not the long curve.
_REMEASURE_SHARE = 0.5
# The first run is confirmed only where this many runs of its length are left: the
# confirmation, a first trial, one validation pair (two arms) and about two more for an fp16
# candidate's run to its overflow horizon beside its pair, or a second trial. At four, a 38 s
# budget's confirmation (3.8 s) left the AMP recipe's pair too short for its 500 steps, and
# the search fell back with 11 s unspent. Unconfirmed, the trials rank against the one
# measurement (each validation pair measures the reference again beside its candidate).
_CONFIRM_RUNS = 6
# Two measurements of the same work more than this factor apart are no run-to-run noise: the
# noisiest machine recorded (a laptop CPU, 12% from run to run) keeps about 98% of honest pairs
# within it. One of them ran during a warm-up or a neighbour's burst.
_AGREE = 1.5
# Measurements at most, after the one that disagrees, for two in a row to agree.
_SETTLE_TRIES = 2
# A precision change (with the knobs) speeds a whole model's step up by less than this at the
# same batch: the reduced-precision peak of a GPU is 2-16x its fp32 one, and a model's other
# work (memory-bound layers, the optimizer, the input) keeps whole steps far below the peak
# ratio. A step never gets faster when its batch grows, so samples/s grow at most with the batch.
_MAX_MODE_SPEEDUP = 8.0


class ReferenceUnavailable(Exception):
    """The reference could not be measured (it diverged, ran out of memory or crashed)."""

    def __init__(self, result: ProbeResult) -> None:
        super().__init__(f"the fp32 reference {result.outcome}: {result.reason}")
        self.result = result


def _measurement(result: ProbeResult, seed_gap: float | None = None) -> ReferenceMeasurement:
    return ReferenceMeasurement(
        at=clock.wall(),
        throughput=result.throughput,
        low=result.throughput_low or result.throughput,
        high=result.throughput_high or result.throughput,
        blocks=len(result.blocks),
        spread=result.spread or 0.0,
        seed=result.seed,
        seed_gap=seed_gap,
    )


def _agree(a: ReferenceMeasurement, b: ReferenceMeasurement) -> bool:
    return max(a.throughput, b.throughput) <= _AGREE * min(a.throughput, b.throughput)


def implausible(
    ref: ReferenceRecord, cand: Candidate, speedup: float, *, same_work: bool
) -> str | None:
    """Why a trial's speedup over the reference is none the device gives, or None when it may be.

    ``same_work``: the candidate runs the reference's own precision at its batch with no knob that
    changes the kernels (its lr may differ): the same steps, at the same speed.

    Example:
        >>> ref = ReferenceRecord(batch_size=64, learning_rate=0.1)
        >>> bf16 = Candidate(precision="bf16", batch_size=64, learning_rate=0.1)
        >>> implausible(ref, bf16, 1.4, same_work=False) is None
        True
        >>> implausible(ref, bf16, 23.9, same_work=False)
        "23.90x at the reference's batch: a precision change gives at most 8x there"
        >>> fp32 = Candidate(precision="fp32", batch_size=64, learning_rate=0.2)
        >>> implausible(ref, fp32, 0.5, same_work=True)
        "0.50x for the reference's own precision and batch, which run at 1.00x"
    """
    if speedup <= 0:
        return None
    if same_work:
        if max(speedup, 1 / speedup) > _AGREE:
            return f"{speedup:.2f}x for the reference's own precision and batch, which run at 1.00x"
        return None
    ratio = cand.batch_size / ref.batch_size
    bound = _MAX_MODE_SPEEDUP * max(1.0, ratio)
    if speedup <= bound:
        return None
    where = "at the reference's batch" if ratio <= 1 else f"at {ratio:g}x the reference's batch"
    return f"{speedup:.2f}x {where}: a precision change gives at most {bound:g}x there"


class ReferenceKeeper:
    """Keeps one machine-and-device's fp32 reference fresh, in the study's storage."""

    def __init__(self, ctx: SearchContext, store: StudyStore) -> None:
        self.ctx = ctx
        self.store = store
        self.where = (socket.gethostname(), ctx.device)
        self.key = reference_key(*self.where)
        self.record: ReferenceRecord | None = store.reference(*self.where)
        self.drifted = False
        # Measurements (by time) a disagreeing trial challenged already, or that a challenge
        # confirmed: never challenged (again).
        self._vouched: set[float] = set()
        # Seconds the first run took, set-up included: what a confirmation costs, about.
        self._run_seconds = 0.0
        # Seconds of the budget gone when the reference's phase began; what was tried before
        # the time ran out, where something was.
        self._began = 0.0
        self._unmeasured = ""

    def _save(self) -> None:
        if self.record is not None:
            self.store.set_reference(*self.where, self.record)

    def establish(self, opening: Sequence[Candidate] = ()) -> ReferenceRecord:
        """The reference with its loss curve: the long first run, or the stored one measured
        again now (a resumed run, or another worker on this machine); with ``opening`` (a
        short budget's picks), the first run is a pick's pair with it: the first pick's, or the
        next one's where the one before stopped early.

        Raises:
            ReferenceUnavailable: the reference run did not complete.
        """
        ctx = self.ctx
        ctx.emit(PhaseStarted(phase=Phase.REFERENCE))
        self._began = ctx.budget.elapsed()
        cand = ctx.space.candidate("fp32", ctx.space.base_batch)
        if (
            self.record is not None
            and self.record.losses
            and self.record.batch_size == cand.batch_size
        ):
            self.measure()
            self._settle()
            return self.record
        if opening and (result := self._open(cand, opening)) is not None:
            return self._first(cand, result)
        settings = self._alone(cand)
        result = ctx.run_probe(cand, settings)
        cold = result.ok and result.truncated and not result.blocks
        # A pair stopped at its hard limit (its record dropped) was the first try already.
        retry = not opening or bool(ctx.found.openings)
        retry = retry and ctx.budget.left() >= _LEAST + _AFTER
        if retry and (cold or (result.outcome == Outcome.CRASHED and not ctx.should_stop())):
            # Cut inside its warm-up, or stopped at its hard limit: on a busy machine a fresh
            # worker's first-use costs (or a neighbour's burst) can outlast the limit. Once more,
            # warm; a retry that fails keeps the first run where that one completed.
            logger.info("fp32 reference {}: measuring it again", "stopped inside its warm-up"
                        if cold else result.reason)  # fmt: skip
            again = ctx.run_probe(cand, self._alone(cand))
            result = again if again.ok or not result.ok else result
        spent = ctx.budget.left() < _LEAST + _AFTER
        stopped = spent and not result.ok and result.timed_out
        if stopped:
            # Stopped at a hard limit the budget cut, no time for another: its set-up, or a hang.
            self._unmeasured = (
                "the fp32 reference was stopped at its hard limit, which the budget cut: its "
                "set-up did not fit, or a build or a step hangs (autotune probe --workload "
                f"{ctx.workload} --device {ctx.device} tells which)"
            )
        if spent and (cold or stopped):
            # Nothing measured, for want of time (a crash of its own is the workload's:
            # ReferenceUnavailable below).
            raise self._too_short()
        if not result.ok:
            raise ReferenceUnavailable(result)
        return self._first(cand, result)

    def _floor(self) -> float:
        """The least a reference run alone is given: its floor, or the probe's own limit."""
        return min(self.ctx.spec.probe.time_limit, REFERENCE_FLOOR)

    def _too_short(self) -> BudgetTooShort:
        """The budget spent before the reference was measured: what went where, and the fix."""
        ctx = self.ctx
        start = ctx.found.spent.get(Phase.START, 0.0)
        return BudgetTooShort(
            f"study {ctx.spec.name!r}: the {ctx.budget.total:.0f}s budget ran out before the fp32 "
            f"reference was measured ({self._began:.1f}s had gone by when it began; the worker "
            f"took {start:.1f}s to start)"
            f"{'; ' + self._unmeasured if self._unmeasured else ''}: "
            "nothing was measured, so no config was written; --budget "
            f"{math.ceil(self._began + OPENING_PLAN)}s or more leaves room for a trial and its "
            "validation",
            elapsed=ctx.budget.elapsed(),
        )

    def _alone(self, cand: Candidate) -> ProbeSettings:
        """The reference's run alone: long enough that its curve has seen as many samples as a
        probe of the largest batch does (parity compares at equal samples seen), its floor where
        that fits, and within the budget: with under a second left, the search ends, saying so
        (:class:`BudgetTooShort`; a budget is a promise, and nothing compares without it)."""
        ctx, probe = self.ctx, self.ctx.spec.probe
        factor = reference_factor(max(ctx.space.ladder), cand.batch_size)
        left = ctx.budget.left() - _AFTER
        if left < _LEAST:
            raise self._too_short()
        limit = max(
            min(self._floor(), left),
            min(probe.time_limit * factor, _CURVE_SHARE * ctx.budget.total, left),
        )
        return probe.model_copy(update={"steps": probe.steps * factor, "time_limit": limit})

    def _first(self, cand: Candidate, result: ProbeResult) -> ReferenceRecord:
        """Keep the first run's measurement and curve as the reference, confirmed where a
        confirmation fits."""
        self._run_seconds = result.wall_seconds
        self.record = ReferenceRecord(
            batch_size=cand.batch_size,
            learning_rate=cand.learning_rate,
            seed=result.seed,
            losses=[v if v == v and abs(v) != float("inf") else None for v in result.losses],
            peak_memory_bytes=result.peak_memory,
            measurements=[_measurement(result)],
        )
        m = self.record.measurements[-1]
        logger.info(
            "fp32 reference {} bs={}: {:,.1f} samples/s ({:,.1f}–{:,.1f}), {} steps for the "
            "parity curve",
            "fp32",
            cand.batch_size,
            m.throughput,
            m.low,
            m.high,
            len(result.losses),
        )
        self._save()
        self._settle()  # confirmed here, not inside the first trial (a short budget: not at all)
        return self.record

    def _open(self, cand: Candidate, picks: Sequence[Candidate]) -> ProbeResult | None:
        """The opening pair: a pick beside the reference in most of what is left, its arms past
        fp16's overflow horizon where it is fp16, kept in ``ctx.found.openings``: the first
        pick's, and the next one's where a pick's arm stopped early (diverged, or out of memory)
        and another pair fits. The last pair's reference arm, or None where that arm did not
        complete (the reference then runs alone)."""
        ctx = self.ctx
        for i, pick in enumerate(picks):
            paired, timeout = self._pair(cand, pick)
            ctx.found.openings.append(paired)
            arm, failed = paired.reference, paired.candidate
            if not arm.ok and arm.timed_out:
                # Stopped at its hard limit: two arms' set-up did not fit in what a short
                # budget left, or a build or a step hangs. The reference alone tells which (a
                # hang raises there); neither arm stands for a trial.
                logger.info("the opening pair did not finish within its {:.0f}s: measuring the "
                            "reference alone", timeout)  # fmt: skip
                ctx.found.openings.remove(paired)
                self._unmeasured = (
                    f"the opening pair, the fp32 reference beside {pick.precision}, was stopped "
                    f"at its hard limit of {timeout:.0f}s: its two set-ups did not fit, or a "
                    f"build or a step hangs (autotune probe --workload {ctx.workload} --device "
                    f"{ctx.device} tells which)"
                )
                return None
            # The next pair fits where its time limit covers what this one's set-ups took and
            # the reference's floor of pairs after them.
            need = max(failed.wall_seconds, arm.wall_seconds) + REFERENCE_FLOOR
            early = not failed.ok and not failed.timed_out
            if not early or i + 1 == len(picks) or self._limit() < need:
                break
            logger.info("the opening pick stopped early ({}): pairing the next one, {} bs={}",
                        failed.reason, picks[i + 1].precision, picks[i + 1].batch_size)  # fmt: skip
        probe = ctx.spec.probe
        short = len(arm.losses) < probe.warmup_steps + probe.steps
        # No timed block: its figure is its warm-up's (first-use costs), not a step's.
        untimed = not arm.blocks
        if not arm.ok or arm.throughput <= 0 or untimed or (short and ctx.budget.left() > _ALONE):
            # Stopped early (its candidate diverged or ran out of memory): too short a curve,
            # where a run alone still fits.
            logger.info("the opening pair's reference arm ran {} steps: measuring the reference "
                        "alone", len(arm.losses))  # fmt: skip
            return None
        return arm

    def _limit(self) -> float:
        """An opening pair's time limit: most of what is left, a second kept for its end."""
        return max(1.0, _OPENING_SHARE * (self.ctx.budget.left() - WRITE_RESERVE) - 1.0)

    def _pair(self, cand: Candidate, opening: Candidate) -> tuple[PairedResult, float]:
        """``opening`` paired with the reference ``cand`` in most of what is left; the pair and
        its hard limit."""
        ctx, probe = self.ctx, self.ctx.spec.probe
        # fp16's arms run past its overflow horizon, the candidate's last steps alone where the
        # time left is what they need.
        alone = ctx.spec.validation.fp16_steps if opening.precision == "fp16" else 0
        left = ctx.budget.left() - WRITE_RESERVE
        share = _OPENING_SHARE * left
        settings = probe.model_copy(
            update={
                "steps": max(ctx.spec.validation.steps, alone),
                "alone_steps": alone,
                "time_limit": self._limit(),
                "min_time": ctx.default_min_time,
                "precision": 0.01,
            }
        )
        # Stopped at the budget's end at the latest (a second for the worker to stop).
        timeout = min(share + ctx.hard_grace(), left - 1.0)
        paired = ctx.run_compare(opening, cand, settings, timeout=timeout)
        logger.info("opening pair, the reference beside the opening pick: {}", paired.summary())
        return paired, timeout

    def refresh_after(self) -> float:
        """Seconds a measurement stays fresh: a few typical trials, shorter after drift."""
        typical = self.ctx.typical_probe(default=_REFRESH_MIN)
        seconds = min(_REFRESH_MAX, max(_REFRESH_MIN, _REFRESH_TRIALS * typical))
        return max(_REFRESH_MIN, seconds / 2) if self.drifted else seconds

    def current(self) -> ReferenceMeasurement:
        """The latest measurement, re-measured first when it is stale, and measured again until
        two in a row agree (no measurement is trusted alone)."""
        assert self.record is not None, "establish() first"
        latest = self.record.latest()
        if latest is None or clock.wall() - latest.at > self.refresh_after():
            self.measure()
        return self._settle()

    def _settle(self) -> ReferenceMeasurement:
        """Measure again until the last two measurements agree (a few times at most)."""
        assert self.record is not None
        ms = self.record.measurements
        if len(ms) == 1 and self.ctx.budget.left() > max(
            SAFE_PLAN, _CONFIRM_RUNS * self._run_seconds
        ):
            # No measurement is trusted alone; a short budget's trials rank against the one
            # there is (validation's pairs measure the reference again beside each candidate):
            # where a confirmation, a first trial and one pair would not all fit.
            self.measure()
        for _ in range(_SETTLE_TRIES):
            if len(ms) < 2 or _agree(ms[-1], ms[-2]):
                break
            logger.info(
                "fp32 reference measured at {:,.1f} then {:,.1f} samples/s: more than {:g}x "
                "apart, so one of them ran in a warm-up or a neighbour's burst; measuring it again",
                ms[-2].throughput,
                ms[-1].throughput,
                _AGREE,
            )
            count = len(ms)
            self.measure()
            if len(ms) == count:
                break  # the re-measurement did not complete: keep what there is
        if len(ms) >= 2 and not _agree(ms[-1], ms[-2]):
            logger.warning(
                "fp32 reference does not settle ({} samples/s): using the latest",
                ", ".join(f"{m.throughput:,.1f}" for m in ms[-_SETTLE_TRIES - 1 :]),
            )
        latest = self.record.latest()
        assert latest is not None
        return latest

    def divisor(
        self, cand: Candidate, throughput: float, used: ReferenceMeasurement, *, same_work: bool
    ) -> ReferenceMeasurement:
        """The measurement a trial's throughput is divided by: ``used``, or — when the speedup
        it gives is none the device makes (:func:`implausible`) — the reference measured again
        (each measurement is challenged once; one a challenge confirmed is not challenged)."""
        assert self.record is not None
        why = implausible(self.record, cand, throughput / used.throughput, same_work=same_work)
        if why is None or used.at in self._vouched:
            return used
        self._vouched.add(used.at)
        logger.info(
            "{} bs={} over the fp32 reference measured at {:,.1f} samples/s: {}; measuring the "
            "reference again before dividing by it",
            cand.precision,
            cand.batch_size,
            used.throughput,
            why,
        )
        self.measure()
        fresh = self._settle()
        if fresh is not used and _agree(fresh, used):
            self._vouched.add(fresh.at)  # measured twice, the same: the device is this way
        return fresh

    def name(self, m: ReferenceMeasurement) -> dict[str, object]:
        """How a trial names the measurement it divided by (under ``reference_measurement``)."""
        assert self.record is not None
        return {"key": self.key, "index": self.record.measurements.index(m)}

    def measure(self) -> ReferenceMeasurement:
        """Measure the reference's throughput again (a probe of ordinary length, not the long
        curve), with a fresh seed: its loss curve against the first run's is the seed's gap.

        A run that does not complete keeps the last measurement: the reference ran before, so
        a failure now is the machine's, not the reference's.
        """
        with self.ctx.clock(Phase.REMEASURES):
            return self._measure()

    def _measure(self) -> ReferenceMeasurement:
        assert self.record is not None
        ctx = self.ctx
        probe = ctx.spec.probe
        previous = self.record.latest()
        left = ctx.budget.left() - WRITE_RESERVE
        if left < 1.0 and previous is not None:
            # No time for a run within the budget: the last measurement stands.
            logger.info("fp32 reference: {:.1f}s left, too little to measure it again", left)
            return previous
        limit = max(1.0, min(probe.time_limit, left))
        min_time = probe.min_time if probe.min_time is not None else None
        # A fresh seed each time: the curve against the first run's is the seed-to-seed spread.
        seed = self.record.seed + len(self.record.measurements)
        update: dict[str, object] = {"time_limit": limit, "seed": seed}
        if min_time is None or min_time > 0:
            # Half a probe's timed phase (the device's default when the spec leaves it open).
            update["min_time"] = _REMEASURE_SHARE * (min_time or ctx.default_min_time)
        result = ctx.run_probe(self.record.candidate(), probe.model_copy(update=update))
        if not result.ok or result.throughput <= 0 or (result.truncated and not result.blocks):
            # One cut inside its warm-up timed its first-use costs, not a step.
            logger.warning("fp32 reference re-measurement {}: {}", result.outcome, result.reason)
            if previous is None:
                raise ReferenceUnavailable(result)
            return previous
        ref = self.record
        gap = parity_gap(result.losses, result.batch_size, ref.finite_losses, ref.batch_size)
        m = _measurement(result, seed_gap=gap[0] if gap is not None else None)
        if previous is not None:
            moved = m.throughput / previous.throughput - 1
            # Drift: the new figure lies outside the old interval and the old one outside the new.
            self.drifted = m.high < previous.low or m.low > previous.high
            if self.drifted:
                logger.info(
                    "fp32 reference drifted: {:,.1f} → {:,.1f} samples/s ({:+.0%}) in {:.0f}s; "
                    "re-measuring it more often",
                    previous.throughput,
                    m.throughput,
                    moved,
                    m.at - previous.at,
                )
        self.record.measurements.append(m)
        self._save()
        return m


def establish(
    ctx: SearchContext, refs: ReferenceKeeper, opening: Sequence[Candidate] = ()
) -> ReferenceRecord:
    """The fp32 reference, measured first: without it there is nothing to compare with."""
    try:
        with ctx.clock(Phase.REFERENCE):
            return refs.establish(opening)
    except ReferenceUnavailable as exc:
        # A drain, a cancel or a preemption stops the worker under the reference: that is
        # the operator's doing, not the workload's.
        ctx.stop_if_asked()
        raise DeviceError(
            f"study {ctx.spec.name!r}: {exc} at batch_size={ctx.space.base_batch}; the search "
            "needs it as the baseline — check the workload runs in fp32 on "
            f"{ctx.device} (autotune probe --workload {ctx.workload} --device "
            f"{ctx.device})"
        ) from None
