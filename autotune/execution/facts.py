"""What only the worker may find out, the workload's facts and the device's, as the parent reads
them: :class:`WorkerFacts` (no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from autotune.infra.lazy import lazy
from autotune.schema.config import Environment

__all__ = ["WorkerFacts"]

# Found in the worker, with torch: autotune.execution.collect's, still importable from here
# (loaded on first use).
_COLLECTED = frozenset({"collect_facts", "device_memory", "optimizer_settings", "workload_facts"})


class WorkerFacts(BaseModel):
    """A workload's facts and its device's, as the worker found them."""

    model_config = ConfigDict(extra="forbid")

    workload: str
    name: str
    base_lr: float
    base_batch_size: int
    lr_scaling: Literal["linear", "sqrt"]
    channels_last: bool
    # The class of what the workload's build_optimizer returns: the lr belongs to it.
    optimizer: str
    # Its constructor's other settings (optimizer_settings); None when they cannot be recorded.
    optimizer_kwargs: dict[str, Any] | None = None
    # The lr schedule the workload trains under ("constant", "linear", "CosineAnnealingLR");
    # None where the worker does not say (a simulated device).
    lr_schedule: str | None = None
    device: str
    # Modes this device cannot really run, each with the reason.
    unsupported: dict[str, str]
    # Bytes free and in all on the device (CUDA: the driver's view, other processes count, plus
    # what the worker's own allocator holds; CPU: MemAvailable and MemTotal); None when they
    # cannot be read.
    memory_free: int | None = None
    memory_total: int | None = None
    environment: Environment

    def memory_budget(self, margin: float) -> int | None:
        """Bytes a probe may use so that ``margin`` of the device's memory stays free.

        Example:
            >>> f = WorkerFacts.model_construct(memory_free=8 * 2**30, memory_total=16 * 2**30)
            >>> f.memory_budget(0.25) / 2**30
            4.0
        """
        if self.memory_free is None or self.memory_total is None:
            return None
        return max(0, int(self.memory_free - margin * self.memory_total))


__getattr__ = lazy(__name__, dict.fromkeys(_COLLECTED, "autotune.execution.collect"))
