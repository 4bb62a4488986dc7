"""Probes in an isolated process, one persistent worker per device: :class:`ProbeWorker`, the
parent's side (no torch), and the worker's loop (:func:`main`)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from loguru import logger
from pydantic import BaseModel

from autotune.errors import AutotuneError, SpecError, WorkloadError
from autotune.execution.facts import WorkerFacts
from autotune.execution.limits import (
    apply_memory_limit,
    limit_note,
    pci_bus_order,
    too_small,
    worker_device,
    worker_env,
    worker_memory_limit,
)
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
    Reply,
    Request,
    ResultReply,
    UserErrorReply,
    WorkerMemory,
    decode_reply,
    encode,
)
from autotune.execution.output import CapturedOutput, how_it_ended, last_words
from autotune.execution.runner import (
    RESTARTED,
    InProcessRunner,
    Runner,
    StartTooSlow,
    crashed_pair,
    crashed_result,
    poisons_context,
)
from autotune.infra.leave import leave
from autotune.measure.oom import OOM_MESSAGES
from autotune.measure.result import PairedResult, ProbeResult
from autotune.schema.enums import Outcome

__all__ = ["InProcessRunner", "ProbeWorker", "Runner", "WorkerMemory", "poisons_context"]

# Seconds a probe may run past its own soft time limit before the worker is killed.
_GRACE = 15.0
# How a failed allocation reads in a reason, beside torch's own OOM messages.
_NO_MEMORY = (*OOM_MESSAGES, "MemoryError", "Cannot allocate memory")
# What a worker that could not map enough to start torch says as it dies.
_CANNOT_START = (*_NO_MEMORY, "failed to map segment", "Memory allocation still failed")
# The reply a request waits for.
_Answer = TypeVar("_Answer", ResultReply, PairedReply, FactsReply, DiagnosisReply)


@dataclass(frozen=True)
class _Failure:
    """A request that brought no answer, as its caller reads it."""

    # The ``crashed`` result's reason.
    reason: str
    # The worker's own words ("Type: message"); "" when it said nothing: it died, or hung.
    said: str = ""
    timed_out: bool = False


def _hard(request: ProbeRequest | CompareRequest, timeout: float | None) -> float:
    """A probe's hard time limit: ``timeout``, or its soft limit and a grace period."""
    return timeout if timeout is not None else request.settings.time_limit + _GRACE


def _serve(
    requests: Any, replies: Any, device: str, *, warm: bool = False, limit: int | None = None
) -> None:
    """The worker's loop: read a request line, answer it, write the reply line.

    After an error that poisons the CUDA context it says so and returns: the process exits
    and the parent starts a fresh one for the next request.

    A CUDA worker sees its one GPU as ``cuda:0`` (:func:`~autotune.execution.limits.worker_env`): it
    runs everything there, and its replies name the device as the caller did, ``cuda:N``.
    """
    # Ctrl-C goes to the whole process group; the parent decides what to do with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shown = f"cuda:{device.partition(':')[2] or 0}" if device.startswith("cuda") else device
    device = worker_device(device)
    here = re.compile(rf"\b{re.escape(device)}\b") if device != shown else None

    def send(message: BaseModel) -> None:
        # What the workload printed goes out before its reply: it is that request's output.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        text = encode(message)
        replies.write(here.sub(shown, text) if here else text)
        replies.flush()

    # The worker's side, torch with it, loaded here in the worker and before `ready`, as
    # start() promises: the first probe pays only for itself, and the parent never loads it.
    from autotune.execution.answers import answer

    if warm:
        # Torch's compiler front end too, which torch imports at the first optimizer built (every
        # workload's): 1-1.4 s of a core, paid here by a worker started before it has work.
        import torch._dynamo  # noqa: F401

    cache: dict[str, Any] = {}
    send(ReadyReply(pid=os.getpid(), memory_limit=limit))
    for line in requests:
        reply = answer(line, cache, device)
        send(reply)
        if isinstance(reply, PoisonedReply):
            return


def _sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    """Entry point of a worker process: ``python -m autotune.execution.probe_worker DEVICE
    REQ_FD REPLY_FD [MEMORY_LIMIT_BYTES [warm]]``."""
    device, req_fd, reply_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # First thing: GPUs numbered in PCI bus order (the parent set it; before CUDA starts, in any
    # case), and what the probes allocate from here on counts against the memory limit
    # (autotune.execution.limits): a CPU's worker's, ``auto``'s too where it finds no GPU.
    if not device.startswith("cpu"):
        pci_bus_order()
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    limit = None if device == "auto" and _sees_cuda() else limit or None
    apply_memory_limit(limit)
    # The parent logs every decision; the worker only says what goes wrong.
    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("AUTOTUNE_WORKER_LOG_LEVEL", "WARNING"))
    try:
        with os.fdopen(req_fd, "r") as requests, os.fdopen(reply_fd, "w") as replies:
            warm = len(sys.argv) > 5 and sys.argv[5] == "warm"
            _serve(requests, replies, device, warm=warm, limit=limit)
    except (BrokenPipeError, KeyboardInterrupt):
        # The parent is gone (killed, or Ctrl-C): nobody is left to read a reply.
        pass
    # Every reply is written: leave without the interpreter's teardown of torch's modules
    # (seconds of a core); the exit hooks still run (a workload's temporary files go).
    leave(0)


# The longest a worker may take to say it is ready.
_READY_SECONDS = 120.0


class ProbeWorker(Runner):
    """A persistent worker process for one device.

    Args:
        device: the device probes run on, e.g. ``cpu`` or ``cuda:1``.
        warm: the worker also loads what the first probe would (torch's compiler front end,
            which any optimizer imports) before it says it is ready: for a worker started
            before it has work, as a service's, whose first study then pays only for its own
            probes. A search that waits on the worker anyway gains nothing from it.

    Raises:
        SpecError: ``AUTOTUNE_WORKER_MEMORY`` is not a size (:mod:`autotune.execution.limits`).

    Example:
        >>> with ProbeWorker("cpu") as worker:  # doctest: +SKIP
        ...     result = worker.run("tiny_mlp", candidate, ProbeSettings(steps=5), timeout=30)
    """

    def __init__(self, device: str = "cpu", *, warm: bool = False) -> None:
        self.device = device
        self.warm = warm
        self._proc: subprocess.Popen | None = None
        self._output: CapturedOutput | None = None
        self._served = 0
        # What the workload wrote during the last request: its tail, and how many bytes.
        self.output: tuple[str, int] = ("", 0)
        self._requests: Any = None
        self._replies: Any = None
        self.starts = 0
        # Spawned and not yet heard ready (spawn() returned at once).
        self._unready = False
        # The device's memory as the worker last reported it (CUDA only; None until then).
        self.memory: WorkerMemory | None = None
        # The address-space limit in bytes its worker runs under (CPU only; None: none), as set
        # and as the worker reports it once started (auto on a GPU: none).
        self.memory_limit = self._limit = worker_memory_limit(device)

    def interrupt(self) -> None:
        # Safe from a signal handler: only sends a signal; run() sees the pipe close.
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def start(self, within: float | None = None) -> None:
        """A live worker, ready for a request: started now (a fresh one after one died), or the
        one :meth:`spawn` started, waited for.

        Raises:
            StartTooSlow: it was not ready ``within`` seconds (a budget's share), and was
                killed.
            RuntimeError: it did not say it was ready within 120 s.
        """
        self.spawn()
        if self._unready:
            self._await_ready(within)

    def spawn(self) -> None:
        """Start the worker's process and return at once: it imports torch while the caller
        goes on (the command line imports the search and opens the study meanwhile); the next
        request waits for it. Nothing when a worker lives already."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop(kill=True)
            self._launch()

    def _launch(self) -> None:
        # A fresh interpreter, not a fork: CUDA cannot be forked, and the caller's main module
        # is never re-imported. A CUDA worker sees only its own GPU, as cuda:0 (worker_env).
        env = {
            **os.environ,
            **worker_env(self.device),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
            ),
        }
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.execution.probe_worker",
                self.device,
                str(req_r),
                str(rep_w),
            ]
            + [str(self._limit or 0)]
            + (["warm"] if self.warm else []),
            pass_fds=(req_r, rep_w),
            stdin=subprocess.DEVNULL,
            # The workload's prints: kept per request, never copied whole (CapturedOutput).
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        os.close(req_r)
        os.close(rep_w)
        assert proc.stdout is not None
        self._output = CapturedOutput(proc.stdout)
        self._proc = proc
        self._served = 0  # requests this process answered
        self._requests = os.fdopen(req_w, "w")
        self._replies = os.fdopen(rep_r, "r")
        self._unready = True

    def _await_ready(self, within: float | None = None) -> None:
        assert self._proc is not None
        limit = _READY_SECONDS if within is None else max(0.0, min(within, _READY_SECONDS))
        reply = self._recv(limit)
        if not isinstance(reply, ReadyReply):
            self._stop(kill=True)
            if limit < _READY_SECONDS and reply is None:
                raise StartTooSlow(limit)
            raise RuntimeError(f"the probe worker did not start within {_READY_SECONDS:.0f} s")
        self._unready = False
        self.starts += 1
        self.memory_limit = reply.memory_limit  # auto's: none where it runs on a GPU
        logger.debug("worker pid {} started for {}", self._proc.pid, self.device)

    def _recv(self, timeout: float) -> Reply | None:
        """One reply, or None when none came within ``timeout``.

        Raises:
            EOFError: the worker closed its pipe (it died).
            MessageError: the line is no reply.
        """
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            return None
        line = self._replies.readline()
        if not line:
            raise EOFError("worker closed its pipe")
        return decode_reply(line)

    def _stop(self, kill: bool = False) -> None:
        if self._proc is None:
            return
        for f in (self._requests, self._replies):
            with contextlib.suppress(OSError):
                f.close()
        if kill:
            self._proc.kill()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        if self._output is not None:
            self._output.join(2)  # its last words, read before anyone asks for them
        self._proc = self._requests = self._replies = None
        self._unready = False
        # A new worker holds nothing yet: the old one's report no longer says anything.
        self.memory = None

    def _noted(self, reason: str) -> str:
        """``reason``, plus the worker's memory limit when the reason is a failed allocation
        under one: the limit, not the machine, may be what ran out."""
        if self.memory_limit and any(sign in reason for sign in _NO_MEMORY):
            return f"{reason}; {limit_note(self.memory_limit)}"
        return reason

    def _with_output(self, result: ProbeResult) -> ProbeResult:
        """``result`` with what the workload wrote during its request (:attr:`output`)."""
        tail, written = self.output
        return result.model_copy(update={"output": tail, "output_bytes": written})

    def _noted_result(self, result: ProbeResult) -> ProbeResult:
        if result.reason and (result.outcome in (Outcome.OOM, Outcome.CRASHED)):
            return result.model_copy(update={"reason": self._noted(result.reason)})
        return result

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        """In the worker, restarted when it died or hung; ``timeout`` defaults to the probe's
        ``time_limit`` plus a grace period."""
        answer = self._ask(request, ResultReply, _hard(request, timeout), doing="probe")
        if isinstance(answer, _Failure):
            result = crashed_result(
                request.workload,
                request.candidate,
                self.device,
                request.settings,
                answer.reason,
                timed_out=answer.timed_out,
            )
        else:
            result = self._noted_result(answer.result)
        return self._with_output(result)

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        """In the worker, as :meth:`answer_probe`."""
        answer = self._ask(request, PairedReply, _hard(request, timeout), doing="paired run")
        if isinstance(answer, _Failure):
            return crashed_pair(request, self.device, answer.reason, timed_out=answer.timed_out)
        paired = answer.paired
        return paired.model_copy(
            update={
                "candidate": self._with_output(self._noted_result(paired.candidate)),
                "reference": self._noted_result(paired.reference),
            }
        )

    def facts(self, workload: str, *, timeout: float = 120.0) -> WorkerFacts:
        answer = self._ask(FactsRequest(workload=workload), FactsReply, timeout, doing="facts")
        if not isinstance(answer, _Failure):
            return answer.facts
        if not answer.said:
            raise RuntimeError(f"the probe worker did not answer about workload {workload!r}")
        raise WorkloadError(f"workload {workload!r} could not be inspected: {answer.said}")

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        try:
            answer = self._ask(request, DiagnosisReply, timeout, doing="diagnosis")
        except AutotuneError:
            return None
        return None if isinstance(answer, _Failure) else answer.diagnosis

    def _ask(
        self, request: Request, answer: type[_Answer], timeout: float, *, doing: str
    ) -> _Answer | _Failure:
        """:meth:`_answer`, keeping what the workload wrote meanwhile in :attr:`output`."""
        try:
            return self._answer(request, answer, timeout, doing=doing)
        finally:
            self.output = self._output.take() if self._output is not None else ("", 0)

    def _answer(
        self, request: Request, answer: type[_Answer], timeout: float, *, doing: str
    ) -> _Answer | _Failure:
        """Send one request (starting the worker if needed) and wait for its reply ``answer``:
        the one place that says what each way of failing means to the caller.

        1. The worker died (or its reply could not be read): it is stopped; the reason says how.
        2. No reply within ``timeout``: the worker is killed; the failure is ``timed_out``.
        3. A user error: raised again here, as its own class.
        4. A poisoned CUDA context: the worker has exited; stopped, and the reason says so.
        5. A crash (or a reply of another kind): the worker lives on; its message is the reason.

        Raises:
            AutotuneError: the user's mistake, raised in the worker (its message noted with the
                worker's memory limit where that may be what ran out).
        """
        started = time.perf_counter()
        try:
            self.start()
            self._requests.write(encode(request))
            self._requests.flush()
            reply = self._recv(timeout)
        except MessageError as exc:
            self._stop(kill=True)
            return _Failure(f"the probe worker's reply to the {doing} could not be read: {exc}")
        except (EOFError, OSError, ValueError):
            how, fresh = how_it_ended(self._proc), not self._served
            self._stop(kill=True)
            said = self._output.peek() if self._output is not None else ""
            if fresh and self._limit and any(sign in said for sign in _CANNOT_START):
                how = f"it died before its first answer{last_words(said, 120)}"
                raise SpecError(too_small(self._limit, how)) from None
            return _Failure(f"worker process died ({how}) during the {doing}{last_words(said)}")
        if reply is None:
            self._stop(kill=True)
            return _Failure(
                f"{doing} exceeded its hard time limit of {timeout:.0f}s; worker stopped after "
                f"{time.perf_counter() - started:.0f}s",
                timed_out=True,
            )
        self._served += 1
        if isinstance(reply, ResultReply | FactsReply | DiagnosisReply):
            self.memory = reply.memory
        if isinstance(reply, answer):
            return reply
        if isinstance(reply, UserErrorReply):
            raise reply.exception(self._noted(reply.message))
        if isinstance(reply, PoisonedReply):
            logger.warning("{}: {}\n{}", RESTARTED, reply.message, reply.traceback)
            self._stop(kill=True)
            return _Failure(f"{reply.message}; {RESTARTED}", said=reply.message)
        if isinstance(reply, CrashReply):
            logger.debug("{} crashed in worker:\n{}", doing, reply.traceback)
            return _Failure(self._noted(reply.message), said=reply.message)
        said = f"the worker answered a {request.op} request with a {reply.kind!r} reply"
        return _Failure(said, said=said)

    def close(self) -> None:
        """End the worker: it exits when its pipe closes. One still starting (spawned, not yet
        heard ready: importing torch, holding nothing) is killed at once instead of waited for,
        so a command that fails before its first request (a storage it cannot open) says so in
        a moment, not after the import."""
        if self._unready:
            self._stop(kill=True)
            return
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._requests.close()
        self._stop()


if __name__ == "__main__":
    main()
