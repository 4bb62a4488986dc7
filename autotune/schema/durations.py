"""Durations in a spec: ``30m``, ``1h30m``, ``90s`` or seconds read in, and written back in a
form that reads back to the same seconds."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

from autotune.errors import short_repr

__all__ = ["Duration", "duration_text", "format_duration", "parse_duration"]

_DURATION = re.compile(
    r"^(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)


def parse_duration(value: Any, field: str = "budget") -> float:
    """Parse ``30m``, ``1h30m``, ``90s``, ``1.5h`` or a number of seconds into seconds.

    Args:
        value: the text or number to parse.
        field: the field name used in the error message.

    Returns:
        The duration in seconds, always positive.

    Raises:
        ValueError: naming the field and the value when it is not a positive duration.

    Example:
        >>> parse_duration("1h30m")
        5400.0
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{field} must be a duration like 30m, 1h30m or 90s, got {field}={short_repr(value)}"
        )
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        if text.startswith("-"):
            raise ValueError(f"{field} must be positive, got {field}={short_repr(value)}; try 30m")
        try:
            seconds = float(text)
        except ValueError:
            match = _DURATION.match(text) if len(text) <= 40 else None
            if not text or match is None:
                raise ValueError(
                    f"{field} must be a duration like 30m, 1h30m or 90s, got "
                    f"{field}={short_repr(value)}"
                ) from None
            seconds = (
                float(match["h"] or 0) * 3600 + float(match["m"] or 0) * 60 + float(match["s"] or 0)
            )
    if seconds != seconds or seconds == float("inf"):
        raise ValueError(
            f"{field} must be a finite duration, got {field}={short_repr(value)}; try 30m"
        )
    if not seconds > 0:
        raise ValueError(f"{field} must be positive, got {field}={short_repr(value)}; try 30m")
    return seconds


def format_duration(seconds: float) -> str:
    """``5400`` → ``"1h30m"``; ``95`` → ``"1m35s"``; ``1.88415`` → ``"1.88s"``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    total = round(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{u}" for n, u in ((h, "h"), (m, "m"), (s, "s")) if n)


def duration_text(seconds: float) -> str:
    """A duration as a spec stores it: the readable form where it reads back exactly, else the
    seconds in full. A copy of a spec is made through this form (``with_overrides``, a study's
    stored spec): a budget of 1799.6 s read back as ``30m`` let a search run 0.4 s past it.

    Example:
        >>> duration_text(5400.0), duration_text(1799.6)
        ('1h30m', '1799.6s')
    """
    text = format_duration(seconds)
    if parse_duration(text) == seconds:
        return text
    exact = repr(seconds)
    return exact if "e" in exact else f"{exact}s"  # 1e-05 reads back as a number of seconds


Duration = Annotated[
    float,
    BeforeValidator(lambda v, info: parse_duration(v, info.field_name or "duration")),
    PlainSerializer(duration_text, return_type=str),
]
