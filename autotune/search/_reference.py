"""The fp32 reference: measured first (long enough for the parity curve), then again as the
search goes, so every trial's speedup divides by a reference measured close to it in time.

A reference measured once, cold, at the start is no baseline for a trial an hour later on a
shared machine: the neighbour's job that started meanwhile slows the trial, not the reference.
So the keeper re-measures the reference whenever its last measurement is older than a few
typical trials, and sooner after it saw the reference move (drift).
"""

from __future__ import annotations

import socket

import optuna
from loguru import logger

from autotune import clock
from autotune.reference import ReferenceMeasurement, ReferenceRecord, reference_key
from autotune.result import ProbeResult
from autotune.search._context import SearchContext
from autotune.search._events import PhaseStarted
from autotune.search._space import reference_factor

__all__ = ["ReferenceKeeper", "ReferenceUnavailable"]

# The long first run takes at most this share of the budget ...
_CURVE_SHARE = 0.15
# ... and at least this many seconds (or the probe's own time limit, if shorter).
_REFERENCE_FLOOR = 3.0
# Re-measure when the last measurement is older than this many typical trials ...
_REFRESH_TRIALS = 8
# ... but never more often than this (seconds), and at least this often.
_REFRESH_MIN = 15.0
_REFRESH_MAX = 120.0
# A re-measurement is shorter than a probe: it needs a throughput, not a loss curve.
_REMEASURE_SHARE = 0.5


class ReferenceUnavailable(Exception):
    """The reference could not be measured (it diverged, ran out of memory or crashed)."""

    def __init__(self, result: ProbeResult) -> None:
        super().__init__(f"the fp32 reference {result.outcome}: {result.reason}")
        self.result = result


def _measurement(result: ProbeResult) -> ReferenceMeasurement:
    return ReferenceMeasurement(
        at=clock.wall(),
        throughput=result.throughput,
        low=result.throughput_low or result.throughput,
        high=result.throughput_high or result.throughput,
        blocks=len(result.blocks),
        spread=result.spread or 0.0,
    )


class ReferenceKeeper:
    """Keeps one machine-and-device's fp32 reference fresh, in the study's storage."""

    def __init__(self, ctx: SearchContext, study: optuna.Study) -> None:
        self.ctx = ctx
        self.study = study
        self.key = reference_key(socket.gethostname(), ctx.device)
        stored = study.user_attrs.get(self.key)
        self.record: ReferenceRecord | None = None
        if isinstance(stored, dict):
            try:
                self.record = ReferenceRecord.model_validate(stored)
            except ValueError:
                self.record = None
        self.drifted = False

    def _save(self) -> None:
        if self.record is not None:
            self.study.set_user_attr(self.key, self.record.model_dump(mode="json"))

    def establish(self) -> ReferenceRecord:
        """The reference with its loss curve: the long first run, or the stored one measured
        again now (a resumed run, or another worker on this machine).

        Raises:
            ReferenceUnavailable: the reference run did not complete.
        """
        ctx = self.ctx
        ctx.emit(PhaseStarted(phase="reference"))
        cand = ctx.space.candidate("fp32", ctx.space.base_batch)
        if (
            self.record is not None
            and self.record.losses
            and self.record.batch_size == cand.batch_size
        ):
            self.measure()
            return self.record
        # Parity compares at equal samples seen: the reference must have seen as many samples as
        # a probe of the largest batch size does.
        factor = reference_factor(max(ctx.space.ladder), cand.batch_size)
        probe = ctx.spec.probe
        # Without the reference nothing can be compared: it gets its floor even when the
        # budget is nearly spent (the search then ends with it as the config).
        floor = min(probe.time_limit, _REFERENCE_FLOOR)
        limit = max(
            floor,
            min(probe.time_limit * factor, _CURVE_SHARE * ctx.budget.total, ctx.budget.left()),
        )
        settings = probe.model_copy(update={"steps": probe.steps * factor, "time_limit": limit})
        result = ctx.run_probe(cand, settings, floor=True)
        if result.ok and result.truncated and not result.blocks:
            # Cut inside its warm-up: on a busy machine a fresh worker's first-use costs alone
            # can outlast the limit, leaving a curve of a step or two. Once more, warm.
            logger.info(
                "fp32 reference stopped inside its warm-up after {} steps: measuring it again",
                len(result.losses),
            )
            result = ctx.run_probe(cand, settings, floor=True)
        if not result.ok:
            raise ReferenceUnavailable(result)
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
        return self.record

    def refresh_after(self) -> float:
        """Seconds a measurement stays fresh: a few typical trials, shorter after drift."""
        typical = self.ctx.typical_probe(default=_REFRESH_MIN)
        seconds = min(_REFRESH_MAX, max(_REFRESH_MIN, _REFRESH_TRIALS * typical))
        return max(_REFRESH_MIN, seconds / 2) if self.drifted else seconds

    def current(self) -> ReferenceMeasurement:
        """The latest measurement, re-measured first when it is stale."""
        assert self.record is not None, "establish() first"
        latest = self.record.latest()
        if latest is None or clock.wall() - latest.at > self.refresh_after():
            return self.measure()
        return latest

    def measure(self) -> ReferenceMeasurement:
        """Measure the reference's throughput again (no curve: a probe of ordinary length).

        A run that does not complete keeps the last measurement: the reference ran before, so
        a failure now is the machine's, not the reference's.
        """
        with self.ctx.clock("re-measures"):
            return self._measure()

    def _measure(self) -> ReferenceMeasurement:
        assert self.record is not None
        ctx = self.ctx
        probe = ctx.spec.probe
        limit = max(1.0, min(probe.time_limit, ctx.budget.left()))
        min_time = probe.min_time if probe.min_time is not None else None
        update: dict[str, object] = {"time_limit": limit}
        if min_time is None or min_time > 0:
            # Half a probe's timed phase (the device's default when the spec leaves it open).
            update["min_time"] = _REMEASURE_SHARE * (min_time or ctx.default_min_time)
        result = ctx.run_probe(self.record.candidate(), probe.model_copy(update=update), floor=True)
        previous = self.record.latest()
        if not result.ok or result.throughput <= 0:
            logger.warning("fp32 reference re-measurement {}: {}", result.outcome, result.reason)
            if previous is None:
                raise ReferenceUnavailable(result)
            return previous
        m = _measurement(result)
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
