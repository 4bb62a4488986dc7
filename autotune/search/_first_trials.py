"""The informed first trials, before the sampler's own: each mode at the reference's settings,
then the fastest mode's larger batches first, then the batches between."""

from __future__ import annotations

import math
from collections.abc import Callable

from optuna.trial import FrozenTrial, TrialState

from autotune.schema.enums import Outcome, Role
from autotune.schema.spec import Candidate
from autotune.search._ceiling_moves import scaled_ceiling, time_limited
from autotune.search._context import SearchContext
from autotune.search._shortlist import eligible
from autotune.study.reference import ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.trials import TrialRecord, record

__all__ = [
    "enqueue_base_trials",
    "enqueue_between",
    "enqueue_larger_batches",
    "opening_picks",
    "safe_pick",
]


_WAVE_ONE = ("bf16", "fp16", "tf32")


def safe_pick(ctx: SearchContext, modes: list[str]) -> Candidate | None:
    """The safe rule's pick among ``modes``: bf16 at the base batch, else the AMP recipe."""
    mode = next((m for m in _WAVE_ONE[:2] if m in modes), None)
    return ctx.space.candidate(mode, ctx.space.base_batch) if mode else None


def opening_picks(ctx: SearchContext, modes: list[str]) -> list[Candidate]:
    """A short budget's opening picks, in order: bf16 at the ladder's next batch above the
    base (the lr by the workload's rule), then the safe rule's pick.

    One pair is what a short budget affords, and a larger batch is where its gain most often
    lies: where launches bind a small batch, every mode runs alike at the base batch. A pick
    that stops early (diverges at the rule's lr, or runs out of memory) leaves its time to the
    next, where its pair still fits. It opens so however little is left: where only one pair
    fits, a larger pick that diverges leaves no config, but the safe rule's pick alone there
    so often stops below ``min_speedup`` that the larger pick wins more (the generated family
    at 10% of its grids' time: median 88.3% -> 88.8% of the optimum, 22 fewer runs with no
    config, five landscapes lower). fp16 opens at the base batch: its verdict must run past
    its overflow horizon, and a larger batch's steps reach it later.
    """
    pick = safe_pick(ctx, modes)
    if pick is None:
        return []
    batch = min((b for b in ctx.space.ladder if b > pick.batch_size), default=None)
    if pick.precision != "bf16" or batch is None:
        return [pick]
    return [ctx.space.candidate(pick.precision, batch), pick]


def enqueue_base_trials(ctx: SearchContext, store: StudyStore, modes: list[str]) -> None:
    """Wave 1: each mode but fp32 (the reference itself) at the base batch; the safe rule's
    picks first (bf16, then the AMP recipe), so a short budget measures them, and the opening
    pairs' picks before all (their arms are those trials' probes)."""
    base = ctx.space.base_batch

    def role(mode: str) -> str:
        return Role.AMP_RECIPE if mode == "fp16" else Role.at_base(mode)

    # The opening pairs' candidates first, in their order: their arms stand for the first
    # trials asked.
    for pair in ctx.found.openings:
        c = pair.candidate.candidate
        at_base = TrialRecord(role=role(c.precision)) if c.batch_size == base else None
        store.enqueue(ctx.space.params(c.precision, c.batch_size), at_base, skip_if_exists=True)
    for mode in sorted(modes, key=lambda m: _WAVE_ONE.index(m) if m in _WAVE_ONE else 9):
        if mode != "fp32":
            rec = TrialRecord(role=role(mode))
            store.enqueue(ctx.space.params(mode, base), rec, skip_if_exists=True)


def enqueue_larger_batches(
    ctx: SearchContext, store: StudyStore, modes: list[str], reference: ReferenceRecord | None
) -> bool:
    """Wave 2, a mode at a time, each once nothing is left waiting: the mode fastest at the
    base batch first, its next batch above the base and its ceiling. A mode's trials may raise
    its ceiling (:func:`autotune.search._ceiling_moves.raise_ceiling`), whose new top is then tried
    before the next mode's batches. True once every mode was offered; False while one waits."""
    if store.trials((TrialState.WAITING,)):
        return False
    base = ctx.space.base_batch
    if ctx.found.wave_two is None:
        speed = _speed_at(store, base, reference)
        # A mode whose step at the base batch outlasted a probe's time limit, or whose warm
        # steps there ran at a fraction of the best's, has no larger batch worth a try (a CPU's
        # fp16 at 2x the batch was killed at its hard limit after the base batch's took 37 s).
        slow = {
            t.params.get("precision")
            for t in store.trials((TrialState.PRUNED,))
            if t.params.get("batch_size") == base and _stopped_warming_up(t)
        }
        offered = [m for m in modes if m in ctx.space.precisions and m not in slow]
        ctx.found.wave_two = sorted(offered, key=_order(speed))
    while ctx.found.wave_two:
        mode = ctx.found.wave_two.pop(0)
        batches = _above_base(ctx, mode)
        if not batches and time_limited(ctx, store, mode) and not _any_above(ctx, base):
            # The ceiling phase ran out of time at the base batch, every mode's: the mode's
            # peak there, scaled with the batch, may vouch for larger ones (scaled_ceiling);
            # where it does not, a try below it gives the mode a second peak, and the line
            # through the two may raise its ceiling (raise_ceiling), whose new top is tried
            # next. (A try below for a second peak cost a 35 s search the time its 2x batch,
            # which the first peak vouched for, needed: an fp32 fallback where fp16 ran 2x.)
            below = [b for b in ctx.space.ladder if b < base][-1:]
            batches = _above_base(ctx, mode) if scaled_ceiling(ctx, store, mode) else below
        for batch in batches:
            store.enqueue(ctx.space.params(mode, batch), skip_if_exists=True)
        if batches:
            return not ctx.found.wave_two
    return True


def _above_base(ctx: SearchContext, mode: str) -> list[int]:
    """What wave two tries of ``mode``: the ladder's next batch above the base and the mode's
    ceiling, where they lie above the base."""
    fitting = [b for b in ctx.space.ladder if b <= ctx.found.ceilings.get(mode, 0)]
    near = next((b for b in fitting if b > ctx.space.base_batch), None)
    top = max(fitting, default=None)
    return [b for b in dict.fromkeys((near, top)) if b is not None and b != ctx.space.base_batch]


def _any_above(ctx: SearchContext, base: int) -> bool:
    """Whether any mode's ceiling lies above the base batch: a larger batch to try as it is."""
    return any(c > base for c in ctx.found.ceilings.values())


def enqueue_between(ctx: SearchContext, store: StudyStore) -> None:
    """While nothing waits: the leader's mode at the ladder's batch halfway between the
    leader's batch and the largest one below it that the mode was tried at (the base batch
    where none was), and halfway to the smallest larger one it was tried at (which did not
    lead), lr by the rule; nothing where the two are neighbours on the ladder.

    Wave two jumps from the base batch's neighbour to the ceiling: throughput that peaks and
    falls (launches, then memory traffic) can put the fastest batch between them, and a
    leader at the ceiling whose parity gap validation's longer look refuses leaves the
    search with the smaller batch unless the one between was measured (on a generated
    landscape, fp16 at 512 ran 3.32x while validation refused 1024 at +3.9% and kept 256's
    1.97x)."""
    if not ctx.maximize or store.trials((TrialState.WAITING,)):
        return
    # The fastest that validation could take: feasible, or off only on parity (a larger
    # batch's gap at the probe's horizon; the batch between has less of it).
    done = [t for t in store.trials((TrialState.COMPLETE,)) if eligible(t, math.inf)]
    leader = max(done, key=lambda t: record(t).speedup or 0.0, default=None)
    if leader is None:
        return
    mode, batch = leader.params.get("precision"), leader.params.get("batch_size")
    if not isinstance(mode, str) or not isinstance(batch, int):
        return
    tried = {
        int(t.params["batch_size"]): rec.throughput or 0.0
        for t in store.trials()
        if t.params.get("precision") == mode
        and "batch_size" in t.params
        and (rec := record(t)).outcome != Outcome.ABOVE_CEILING
    }
    lower = max((b for b in tried if b < batch), default=ctx.space.base_batch)
    between = [b for b in ctx.space.ladder if lower < b < batch]
    # Where the batch below ran about as fast, the curve is flat between them: the one between
    # would run alike, and the one below is already measured.
    flat = tried.get(lower, 0.0) >= _TIE * (record(leader).throughput or 0.0)
    if between and not flat:
        middle = between[len(between) // 2]
        store.enqueue(ctx.space.params(mode, middle), skip_if_exists=True)
    # A larger batch measured and not leading (slower, or off parity): throughput that peaks
    # and falls, or a gap that grows with the batch, may put the best between the two (not
    # past one that diverged: the batch between carries its risk).
    measured = {
        int(t.params["batch_size"])
        for t in store.trials()
        if t.params.get("precision") == mode
        and record(t).outcome
        in (Outcome.COMPLETED, Outcome.INFEASIBLE, Outcome.SLOWER, Outcome.OFF_PARITY)
    }
    upper = min((b for b in tried if b > batch and b in measured), default=None)
    above = [b for b in ctx.space.ladder if upper is not None and batch < b < upper]
    if above:
        store.enqueue(ctx.space.params(mode, above[len(above) // 2]), skip_if_exists=True)


def _stopped_warming_up(trial: FrozenTrial) -> bool:
    """Stopped inside its warm-up for its steps' time: too slow for the time limit, or far
    slower than the best (no step was timed)."""
    rec = record(trial)
    slow = rec.outcome in (Outcome.TOO_SLOW, Outcome.SLOWER)
    return slow and not rec.blocks


# Among modes within a tenth of the fastest at the base batch (where launches bind, every mode
# runs alike there), the one whose per-sample cost is usually least comes first: 16-bit tensor
# cores, then tf32's, then fp32.
_TIE = 0.9
_PRIOR = ("fp16", "bf16", "tf32", "fp32")


def _order(speed: dict[str, float]) -> Callable[[str], tuple[int, float]]:
    best = max(speed.values(), default=0.0)

    def key(mode: str) -> tuple[int, float]:
        tp = speed.get(mode, 0.0)
        if best and tp >= _TIE * best:
            return 0, float(_PRIOR.index(mode) if mode in _PRIOR else len(_PRIOR))
        return 1, -tp

    return key


def _speed_at(store: StudyStore, batch: int, reference: ReferenceRecord | None) -> dict[str, float]:
    """Each mode's best throughput measured at ``batch`` (fp32's: the reference's)."""
    speed: dict[str, float] = {}
    latest = reference.latest() if reference is not None else None
    if latest is not None:
        speed["fp32"] = latest.throughput
    for t in store.trials((TrialState.COMPLETE, TrialState.PRUNED)):
        mode, tp = t.params.get("precision"), record(t).throughput
        if isinstance(mode, str) and t.params.get("batch_size") == batch and tp:
            speed[mode] = max(speed.get(mode, 0.0), tp)
    return speed
