"""The step engine and its memory helpers: applied steps, loss read-back, OOM in every form,
recovery before the cache is cleared, and each run's peak memory its own."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from autotune import step
from autotune.ceilings import find_ceiling
from autotune.memory import PeakMemory, is_oom
from autotune.probe import run_probe
from autotune.result import ProbeResult
from autotune.spec import Candidate, ProbeSettings
from autotune.step import StepEngine
from autotune.workloads import Workload, tiny_mlp

CPU = torch.device("cpu")
MIB = 2**20


def cand(precision: str = "fp32", batch_size: int = 16, **kw: Any) -> Candidate:
    return Candidate(precision=precision, batch_size=batch_size, learning_rate=0.05, **kw)


# ---- the engine ----------------------------------------------------------------------------


def test_a_block_runs_between_syncs_and_its_losses_come_back_in_one_read() -> None:
    with StepEngine(tiny_mlp(), cand("bf16"), CPU) as engine:
        engine.build()
        block = engine.run_steps(4)
        assert (block.first_step, block.steps, block.skipped) == (0, 4, 0)
        assert block.seconds > 0 and block.step_time == pytest.approx(block.seconds / 4)
        assert len(engine.pending) == 4 and engine.losses == []
        values = engine.read_losses()
        assert len(values) == 4 and engine.losses == values and not engine.pending
        assert engine.run_steps(2).first_step == 4
        assert engine.read_losses() == engine.losses[4:] and len(engine.losses) == 6


def test_steps_grad_scaler_skips_are_counted_as_not_applied() -> None:
    # 2^60 overflows every fp16 gradient: GradScaler skips each optimizer step.
    with StepEngine(tiny_mlp(), cand("fp16", init_scale=2.0**60), CPU) as engine:
        engine.build()
        block = engine.run_steps(3)
        assert (engine.steps, engine.applied, engine.skipped, block.skipped) == (3, 0, 3, 3)
        assert engine.scale() == 2.0**57
    with StepEngine(tiny_mlp(), cand("fp32"), CPU) as engine:
        engine.build()
        engine.run_steps(3)
        assert (engine.applied, engine.skipped, engine.scale()) == (3, 0, 1.0)


def test_the_same_seed_gives_the_same_losses() -> None:
    def losses(seed: int) -> list[float]:
        torch.manual_seed(seed)
        with StepEngine(tiny_mlp(), cand(), CPU, seed=seed) as engine:
            engine.build()
            engine.run_steps(3)
            return engine.read_losses()

    assert losses(0) == losses(0) != losses(1)


def test_closing_drops_the_run_and_stops_counting_steps() -> None:
    engine = StepEngine(tiny_mlp(), cand(), CPU)
    with engine:
        engine.build()
        opt = engine.optimizer
        engine.step()
    assert engine.model is None and engine.optimizer is None and engine.batches is None
    assert opt is not None
    opt.step()  # the caller's optimizer goes on; the closed engine no longer counts it
    assert engine.applied == 1


def test_an_oom_frees_the_run_before_the_cache_is_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    model_ref: list[weakref.ref] = []

    def policy(engine: StepEngine) -> None:
        engine.build()
        model = engine.model  # a loop's local, held by the traceback while it is handled
        model_ref.append(weakref.ref(model))
        engine.step()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore")

    # What the engine frees must already be gone when the cache is cleared.
    monkeypatch.setattr(step, "release_memory", lambda dev: seen.append(model_ref[0]() is None))
    with StepEngine(tiny_mlp(), cand(), CPU) as engine:
        message = engine.run(policy)
        assert message == "CUDA out of memory. Tried to allocate 8.00 GiB"
        assert engine.steps == 1 and engine.model is None
    assert seen == [True]


def test_an_error_that_is_not_an_oom_propagates() -> None:
    def policy(engine: StepEngine) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with StepEngine(tiny_mlp(), cand(), CPU) as engine, pytest.raises(RuntimeError, match="mat1"):
        engine.run(policy)


# ---- what counts as out of memory ----------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "oom"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ALLOC"), True),
        (RuntimeError("CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), False),
        (ValueError("CUDA out of memory"), False),  # not raised by an allocator
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_is_oom(exc: BaseException, oom: bool) -> None:
    assert is_oom(exc) is oom


class _LibraryOOM(torch.nn.Module):
    """Fails above ``limit`` as cuBLAS does when it cannot allocate its workspace."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.inner = limit, torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise RuntimeError(
                "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
            )
        return self.inner(x)


def test_a_library_oom_is_an_oom_outcome_and_limits_the_ceiling_by_memory() -> None:
    base = tiny_mlp()
    wl = Workload(
        name="cublas_oom_above_32",
        build_model=lambda: _LibraryOOM(32),
        make_batches=base.make_batches,
        build_optimizer=base.build_optimizer,
        base_lr=base.base_lr,
        base_batch_size=16,
    )
    settings = ProbeSettings(warmup_steps=0, steps=2)

    def try_batch(bs: int) -> ProbeResult:
        return run_probe(wl, cand(batch_size=bs), "cpu", settings)

    r = try_batch(33)
    assert r.outcome == "oom", r.summary()
    assert r.reason.startswith("out of memory at batch_size=33, step 0: CUDA error: CUBLAS_")
    ceiling = find_ceiling(try_batch, "fp32", start=16, cap=256)
    assert (ceiling.batch_size, ceiling.limited_by) == (32, "memory")


# ---- peak memory ---------------------------------------------------------------------------


class _FakeAllocator:
    """The CUDA caching allocator's bookkeeping: freed blocks stay reserved until emptied."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n  # the block stays in the cache

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def test_each_runs_cuda_peak_is_its_own_not_an_earlier_runs_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeAllocator()
    for name, fn in {
        "empty_cache": fake.empty_cache,
        "reset_peak_memory_stats": fake.reset_peak_memory_stats,
        "memory_allocated": lambda device=None: fake.allocated,
        "max_memory_allocated": lambda device=None: fake.peak_allocated,
        "max_memory_reserved": lambda device=None: fake.peak_reserved,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    cuda = torch.device("cuda", 0)
    figures = []
    for size in (1024 * MIB, 100 * MIB):  # a large run, then a small one, in one process
        peak = PeakMemory(cuda)
        peak.start()
        fake.alloc(size)
        figures.append((peak.allocated(), peak.reserved(), peak.growth()))
        fake.free(size)
    assert figures[1] == (100 * MIB, 100 * MIB, 100 * MIB)
    assert PeakMemory(cuda).source == "cuda_allocated"


def test_a_cpu_peak_is_the_growth_of_resident_memory() -> None:
    peak = PeakMemory(CPU)
    peak.start()
    block = torch.ones(64 * MIB // 4)  # 64 MiB, touched
    growth = peak.growth()
    del block
    if peak.source == "unavailable":
        pytest.skip("this system cannot reset its peak resident memory")
    assert growth is not None and growth >= 32 * MIB
    assert peak.allocated() == peak.growth() and peak.reserved() is None


@pytest.mark.gpu
def test_a_probe_after_a_larger_one_reports_its_own_reserved_peak() -> None:
    from autotune.workloads import load_workload

    dev = torch.device("cuda", torch.cuda.current_device())
    wl = load_workload("resnet18")
    settings = ProbeSettings(warmup_steps=1, steps=2, check_every=2)
    small = run_probe(wl, cand("bf16", batch_size=64), dev, settings)
    large = run_probe(wl, cand("bf16", batch_size=1024), dev, settings)
    again = run_probe(wl, cand("bf16", batch_size=64), dev, settings)
    assert small.ok and large.ok and again.ok
    assert again.peak_memory_reserved < large.peak_memory_reserved
    assert again.peak_memory_reserved <= 1.5 * small.peak_memory_reserved
