"""The shortlist validation measures: the leaders, a standby, and what failures rule out."""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import cast

from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import clearly_off
from autotune.measure.stats import claimable
from autotune.search._context import SearchContext
from autotune.search._risk import carries_risk, overflow_step, settings_key, unproven
from autotune.search._validation_time import opened
from autotune.study.reference import ReferenceRecord
from autotune.study.store import StudyStore
from autotune.study.trials import candidate, constraints, feasible_trials, is_feasible, record

__all__ = [
    "CLOSE",
    "candidates",
    "eligible",
    "safe_standby",
    "shortlist",
    "slower_bar",
]


def shortlist(  # noqa: PLR0913 - the shortlist's rules, keyword-only
    trials: Iterable[FrozenTrial],
    *,
    top_k: int,
    min_speedup: float,
    parity_tolerance: float,
    maximize: bool = True,
    parity_allowance: float | None = None,
    reference_batch: int | None = None,
    ruled_out: Container[FrozenTrial] = (),
    overflow: int | None = None,
) -> list[FrozenTrial]:
    """The trials worth validating, best first.

    Feasible, measured (not copied from a twin) trials whose search speedup reaches
    ``min_speedup`` (a candidate that does not even look faster is not worth validating),
    ranked by their objective; the first ``top_k``, plus the fastest feasible one when none of
    those is (see below), plus the fastest one with a clear parity margin (half the tolerance)
    when none of those has one: the fastest candidates often sit at the edge of the tolerance,
    where a fresh seed can tip them over.

    With ``parity_allowance`` (when maximizing), a trial that failed only parity, by a gap
    within it, competes too: it was judged early in the search, against the seed-to-seed spread
    known then; validation measures its parity again, at a longer horizon.

    With ``reference_batch`` too, a trial at a larger batch may be off by up to the gap the
    search calls clearly off for its batch (:func:`~autotune.measure.parity.clearly_off`) plus
    the band: early in training it lags by more than any seed explains, a lag a full run
    erases. Validation's horizon is longer; its verdict stands.

    One batch at several init_scales is one candidate (the best of them stands for it), and
    what ``ruled_out`` holds (what a failed validation implies) is left out. An fp16 trial
    shorter than fp16's known ``overflow`` step may stand in the list but sets no standby.

    Example:
        >>> shortlist([], top_k=2, min_speedup=1.05, parity_tolerance=0.05)
        []
    """
    allowance = parity_allowance if maximize else None
    ranked = []
    for t in trials:
        speedup = record(t).speedup
        limit = allowance
        batch = t.params.get("batch_size", 0)
        if allowance is not None and reference_batch and batch > reference_batch:
            # The batch's clearly-off level (always above the tolerance), the band on top.
            lag = clearly_off(parity_tolerance, batch / reference_batch)
            limit = lag + allowance - parity_tolerance
        if speedup is None or speedup < min_speedup or not eligible(t, limit):
            continue
        if t in ruled_out:
            continue
        ranked.append(t)
    ranked.sort(key=_rank, reverse=maximize)
    seen: set[tuple] = set()
    unique = []
    for t in ranked:
        key = settings_key(t)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    best = unique[:top_k]
    if not any(is_feasible(t) for t in best):
        # Those judged off parity early may be refused again: the fastest feasible one stands by.
        standby = next(
            (t for t in unique[top_k:] if is_feasible(t) and not unproven(t, overflow)), None
        )
        if standby is not None:
            best.append(standby)

    def clear(t: FrozenTrial) -> bool:
        gap = record(t).parity_gap
        return is_feasible(t) and gap is not None and gap <= parity_tolerance / 2

    if not any(clear(t) for t in best):
        margin = next((t for t in unique[top_k:] if clear(t)), None)
        if margin is not None:
            best.append(margin)
    return best


def eligible(trial: FrozenTrial, parity_allowance: float | None) -> bool:
    """May ``trial`` be shortlisted: feasible, or off only by its parity gap, within the
    allowance? A twin's copied measurement never is."""
    if feasible_trials([trial]):
        return True
    rec = record(trial)
    if parity_allowance is None or trial.state != TrialState.COMPLETE or rec.parity_gap is None:
        return False
    if rec.tuned_config or rec.duplicate_of is not None:
        return False
    failed = {name for name, value in constraints(trial).items() if value > 0}
    return failed == {"parity"} and rec.parity_gap <= parity_allowance


def _rank(trial: FrozenTrial) -> float:
    """A shortlisted trial's objective; a borderline one's speedup (its stored value is the
    worst there is)."""
    return cast(float, trial.value) if is_feasible(trial) else record(trial).speedup or 0.0


def safe_standby(  # noqa: PLR0913 - the standby's rules, keyword-only
    trials: Iterable[FrozenTrial],
    picked: list[FrozenTrial],
    *,
    min_speedup: float,
    ruled_out: Container[FrozenTrial] = (),
    parity_tolerance: float | None = None,
) -> FrozenTrial | None:
    """The candidate validation falls to when every leader is refused: the fastest feasible
    trial that carries neither risk a short probe cannot rule out (fp16's late overflow, a
    compile that must be paid again) nor, with ``parity_tolerance``, a parity gap past half of
    it (the fastest batches sit at the tolerance's edge, where validation's longer look may
    tip them over), when no leader is such a one already; None when there is none, or no need.

    Example:
        >>> safe_standby([], [], min_speedup=1.05) is None
        True
    """

    def safe(t: FrozenTrial) -> bool:
        gap = record(t).parity_gap
        clear = parity_tolerance is None or (gap is not None and gap <= parity_tolerance / 2)
        return not carries_risk(t.params) and clear

    if any(safe(t) for t in picked):
        return None
    keys = {settings_key(t) for t in picked}
    options = [
        t
        for t in feasible_trials(trials)
        if safe(t)
        and (record(t).speedup or 0.0) >= min_speedup
        and settings_key(t) not in keys
        and t not in ruled_out
    ]
    return max(options, key=_rank, default=None)


def slower_bar(
    trials: Iterable[FrozenTrial], *, risky: bool, batch: int, parity_tolerance: float
) -> FrozenTrial | None:
    """The trial a probe is stopped as slower than: the best feasible trial no probe found off
    parity (one on the boundary would stop the safe ones below it), none above ``batch`` with
    a parity gap past half the tolerance (validation may refuse it; a smaller batch is its
    standby), none an fp16 trial shorter than fp16's known overflow (it may diverge); for a
    candidate not ``risky``, the best safe one (a risky bar may fail validation and leave no
    safe pick to fall back to)."""
    trials = list(trials)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    contested = {_curve_settings(t) for t in done if not is_feasible(t)}
    overflow = overflow_step(t for t in trials if t.state == TrialState.PRUNED)
    bars = [
        t
        for t in feasible_trials(done)
        if _curve_settings(t) not in contested
        and not unproven(t, overflow)
        and (risky or not carries_risk(t.params))
        and (
            t.params.get("batch_size", 0) <= batch
            or (record(t).parity_gap or 0.0) <= parity_tolerance / 2
        )
    ]
    return max(bars, key=lambda t: cast(float, t.value)) if bars else None


def _curve_settings(trial: FrozenTrial) -> tuple[object, ...]:
    """What decides a trial's loss curve, apart from the seed: precision, batch and lr (the
    GradScaler's init_scale only shifts its first steps)."""
    p = trial.params
    return (p.get("precision"), p.get("batch_size"), p.get("lr_multiplier"))


# A close runner: a trial the search measured at least this fast against the reference, short
# of ``min_speedup``. Where the search ends with nothing clearly faster and time left, these
# are validated with it (validation's bar stays ``min_speedup``'s lower bound): a fast model's
# probe can read a real win as none (the Hugging Face example's fp32 at twice the batch, 1.04x
# in the search and 1.31x in full, with 69 s of 90 s unspent).
CLOSE = 1.0


def _shortlist(
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord | None,
    ruled_out: Container[FrozenTrial] = (),
    least: float | None = None,
) -> list[FrozenTrial]:
    """The study's shortlist, with the parity allowance the reference's repeats give now;
    ``least``: the search speedup a trial must reach (by default what a claim's lower bound
    needs to clear ``min_speedup``, :func:`claimable`)."""
    tol = ctx.spec.parity_tolerance
    noise = reference.seed_noise(tol) if reference is not None else 0.0
    trials = store.trials((TrialState.COMPLETE,))
    if reference is not None:
        # (The reference's own settings: fp32 against itself.)
        trials = [t for t in trials if not _is_reference(t, reference)]
    return shortlist(
        trials,
        top_k=ctx.spec.validation.top_k,
        min_speedup=claimable(ctx.spec.validation.min_speedup) if least is None else least,
        parity_tolerance=tol,
        maximize=ctx.maximize,
        parity_allowance=tol + noise if reference is not None else None,
        reference_batch=reference.batch_size if reference is not None else None,
        ruled_out=ruled_out,
        overflow=overflow_step(store.trials((TrialState.PRUNED,))),
    )


def _is_reference(trial: FrozenTrial, reference: ReferenceRecord) -> bool:
    try:
        ran = candidate(trial)
    except ValueError:
        return False
    return ran.model_copy(update={"init_scale": reference.candidate().init_scale}) == (
        reference.candidate()
    )


def candidates(
    ctx: SearchContext,
    store: StudyStore,
    reference: ReferenceRecord | None,
    ruled_out: Container[FrozenTrial] = (),
    *,
    close: bool = False,
) -> tuple[list[FrozenTrial], FrozenTrial | None]:
    """What validation measures next: the shortlist, and its safe standby (or None);
    ``close``: the close runners (see :data:`CLOSE`), no standby."""
    if close:
        return _shortlist(ctx, store, reference, ruled_out, least=CLOSE), None
    picked = _shortlist(ctx, store, reference, ruled_out)
    if not picked or not ctx.maximize:
        return picked, None
    done = store.trials((TrialState.COMPLETE,))
    min_speedup = ctx.spec.validation.min_speedup
    standby = safe_standby(
        done,
        picked,
        min_speedup=claimable(min_speedup),
        ruled_out=ruled_out,
        parity_tolerance=ctx.spec.parity_tolerance,
    )
    # An opening pair's pick costs validation nothing: the standby, where it is the faster.
    for first in (t for t in done if opened(ctx, t) and t not in picked):
        if first in ruled_out or not is_feasible(first):
            continue
        speed = record(first).speedup or 0.0
        if speed >= min_speedup and (standby is None or speed >= (record(standby).speedup or 0)):
            standby = first
    return picked, standby
