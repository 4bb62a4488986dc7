"""What the service's HTTP API answers: pydantic models, shared by the server and the client."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from autotune.schema.enums import StudyState

__all__ = [
    "CancelReply",
    "DeviceInfo",
    "DeviceProcess",
    "ErrorReply",
    "Health",
    "StudyDetail",
    "StudyProgress",
    "StudyState",
    "StudyStatus",
    "SubmitReply",
    "TrialInfo",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorReply(_Model):
    """Every refusal: one message naming what is wrong and what would work."""

    detail: str


class StudyProgress(_Model):
    """How far a study is: trials by state and the budget it has spent."""

    phase: str | None = Field(default=None, description="ceilings, search or validation")
    trials: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "trial counts by state: complete, pruned, fail, not_run (queued, never started), "
            "reused (an earlier trial's measurement: nothing measured)..."
        ),
    )
    budget_seconds: float
    budget_used_seconds: float = Field(description="probe time spent; queue time is not counted")
    best_throughput: float | None = Field(default=None, description="best feasible samples/s")
    reference_throughput: float | None = Field(default=None, description="fp32 reference")


class StudyStatus(_Model):
    """One study in the queue."""

    name: str
    state: StudyState
    detail: str = Field(description="what the study is doing or waiting for, in words")
    priority: int
    owner: str | None = Field(
        default=None, description="who submitted it, as their client said (shown, not checked)"
    )
    workload: str
    device: str | None = Field(description="where it runs or ran; None while queued")
    submitted_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    progress: StudyProgress


class TrialInfo(_Model):
    """One trial, as the search recorded it."""

    number: int
    state: str
    params: dict[str, Any]
    outcome: str | None = None
    reason: str | None = None
    throughput: float | None = None
    speedup: float | None = Field(
        default=None, description="over the fp32 reference measured close in time"
    )
    speedup_low: float | None = Field(default=None, description="the speedup's 95% interval")
    speedup_high: float | None = None
    peak_memory_bytes: int | None = None
    role: str | None = Field(
        default=None,
        description="a baseline's role, or tuned_config: the config's trial, validation's figure",
    )
    retry_of: int | None = None


class StudyDetail(StudyStatus):
    """A study with its trials: counts by outcome, the best so far, the latest trials."""

    by_outcome: dict[str, int] = Field(default_factory=dict)
    best: TrialInfo | None = None
    trials: list[TrialInfo] = Field(default_factory=list, description="the latest 100")
    spec: dict[str, Any] = Field(default_factory=dict)


class SubmitReply(_Model):
    """A study was queued."""

    name: str
    state: StudyState
    priority: int
    position: int = Field(description="1 = next to run")
    message: str


class CancelReply(_Model):
    """A study was cancelled, or is being stopped."""

    name: str
    state: Literal[StudyState.CANCELLED, "cancelling"]
    message: str


class DeviceProcess(_Model):
    """Another process on a device (GPU only)."""

    pid: int
    used_bytes: int | None = None


class DeviceInfo(_Model):
    """One device the service schedules on."""

    name: str
    description: str
    total_bytes: int | None = None
    free_bytes: int | None = None
    utilization: float | None = Field(default=None, description="percent, GPU only")
    busy: bool
    busy_reason: str = ""
    study: str | None = Field(default=None, description="the study running there")
    worker_pid: int | None = None
    others_bytes: int | None = Field(default=None, description="memory held by other processes")
    other_processes: list[DeviceProcess] = Field(default_factory=list)


class Health(_Model):
    """Whether the service is up, and a one-look summary."""

    status: Literal["ok", "draining", "storage_error"]
    # What is wrong with the storage, as its last read or write found it (None: nothing).
    storage_error: str | None = None
    version: str
    devices: list[str]
    queued: int
    running: int
    storage: str
    token_required: bool = Field(description="changing requests need a bearer token")
