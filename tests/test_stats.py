"""Intervals on synthetic timings with known noise, and paired ratios under drift."""

from __future__ import annotations

import math
import random

import pytest

from autotune.measure.stats import (
    MIN_VALUES,
    Estimate,
    claimed,
    median_interval,
    min_values,
    paired_ratios,
    ratio_estimate,
    serial_interval,
    spread,
)


def test_the_median_interval_covers_the_true_median_about_as_often_as_it_says() -> None:
    rng = random.Random(1)
    true = 100.0
    hits = 0
    runs = 2000
    for _ in range(runs):
        # Lognormal block rates around 100 (median exactly 100), 10% noise, and now and then a
        # block slowed by a neighbour.
        values = [true * math.exp(rng.gauss(0, 0.1)) for _ in range(12)]
        values[rng.randrange(12)] *= 0.5
        est = median_interval(values)
        hits += est.low <= true <= est.high
    # 95% nominal; the order-statistic interval is conservative (about 96% at n=12).
    assert hits / runs > 0.93


def test_an_outlier_block_does_not_move_the_median_or_widen_its_interval_much() -> None:
    steady = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0, 100.2, 99.8]
    noisy = steady + [20.0]  # one block slowed five-fold by a neighbour
    a, b = median_interval(steady), median_interval(noisy)
    assert b.value == pytest.approx(a.value, rel=0.01)
    assert b.half_width < 0.05


@pytest.mark.parametrize("n", [1, 2, 5])
def test_few_values_give_the_whole_range_not_false_precision(n: int) -> None:
    values = [float(v) for v in range(10, 10 + n)]
    est = median_interval(values)
    assert (est.low, est.high, est.n) == (min(values), max(values), n)


def test_an_empty_list_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_paired_ratios_cancel_a_drift_that_sequential_runs_would_take_for_a_speedup() -> None:
    # The machine slows by 5% per block; the candidate (a) is truly 2x the reference (b).
    a, b = [], []
    for i in range(10):
        a.append(200.0 / (1 + 0.05 * (2 * i)))  # a runs first in each pair
        b.append(100.0 / (1 + 0.05 * (2 * i + 1)))
    est = ratio_estimate(a, b)
    assert est is not None and est.low <= 2.0 * 1.03 and est.high >= 2.0 * 0.97
    # Measured one after the other (all of a, then all of b), the drift would read as 2.5x+.
    sequential = (sum(a[:5]) / 5) / (sum(b[5:]) / 5)
    assert sequential > 2.4
    assert len(paired_ratios(a, b)) == 10


def test_spread_reads_quiet_and_busy_machines_apart() -> None:
    quiet = [100.0 + d for d in (0, 1, -1, 0.5, -0.5, 0.2, -0.2, 0.1)]
    busy = [100.0, 60.0, 110.0, 45.0, 100.0, 70.0, 105.0, 50.0]
    assert spread(quiet) < 0.02 < 0.3 < spread(busy)
    assert spread([1.0, 2.0]) == 0.0


def test_estimate_text_and_half_width() -> None:
    e = Estimate(1.93, 1.85, 2.01, 12)
    assert e.text(".2f", "x") == "1.93x (1.85x–2.01x)"
    assert e.half_width == pytest.approx(0.08 / 1.93)
    assert Estimate(0.0, 0.0, 0.0, 1).half_width == math.inf


@pytest.mark.parametrize("n", [2, 5])
def test_an_interval_from_fewer_than_six_values_says_it_is_not_a_95_percent_one(n: int) -> None:
    """Below six values the whole range is all there is, and it covers the median less than
    95% of the time (two values: half the time): the Estimate says so, and a claimed one too."""
    est = median_interval([1.2 + 0.05 * i for i in range(n)])
    assert est.too_few and claimed(est).too_few
    assert ratio_estimate([2.0] * n, [1.0] * n).too_few  # type: ignore[union-attr]
    assert not median_interval([1.2 + 0.05 * i for i in range(6)]).too_few
    assert min_values() == MIN_VALUES == 6


def test_an_arms_own_slow_wander_widens_the_paired_interval_to_cover_the_truth() -> None:
    """The candidate's clock wanders slowly (each block's noise 0.8 of the last's), which
    pairing does not cancel: neighbouring ratios move together, and an interval that took
    them for independent draws covered the true 3x in about 67% of runs. Read with its lag-1
    correlation it covers about as often as it says."""
    rng = random.Random(3)
    hits = independent = 0
    runs = 1000
    for _ in range(runs):
        x, cand, ref = 0.0, [], []
        for _ in range(24):
            x = 0.8 * x + 0.6 * rng.gauss(0, 0.06)
            cand.append(3.0 * math.exp(x))
            ref.append(math.exp(rng.gauss(0, 0.02)))
        est = ratio_estimate(cand, ref)
        assert est is not None
        hits += est.low <= 3.0 <= est.high
        iid = median_interval(paired_ratios(cand, ref))
        independent += iid.low <= 3.0 <= iid.high
    assert hits / runs > 0.93
    assert independent / runs < 0.8  # what the independent reading gave


def test_independent_values_keep_their_interval() -> None:
    rng = random.Random(5)
    values = [100 * math.exp(rng.gauss(0, 0.1)) for _ in range(40)]
    values.sort(key=lambda _: rng.random())
    serial, iid = serial_interval(values), median_interval(values)
    assert serial.value == iid.value
    assert iid.low - 5 <= serial.low <= iid.low and iid.high <= serial.high <= iid.high + 5
