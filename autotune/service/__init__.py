"""The tuning service for a shared box, ``autotune serve``: :class:`TuningService` (queue, device
monitor, scheduler), :func:`create_app` (its HTTP API and page) and :class:`ServiceClient`."""

from autotune.service._access import TOKEN_ENV, WorkloadPolicy, check_bind, is_loopback, load_token
from autotune.service._api import (
    KEEP_ALIVE,
    MAX_BODY,
    MAX_HEAD,
    REQUEST_TIMEOUT,
    DrainFirstServer,
    SlowClientGuard,
    create_app,
)
from autotune.service._client import DEFAULT_SERVER, SERVER_ENV, ServiceClient
from autotune.service._device_monitor import (
    DeviceMonitor,
    DeviceReading,
    SimulatedHardware,
    parse_devices,
)
from autotune.service._models import (
    CancelReply,
    DeviceInfo,
    Health,
    StudyDetail,
    StudyStatus,
    SubmitReply,
    TrialInfo,
)
from autotune.service._queue import StudyQueue
from autotune.service._tuning_service import MAX_BUDGET, RequestError, TuningService

__all__ = [
    "DeviceReading",
    "SimulatedHardware",
    "DEFAULT_SERVER",
    "KEEP_ALIVE",
    "MAX_BODY",
    "MAX_BUDGET",
    "MAX_HEAD",
    "REQUEST_TIMEOUT",
    "SERVER_ENV",
    "TOKEN_ENV",
    "CancelReply",
    "DeviceInfo",
    "DeviceMonitor",
    "DrainFirstServer",
    "Health",
    "RequestError",
    "ServiceClient",
    "SlowClientGuard",
    "StudyDetail",
    "StudyQueue",
    "StudyStatus",
    "SubmitReply",
    "TrialInfo",
    "TuningService",
    "WorkloadPolicy",
    "check_bind",
    "create_app",
    "is_loopback",
    "load_token",
    "parse_devices",
]
