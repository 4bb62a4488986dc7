"""The probe worker's protocol: every message reads back as it was sent, a line that is no
message is named, the worker turns each exception into its reply, and the parent turns each
failure into what its caller gets: a crashed outcome, a raised error or None."""

from __future__ import annotations

import math
import signal
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from autotune.errors import DeviceError, SpecError, WorkloadError
from autotune.execution import probe_worker
from autotune.execution.facts import collect_facts
from autotune.execution.limits import MEMORY_ENV
from autotune.execution.messages import (
    CompareRequest,
    CrashReply,
    DiagnoseRequest,
    DiagnosisReply,
    FactsReply,
    FactsRequest,
    MessageError,
    PairedReply,
    PoisonedReply,
    ProbeRequest,
    ReadyReply,
    ResultReply,
    UserErrorReply,
    WorkerMemory,
    decode_reply,
    decode_request,
    encode,
)
from autotune.execution.probe_worker import ProbeWorker
from autotune.execution.runner import RESTARTED, crashed_result
from autotune.measure.result import PairedResult
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings

SHORT = ProbeSettings(warmup_steps=1, steps=4, check_every=2, min_time=0)
CAND = Candidate(precision="fp32", batch_size=16, learning_rate=0.05)
REF = Candidate(precision="fp32", batch_size=8, learning_rate=0.1)
RESULT = crashed_result("tiny_mlp", CAND, "cpu", SHORT, "ValueError: boom")
MEMORY = WorkerMemory(free=6 * 2**30, total=80 * 2**30, reserved=2**30)

REQUESTS = [
    ProbeRequest(workload="tiny_mlp", candidate=CAND, settings=SHORT),
    ProbeRequest(
        workload="tiny_mlp", candidate=CAND, settings=SHORT, early_stop=EarlyStop(below=120.0)
    ),
    CompareRequest(workload="tiny_mlp", candidate=CAND, reference=REF, settings=SHORT),
    FactsRequest(workload="tiny_mlp"),
    DiagnoseRequest(workload="tiny_mlp", candidate=CAND, steps=5, seed=7),
]
REPLIES = [
    ReadyReply(pid=4242),
    ResultReply(result=RESULT, memory=MEMORY),
    ResultReply(result=RESULT),
    PairedReply(paired=PairedResult(candidate=RESULT, reference=RESULT)),
    DiagnosisReply(diagnosis={"verdict": "fine", "layers": [{"name": "fc1"}]}, memory=None),
    UserErrorReply(error="SpecError", message="steps must be positive"),
    PoisonedReply(message="RuntimeError: CUDA error: an illegal memory access", traceback="…"),
    CrashReply(message="ValueError: boom", traceback="Traceback …"),
]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: m.op)
def test_every_request_reads_back_as_it_was_sent_on_one_line(message: BaseModel) -> None:
    line = encode(message)
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert decode_request(line) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: m.kind)
def test_every_reply_reads_back_as_it_was_sent_on_one_line(message: BaseModel) -> None:
    line = encode(message)
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert decode_reply(line) == message


def test_the_facts_reply_reads_back_as_it_was_sent() -> None:
    reply = FactsReply(facts=collect_facts("tiny_mlp", "cpu"), memory=MEMORY)
    assert decode_reply(encode(reply)) == reply


def test_nan_and_inf_losses_survive_the_trip() -> None:
    diverged = RESULT.model_copy(update={"losses": [2.3, math.inf, math.nan]})
    back = decode_reply(encode(ResultReply(result=diverged)))
    assert isinstance(back, ResultReply)
    assert back.result.losses[0] == 2.3
    assert math.isinf(back.result.losses[1]) and math.isnan(back.result.losses[2])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"kind":"bogus","pid":1}', "unknown probe worker reply kind='bogus'; expected one of"),
        ('["ready", 4242]', "unreadable probe worker reply .*Input should be an object"),
        ('{"kind":"ready"}', r"unreadable probe worker reply at ready\.pid: Field required"),
        ("not json", "unreadable probe worker reply .*Invalid JSON"),
    ],
    ids=["unknown-kind", "positional", "missing-field", "not-json"],
)
def test_a_line_that_is_no_reply_is_named(line: str, expected: str) -> None:
    with pytest.raises(MessageError, match=expected):
        decode_reply(line)


def test_a_request_of_an_unknown_op_is_named() -> None:
    with pytest.raises(MessageError, match="unknown probe worker request op='train'"):
        decode_request('{"op":"train","workload":"tiny_mlp"}')


@pytest.mark.parametrize(
    ("error", "raised"),
    [("SpecError", SpecError), ("DeviceError", DeviceError), ("NoSuchError", WorkloadError)],
    ids=["spec", "device", "unknown-name"],
)
def test_a_user_error_is_raised_again_as_its_own_class_with_its_message(
    error: str, raised: type[Exception]
) -> None:
    reply = decode_reply(encode(UserErrorReply(error=error, message="steps must be positive")))
    assert isinstance(reply, UserErrorReply)
    exc = reply.exception()
    assert type(exc) is raised and str(exc) == "steps must be positive"


def test_a_name_in_errors_that_is_no_error_class_is_raised_as_a_workload_error() -> None:
    assert type(UserErrorReply(error="short_repr", message="x").exception()) is WorkloadError


# ---- the worker's side: each exception becomes its reply ------------------------------------


def _serve(*requests: str) -> list[Any]:
    """The replies of the worker's loop, run in this process for the CPU."""
    replies = StringIO()
    previous = signal.getsignal(signal.SIGINT)
    try:
        probe_worker._serve(StringIO("".join(requests)), replies, "cpu")
    finally:
        signal.signal(signal.SIGINT, previous)
    return [decode_reply(line) for line in replies.getvalue().splitlines()]


def _probe(workload: str) -> str:
    return encode(ProbeRequest(workload=workload, candidate=CAND, settings=SHORT))


def test_the_worker_answers_each_failure_in_kind_and_stops_after_a_poisoned_context() -> None:
    ready, user_error, unreadable, result, poisoned = _serve(
        _probe("no_such_package_xyz.mod:fn"),
        '["tiny_mlp", "{}", "{}", "probe"]\n',  # the old positional form: no longer a request
        _probe("tiny_mlp"),
        _probe("autotune.testing.workloads:cuda_context_lost"),
        _probe("tiny_mlp"),  # never answered: the worker has returned
    )
    assert isinstance(ready, ReadyReply)
    assert isinstance(user_error, UserErrorReply)
    with pytest.raises(WorkloadError, match="cannot import module 'no_such_package_xyz.mod'"):
        raise user_error.exception()
    assert isinstance(unreadable, CrashReply)
    assert unreadable.message.startswith("MessageError: unreadable probe worker request")
    assert isinstance(result, ResultReply) and result.result.outcome == Outcome.COMPLETED
    assert isinstance(poisoned, PoisonedReply) and "illegal memory access" in poisoned.message
    assert "Traceback" in poisoned.traceback


# ---- the parent's side: one place turns each failure into what the caller gets -------------


class _Scripted(ProbeWorker):
    """A ProbeWorker whose worker answers with ``reply`` (an exception: raised on reading),
    and that starts and stops no process."""

    def __init__(self, reply: Any) -> None:
        super().__init__("cpu")
        self.reply = reply
        self.stops = 0
        self._requests = StringIO()

    def start(self) -> None:
        pass

    def _recv(self, timeout: float) -> Any:
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    def _stop(self, kill: bool = False) -> None:
        self.stops += 1


CRASH = CrashReply(message="ValueError: boom", traceback="Traceback …")
POISONED = PoisonedReply(message="RuntimeError: CUDA error: illegal memory access", traceback="")
USER_ERROR = UserErrorReply(error="SpecError", message="steps must be positive")


@pytest.mark.parametrize(
    ("reply", "reason", "timed_out", "stops"),
    [
        (CRASH, "ValueError: boom", False, 0),
        (POISONED, f"RuntimeError: CUDA error: illegal memory access; {RESTARTED}", False, 1),
        (None, "probe exceeded its hard time limit of 5s; worker stopped after 0s", True, 1),
        (EOFError("closed"), "worker process died (no process) during the probe", False, 1),
        (MessageError("kind='x'"), "reply to the probe could not be read: kind='x'", False, 1),
        (ReadyReply(pid=1), "answered a probe request with a 'ready' reply", False, 0),
    ],
    ids=["crash", "poisoned", "timeout", "died", "unreadable", "wrong-kind"],
)
def test_a_failed_probe_is_a_crashed_result_naming_why(
    reply: Any, reason: str, timed_out: bool, stops: int
) -> None:
    runner = _Scripted(reply)
    r = runner.run("tiny_mlp", CAND, SHORT, timeout=5)
    assert r.outcome == Outcome.CRASHED and reason in r.reason
    assert (r.timed_out, runner.stops) == (timed_out, stops)
    assert decode_request(runner._requests.getvalue()) == REQUESTS[0]


def test_a_failed_paired_run_is_two_crashed_arms_with_one_reason() -> None:
    paired = _Scripted(None).compare("tiny_mlp", CAND, REF, SHORT, timeout=5)
    for arm, cand in ((paired.candidate, CAND), (paired.reference, REF)):
        assert arm.outcome == Outcome.CRASHED and arm.timed_out and arm.candidate == cand
        assert arm.reason.startswith("paired run exceeded its hard time limit of 5s")


def test_a_crash_under_the_memory_limit_names_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_ENV, "6G")
    runner = _Scripted(CrashReply(message="MemoryError: ", traceback=""))
    reason = runner.run("tiny_mlp", CAND, SHORT, timeout=5).reason
    assert reason.startswith("MemoryError: ; ") and "AUTOTUNE_WORKER_MEMORY" in reason


@pytest.mark.parametrize(
    "call",
    [
        lambda w: w.run("tiny_mlp", CAND, SHORT),
        lambda w: w.compare("tiny_mlp", CAND, REF, SHORT),
        lambda w: w.facts("tiny_mlp"),
    ],
    ids=["run", "compare", "facts"],
)
def test_a_user_error_in_the_worker_is_raised_in_the_parent(call: Any) -> None:
    runner = _Scripted(USER_ERROR)
    with pytest.raises(SpecError, match="^steps must be positive"):
        call(runner)
    assert runner.stops == 0  # the worker lives on


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (None, RuntimeError, "the probe worker did not answer about workload 'tiny_mlp'"),
        (EOFError("closed"), RuntimeError, "did not answer about workload 'tiny_mlp'"),
        (CRASH, WorkloadError, "workload 'tiny_mlp' could not be inspected: ValueError: boom"),
        (POISONED, WorkloadError, "could not be inspected: RuntimeError: CUDA error"),
    ],
    ids=["timeout", "died", "crash", "poisoned"],
)
def test_facts_that_could_not_be_found_raise(reply: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _Scripted(reply).facts("tiny_mlp")


@pytest.mark.parametrize(
    "reply",
    [None, EOFError("closed"), CRASH, POISONED, USER_ERROR],
    ids=["timeout", "died", "crash", "poisoned", "user-error"],
)
def test_a_diagnosis_that_could_not_run_is_none(reply: Any) -> None:
    assert _Scripted(reply).diagnose("tiny_mlp", CAND) is None


def test_an_answer_updates_the_devices_memory_and_is_returned() -> None:
    runner = _Scripted(DiagnosisReply(diagnosis={"verdict": "fine"}, memory=MEMORY))
    assert runner.diagnose("tiny_mlp", CAND, steps=5, seed=7) == {"verdict": "fine"}
    assert runner.memory == MEMORY
    assert decode_request(runner._requests.getvalue()) == REQUESTS[-1]


def test_a_users_module_whose_library_is_missing_names_the_integrations_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's Lightning example after `make search` alone: the user's module is there, the
    library it imports is not; the error names the extra that brings it, not the spelling."""
    from autotune.workloads._objects import import_user_module

    (tmp_path / "needs_lightning_xyz.py").write_text("import lightning\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "lightning", None)  # as where it is not installed
    with pytest.raises(WorkloadError) as err:
        import_user_module("lightning.module", "needs_lightning_xyz")
    text = str(err.value)
    assert "needs Lightning, which is not installed" in text
    assert "'autotune[integrations]'" in text and "check the spelling" not in text
