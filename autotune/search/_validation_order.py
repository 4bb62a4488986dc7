"""Which candidate a validation round measures first where its time holds only one of them."""

from __future__ import annotations

from collections.abc import Callable

from loguru import logger
from optuna.trial import FrozenTrial

from autotune.search._context import SearchContext
from autotune.search._rerun import least_seconds
from autotune.search._validation_time import (
    ENDURANCE_SHARE,
    alone_seconds,
    opened,
    proof_seconds,
)
from autotune.study.trials import is_feasible, record

__all__ = ["EDGE", "NEAR", "least_needed", "likelier_first"]

# A candidate with a clear parity margin goes before a leader at the tolerance's edge only
# where it runs at least this share of the leader's speed: it gives up at most a tenth where the
# leader would have passed, where an fp32 fallback gives up a third to two thirds.
NEAR = 0.9
# A leader is at the tolerance's edge where its search read is past this share of it (or it
# was read off parity). The generated family at 30% (500 x 20): at half the tolerance, as a
# clear margin is counted, the leaders read at 2.6-3.5% that pass (family0-0448, 0016) went
# second too, and the median fell 97.08% -> 97.03%; at 0.7 it stayed, and every landscape the
# turn saved (family0-0247, 0131, 0289, 0409: +167 points) still gained.
EDGE = 0.7


def least_needed(ctx: SearchContext, trial: FrozenTrial, horizon: int, spare: float = 1.0) -> float:
    """The least a candidate's validation takes: its least pair, ``spare`` times over (none for
    an opening pair's pick, whose pair is paid: accepted or not, it costs nothing more), and
    fp16's run to its horizon."""
    pair = 0.0 if opened(ctx, trial) else spare * least_seconds(ctx, trial)
    return pair + proof_seconds(ctx, trial, horizon)


def likelier_first(
    ctx: SearchContext,
    leaders: list[FrozenTrial],
    left: float,
    horizon_of: Callable[[FrozenTrial], int],
) -> list[FrozenTrial]:
    """A round's leaders, the second in the first's place where the ``left`` seconds hold the
    least of only one of the first two, the first's search read puts it at the tolerance's
    edge (past :data:`EDGE` of it, or off parity), the second's leaves a clear margin (within
    half of it), and the second runs at least :data:`NEAR` of the first's speed. Otherwise as
    given.

    Where only one fits, the one measured is the one shipped or nothing is: a leader read at
    the tolerance's edge is as likely refused as not (the generated family at 30% of its
    grids' time: fp16 at twice the base batch read +4.9% in the search, took all 26 s left,
    was refused at +4.6% with an upper bound of +5.8%, and fp16 at the base batch, 1.95x and
    +0.1%, was never measured: an fp32 fallback). The first waits for the next round, where
    it is measured with what the second leaves, if the second is refused: kept in this one,
    its least was kept from the second's share, and both fell short of six pairs. Not moved:
    an opening pair's pick (its pair is paid: it takes nothing from the second), and a leader
    whose fp16 run alone is past what a budget allows it (passed over in any case). (The
    standby needs no such turn: one at least as fast as ``min_speedup`` asks would be a
    leader, but for an opening pair's pick.)
    """
    if len(leaders) < 2 or not ctx.maximize:
        return leaders
    first, second = leaders[0], leaders[1]
    both = sum(least_needed(ctx, t, horizon_of(t)) for t in (first, second))
    if opened(ctx, first) or left >= both:
        return leaders
    if alone_seconds(ctx, first, horizon_of(first)) > ENDURANCE_SHARE * ctx.budget.total:
        return leaders
    tol = ctx.spec.parity_tolerance
    read, margin = record(first).parity_gap, record(second).parity_gap
    edge = not is_feasible(first) or read is None or read > EDGE * tol
    clear = is_feasible(second) and margin is not None and margin <= tol / 2
    fast, near = record(first).speedup or 0.0, record(second).speedup or 0.0
    if not (edge and clear and near >= NEAR * fast):
        return leaders
    logger.info(
        "validation: the {:.0f}s left hold one candidate's least; trial {} ({:.2f}x, parity "
        "{:+.1%} in the search) goes in the place of trial {} ({:.2f}x, {}), the likelier "
        "accepted; that one waits for what it leaves",
        left, second.number, near, margin, first.number, fast,
        f"parity {read:+.1%}" if read is not None and is_feasible(first) else "off parity",
    )  # fmt: skip
    return [second, *leaders[2:]]
