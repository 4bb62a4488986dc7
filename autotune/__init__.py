"""autotune: the fastest numerically safe mixed-precision training setup, measured.

Example:
    >>> import autotune
    >>> cfg = autotune.load_config("studies/resnet18/best.json")  # doctest: +SKIP
    >>> with autotune.session(cfg, "cuda") as amp:  # doctest: +SKIP
    ...     model = amp.prepare(model)
    >>> trainer = lightning.Trainer(**autotune.export(cfg, "lightning").kwargs)  # doctest: +SKIP

``autotune.session`` and ``autotune.export`` are the functions; their modules are imported by
name (``from autotune.session import AmpSession``, ``from autotune.export import Export``).
"""

import time as _time

# The CLI counts its budget from here: importing torch is part of the job's wall time.
STARTED = _time.monotonic()

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
from autotune.export import Export, export  # noqa: E402
from autotune.result import ProbeResult  # noqa: E402

# Last: these names replace the submodules of the same name as attributes of the package.
from autotune.session import AmpSession, session  # noqa: E402
from autotune.spec import Candidate, ProbeSettings, StudySpec, load_spec  # noqa: E402
from autotune.version import __version__  # noqa: E402
from autotune.workloads import Workload, load_workload  # noqa: E402

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
]
