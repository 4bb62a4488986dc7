"""How long validation's runs take, from the search's own measurements: a pair, an fp16 run to
its overflow horizon, a compiled candidate's compiling again."""

from __future__ import annotations

from optuna.trial import FrozenTrial

from autotune.measure.result import PairedResult
from autotune.measure.stats import MIN_VALUES
from autotune.search._context import SearchContext
from autotune.search._risk import steps_run
from autotune.study.trials import candidate, is_feasible, record

__all__ = [
    "ENDURANCE_SHARE",
    "LONGER",
    "alone_seconds",
    "compiling",
    "endurance_seconds",
    "in_pair_seconds",
    "least_pair",
    "opened",
    "opening_of",
    "per_pair",
    "proof_seconds",
    "rerun_need",
    "setup_seconds",
    "six_pairs",
    "weight",
]

# How many times longer than a pair of a feasible trial a pair of one judged off parity at the
# probe's horizon measures (its share of validation's time, and so its horizon).
LONGER = 4


def weight(trial: FrozenTrial) -> int:
    """A shortlisted trial's shares of validation's time: ``LONGER`` for one judged off parity
    at the probe's horizon (a lag fades over its first steps), else one."""
    return 1 if is_feasible(trial) else LONGER


def least_pair(ctx: SearchContext) -> float:
    """Seconds the shortest pair that gives an interval takes, before its candidate is known:
    both arms' set-up, as the search's probes paid it, and six short pairs, with room."""
    return 1.15 * 2 * ctx.least_probe() + 1.0


def per_pair(ctx: SearchContext) -> float:
    """Seconds a pair takes: both arms, each about as long as a probe scaled to validation's
    longer horizon."""
    val, probe = ctx.spec.validation, ctx.spec.probe
    ratio = max(1.0, (probe.warmup_steps + val.steps) / (probe.warmup_steps + probe.steps))
    return 2.5 * ratio * ctx.typical_probe(default=0.0) + 1.0


def opening_of(ctx: SearchContext, trial: FrozenTrial) -> PairedResult | None:
    """``trial``'s opening pair (its first validation pair, measured before any trial), where
    the search opened with one for its candidate and no rerun took it yet."""
    pairs = [p for p in ctx.found.openings if p.ok]
    if not pairs or "precision" not in trial.params:
        return None
    cand = candidate(trial)
    return next((p for p in pairs if p.candidate.candidate == cand), None)


def opened(ctx: SearchContext, trial: FrozenTrial) -> bool:
    """Is ``trial``'s first validation pair one of the search's opening pairs, still untaken?"""
    return opening_of(ctx, trial) is not None


def rerun_need(ctx: SearchContext, trial: FrozenTrial, horizon: int) -> float:
    """Seconds a trial's validation needs: its pair (by its weight, and at least what six
    pairs take at its measured step times), fp16's run alone to ``horizon`` steps, and a
    compiled candidate's compiling again; for the opening pair's candidate (its pair paid
    already), fp16's run alone only."""
    if opened(ctx, trial):
        return proof_seconds(ctx, trial, horizon)
    pair = max(per_pair(ctx), six_pairs(ctx, trial)) * weight(trial)
    seconds = compiling(trial)
    # A compiled one also needs a second to spare: its pair is measured only where its share
    # covers compiling and six pairs (below that, the time goes to the next candidate).
    proof = proof_seconds(ctx, trial, horizon)
    return pair + (seconds + 1.0 if seconds else 0.0) + proof


def compiling(trial: FrozenTrial) -> float:
    """Seconds a compiled trial's compiling took in the search (0 for one not compiled)."""
    return (record(trial).compile_seconds or 0.0) if trial.params.get("compile") else 0.0


# An fp16 run alone to its overflow horizon takes at most this share of the budget (one that
# needs more is not validated: its verdict would fall short of the horizon).
ENDURANCE_SHARE = 0.2


def endurance_seconds(
    ctx: SearchContext, trial: FrozenTrial, horizon: int, *, capped: bool = True, ran: int = 0
) -> float:
    """Seconds an fp16 trial's run alone to ``horizon`` steps takes, from its measured
    throughput, at most :data:`ENDURANCE_SHARE` of the budget unless not ``capped`` (0 for
    another mode, or one that ran that long already: in the search, or ``ran`` steps in
    validation)."""
    steps = alone_seconds(ctx, trial, horizon, ran)
    if not steps:
        return 0.0
    # Its own build and first step come on top of its steps (and their half second to spare).
    seconds = steps + setup_seconds(trial) + 0.5
    return min(seconds, ENDURANCE_SHARE * ctx.budget.total) if capped else seconds


def in_pair_seconds(ctx: SearchContext, trial: FrozenTrial, horizon: int) -> float:
    """Seconds a pair of an fp16 trial takes beyond its least when both its arms run to
    ``horizon`` steps: fp16's verdict from the pair itself, without a run alone (whose build and
    first step come on top); 0 where none is needed or the steps' times are unknown."""
    rec = record(trial)
    if not endurance_seconds(ctx, trial, horizon) or not rec.reference_throughput:
        return 0.0
    step = trial.params.get("batch_size", 1) / rec.throughput
    ref_step = ctx.space.base_batch / rec.reference_throughput
    return 1.15 * horizon * (step + ref_step)


def proof_seconds(ctx: SearchContext, trial: FrozenTrial, horizon: int) -> float:
    """Seconds fp16's verdict to ``horizon`` steps adds to a trial's pair, as validation's
    shares count it: its arms run that far, or a run alone after it, whichever is shorter (0
    for another mode). Its pair needs no more than :func:`alone_seconds` at the least."""
    alone = endurance_seconds(ctx, trial, horizon, capped=False)
    along = in_pair_seconds(ctx, trial, horizon)
    return min(alone, along) if along else alone


def alone_seconds(ctx: SearchContext, trial: FrozenTrial, horizon: int, ran: int = 0) -> float:
    """The least fp16's verdict to ``horizon`` steps adds to a trial's pair: its candidate's
    steps run on alone after the pairs, at its measured step time, with a fifth to spare (0
    for another mode, or one that ran that far already: in the search, or ``ran`` steps in
    validation)."""
    rec = record(trial)
    if trial.params.get("precision") != "fp16" or max(ran, steps_run(trial)) >= horizon:
        return 0.0
    if not rec.throughput:
        return 0.0
    step = trial.params.get("batch_size", 1) / rec.throughput
    return 1.2 * horizon * step + 0.5


def setup_seconds(trial: FrozenTrial) -> float:
    """Seconds a run of ``trial``'s settings spends before its steps (building the model and
    its data, a first step's first-use costs; compiling apart), from its probe in the search."""
    rec = record(trial)
    if not rec.throughput or rec.probe_seconds is None:
        return 0.0
    steps = steps_run(trial) * trial.params.get("batch_size", 1) / rec.throughput
    return max(0.0, rec.probe_seconds - steps - compiling(trial))


def six_pairs(ctx: SearchContext, trial: FrozenTrial) -> float:
    """Seconds a paired rerun of ``trial`` needs at the least to measure the pairs a 95%
    interval needs: each arm's set-up and warm-up (its warm-up steps, its first step, a
    settling step) and six pairs of one-step blocks, at the steps' times the search measured,
    with 15% and half a second to spare; 0 when they are unknown. Slow steps need more than a probe's time scaled."""
    rec = record(trial)
    if not rec.throughput or not rec.reference_throughput:
        return 0.0
    step = trial.params.get("batch_size", ctx.space.base_batch) / rec.throughput
    ref_step = ctx.space.base_batch / rec.reference_throughput
    steps = ctx.spec.probe.warmup_steps + 2 + MIN_VALUES
    # Both arms are set up before their steps; the reference's set-up is taken as like its.
    return 1.15 * (steps * (step + ref_step) + 2 * setup_seconds(trial)) + 0.5
