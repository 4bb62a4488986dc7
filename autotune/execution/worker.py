"""Probes in an isolated process: one persistent worker per device.

An OOM can leave an allocator fragmented, a CUDA error can poison a context, a probe can hang:
a worker process contains all of it. The worker imports torch once and keeps loaded workloads,
so a trial costs only its probe. A probe that outlives its hard time limit, or a worker that
dies, becomes a ``crashed`` result with the reason, and the next call starts a fresh worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

from autotune.errors import AutotuneError, WorkloadError
from autotune.execution.facts import WorkerFacts
from autotune.execution.limits import (
    apply_memory_limit,
    limit_note,
    pci_bus_order,
    worker_device,
    worker_env,
    worker_memory_limit,
)
from autotune.execution.runner import (
    RESTARTED,
    InProcessRunner,
    Runner,
    crashed_result,
    poisons_context,
)
from autotune.measure.memory import OOM_MESSAGES
from autotune.measure.result import PairedResult, ProbeResult
from autotune.spec import Candidate, EarlyStop, ProbeSettings

__all__ = ["InProcessRunner", "ProbeWorker", "Runner", "WorkerMemory", "poisons_context"]

# Seconds a probe may run past its own soft time limit before the worker is killed.
_GRACE = 15.0
# How a failed allocation reads in a reason, beside torch's own OOM messages.
_NO_MEMORY = (*OOM_MESSAGES, "MemoryError", "Cannot allocate memory")


@dataclass(frozen=True)
class WorkerMemory:
    """A CUDA device's memory as the worker saw it after its last request, in bytes.

    ``reserved`` is what the worker's allocator holds (its cache included): the next probe
    there reuses it, so it is the worker's own memory, never a neighbour's.
    """

    free: int
    total: int
    reserved: int


def _device_memory(device: str) -> list[int] | None:
    """``[free, total, reserved]`` of the worker's CUDA device; None on a CPU or before CUDA
    was used here (asking would open a context for nothing)."""
    try:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_initialized():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return [int(free), int(total), int(torch.cuda.memory_reserved(index))]
    except Exception:  # a broken context or an odd device name: no report, not a failure
        return None


def _serve(requests: Any, replies: Any, device: str) -> None:
    """The worker's loop: read a probe request line, run it, write the reply line.

    After an error that poisons the CUDA context it says so and returns: the process exits
    and the parent starts a fresh one for the next request.

    A CUDA worker sees its one GPU as ``cuda:0`` (:func:`~autotune.execution.limits.worker_env`): it
    runs everything there, and its replies name the device as the caller did, ``cuda:N``.
    """
    # Ctrl-C goes to the whole process group; the parent decides what to do with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from autotune.measure.probe import run_probe
    from autotune.workloads import load_workload

    shown = f"cuda:{device.partition(':')[2] or 0}" if device.startswith("cuda") else device
    device = worker_device(device)
    here = re.compile(rf"\b{re.escape(device)}\b") if device != shown else None

    def send(*message: Any) -> None:
        text = json.dumps(message)
        replies.write((here.sub(shown, text) if here else text) + "\n")
        replies.flush()

    cache: dict[str, Any] = {}
    send("ready", os.getpid())
    for line in requests:
        ref, candidate_json, settings_json, op, *extra = json.loads(line)
        try:
            if ref not in cache:
                cache[ref] = load_workload(ref)
            if op == "compare":
                from autotune.measure.paired import run_paired

                candidate, reference = (
                    Candidate.model_validate(c) for c in json.loads(candidate_json)
                )
                paired = run_paired(
                    cache[ref],
                    candidate,
                    reference,
                    device,
                    ProbeSettings.model_validate_json(settings_json),
                )
                send("paired", paired.model_dump_json())
                continue
            if op == "facts":
                from autotune.execution.facts import collect_facts

                facts = collect_facts(ref, device).model_dump_json()
                send("facts", facts, _device_memory(device))
                continue
            if op == "diagnose":
                from autotune.diagnose import diagnose

                settings = ProbeSettings.model_validate_json(settings_json)
                found = diagnose(
                    cache[ref],
                    Candidate.model_validate_json(candidate_json),
                    device,
                    steps=settings.steps,
                    seed=settings.seed,
                )
                send("diagnosis", found.model_dump_json(), _device_memory(device))
                continue
            result = run_probe(
                cache[ref],
                Candidate.model_validate_json(candidate_json),
                device,
                ProbeSettings.model_validate_json(settings_json),
                early_stop=EarlyStop.model_validate_json(extra[0]) if extra and extra[0] else None,
            )
            send("result", result.model_dump_json(), _device_memory(device))
        except AutotuneError as exc:
            send("user_error", type(exc).__name__, str(exc))
        except Exception as exc:  # a bug in the workload or in autotune: a crashed probe
            if poisons_context(exc):
                send("poisoned", f"{type(exc).__name__}: {exc}", traceback.format_exc())
                return
            send("crash", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def main() -> None:
    """Entry point of a worker process:
    ``python -m autotune.execution.worker DEVICE REQ_FD REPLY_FD [MEMORY_LIMIT_BYTES]``."""
    device, req_fd, reply_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # First thing: what the probes allocate from here on counts against it
    # (autotune.execution.limits); and GPUs numbered in PCI bus order (the parent set it; before
    # CUDA starts, in any case).
    apply_memory_limit(int(sys.argv[4]) if len(sys.argv) > 4 else None)
    if not device.startswith("cpu"):
        pci_bus_order()
    # The parent logs every decision; the worker only says what goes wrong.
    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("AUTOTUNE_WORKER_LOG_LEVEL", "WARNING"))
    try:
        with os.fdopen(req_fd, "r") as requests, os.fdopen(reply_fd, "w") as replies:
            _serve(requests, replies, device)
    except (BrokenPipeError, KeyboardInterrupt):
        # The parent is gone (killed, or Ctrl-C): nobody is left to read a reply.
        sys.exit(0)


class ProbeWorker(Runner):
    """A persistent worker process for one device.

    Args:
        device: the device probes run on, e.g. ``cpu`` or ``cuda:1``.

    Raises:
        SpecError: ``AUTOTUNE_WORKER_MEMORY`` is not a size (:mod:`autotune.execution.limits`).

    Example:
        >>> with ProbeWorker("cpu") as worker:  # doctest: +SKIP
        ...     result = worker.run("tiny_mlp", candidate, ProbeSettings(steps=5), timeout=30)
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._proc: subprocess.Popen | None = None
        self._requests: Any = None
        self._replies: Any = None
        self.starts = 0
        # The device's memory as the worker last reported it (CUDA only; None until then).
        self.memory: WorkerMemory | None = None
        # The worker's address-space limit in bytes (a CPU worker only; None: none).
        self.memory_limit = worker_memory_limit(device)

    def interrupt(self) -> None:
        # Safe from a signal handler: only sends a signal; run() sees the pipe close.
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def start(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._stop(kill=True)
            self._start()

    def _start(self) -> None:
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
            [sys.executable, "-m", "autotune.execution.worker", self.device, str(req_r), str(rep_w)]
            + [str(self.memory_limit or 0)],
            pass_fds=(req_r, rep_w),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        os.close(req_r)
        os.close(rep_w)
        self._proc = proc
        self._requests = os.fdopen(req_w, "w")
        self._replies = os.fdopen(rep_r, "r")
        reply = self._recv(120)
        if reply is None or reply[0] != "ready":
            self._stop(kill=True)
            raise RuntimeError("the probe worker did not start within 120 s")
        self.starts += 1
        logger.debug("worker pid {} started for {}", proc.pid, self.device)

    def _recv(self, timeout: float) -> list | None:
        """One reply line, or None when none came within ``timeout`` or the worker is gone."""
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            return None
        line = self._replies.readline()
        if not line:
            raise EOFError("worker closed its pipe")
        return json.loads(line)

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
        self._proc = self._requests = self._replies = None
        # A new worker holds nothing yet: the old one's report no longer says anything.
        self.memory = None

    def _noted(self, reason: str) -> str:
        """``reason``, plus the worker's memory limit when the reason is a failed allocation
        under one: the limit, not the machine, may be what ran out."""
        if self.memory_limit and any(sign in reason for sign in _NO_MEMORY):
            return f"{reason}; {limit_note(self.memory_limit)}"
        return reason

    def _noted_result(self, result: ProbeResult) -> ProbeResult:
        if result.reason and (result.outcome == "oom" or result.outcome == "crashed"):
            return result.model_copy(update={"reason": self._noted(result.reason)})
        return result

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def run(
        self,
        workload: str,
        candidate: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
        early_stop: EarlyStop | None = None,
    ) -> ProbeResult:
        """Run one probe in the worker; restart the worker when it died or hung.

        Args:
            workload: the workload reference (the worker imports it).
            candidate: what to train with.
            settings: probe settings; ``time_limit`` is the soft limit.
            timeout: the hard limit in seconds; default ``time_limit`` plus a grace period.

        Returns:
            The probe's result; ``crashed`` with a reason when the worker hung or died.

        Raises:
            WorkloadError, SpecError, DeviceError: the user's mistake, raised again here.
        """
        hard = timeout if timeout is not None else settings.time_limit + _GRACE
        started = time.perf_counter()
        try:
            reply = self._exchange("probe", workload, candidate, settings, hard, early_stop)
        except (EOFError, OSError, ValueError):
            how = _death(self._proc)
            self._stop(kill=True)
            return crashed_result(
                workload,
                candidate,
                self.device,
                settings,
                f"worker process died ({how}) during the probe",
            )
        if reply is None:
            self._stop(kill=True)
            return crashed_result(
                workload,
                candidate,
                self.device,
                settings,
                f"probe exceeded its hard time limit of {hard:.0f}s; worker stopped "
                f"after {time.perf_counter() - started:.0f}s",
                timed_out=True,
            )
        kind = reply[0]
        if kind == "result":
            return self._noted_result(ProbeResult.model_validate_json(reply[1]))
        if kind == "user_error":
            from autotune import errors

            raise getattr(errors, reply[1], WorkloadError)(self._noted(reply[2]))
        if kind == "poisoned":
            # The worker has exited; the next request starts a fresh one.
            logger.warning("{}: {}\n{}", RESTARTED, reply[1], reply[2])
            self._stop(kill=True)
            return crashed_result(
                workload, candidate, self.device, settings, f"{reply[1]}; {RESTARTED}"
            )
        logger.debug("probe crashed in worker:\n{}", reply[2])
        return crashed_result(workload, candidate, self.device, settings, self._noted(reply[1]))

    def _exchange(
        self,
        op: str,
        workload: str,
        candidate: Candidate,
        settings: ProbeSettings,
        timeout: float,
        early_stop: EarlyStop | None = None,
    ) -> list | None:
        """Send one request (starting the worker if needed); its reply, or None on timeout."""
        self.start()
        request = [workload, candidate.model_dump_json(), settings.model_dump_json(), op]
        if early_stop is not None:
            request.append(early_stop.model_dump_json())
        self._requests.write(json.dumps(request) + "\n")
        self._requests.flush()
        reply = self._recv(timeout)
        if reply is not None and reply[0] in ("result", "facts", "diagnosis") and len(reply) > 2:
            self.memory = WorkerMemory(*reply[2]) if reply[2] else None
        return reply

    def compare(
        self,
        workload: str,
        candidate: Candidate,
        reference: Candidate,
        settings: ProbeSettings,
        *,
        timeout: float | None = None,
    ) -> PairedResult:
        """Run a paired measurement in the worker; a crashed arm when the worker hung or died."""
        hard = timeout if timeout is not None else settings.time_limit + _GRACE
        started = time.perf_counter()
        both = json.dumps([candidate.model_dump(mode="json"), reference.model_dump(mode="json")])
        reason = ""
        try:
            self.start()
            request = [workload, both, settings.model_dump_json(), "compare"]
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
            reply = self._recv(hard)
        except (EOFError, OSError, ValueError):
            how = _death(self._proc)
            self._stop(kill=True)
            reply, reason = None, f"worker process died ({how}) during the paired run"
        timed_out = False
        if reply is None and not reason:
            self._stop(kill=True)
            timed_out = True
            reason = (
                f"paired run exceeded its hard time limit of {hard:.0f}s; worker stopped after "
                f"{time.perf_counter() - started:.0f}s"
            )
        elif reply is not None and reply[0] == "paired":
            paired = PairedResult.model_validate_json(reply[1])
            return paired.model_copy(
                update={
                    "candidate": self._noted_result(paired.candidate),
                    "reference": self._noted_result(paired.reference),
                }
            )
        elif reply is not None and reply[0] == "user_error":
            from autotune import errors

            raise getattr(errors, reply[1], WorkloadError)(self._noted(reply[2]))
        elif reply is not None:
            reason = self._noted(reply[1])
        return PairedResult(
            candidate=crashed_result(
                workload, candidate, self.device, settings, reason, timed_out=timed_out
            ),
            reference=crashed_result(
                workload, reference, self.device, settings, reason, timed_out=timed_out
            ),
        )

    def facts(self, workload: str, *, timeout: float = 120.0) -> WorkerFacts:
        reply = None
        try:
            reply = self._exchange(
                "facts",
                workload,
                Candidate(precision="fp32", batch_size=1, learning_rate=1.0),
                ProbeSettings(),
                timeout,
            )
        except (EOFError, OSError, ValueError):
            reply = None
        if reply is None:
            self._stop(kill=True)
            raise RuntimeError(f"the probe worker did not answer about workload {workload!r}")
        if reply[0] == "facts":
            return WorkerFacts.model_validate_json(reply[1])
        if reply[0] == "user_error":
            from autotune import errors

            raise getattr(errors, reply[1], WorkloadError)(reply[2])
        if reply[0] == "poisoned":
            self._stop(kill=True)
        raise WorkloadError(f"workload {workload!r} could not be inspected: {reply[1]}")

    def diagnose(
        self,
        workload: str,
        candidate: Candidate,
        *,
        steps: int = 3,
        seed: int = 0,
        timeout: float = 60.0,
    ) -> dict | None:
        """Run :func:`autotune.diagnose.diagnose` in the worker; its JSON, or None when the
        worker hung or died (the diagnosis is evidence, never a reason to fail a search)."""
        settings = ProbeSettings(steps=steps, seed=seed)
        try:
            reply = self._exchange("diagnose", workload, candidate, settings, timeout)
        except (EOFError, OSError, ValueError):
            reply = None
        if reply is None or reply[0] != "diagnosis":
            if reply is None or reply[0] == "poisoned":
                self._stop(kill=True)
            return None
        return json.loads(reply[1])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._requests.close()
        self._stop()


if __name__ == "__main__":
    main()


def _death(proc: subprocess.Popen | None) -> str:
    """How a worker whose pipe just closed ended: ``exit code 1``, ``killed by SIGKILL``.

    The pipe closes a moment before the process can be reaped: wait a little for its code.
    """
    if proc is None:
        return "no process"
    try:
        code = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return "its pipe closed, the process still runs"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
