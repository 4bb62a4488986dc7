"""The fp32 reference of one machine and device, as a study stores it: its settings, its loss
curve, and every throughput measurement of it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from autotune.schema.spec import Candidate
from autotune.study.study_keys import MEASUREMENT, parse_reference_key, reference_key

__all__ = [
    "ReferenceMeasurement",
    "ReferenceRecord",
    "measurement_used",
    "reference_key",
    "stored_references",
]

# A candidate's loss gap that a fresh seed alone explains: the spread of the reference's own
# repeats, once. Validation judges a gap by its upper bound already (search/_validate.py);
# twice the spread on top let lasting gaps of up to 6.6% through a 5% tolerance.
_BAND = 1.0


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
    # The run's seed, and its loss curve's relative gap to the long first run's at equal samples
    # seen (None: the first run itself, or a curve too short to compare).
    seed: int | None = None
    seed_gap: float | None = None


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

    def timing_noise(self, spread: float | None = None) -> float | None:
        """This device's timing noise, the one figure every surface shows: ``spread`` (the
        spread of the run a config's figures come from) where that run timed enough blocks for
        one, else the median spread of the reference's measurements that did; None where none
        did. A run of fewer than four blocks has no spread: shown as 0%, it read as a quiet
        machine beside a summary's 50% and a report's 72% for the same study.

        Example:
            >>> m = [ReferenceMeasurement(at=0, throughput=1, low=1, high=1, blocks=b, spread=s)
            ...      for b, s in ((12, 0.08), (3, 0.0), (9, 0.02))]
            >>> rec = ReferenceRecord(batch_size=32, learning_rate=0.1, measurements=m)
            >>> rec.timing_noise(0.03), rec.timing_noise(0.0), rec.timing_noise()
            (0.03, 0.05, 0.05)
        """
        if spread:
            return spread
        spreads = [m.spread for m in self.measurements if m.blocks > 0 and m.spread]
        return statistics.median(spreads) if spreads else None

    def seed_noise(self, cap: float, also: Sequence[float] = ()) -> float:
        """How far a fresh seed alone may move a loss at a probe's horizon: the root mean
        square of the reference's repeats' gaps to its first run (and of the seed gaps in
        ``also``: validation's reference arms), 0 before any, at most ``cap``.

        A repeat's gap to the first run is a gap between two seeds, as a candidate's gap to the
        first run is: the search's screen allows it on top of the tolerance; validation widens
        its bar by it only where a seed alone moves the loss past what the tolerance can tell
        apart (allowed on top there, a seed's draw carried lasting gaps past the tolerance).

        Example:
            >>> m = [ReferenceMeasurement(at=0, throughput=1, low=1, high=1, seed_gap=g)
            ...      for g in (None, 0.01, -0.02)]
            >>> rec = ReferenceRecord(batch_size=32, learning_rate=0.1, measurements=m)
            >>> round(rec.seed_noise(0.05), 4), rec.seed_noise(0.01)
            (0.0158, 0.01)
        """
        gaps = [m.seed_gap for m in self.measurements if m.seed_gap is not None] + list(also)
        if not gaps:
            return 0.0
        return min(cap, _BAND * math.sqrt(sum(g * g for g in gaps) / len(gaps)))

    def candidate(self) -> Candidate:
        return Candidate(
            precision=self.precision,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
        )


def stored_references(attrs: Mapping[str, Any]) -> dict[tuple[str, str], ReferenceRecord]:
    """Every stored reference of a study, by ``(host, device)``; unreadable ones are skipped."""
    out: dict[tuple[str, str], ReferenceRecord] = {}
    for key, value in attrs.items():
        where = parse_reference_key(key)
        if where is None or not isinstance(value, dict):
            continue
        try:
            out[where] = ReferenceRecord.model_validate(value)
        except ValidationError:
            continue
    return out


def measurement_used(
    study_attrs: Mapping[str, Any], trial_attrs: Mapping[str, Any]
) -> ReferenceMeasurement | None:
    """The reference measurement a trial's speedup was divided by (None: not named, or no longer
    stored)."""
    named = trial_attrs.get(MEASUREMENT)
    if not isinstance(named, dict) or not isinstance(named.get("index"), int):
        return None
    stored = study_attrs.get(str(named.get("key")))
    if not isinstance(stored, dict):
        return None
    try:
        record = ReferenceRecord.model_validate(stored)
    except ValidationError:
        return None
    index = named["index"]
    return record.measurements[index] if 0 <= index < len(record.measurements) else None
