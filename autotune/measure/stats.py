"""Small, distribution-free statistics for timings: medians with intervals from order statistics,
and paired speedups."""

from __future__ import annotations

import fractions
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "HOPELESS",
    "MIN_VALUES",
    "Estimate",
    "claimable",
    "median_interval",
    "min_values",
    "paired_ratios",
    "ratio_estimate",
    "serial_interval",
    "spread",
]

# Two-sided confidence of every interval autotune reports.
CONFIDENCE = 0.95


def min_values(confidence: float = CONFIDENCE) -> int:
    """The fewest values whose median has a distribution-free interval at ``confidence``.

    Even the whole range ``[x_(1), x_(n)]`` misses the median with probability ``2 · 0.5^n``
    (all values on one side of it), so a ``confidence`` interval needs ``2 · 0.5^n ≤
    1 - confidence``: 6 values at 95% (``2 · 0.5^6 ≈ 0.031``), while 5 cover only 93.75% and 2
    only 50%.

    Example:
        >>> min_values(), min_values(0.9)
        (6, 5)
    """
    # Exact, as in _lower_rank: 0.05 is not exact in binary.
    share = fractions.Fraction(1 - confidence).limit_denominator(10**9)
    n = 1
    while 2 * share.denominator > share.numerator * 2**n:
        n += 1
    return n


# The fewest values (block pairs, blocks) a 95% interval is claimed from.
MIN_VALUES = min_values()

# A rate under the best's divided by this is far slower than any neighbour's burst explains: a
# probe's slow warm step so stops it as slower, and the search tries that mode at no smaller
# batch (measure/timed.py, search/_risk.py).
HOPELESS = 4.0


@dataclass(frozen=True)
class Estimate:
    """A median with its confidence interval, from ``n`` samples.

    Example:
        >>> e = Estimate(100.0, 95.0, 104.0, 12)
        >>> round(e.half_width, 3), e.text()
        (0.045, '100 (95–104)')
    """

    value: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the value (0.05: ±5%)."""
        if self.value <= 0:
            return math.inf
        return (self.high - self.low) / 2 / self.value

    def text(self, fmt: str = ".3g", suffix: str = "") -> str:
        """``1.93x (1.85–2.01)``-style text."""
        return f"{self.value:{fmt}}{suffix} ({self.low:{fmt}}{suffix}–{self.high:{fmt}}{suffix})"

    @property
    def too_few(self) -> bool:
        """Whether the interval comes from fewer than :data:`MIN_VALUES` values: then it is
        only the range of what was measured, which does not cover the median 95% of the time
        (with 2 values, half of it), and must not be presented as a 95% interval."""
        return self.n < MIN_VALUES

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.value * factor, self.low * factor, self.high * factor, self.n)


@functools.lru_cache(maxsize=4096)
def _lower_rank(n: int, alpha: float) -> int:
    """The 0-based index of the lower order statistic of the median's interval: the largest
    ``l - 1`` with ``2 P(X ≤ l - 1) ≤ alpha`` for X ~ Binomial(n, 1/2), or 0 when none.

    One pass over the cumulative sum (a paired run asks after every block, with hundreds of
    pairs: recomputing each tail would cost the measurement its own time).
    """
    total = 2**n
    # Exact in integers: 2**n is past what a float holds once n passes about a thousand.
    share = fractions.Fraction(alpha).limit_denominator(10**9)
    cumulative = 0
    lo = 0
    for l in range(1, n // 2 + 1):  # noqa: E741 - l as in the order-statistic formula
        cumulative += math.comb(n, l - 1)
        # Coverage of [x_(l), x_(n+1-l)] is 1 - 2 P(X ≤ l-1).
        if 2 * cumulative * share.denominator <= share.numerator * total:
            lo = l - 1
        else:
            break
    return lo


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """The median of ``values`` and a distribution-free interval for it.

    The interval is ``[x_(l), x_(n+1-l)]`` for the largest ``l`` whose coverage is at least
    ``confidence``; with fewer than :func:`min_values` values (6 at 95%) no such ``l`` exists,
    and the interval is the whole range (as wide as the data can say, but narrower than a
    ``confidence`` interval would be): the Estimate's ``too_few`` says so, and a caller that
    claims the interval checks it.

    Raises:
        ValueError: ``values`` is empty.

    Example:
        >>> e = median_interval([10, 11, 9, 10, 12, 10, 50, 10, 9, 11])
        >>> e.value, e.low, e.high
        (10.0, 9.0, 12.0)
    """
    xs = sorted(values)
    if not xs:
        raise ValueError("median_interval needs at least one value, got none")
    return _around_median(xs, _lower_rank(len(xs), 1 - confidence))


def _around_median(xs: Sequence[float], lo: int) -> Estimate:
    """The median of sorted ``xs`` with ``lo`` values left out of its interval on each side."""
    n = len(xs)
    mid = n // 2
    median = float(xs[mid]) if n % 2 else (xs[mid - 1] + xs[mid]) / 2
    return Estimate(median, float(xs[lo]), float(xs[n - 1 - lo]), n)


def spread(values: Sequence[float]) -> float:
    """Relative spread of timings: the interquartile range over the median (0 when fewer than
    4 values). A quiet machine shows a few percent; a shared one under load, tens.

    Example:
        >>> spread([100, 101, 99, 100, 102, 98, 100, 100])
        0.01
    """
    xs = sorted(values)
    n = len(xs)
    if n < 4:
        return 0.0
    q1, q3 = xs[n // 4], xs[(3 * n) // 4]
    median = xs[n // 2]
    return (q3 - q1) / median if median else 0.0


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-pair ratios of interleaved measurements ``a1 b1 a2 b2 …`` (rates: higher is faster).

    Each ``a_i`` is divided by the geometric mean of the ``b`` blocks on either side of it
    (``b_{i-1}`` and ``b_i``), so a slow drift of the machine cancels out instead of favouring
    whichever arm ran later.

    Example:
        >>> [round(r, 3) for r in paired_ratios([2, 2, 2], [1, 1, 1])]
        [2.0, 2.0, 2.0]
    """
    n = min(len(a), len(b))
    out = []
    for i in range(n):
        ref = b[0] if i == 0 else math.sqrt(b[i - 1] * b[i])
        if ref > 0 and a[i] > 0:
            out.append(a[i] / ref)
    return out


def ratio_estimate(a: Sequence[float], b: Sequence[float]) -> Estimate | None:
    """The speedup of arm ``a`` over arm ``b`` from interleaved block rates, with its interval;
    None when no pair was measured. With fewer than :data:`MIN_VALUES` pairs the interval is
    only the ratios' range (``too_few``).

    Example:
        >>> e = ratio_estimate([200, 210, 190, 205, 198, 202], [100, 101, 99, 100, 102, 98])
        >>> round(e.value, 2)
        2.01
    """
    ratios = paired_ratios(a, b)
    return serial_interval(ratios) if ratios else None


# Below this many values a lag-1 correlation says too little to widen by.
_SERIAL_MIN = 8
# The most a serial correlation is taken to be (a wider figure is mostly noise of few values).
_SERIAL_MAX = 0.8


def serial_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """:func:`median_interval` for values in the order they ran, where neighbours move
    together (a neighbour's burst lasts several blocks, a device drifts): with a lag-1
    correlation ``rho`` of their logarithms above 0, the interval's ranks are those of
    ``n (1 - rho) / (1 + rho)`` independent values, as wide as so few would give.

    Example:
        >>> runs = [1.0, 1.0, 1.0, 1.1, 1.1, 1.1, 1.2, 1.2, 1.2, 1.1, 1.1, 1.1] * 2
        >>> e, iid = serial_interval(runs), median_interval(runs)
        >>> (e.low, e.high), (iid.low, iid.high)
        ((1.0, 1.2), (1.1, 1.1))
    """
    rho = _lag_one([math.log(v) for v in values if v > 0])
    if rho <= 0:
        return median_interval(values, confidence)
    xs = sorted(values)
    n = len(xs)
    n_eff = n * (1 - rho) / (1 + rho)
    excluded = int(_lower_rank(max(1, int(n_eff)), 1 - confidence) * n / n_eff)
    # Never narrower than independent values would give.
    return _around_median(xs, min(_lower_rank(n, 1 - confidence), excluded))


def _lag_one(xs: Sequence[float]) -> float:
    """The lag-1 correlation of ``xs`` (0 for fewer than :data:`_SERIAL_MIN`), at most
    :data:`_SERIAL_MAX`."""
    n = len(xs)
    if n < _SERIAL_MIN:
        return 0.0
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs)
    if var <= 0:
        return 0.0
    cov = sum((xs[i] - mean) * (xs[i + 1] - mean) for i in range(n - 1))
    return min(_SERIAL_MAX, cov / var)


# No speedup is claimed tighter than this (relative): between one run and the next a device's
# clocks, temperature and neighbours move a figure by a few percent, which no number of pairs
# inside one run can see. On the simulated devices (drift, bursts from a neighbour) a claim's
# truth lay up to 2.6% from its figure: at ±1% and ±2% a few claims in 1,800 searches missed
# it, at ±3% none (benchmarks/search_sim.py).
CLAIM_FLOOR = 0.03


def claimable(bar: float, floor: float = CLAIM_FLOOR) -> float:
    """The least figure whose claimed interval (:func:`claimed`, never tighter than ``floor``)
    can have its lower bound clear ``bar``: below it, no number of pairs helps. In the search,
    tf32 at 1.05x took 8 s of a 42 s budget's validation beside bf16 at 2x the batch, whose
    share then held 5 pairs of the 6 an interval needs: an fp32 fallback.

    Example:
        >>> round(claimable(1.05), 4)
        1.0815
    """
    return bar * (1 + floor)


def claimed(est: Estimate, floor: float = CLAIM_FLOOR) -> Estimate:
    """The interval a paired figure is claimed with: its own, at least ``±floor`` wide.

    The floor widens; it cannot make a 95% interval out of too few pairs: a caller checks the
    Estimate's ``too_few`` (kept here) before it claims the interval as one.

    Example:
        >>> e = claimed(Estimate(2.0, 1.999, 2.001, 800))
        >>> round(e.low, 3), round(e.high, 3)
        (1.942, 2.06)
    """
    low = min(est.low, est.value / (1 + floor))
    high = max(est.high, est.value * (1 + floor))
    return Estimate(est.value, low, high, est.n)
