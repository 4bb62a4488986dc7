"""Convergence parity: does a candidate learn as well as the fp32 reference, sample for sample?"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = [
    "clearly_off",
    "parity_gap",
    "parity_gap_error",
    "parity_growth",
    "smoothed_loss_at",
    "time_to_loss",
]

# Average the loss over the second half of the shared range: short probes are noisy per step.
_WINDOW = 0.5


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


def samples_seen(samples: int | None) -> str:
    """The horizon a parity verdict holds for, as the surfaces print it ("" where unknown).

    Example:
        >>> samples_seen(33280)
        ' over 33,280 samples seen'
    """
    return f" over {samples:,} samples seen" if samples else ""


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
    mean = total / len(w)
    if mean == 0:
        return 0.0
    step_var = sum((b - a) ** 2 for a, b in zip(w, w[1:], strict=False)) / (2 * (len(w) - 1))
    return math.sqrt(step_var / len(w)) / abs(mean)


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
        0.093
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
