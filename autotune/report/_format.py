"""Figures with their intervals, written the same way in the report, the text and the CLI."""

from __future__ import annotations

import math

__all__ = ["noise_text", "optimism_text", "ratio_text", "throughput_text"]


def _number(value: object) -> float | None:
    """A finite number, or None (absent, not a number, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def ratio_text(
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    x: str = "x",
    missing: str = "",
) -> str:
    """A speedup with its interval: ``1.93x (1.85–2.01)``.

    Args:
        value: the speedup; None gives ``—``.
        low, high: its interval; when either is absent only the value is written, followed by
            ``missing`` (``" (—)"`` in a table, where the column promises an interval).
        x: the sign after the number (``×`` in HTML).
        missing: what stands for an interval that was not measured.

    Example:
        >>> ratio_text(1.934, 1.851, 2.012), ratio_text(1.5), ratio_text(None)
        ('1.93x (1.85–2.01)', '1.50x', '—')
        >>> ratio_text(1.5, x="×", missing=" (—)")
        '1.50× (—)'
    """
    v, lo, hi = _number(value), _number(low), _number(high)
    if v is None:
        return "—"
    if lo is None or hi is None:
        return f"{v:.2f}{x}{missing}"
    return f"{v:.2f}{x} ({lo:.2f}–{hi:.2f})"


def throughput_text(
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    unit: str = "",
    missing: str = "",
) -> str:
    """Samples/s with its interval: ``1,812.5 (1,790.2–1,840.0)``; ``—`` without a value.

    Example:
        >>> throughput_text(1812.49, 1790.2, 1840.0, unit=" samples/s")
        '1,812.5 samples/s (1,790.2–1,840.0)'
        >>> throughput_text(0), throughput_text(812.5)
        ('—', '812.5')
    """
    v, lo, hi = _number(value), _number(low), _number(high)
    if not v:
        return "—"
    if lo is None or hi is None:
        return f"{v:,.1f}{unit}{missing}"
    return f"{v:,.1f}{unit} ({lo:,.1f}–{hi:,.1f})"


def optimism_text(optimism: float | None) -> str:
    """The search's figure against validation's: ``+8.8%`` (the search measured 8.8% more).

    Example:
        >>> optimism_text(0.0876), optimism_text(-0.02), optimism_text(None)
        ('+8.8%', '-2.0%', '—')
    """
    v = _number(optimism)
    return "—" if v is None else f"{v:+.1%}"


def noise_text(spread: float | None) -> str:
    """A device's timing noise: the spread of the fp32 reference's timed blocks (their
    interquartile range over their median), in words a reader can place.

    Example:
        >>> print(noise_text(0.021))
        2.1% (spread of the fp32 reference's timed blocks: interquartile range over median)
        >>> noise_text(None)
        '—'
    """
    v = _number(spread)
    if v is None:
        return "—"
    return f"{v:.1%} (spread of the fp32 reference's timed blocks: interquartile range over median)"
