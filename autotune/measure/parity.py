"""Convergence parity: does a candidate learn as well as the fp32 reference, sample for sample?"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = [
    "SLOWING",
    "clearly_off",
    "few_steps",
    "parity_gap",
    "parity_gap_error",
    "parity_growth",
    "projected_gap",
    "smoothed_loss_at",
    "time_to_loss",
]

# Average the loss over the second half of the shared range: short probes are noisy per step.
_WINDOW = 0.5
# The standard errors a gap's bound is taken at, for which few_steps widens an error read
# from few steps (the search's bounds and growth checks are all taken at two).
_BOUND_Z = 2.0
# A falling gap is projected past the curves only where each fifth's fall is at most this
# share of the one before (an exponential fade with a time constant at most 0.9 times the
# curves' horizon): a projection from a fade that slows less leans on the far tail of one.
SLOWING = 0.8


def clearly_off(tolerance: float, batch_ratio: float = 1.0) -> float:
    """A parity gap no short horizon explains away: three tolerances, and at least 10 points
    more than the tolerance; once more for each doubling of the batch past the first above
    the reference's. Below it, a gap may still be a fresh seed's spread or a larger batch's
    early lag: at equal samples it has taken fewer steps, and until training settles (the
    learning-rate rule holds only then) it lags, the more the larger the batch, by as much as
    a full run later erases (``benchmarks/parity_horizon.py``). A longer horizon tells them
    apart.

    Example:
        >>> round(clearly_off(0.05), 2), round(clearly_off(0.1), 2)
        (0.15, 0.3)
        >>> round(clearly_off(0.05, batch_ratio=2), 2), round(clearly_off(0.05, batch_ratio=8), 2)
        (0.15, 0.45)
    """
    return max(3.0 * tolerance, tolerance + 0.10) * max(1.0, math.log2(max(batch_ratio, 1.0)))


def samples_seen(
    samples: int | None, run: int | None = None, projected: float | None = None
) -> str:
    """The horizon a parity verdict holds for, as the surfaces print it ("" where unknown): the
    samples its gap was read at, and the real run's (where longer), with the gap projected to
    it where an early lag was projected.

    Example:
        >>> samples_seen(33280)
        ' over 33,280 samples seen'
        >>> samples_seen(33280, run=819200)
        ' over 33,280 samples seen (the run sees 819,200)'
        >>> print(samples_seen(33280, run=819200, projected=0.012))
         over 33,280 samples seen, projected +1.2% at the run's 819,200 (an early lag fading)
    """
    if not samples:
        return ""
    out = f" over {samples:,} samples seen"
    if run and projected is not None:
        return f"{out}, projected {projected:+.1%} at the run's {run:,} (an early lag fading)"
    return f"{out} (the run sees {run:,})" if run and run > samples else out


def _window(losses: Sequence[float], batch_size: int, samples: float) -> list[float]:
    """The losses of the steps whose samples-seen fall in ``[samples / 2, samples]``; with fewer
    steps than that, the step closest to ``samples``."""
    lo = (1 - _WINDOW) * samples
    if batch_size >= 0 and not math.isnan(lo) and not math.isnan(samples):
        # Samples-seen grow with the step: the window's ends by the same comparisons, bisected.
        steps = range(1, len(losses) + 1)
        first = bisect.bisect_left(steps, lo, key=lambda k: k * batch_size)
        last = bisect.bisect_right(steps, samples, key=lambda k: k * batch_size)
        window = list(losses[first:last])
    else:
        window = [v for i, v in enumerate(losses) if lo <= (i + 1) * batch_size <= samples]
    if not window:
        i = min(len(losses), max(1, round(samples / batch_size))) - 1
        window = [losses[i]] if 0 <= i < len(losses) else []
    return window


def smoothed_loss_at(losses: Sequence[float], batch_size: int, samples: float) -> float | None:
    """Mean loss over the steps whose samples-seen fall in ``[samples / 2, samples]``.

    Returns None when no step falls in the window or a loss there is not finite.
    """
    window = _window(losses, batch_size, samples)
    if not window:
        return None
    total = sum(window)
    # A non-finite loss makes the sum non-finite; a finite sum's losses are all finite.
    if not math.isfinite(total) and not all(math.isfinite(v) for v in window):
        return None
    return total / len(window)


def _window_error(losses: Sequence[float], batch_size: int, samples: float) -> float:
    """The relative standard error of :func:`smoothed_loss_at`'s mean, from the window's own
    step-to-step noise: successive differences, so a falling curve's trend is not read as noise
    (0 with fewer than three finite steps)."""
    w = _window(losses, batch_size, samples)
    if len(w) < 3:
        return 0.0
    total = sum(w)
    if not math.isfinite(total) and not all(math.isfinite(v) for v in w):
        return 0.0
    return _step_error(w, total / len(w))


def _step_error(w: Sequence[float], mean: float) -> float:
    """The relative standard error of ``w``'s ``mean`` from its step-to-step noise: successive
    differences, so a falling curve's trend is not read as noise (0 for a mean of 0); widened
    by :func:`few_steps` where the window holds few steps."""
    if mean == 0:
        return 0.0
    step_var = sum((b - a) ** 2 for a, b in zip(w, w[1:], strict=False)) / (2 * (len(w) - 1))
    return few_steps(len(w) - 1) * math.sqrt(step_var / len(w)) / abs(mean)


def few_steps(differences: int) -> float:
    """How much wider an error read from ``differences`` step-to-step differences is taken, so
    that a bound two of them above a gap holds as often as two known standard errors do (about
    97.7% one-sided): Student's t over the normal's 2.0, to its expansion's second order (1.41
    at 4 differences, 1.16 at 9, 1.06 at 20, 1.0 in the limit).

    A noise read from a handful of steps is itself noisy: one that came out low carried a
    lasting gap of 5.2% under a 5% tolerance (fp16 at 8x the batch, +2.2% read over 29 steps,
    bound +4.7%) where the few steps' quantile puts its bound at +5.0%.

    Example:
        >>> round(few_steps(4), 2), round(few_steps(9), 2), round(few_steps(1000), 3)
        (1.41, 1.16, 1.001)
    """
    z, dof = _BOUND_Z, differences
    t = z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
    return t / z


def parity_gap(
    losses: Sequence[float], batch_size: int, ref_losses: Sequence[float], ref_batch_size: int
) -> tuple[float, float, float] | None:
    """Relative loss gap to the reference at an equal number of samples seen.

    Returns:
        ``(gap, loss, ref_loss)`` where ``gap = (loss - ref_loss) / |ref_loss|`` (positive: the
        candidate learns worse), or None when either curve is empty or not finite there.

    Example:
        >>> gap, loss, ref = parity_gap([2.0, 1.0], 64, [2.0, 1.5, 1.0, 0.9], 32)
        >>> round(gap, 3), loss, round(ref, 3)
        (0.324, 1.5, 1.133)
    """
    if not losses or not ref_losses:
        return None
    samples = min(len(losses) * batch_size, len(ref_losses) * ref_batch_size)
    loss = smoothed_loss_at(losses, batch_size, samples)
    ref = smoothed_loss_at(ref_losses, ref_batch_size, samples)
    if loss is None or ref is None:
        return None
    return (loss - ref) / max(abs(ref), 1e-12), loss, ref


def parity_gap_error(
    losses: Sequence[float], batch_size: int, ref_losses: Sequence[float], ref_batch_size: int
) -> float:
    """The standard error of :func:`parity_gap`'s gap from the two curves' own step-to-step
    noise (0 where either curve is too short to say). At a short horizon the reference's mean
    is as noisy as the candidate's: a CPU's tiny model on random batches moves its loss by a
    third from step to step, so a gap of 20% over twenty steps can be noise alone.

    Example:
        >>> flat = [1.0] * 40
        >>> parity_gap_error(flat, 32, flat, 32)
        0.0
        >>> noisy = [1.3, 0.7] * 20
        >>> round(parity_gap_error(noisy, 32, flat, 32), 3)
        0.099
    """
    found = parity_gap(losses, batch_size, ref_losses, ref_batch_size)
    if found is None:
        return 0.0
    samples = min(len(losses) * batch_size, len(ref_losses) * ref_batch_size)
    mine = _window_error(losses, batch_size, samples)
    ref = _window_error(ref_losses, ref_batch_size, samples)
    return abs(1 + found[0]) * math.hypot(mine, ref)


def parity_growth(
    losses: Sequence[float], batch_size: int, ref_losses: Sequence[float], ref_batch_size: int
) -> tuple[float, float] | None:
    """How much the gap grew over the second half of the samples both runs have seen: the gap
    at all of them minus the gap at half of them, with that difference's standard error.

    A larger batch's early lag fades as both runs go on (the gap shrinks); a lasting gap that
    shows only after some samples grows: a gap still growing where the curves end has not shown
    all of itself yet. None where either horizon has no comparable gap.

    Example:
        >>> ref = [1.0] * 400
        >>> growing = [1.0] * 200 + [1.04] * 200
        >>> grew, err = parity_growth(growing, 32, ref, 32)
        >>> round(grew, 2), round(err, 2)
        (0.04, 0.0)
    """
    full = parity_gap(losses, batch_size, ref_losses, ref_batch_size)
    if full is None:
        return None
    samples = min(len(losses) * batch_size, len(ref_losses) * ref_batch_size)
    half = [v for i, v in enumerate(losses) if (i + 1) * batch_size <= samples / 2]
    ref_half = [v for i, v in enumerate(ref_losses) if (i + 1) * ref_batch_size <= samples / 2]
    early = parity_gap(half, batch_size, ref_half, ref_batch_size)
    if early is None:
        return None
    err = math.hypot(
        parity_gap_error(losses, batch_size, ref_losses, ref_batch_size),
        parity_gap_error(half, batch_size, ref_half, ref_batch_size),
    )
    return full[0] - early[0], err


def _window_gap(
    losses: Sequence[float], batch_size: int, ref_losses: Sequence[float], ref_batch_size: int,
    lo: float, hi: float,
) -> tuple[float, float] | None:  # fmt: skip
    """The relative gap of the mean losses over samples-seen ``(lo, hi]``, with its standard
    error from both curves' step-to-step noise (None where a curve has under three steps there
    or a loss there is not finite)."""
    means: list[float] = []
    errors: list[float] = []
    for curve, batch in ((losses, batch_size), (ref_losses, ref_batch_size)):
        w = [v for i, v in enumerate(curve) if lo < (i + 1) * batch <= hi]
        if len(w) < 3 or not all(math.isfinite(v) for v in w):
            return None
        mean = sum(w) / len(w)
        means.append(mean)
        errors.append(_step_error(w, mean))
    ratio = means[0] / max(abs(means[1]), 1e-12)
    return ratio - 1, abs(ratio) * math.hypot(*errors)


def projected_gap(
    losses: Sequence[float],
    batch_size: int,
    ref_losses: Sequence[float],
    ref_batch_size: int,
    samples: int,
    *,
    z: float = 2.0,
) -> tuple[float, float] | None:
    """The gap projected to ``samples`` seen (the real run's length, past the ``H`` samples
    both curves share), where it fades as a larger batch's early lag does: an exponential
    relaxation. The gap over each of the last four fifths of ``H`` (each fifth's mean losses)
    falls, each fall a share ``q`` of the one before it, at most ``SLOWING``; an exponential
    fade keeps that share, so the rest of the series from the last fall is the fall still to
    come. A slower fade (a power law) falls more than that; one that stops dead shows a last
    fall far below the one before and is projected to fall little more. A gap that grows, or
    falls without slowing, is not projected: where such a fade ends says nothing of the
    lasting gap under it.

    Returns:
        ``(projected, least)``: the gap at ``samples`` from the falls measured, and from the
        least fall their step noise allows (the first fall ``z`` standard errors steeper, the
        second ``z`` shallower); None where the gap is not fading so, where ``samples`` is
        within ``H``, or where a curve is too short to say.

    Example:
        A lag fading by half every 200 steps over a lasting gap of 3%:

        >>> ref = [1.0] * 800
        >>> lag = [1.03 + 0.5 ** (i / 200) for i in range(800)]
        >>> projected, least = projected_gap(lag, 32, ref, 32, 32 * 6400)
        >>> round(parity_gap(lag, 32, ref, 32)[0], 3), round(projected, 3), round(least, 3)
        (0.166, 0.03, 0.031)
        >>> projected_gap([1.0] * 200 + [1.04] * 200, 32, [1.0] * 400, 32, 10**6) is None
        True
    """
    shared = min(len(losses) * batch_size, len(ref_losses) * ref_batch_size)
    if samples <= shared:
        return None
    fifth = shared / 5
    found = [
        _window_gap(losses, batch_size, ref_losses, ref_batch_size, k * fifth, (k + 1) * fifth)
        for k in (1, 2, 3, 4)
    ]
    if any(f is None for f in found):
        return None
    gaps = [f[0] for f in found if f is not None]
    errors = [f[1] for f in found if f is not None]
    falls = [b - a for a, b in zip(gaps, gaps[1:], strict=False)]
    fall_errors = [math.hypot(a, b) for a, b in zip(errors, errors[1:], strict=False)]
    if not falls[0] < falls[1] < falls[2] < 0 or max(falls[1] / falls[0], falls[2] / falls[1]) > (
        SLOWING
    ):
        return None
    # Fifths still to come past the last one's middle, to the run's end.
    ahead = (samples - shared) / fifth + 0.5

    def rest(q: float, last: float) -> float:
        # The series last*q + last*q^2 + ... over ``ahead`` more fifths.
        return last * q * (1 - q**ahead) / (1 - q) if 0 < q < 1 and last < 0 else 0.0

    # The least fall the noise allows: the last fall z errors shallower, each share from the
    # earlier fall z errors steeper and the later z errors shallower, the smaller of the two.
    shallow = [f + z * e for f, e in zip(falls, fall_errors, strict=False)]
    steep = [f - z * e for f, e in zip(falls, fall_errors, strict=False)]
    q_least = min(shallow[1] / steep[0], shallow[2] / steep[1]) if shallow[1] < 0 else 0.0
    measured = rest(falls[2] / falls[1], falls[2])
    return gaps[-1] + measured, gaps[-1] + rest(q_least, shallow[2])


def time_to_loss(
    losses: Sequence[float], batch_size: int, throughput: float, target: float
) -> float | None:
    """Seconds to first reach ``target`` (running mean of 3 steps), or None if never reached."""
    if throughput <= 0:
        return None
    for i in range(len(losses)):
        window = losses[max(0, i - 2) : i + 1]
        if all(math.isfinite(v) for v in window) and sum(window) / len(window) <= target:
            return (i + 1) * batch_size / throughput
    return None
