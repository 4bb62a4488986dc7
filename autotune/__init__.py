"""autotune: the fastest numerically safe mixed-precision training setup, measured.

Example:
    >>> import autotune
    >>> cfg = autotune.load_config("studies/resnet18/best.json")  # doctest: +SKIP
    >>> with cfg.session("cuda") as amp:  # doctest: +SKIP
    ...     model = amp.prepare(model)
"""

import time as _time

# The CLI counts its budget from here: importing torch is part of the job's wall time.
STARTED = _time.monotonic()

__version__ = "0.1.0"

from autotune.apply import AmpSession  # noqa: E402
from autotune.config import TunedConfig, load_config  # noqa: E402
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
from autotune.result import ProbeResult  # noqa: E402
from autotune.spec import Candidate, ProbeSettings, StudySpec, load_spec  # noqa: E402
from autotune.workloads import Workload, load_workload  # noqa: E402

__all__ = [
    "AmpSession",
    "AutotuneError",
    "AutotuneWarning",
    "Candidate",
    "ConfigError",
    "DeviceError",
    "EnvironmentMismatchWarning",
    "ProbeResult",
    "ProbeSettings",
    "SpecError",
    "StorageError",
    "StudySpec",
    "TunedConfig",
    "Workload",
    "WorkloadError",
    "__version__",
    "load_config",
    "load_spec",
    "load_workload",
]
