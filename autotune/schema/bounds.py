"""The physical range of every number a study spec or a config holds, checked where it is parsed.

A value past its range is not a preference but a typo or an attack: a ``parity_tolerance`` of
100 switches the safety check off, a batch of 2^40 samples fits no device, ``probe.steps`` of
1e9 holds a device for days. Each is refused at parse time, in one line naming the field, its
range and why (docs/specs.md shows this table).
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator, ValidationInfo

from autotune.errors import SpecError, short_repr

__all__ = ["BOUNDS", "INTERNAL", "Bound", "bounded", "check_bound", "check_plain_text"]

# The validation context of a message between autotune's own processes.
INTERNAL = "autotune-internal"


@dataclass(frozen=True)
class Bound:
    """A closed range ``[low, high]`` and why a value outside it makes no sense."""

    low: float
    high: float
    why: str

    def shown(self) -> str:
        return f"{_number(self.low)} to {_number(self.high)}"


def _number(x: float) -> str:
    if x == int(x) and abs(x) >= 1:
        return f"{int(x):,}"
    exponent = math.log2(x) if x > 0 else 0.5
    if x < 0.001 and exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{x:g}"


_BATCH = Bound(1, 2**20, "a step over more than 2^20 samples fits no device's memory")
_LR = Bound(0.001, 1000, "1000x off the batch-size rule is another optimizer, not a tuning")
_SCALE = Bound(2**-24, 2**32, "GradScaler's scale: past 2^32 every fp16 step overflows")
_STEPS = Bound(1, 100_000, "a probe measures seconds to minutes, not days")

# Dotted field paths (``[]``: each element of a list) and their ranges.
BOUNDS: dict[str, Bound] = {
    "parity_tolerance": Bound(0, 0.5, "a loss 50% above the fp32 reference's is not parity"),
    "memory_margin": Bound(0, 0.9, "a batch must leave itself room to run"),
    "space.batch_size.min": _BATCH,
    "space.batch_size.max": _BATCH,
    "space.batch_sizes[]": _BATCH,
    "space.lr_multiplier.min": _LR,
    "space.lr_multiplier.max": _LR,
    "space.lr_multipliers[]": _LR,
    "space.init_scale.min": _SCALE,
    "space.init_scale.max": _SCALE,
    "probe.warmup_steps": Bound(0, 10_000, "warm-up settles in tens of steps"),
    "probe.steps": _STEPS,
    "probe.check_every": Bound(1, 10_000, "a loss read per block keeps divergence visible"),
    "probe.min_time": Bound(0, 3600, "seconds: a probe's timed phase, not a training run"),
    "probe.time_limit": Bound(0, 86_400, "seconds: a day already holds a device too long"),
    "probe.precision": Bound(0.001, 1, "the throughput interval's half-width, relative"),
    "probe.loss_blowup_factor": Bound(1.01, 1e6, "a loss this many times its first is a blow-up"),
    "probe.max_skip_rate": Bound(0, 1, "a share of the steps"),
    "validation.top_k": Bound(1, 16, "each candidate costs a validation run of its own"),
    "validation.steps": _STEPS,
    "validation.min_speedup": Bound(1, 100, "no precision mode trains 100x faster"),
    "validation.fp16_steps": _STEPS,
    "candidate.batch_size": _BATCH,
    # GradScaler keeps its scale in fp32: past 2^64 fp16 training has long overflowed (a test
    # may ask for 2^60, to see every step skipped).
    "candidate.init_scale": Bound(2**-24, 2**64, "GradScaler's scale, kept in fp32"),
    "candidate.growth_interval": Bound(1, 1_000_000, "steps between GradScaler's growths"),
}


def check_bound(path: str, value: Any) -> Any:
    """``value`` when it lies in ``BOUNDS[path]``; None passes (a default to be filled in).

    Raises:
        ValueError: naming the field, its range, why, and the value.

    Example:
        >>> check_bound("validation.top_k", 2)
        2
    """
    bound = BOUNDS[path]
    if value is None or bound.low <= value <= bound.high:
        return value
    leaf = path.rsplit(".", 1)[-1].removesuffix("[]")
    raise ValueError(f"must be from {bound.shown()} ({bound.why}), got {leaf}={short_repr(value)}")


def bounded(path: str) -> AfterValidator:
    """A field validator checking :data:`BOUNDS` ``[path]``, except in a message between
    autotune's own processes (validated with the context ``{INTERNAL: True}``)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if isinstance(info.context, dict) and info.context.get(INTERNAL):
            return value
        return check_bound(path, value)

    return AfterValidator(check)


# Text direction overrides and isolates: they make "txt.exe" display as "exe.txt".
_BIDI = {chr(c) for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def check_plain_text(text: str, field: str) -> str:
    """``text`` when it holds no control, invisible formatting or direction-changing character.

    Raises:
        SpecError: naming the field, the character and where it is.

    Example:
        >>> check_plain_text("ana", "owner")
        'ana'
    """
    for i, ch in enumerate(text):
        if ch in _BIDI or unicodedata.category(ch) in ("Cc", "Cf"):
            name = unicodedata.name(ch, "a control character")
            raise SpecError(
                f"{field} holds U+{ord(ch):04X} ({name}) at position {i + 1}: control, invisible "
                f"and direction-changing characters are refused in {field}s; write it in plain "
                "text"
            )
    return text
