"""The fp32 reference's record: stored on the study (not a trial) per machine and device,
with its settings, its loss curve and every throughput measurement of it.

:mod:`autotune.trials` re-exports these names beside the trial record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from autotune.spec import Candidate

__all__ = ["ReferenceMeasurement", "ReferenceRecord", "reference_key", "stored_references"]

_REFERENCE = "reference"


class ReferenceMeasurement(BaseModel):
    """One throughput measurement of the fp32 reference: when, and what it measured."""

    model_config = ConfigDict(extra="ignore")

    # Unix time at the end of the measurement.
    at: float
    throughput: float
    low: float
    high: float
    blocks: int = 0
    # Relative spread of the block timings (interquartile range over the median).
    spread: float = 0.0


class ReferenceRecord(BaseModel):
    """The fp32 reference of one machine and device: its settings, the loss curve the parity
    check compares against, and every throughput measurement, oldest first.

    It is not a trial: the reference is the baseline every candidate is compared with, not a
    point of the search space (fp32 is a candidate only when the spec lists it).
    """

    model_config = ConfigDict(extra="ignore")

    precision: str = "fp32"
    batch_size: int
    learning_rate: float
    seed: int = 0
    # Loss of every step of the long first run (None where not finite).
    losses: list[float | None] = []
    peak_memory_bytes: int | None = None
    measurements: list[ReferenceMeasurement] = []

    @property
    def finite_losses(self) -> list[float]:
        return [v for v in self.losses if v is not None]

    def latest(self) -> ReferenceMeasurement | None:
        return self.measurements[-1] if self.measurements else None

    def candidate(self) -> Candidate:
        return Candidate(
            precision=self.precision,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
        )


def reference_key(host: str, device: str) -> str:
    """The study attribute the fp32 reference of one device of one machine is stored under.

    Example:
        >>> reference_key("box1", "cpu")
        'reference:box1:cpu'
    """
    return f"{_REFERENCE}:{host}:{device}"


def stored_references(attrs: Mapping[str, Any]) -> dict[tuple[str, str], ReferenceRecord]:
    """Every stored reference of a study, by ``(host, device)``; unreadable ones are skipped."""
    out: dict[tuple[str, str], ReferenceRecord] = {}
    prefix = f"{_REFERENCE}:"
    for key, value in attrs.items():
        if not key.startswith(prefix) or not isinstance(value, dict):
            continue
        host, sep, device = key[len(prefix) :].partition(":")
        if not sep:
            continue
        try:
            out[(host, device)] = ReferenceRecord.model_validate(value)
        except ValidationError:
            continue
    return out
