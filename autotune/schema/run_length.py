"""How long the real training run lasts: the horizon a config's loss parity is judged for."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RunLength"]


class RunLength(BaseModel):
    """The real run's length: one of ``steps`` (at the workload's base batch), ``samples``, or
    ``epochs`` of ``samples_per_epoch``.

    Example:
        >>> RunLength(epochs=10, samples_per_epoch=50_000).samples_at(128)
        500000
        >>> RunLength(steps=2_000).samples_at(128)
        256000
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int | None = Field(default=None, gt=0, le=10**12)
    samples: int | None = Field(default=None, gt=0, le=10**15)
    epochs: float | None = Field(default=None, gt=0, le=10**6, allow_inf_nan=False)
    samples_per_epoch: int | None = Field(default=None, gt=0, le=10**12)

    @model_validator(mode="after")
    def _one_length(self) -> RunLength:
        given = [k for k in ("steps", "samples", "epochs") if getattr(self, k) is not None]
        if len(given) != 1:
            shown = ", ".join(given) or "none of them"
            raise ValueError(
                f"give exactly one of steps, samples or epochs, got {shown}; "
                "e.g. run: {epochs: 10, samples_per_epoch: 50000}"
            )
        if self.epochs is not None and self.samples_per_epoch is None:
            raise ValueError(
                "epochs needs samples_per_epoch (the samples in one pass over your data set); "
                "e.g. run: {epochs: 10, samples_per_epoch: 50000}"
            )
        if self.epochs is None and self.samples_per_epoch is not None:
            raise ValueError(
                "samples_per_epoch is read only with epochs; give epochs too, or leave it out"
            )
        return self

    def samples_at(self, base_batch: int) -> int:
        """The samples the run sees (``steps`` are counted at the workload's base batch)."""
        if self.steps is not None:
            return self.steps * base_batch
        if self.samples is not None:
            return self.samples
        assert self.epochs is not None and self.samples_per_epoch is not None
        return math.ceil(self.epochs * self.samples_per_epoch)
