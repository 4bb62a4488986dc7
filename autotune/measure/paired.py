"""A candidate and the fp32 reference side by side: their timed blocks interleaved in one
process, the speedup the median of the per-pair ratios."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from loguru import logger

from autotune.measure.knobs import compile_failure
from autotune.measure.memory import PeakMemory, memory_cap
from autotune.measure.precision import PrecisionMode, apply_backend_flags, get_mode, resolve_device
from autotune.measure.probe import leave_no_trace, unsupported_reason
from autotune.measure.result import PairedResult, ProbeResult
from autotune.measure.stats import claimed, ratio_estimate
from autotune.measure.step import StepEngine
from autotune.measure.timed import TimedRun
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, ProbeSettings, format_duration
from autotune.workloads import Workload

__all__ = ["interleave", "run_paired"]

# The ratio's interval needs this many pairs to mean anything.
_MIN_PAIRS = 6
# Seconds a paired run's callers keep after its time limit (validation's pairs and the opening
# pair end a second before their share): the last pair may end this far past the limit.
PAIR_SLACK = 1.0
_MAX_TIME_FACTOR = 4.0


def run_paired(
    workload: Workload,
    candidate: Candidate,
    reference: Candidate,
    device: str | torch.device = "cpu",
    settings: ProbeSettings | None = None,
) -> PairedResult:
    """Measure ``candidate`` and ``reference`` with their timed blocks interleaved.

    Args:
        workload: the workload both arms train.
        candidate: the arm whose speedup is measured.
        reference: the arm it is measured against (the fp32 reference).
        device: ``cpu``, ``cuda:N`` or ``auto``.
        settings: lengths (``steps`` is the candidate's horizon), precision, time limit, seed.

    Returns:
        A PairedResult: each arm's ProbeResult and the speedup with its interval (the
        candidate's with its peak memory). An arm that diverges, runs out of memory or is
        unsupported ends the run with that outcome.

    Raises:
        WorkloadError: the workload breaks its contract.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> fp32 = Candidate(precision="fp32", batch_size=32, learning_rate=0.05)
        >>> r = run_paired(tiny_mlp(), fp32, fp32, "cpu",
        ...                ProbeSettings(warmup_steps=1, steps=4, min_time=0.2, time_limit=20))
        >>> r.ok, r.pairs >= 6, r.speedup_low <= r.speedup <= r.speedup_high
        (True, True, True)
    """
    settings = settings or ProbeSettings()
    dev = resolve_device(device)
    started = time.perf_counter()
    bases = {
        name: {
            "candidate": cand,
            "workload": workload.reference or workload.name,
            "device": str(dev),
            "seed": settings.seed,
            "planned_steps": settings.steps,
            "batch_size": cand.batch_size,
        }
        for name, cand in (("candidate", candidate), ("reference", reference))
    }
    for name, cand in (("candidate", candidate), ("reference", reference)):
        why = unsupported_reason(cand, dev)
        if why is not None:
            other = "reference" if name == "candidate" else "candidate"
            return PairedResult(
                **{
                    name: ProbeResult(**bases[name], outcome=Outcome.UNSUPPORTED, reason=why),
                    other: ProbeResult(
                        **bases[other], outcome=Outcome.UNSUPPORTED, reason=f"the {name} arm: {why}"
                    ),
                }
            )
    with leave_no_trace():
        torch.set_grad_enabled(True)
        random.seed(settings.seed)
        # Cleared cache, reset peaks: the candidate's peak memory is its own.
        peak = PeakMemory(dev)
        peak.start()
        engines = {
            name: StepEngine(workload, cand, dev, seed=settings.seed)
            for name, cand in (("candidate", candidate), ("reference", reference))
        }
        with memory_cap(dev, getattr(settings, "memory_margin", None)):
            result = interleave(engines, settings, started, bases, peak=peak)
    result.candidate.wall_seconds = result.reference.wall_seconds = time.perf_counter() - started
    logger.debug("paired {}", result.summary())
    return result


def interleave(  # noqa: PLR0913 - a simulated device's seams (set_flags, seed, timer), keyword-only
    engines: dict[str, Any],
    settings: ProbeSettings,
    started: float,
    bases: dict[str, dict[str, Any]],
    *,
    set_flags: Callable[[PrecisionMode], Any] = apply_backend_flags,
    seed: Callable[[int], Any] = torch.manual_seed,
    timer: Callable[[], float] | None = None,
    peak: PeakMemory | None = None,
) -> PairedResult:
    """The paired policy over two engines (``candidate``, ``reference``): steps 1–4 above.

    A simulated device passes its own engines, a no-op ``set_flags`` and ``seed``, and its
    virtual clock as ``timer``: the same policy decides when a pair is enough. ``peak``,
    started before the engines build, gives the candidate's peak memory (read after its
    warm-up, before the reference arm is built); None leaves it out.
    """
    # The reference arm is timed by the pairs; its own steps floor is only what parity needs.
    ref_settings = settings.model_copy(update={"steps": 1})
    runs = {
        "candidate": TimedRun(engines["candidate"], settings, started, timer=timer),
        "reference": TimedRun(engines["reference"], ref_settings, started, timer=timer),
    }
    pair = _Pair(engines, runs, set_flags=set_flags, seed=seed)
    try:
        if pair.warm_up(settings, peak) and pair.alternate(settings) and pair.endure(settings):
            pair.catch_up(settings)
        # Before closing; and not while an error propagates (a CUDA error that ended the run
        # would fail the skip count's read too, and hide itself).
        fields = {name: runs[name].fields() for name in runs}
    finally:
        for engine in engines.values():
            engine.close()
    return pair.result(bases, fields)


class _Pair:
    """The two arms of :func:`interleave` and what ended either one: each step of the policy
    returns False once an arm has ended, and the pair stops there."""

    def __init__(
        self,
        engines: dict[str, Any],
        runs: dict[str, TimedRun],
        *,
        set_flags: Callable[[PrecisionMode], Any],
        seed: Callable[[int], Any],
    ) -> None:
        self.engines, self.runs = engines, runs
        self.set_flags, self.seed = set_flags, seed
        self.modes = {name: get_mode(engines[name].candidate.precision) for name in engines}
        self.ended: dict[str, tuple[Outcome, str]] = {}
        self.peaks: dict[str, Any] = {}

    def arm(self, name: str, action: Any) -> bool:
        """Run one arm's action under its own flags; an OOM or a failed compile ends the pair."""
        self.set_flags(self.modes[name])
        engine = self.engines[name]
        holder: list[bool] = []
        try:
            oom = engine.run(lambda e: holder.append(action()))
        except Exception as exc:
            failed = compile_failure(engine.candidate, exc)
            if failed is None:
                raise
            self.ended[name] = (Outcome.COMPILE_FAILED, failed)
            return False
        if oom is not None:
            bs = engine.candidate.batch_size
            self.ended[name] = (Outcome.OOM, f"out of memory at batch_size={bs}: {oom}")
            return False
        return bool(holder and holder[0])

    def warm_up(self, settings: ProbeSettings, peak: PeakMemory | None) -> bool:
        """1. Each arm warms up from the same seed; the candidate's peak memory is read while
        it is alone on the device."""
        for name in ("candidate", "reference"):
            # Same initial weights for both arms: the curves differ by their settings only.
            self.seed(settings.seed)
            if not self.arm(name, self.runs[name].warm_up):
                return False
            if name == "candidate" and peak is not None:
                # Alone on the device so far: its peak is its own.
                self.peaks["peak_memory_allocated"] = peak.allocated()
                self.peaks["peak_memory_reserved"] = peak.reserved()
        return True

    def alternate(self, settings: ProbeSettings) -> bool:
        """2. A block each, in turn, until the pairs are enough."""
        cand, ref = self.runs["candidate"], self.runs["reference"]
        # The candidate's compiling is charged to the budget, not to the pair's time limit.
        ref.started += cand.compile_shift
        # Both arms' blocks last about as long, so each pair sees the same stretch of time.
        min_time = cand.min_time
        last = 0.0
        while True:
            if _no_room(self.runs, settings, last):
                return False
            began = cand.timer()
            if not self.arm("candidate", cand.block):
                return False
            if not self.arm("reference", ref.block):
                return False
            last = cand.timer() - began
            if _enough(self.runs, settings, min_time):
                return True

    def catch_up(self, settings: ProbeSettings) -> None:
        """4. The reference runs on until it has seen the samples of the candidate's horizon
        (``steps`` steps, or all it ran if fewer): parity compares at equal samples seen."""
        c, r = self.runs["candidate"].engine, self.runs["reference"].engine
        horizon = min(c.steps, settings.warmup_steps + settings.steps) * c.candidate.batch_size
        while r.steps * r.candidate.batch_size < horizon:
            if not self.arm("reference", self.runs["reference"].block):
                return

    def endure(self, settings: ProbeSettings) -> bool:
        """3. The candidate runs on alone until it has taken ``alone_steps`` steps, within the
        time limit: fp16's overflow may start late, and its loss must stay finite that far.
        False once its loss did not."""
        run = self.runs["candidate"]
        truncated = run.truncated
        while run.engine.steps < settings.alone_steps and not run.over_time():
            steps = min(run.block_steps, settings.alone_steps - run.engine.steps)
            if not self.arm("candidate", partial(run.block, steps)):
                break
        # Its time limit reached while alone cuts the run short, not the pairs' measurement.
        run.truncated = truncated
        return run.outcome == Outcome.COMPLETED and "candidate" not in self.ended

    def result(
        self, bases: dict[str, dict[str, Any]], fields: dict[str, dict[str, Any]]
    ) -> PairedResult:
        """Both arms' ProbeResults, and the speedup when both completed."""
        if "candidate" not in self.ended:
            fields["candidate"].update(self.peaks)
        for name, (outcome, why) in self.ended.items():
            fields[name].update(outcome=outcome, reason=why, throughput=0.0)
        results = {name: ProbeResult(**bases[name], **fields[name]) for name in self.runs}
        out = PairedResult(candidate=results["candidate"], reference=results["reference"])
        rates_c = self.runs["candidate"].rates()
        pairs = min(len(rates_c), len(self.runs["reference"].rates()))
        est = ratio_estimate(rates_c[:pairs], self.runs["reference"].rates()[:pairs])
        if est is not None and out.candidate.ok and out.reference.ok:
            est = claimed(est)
            out.speedup, out.speedup_low, out.speedup_high = est.value, est.low, est.high
            out.pairs = est.n
        return out


def _alone_is_due(c: TimedRun, settings: ProbeSettings) -> bool:
    """Whether what is left of the time limit is what the candidate's steps alone to
    ``alone_steps`` take (at its timed step time, with a fifth to spare): the pairs stop there."""
    left = settings.alone_steps - c.engine.steps
    if left <= 0 or not c.timed_steps:
        return False
    step = c.timed_seconds / c.timed_steps
    return settings.time_limit - (c.timer() - c.started) <= 1.2 * left * step


def _no_room(runs: dict[str, TimedRun], settings: ProbeSettings, last: float) -> bool:
    """Whether the pairs stop here, as at the time limit: they have the least they need, and
    another pair, at the last one's time, would end more than ``PAIR_SLACK`` past the limit.
    A pair started anyway ran its blocks past what its caller keeps after the limit (a CPU's
    2.5 s blocks: a search ended at 180.1 s of a 180 s budget)."""
    c, r = runs["candidate"], runs["reference"]
    if last <= 0 or min(len(c.blocks), len(r.blocks)) < _MIN_PAIRS:
        return False
    if settings.time_limit + PAIR_SLACK - (c.timer() - c.started) >= last:
        return False
    logger.debug(
        "pair stopped short of its time limit of {}: another pair, {:.1f}s, would end past it",
        format_duration(settings.time_limit),
        last,
    )
    return True


def _enough(runs: dict[str, TimedRun], settings: ProbeSettings, min_time: float) -> bool:
    """The candidate measured what it must and the pairs' ratio is tight (or time is up)."""
    c, r = runs["candidate"], runs["reference"]
    pairs = min(len(c.blocks), len(r.blocks))
    if pairs >= _MIN_PAIRS and _alone_is_due(c, settings):
        return True  # the rest of the time is the candidate's steps alone
    if c.timed_steps < settings.steps:
        return False
    if min_time <= 0:
        return pairs >= 1
    if c.timed_seconds < min_time or pairs < _MIN_PAIRS:
        return False
    if c.timed_seconds >= _MAX_TIME_FACTOR * min_time:
        return True
    est = ratio_estimate(c.rates()[:pairs], r.rates()[:pairs])
    return est is not None and est.half_width <= settings.precision
