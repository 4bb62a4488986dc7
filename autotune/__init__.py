"""autotune: the fastest numerically safe mixed-precision training setup, measured.

Example:
    >>> import autotune
    >>> cfg = autotune.load_config("studies/resnet18/best.json")  # doctest: +SKIP
    >>> with autotune.session(cfg, "cuda") as amp:  # doctest: +SKIP
    ...     model = amp.prepare(model)
    >>> trainer = lightning.Trainer(**autotune.export(cfg, "lightning").kwargs)  # doctest: +SKIP

``autotune.session`` and ``autotune.export`` are the functions; their modules are
``autotune.amp_session`` and ``autotune.exports``.

The names that need torch or the spec's models load on first use, so ``import autotune`` (and
every ``autotune ... --help``) does not pay for torch.
"""

import time as _time
from typing import TYPE_CHECKING

# The CLI counts its budget from here: importing torch, which a command does once it runs, is
# part of the job's wall time.
STARTED = _time.monotonic()

from autotune.errors import (  # noqa: E402
    AutotuneError,
    AutotuneWarning,
    ConfigError,
    DeviceError,
    EnvironmentMismatchWarning,
    SpecError,
    StorageError,
    WorkloadError,
)
from autotune.infra.lazy import lazy as _lazy  # noqa: E402
from autotune.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from autotune.amp_session import AmpSession, session
    from autotune.exports import Export, export
    from autotune.measure.result import ProbeResult
    from autotune.schema.config import TunedConfig, load_config
    from autotune.schema.spec import Candidate, ProbeSettings, StudySpec, load_spec
    from autotune.workloads import Workload, load_workload

__all__ = [
    "AmpSession",
    "AutotuneError",
    "AutotuneWarning",
    "Candidate",
    "ConfigError",
    "DeviceError",
    "EnvironmentMismatchWarning",
    "Export",
    "ProbeResult",
    "ProbeSettings",
    "SpecError",
    "StorageError",
    "StudySpec",
    "TunedConfig",
    "Workload",
    "WorkloadError",
    "__version__",
    "export",
    "load_config",
    "load_spec",
    "load_workload",
    "session",
    "tune",
]

# Where each name loaded on first use lives.
_LAZY = {
    "AmpSession": "autotune.amp_session",
    "Candidate": "autotune.schema.spec",
    "Export": "autotune.exports",
    "ProbeResult": "autotune.measure.result",
    "ProbeSettings": "autotune.schema.spec",
    "StudySpec": "autotune.schema.spec",
    "TunedConfig": "autotune.schema.config",
    "Workload": "autotune.workloads",
    "export": "autotune.exports",
    "load_config": "autotune.schema.config",
    "load_spec": "autotune.schema.spec",
    "load_workload": "autotune.workloads",
    "session": "autotune.amp_session",
    "tune": "autotune.tuning",
}

__getattr__ = _lazy(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
