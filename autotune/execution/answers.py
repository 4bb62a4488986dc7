"""The worker's side of each request (a probe, a paired run, the facts, a diagnosis), answered in
the worker process, where torch and the workloads live."""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel

from autotune.errors import AutotuneError
from autotune.execution.collect import collect_facts
from autotune.execution.messages import (
    CompareRequest,
    CrashReply,
    DiagnoseRequest,
    DiagnosisReply,
    FactsReply,
    FactsRequest,
    PairedReply,
    PoisonedReply,
    ProbeRequest,
    ResultReply,
    UserErrorReply,
    WorkerMemory,
    decode_request,
)
from autotune.measure.knobs import poisons_context
from autotune.measure.paired import run_paired
from autotune.measure.probe import run_probe
from autotune.workloads import load_workload

__all__ = ["answer", "device_memory"]


def device_memory(device: str) -> WorkerMemory | None:
    """The worker's CUDA device's memory; None on a CPU or before CUDA was used here (asking
    would open a context for nothing)."""
    try:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_initialized():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return WorkerMemory(int(free), int(total), int(torch.cuda.memory_reserved(index)))
    except Exception:  # a broken context or an odd device name: no report, not a failure
        return None


def answer(line: str, cache: dict[str, Any], device: str) -> BaseModel:
    """The reply to one request line; an exception becomes a reply too, by what it means (a
    line that is no request, a bug, is a crash: the worker lives on).

    Args:
        line: one request, as :func:`~autotune.execution.messages.encode` wrote it.
        cache: the workloads this worker has loaded, by reference (filled in here).
        device: the device as the worker names it (``cuda:0`` for its one GPU).

    Returns:
        The reply to send back.
    """
    try:
        request = decode_request(line)
        if request.workload not in cache:
            cache[request.workload] = load_workload(request.workload)
        workload = cache[request.workload]
        if isinstance(request, CompareRequest):
            return _compare(request, workload, device)
        if isinstance(request, FactsRequest):
            return _facts(request, device)
        if isinstance(request, DiagnoseRequest):
            return _diagnose(request, workload, device)
        return _probe(request, workload, device)
    except AutotuneError as exc:
        return UserErrorReply.from_exception(exc)
    except Exception as exc:  # a bug in the workload or in autotune: a crashed probe
        if poisons_context(exc):
            return PoisonedReply.from_exception(exc)
        return CrashReply.from_exception(exc)


def _probe(request: ProbeRequest, workload: Any, device: str) -> ResultReply:
    result = run_probe(
        workload, request.candidate, device, request.settings, early_stop=request.early_stop
    )
    return ResultReply(result=result, memory=device_memory(device))


def _compare(request: CompareRequest, workload: Any, device: str) -> PairedReply:
    paired = run_paired(workload, request.candidate, request.reference, device, request.settings)
    return PairedReply(paired=paired)


def _facts(request: FactsRequest, device: str) -> FactsReply:
    return FactsReply(facts=collect_facts(request.workload, device), memory=device_memory(device))


def _diagnose(request: DiagnoseRequest, workload: Any, device: str) -> DiagnosisReply:
    # Loaded on the first diagnosis only: a search asks for one after a divergence, if at all.
    from autotune.diagnose import diagnose

    found = diagnose(workload, request.candidate, device, steps=request.steps, seed=request.seed)
    # Its JSON, as the in-process runner returns it.
    diagnosis = json.loads(found.model_dump_json())
    return DiagnosisReply(diagnosis=diagnosis, memory=device_memory(device))
