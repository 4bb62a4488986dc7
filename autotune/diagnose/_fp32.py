"""Using a diagnosis: the modules it says to keep in fp32, and running them so
(:func:`autotune.measure.knobs.keep_in_fp32`, which the step engine and the session apply too)."""

from __future__ import annotations

from autotune.diagnose._models import Diagnosis
from autotune.measure.knobs import keep_in_fp32

__all__ = ["fp32_modules", "keep_in_fp32"]


def fp32_modules(diagnosis: Diagnosis) -> list[str]:
    """The module names a diagnosis says to run in fp32, in execution order.

    Args:
        diagnosis: a Diagnosis from :func:`diagnose`.

    Returns:
        The layers of its ``keep_fp32`` recommendations (overflowing or near the limit);
        empty when there is nothing to keep in fp32.

    Example:
        >>> from autotune.diagnose import diagnose
        >>> from autotune.schema.spec import Candidate
        >>> from autotune.workloads import load_workload
        >>> d = diagnose(load_workload("autotune.testing.workloads:fp16_overflow"),
        ...              Candidate(precision="fp16", batch_size=64, learning_rate=1e-3), "cpu",
        ...              steps=1)
        >>> fp32_modules(d)
        ['amplify']
    """
    wanted = {n for r in diagnosis.recommendations if r.kind == "keep_fp32" for n in r.layers}
    return [s.name for s in diagnosis.layers if s.name in wanted]
