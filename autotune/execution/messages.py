"""What the parent and its probe worker say to each other: one typed message per JSON line."""

from __future__ import annotations

import traceback as tb
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from autotune import errors
from autotune.errors import AutotuneError, WorkloadError, short_repr
from autotune.execution.facts import WorkerFacts
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.bounds import INTERNAL
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings, Seed

__all__ = [
    "CompareRequest",
    "CrashReply",
    "DiagnoseRequest",
    "DiagnosisReply",
    "FactsReply",
    "FactsRequest",
    "FailureReply",
    "MessageError",
    "PairedReply",
    "PoisonedReply",
    "ProbeRequest",
    "ReadyReply",
    "Reply",
    "Request",
    "ResultReply",
    "UserErrorReply",
    "WorkerMemory",
    "decode_reply",
    "decode_request",
    "encode",
]


class MessageError(ValueError):
    """A line on the pipe is not a message of the protocol: a bug, never a user's mistake."""


@dataclass(frozen=True)
class WorkerMemory:
    """A CUDA device's memory as the worker saw it after its last request, in bytes.

    ``reserved`` is what the worker's allocator holds (its cache included): the next probe
    there reuses it, so it is the worker's own memory, never a neighbour's.
    """

    free: int
    total: int
    reserved: int


class _Message(BaseModel):
    # A probe's NaN and inf losses cross as strings and read back as floats (as ProbeResult's
    # own JSON does); without this they would come back as nulls.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


# ---- requests ---------------------------------------------------------------------------------


class ProbeRequest(_Message):
    """Run one probe: :func:`autotune.measure.probe.run_probe`."""

    op: Literal["probe"] = "probe"
    workload: str
    candidate: Candidate
    settings: ProbeSettings
    early_stop: EarlyStop | None = None


class CompareRequest(_Message):
    """Measure a candidate paired with the reference: :func:`autotune.measure.paired.run_paired`."""

    op: Literal["compare"] = "compare"
    workload: str
    candidate: Candidate
    reference: Candidate
    settings: ProbeSettings


class FactsRequest(_Message):
    """The workload's and the device's facts: :func:`autotune.execution.facts.collect_facts`."""

    op: Literal["facts"] = "facts"
    workload: str


class DiagnoseRequest(_Message):
    """A per-layer numerics diagnosis: :func:`autotune.diagnose.diagnose`."""

    op: Literal["diagnose"] = "diagnose"
    workload: str
    candidate: Candidate
    steps: int = Field(default=3, gt=0)
    seed: Seed = 0


Request = Annotated[
    ProbeRequest | CompareRequest | FactsRequest | DiagnoseRequest, Field(discriminator="op")
]


# ---- replies ----------------------------------------------------------------------------------


class ReadyReply(_Message):
    """The worker has started and reads requests."""

    kind: Literal["ready"] = "ready"
    pid: int
    # The address-space limit it runs under, in bytes (None: none).
    memory_limit: int | None = None


class ResultReply(_Message):
    kind: Literal["result"] = "result"
    result: ProbeResult
    # The device's memory after the request; None on a CPU or before CUDA was used.
    memory: WorkerMemory | None = None


class PairedReply(_Message):
    kind: Literal["paired"] = "paired"
    paired: PairedResult


class FactsReply(_Message):
    kind: Literal["facts"] = "facts"
    facts: WorkerFacts
    memory: WorkerMemory | None = None


class DiagnosisReply(_Message):
    kind: Literal["diagnosis"] = "diagnosis"
    # The Diagnosis as JSON, as the in-process runner returns it too.
    diagnosis: dict[str, Any]
    memory: WorkerMemory | None = None


class UserErrorReply(_Message):
    """An :class:`~autotune.errors.AutotuneError` raised in the worker: the user's mistake."""

    kind: Literal["user_error"] = "user_error"
    error: str  # the class's name in autotune.errors
    message: str

    @classmethod
    def from_exception(cls, exc: AutotuneError) -> UserErrorReply:
        return cls(error=type(exc).__name__, message=str(exc))

    def exception(self, message: str | None = None) -> AutotuneError:
        """The error to raise here: its own class, or a WorkloadError when autotune.errors has
        no error of that name; with ``message`` in place of the worker's when given.

        Example:
            >>> UserErrorReply(error="SpecError", message="steps must be positive").exception()
            SpecError('steps must be positive')
        """
        found = getattr(errors, self.error, None)
        if not (isinstance(found, type) and issubclass(found, AutotuneError)):
            found = WorkloadError
        return found(self.message if message is None else message)


_Failure = TypeVar("_Failure", bound="FailureReply")


class FailureReply(_Message):
    """Any other exception raised in the worker, as ``Type: message`` and its traceback."""

    message: str
    traceback: str

    @classmethod
    def from_exception(cls: type[_Failure], exc: BaseException) -> _Failure:
        trace = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        return cls(message=f"{type(exc).__name__}: {exc}", traceback=trace)


class PoisonedReply(FailureReply):
    """An error after which the CUDA context cannot be used: the worker exits after it."""

    kind: Literal["poisoned"] = "poisoned"


class CrashReply(FailureReply):
    """A bug in the workload or in autotune: the probe crashed, the worker lives on."""

    kind: Literal["crash"] = "crash"


Reply = Annotated[
    ReadyReply
    | ResultReply
    | PairedReply
    | FactsReply
    | DiagnosisReply
    | UserErrorReply
    | PoisonedReply
    | CrashReply,
    Field(discriminator="kind"),
]

_REQUESTS: TypeAdapter[Request] = TypeAdapter(Request)
_REPLIES: TypeAdapter[Reply] = TypeAdapter(Reply)


def encode(message: BaseModel) -> str:
    """A request or a reply as one JSON line, its newline included.

    Example:
        >>> encode(ReadyReply(pid=42, memory_limit=2**30))
        '{"kind":"ready","pid":42,"memory_limit":1073741824}\\n'
    """
    return message.model_dump_json() + "\n"


def decode_request(line: str) -> Request:
    """The request on one line.

    Raises:
        MessageError: the line is no request of the protocol.
    """
    return _decode(_REQUESTS, line, "request")


def decode_reply(line: str) -> Reply:
    """The reply on one line.

    Raises:
        MessageError: the line is no reply of the protocol, e.g. one of an unknown kind.

    Example:
        >>> decode_reply('{"kind":"ready","pid":42}')
        ReadyReply(kind='ready', pid=42, memory_limit=None)
    """
    return _decode(_REPLIES, line, "reply")


def _decode(adapter: TypeAdapter[Any], line: str, what: str) -> Any:
    try:
        # Between autotune's own processes: what the search derived (a reference run of 4x the
        # spec's steps) is not held to the spec's bounds.
        return adapter.validate_json(line, context={INTERNAL: True})
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "union_tag_invalid":
            ctx = first.get("ctx", {})
            field, tag = ctx.get("discriminator", "").strip("'"), ctx.get("tag")
            raise MessageError(
                f"unknown probe worker {what} {field}={tag!r}; expected one of "
                f"{ctx.get('expected_tags')}"
            ) from None
        where = ".".join(str(part) for part in first["loc"]) or "the line"
        raise MessageError(
            f"unreadable probe worker {what} at {where}: {first['msg']}; got {short_repr(line)}"
        ) from None
