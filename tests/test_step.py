"""The step engine and its memory helpers: applied steps, loss read-back, OOM in every form,
recovery before the cache is cleared, each run's peak memory its own, and the memory margin."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from autotune.measure import step
from autotune.measure.ceilings import find_ceiling
from autotune.measure.memory import PeakMemory, is_oom, memory_cap, memory_fraction
from autotune.measure.probe import run_probe
from autotune.measure.result import ProbeResult
from autotune.measure.step import StepEngine
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.workloads import Workload, tiny_mlp

CPU = torch.device("cpu")
MIB = 2**20


def cand(precision: str = "fp32", batch_size: int = 16, **kw: Any) -> Candidate:
    return Candidate(precision=precision, batch_size=batch_size, learning_rate=0.05, **kw)


def with_adamw(workload: Workload, *, fused: bool) -> Workload:
    """The workload with AdamW, fused (one kernel per step, common on GPUs) or not."""

    def adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, fused=fused)

    return dataclasses.replace(workload, build_optimizer=adamw)


def with_sgd(workload: Workload, *, fused: bool) -> Workload:
    """The workload with SGD and momentum, fused or not."""

    def sgd(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=fused)

    return dataclasses.replace(workload, build_optimizer=sgd)


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


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused_adamw"])
def test_steps_grad_scaler_skips_are_counted_as_not_applied(fused: bool) -> None:
    # 2^60 overflows every fp16 gradient: each step is skipped. A fused optimizer is called
    # every step (its kernel skips by itself): the count must not depend on that.
    wl = with_adamw(tiny_mlp(), fused=fused)
    with StepEngine(wl, cand("fp16", init_scale=2.0**60), CPU) as engine:
        engine.build()
        assert engine.model is not None
        weights = [p.detach().clone() for p in engine.model.parameters()]
        block = engine.run_steps(3)
        assert (engine.steps, engine.applied, engine.skipped, block.skipped) == (3, 0, 3, 3)
        assert engine.scale() == 2.0**57
        assert all(
            torch.equal(w, p) for w, p in zip(weights, engine.model.parameters(), strict=True)
        )
        # Steps outside a block are counted too, and come back with their losses.
        engine.step()
        assert len(engine.read_losses()) == 4 and engine.skipped == 4
    # Without a scaler nothing is skipped: fp32, and bf16 (its range needs none).
    for precision in ("fp32", "bf16"):
        with StepEngine(wl, cand(precision), CPU) as engine:
            engine.build()
            block = engine.run_steps(3)
            assert (engine.applied, engine.skipped, block.skipped, engine.scale()) == (3, 0, 0, 1.0)


def test_a_probe_with_a_fused_optimizer_stops_when_its_steps_keep_being_skipped() -> None:
    # Every step overflows: past warm-up the skip rate is 100%, far above max_skip_rate.
    wl = with_adamw(tiny_mlp(), fused=True)
    settings = ProbeSettings(warmup_steps=0, steps=10, check_every=5, min_time=0)
    r = run_probe(wl, cand("fp16", init_scale=2.0**60), "cpu", settings)
    assert r.outcome == "diverged", r.summary()
    assert r.reason.startswith("GradScaler skipped 5 of 5 steps after warmup")
    assert r.skipped_steps == 5


def test_a_fused_sgd_under_fp16_is_named_with_its_fix() -> None:
    # torch's fused SGD creates its momentum buffer uninitialized on a skipped first step: on a
    # GPU fp16 then diverges though the mode is safe. The user's own loop would too, so the
    # engine names the cause and the fix, and a probe that diverged with skipped steps says so.
    fused = with_sgd(tiny_mlp(), fused=True)
    with StepEngine(fused, cand("fp16"), CPU) as engine:
        engine.build()
        assert engine.defect is not None and "build the SGD with fused=False" in engine.defect
    for wl, precision in (
        (fused, "fp32"),
        (fused, "bf16"),
        (with_sgd(tiny_mlp(), fused=False), "fp16"),
    ):
        with StepEngine(wl, cand(precision), CPU) as engine:
            engine.build()
            assert engine.defect is None, (precision, engine.defect)
    settings = ProbeSettings(warmup_steps=0, steps=10, check_every=5, min_time=0)
    r = run_probe(fused, cand("fp16", init_scale=2.0**60), "cpu", settings)
    assert r.outcome == "diverged" and r.skipped_steps == 5, r.summary()
    assert r.reason.startswith("GradScaler skipped 5 of 5 steps after warmup")
    assert r.reason.endswith("build the SGD with fused=False")
    # A stock SGD's divergence is not blamed on it.
    r = run_probe(
        with_sgd(tiny_mlp(), fused=False), cand("fp16", init_scale=2.0**60), "cpu", settings
    )
    assert r.outcome == "diverged" and "fused" not in r.reason, r.summary()


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


def test_closing_a_compiled_run_drops_the_compiled_code_it_leaves_behind() -> None:
    # Compiled code (and with CUDA graphs, their memory pools) outlives the model: the next
    # run in the process would start with this one's memory. Seen here through a function
    # compiled meanwhile: after the compiled run closes, calling it compiles it again.
    compiles: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        compiles.append(1)
        return gm.forward

    double = torch.compile(lambda x: x * 2, backend=backend)
    with StepEngine(tiny_mlp(), cand("fp32"), CPU) as engine:
        engine.build()
        double(torch.ones(2))
    double(torch.ones(2))
    assert len(compiles) == 1  # an eager run leaves the compiler's caches alone
    with StepEngine(tiny_mlp(), cand("fp32", compile=True), CPU) as engine:
        engine.build()  # compiles at its first step; none is taken here
        double(torch.ones(2))
        assert len(compiles) == 2  # its build started the compiler afresh
    double(torch.ones(2))
    assert len(compiles) == 3


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
    settings = ProbeSettings(warmup_steps=0, steps=2, min_time=0)  # counted, not timed

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


# ---- the memory margin ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "reserved", "prior", "fraction"),
    [
        (60, 0, 1.0, 0.5),  # 60 of 100 free, 10 kept: 50 may be taken
        (60, 20, 1.0, 0.7),  # what this process already holds is its own to reuse
        (5, 0, 1.0, 0.0),  # the margin is not free even now: nothing may be taken
        (100, 0, 0.3, 0.3),  # a limit the process already has is never lifted
    ],
)
def test_the_share_of_the_device_a_run_may_take_keeps_the_margin_free(
    free: int, reserved: int, prior: float, fraction: float
) -> None:
    got = memory_fraction(0.1, free * MIB, 100 * MIB, reserved * MIB, prior)
    assert got == pytest.approx(fraction)


class _FakeCudaLimit:
    """The CUDA allocator's per-process limit, on a device with 100 MiB, 60 of them free."""

    def __init__(self) -> None:
        self.fraction = 1.0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def set_fraction(fraction: float, device: Any = None) -> None:
            self.fraction = fraction

        for name, fn in {
            "is_available": lambda: True,
            "mem_get_info": lambda device=None: (60 * MIB, 100 * MIB),
            "memory_reserved": lambda device=None: 0,
            "get_per_process_memory_fraction": lambda device=None: self.fraction,
            "set_per_process_memory_fraction": set_fraction,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_a_run_is_capped_at_the_margin_and_the_cap_is_lifted_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit = _FakeCudaLimit()
    limit.install(monkeypatch)
    cuda = torch.device("cuda", 0)
    with memory_cap(cuda, 0.1) as fraction:
        assert fraction == limit.fraction == pytest.approx(0.5)
    assert limit.fraction == 1.0
    # Also when the run fails (an OOM at the cap is the usual way), and a process's own limit
    # is put back as it was.
    limit.fraction = 0.3
    with pytest.raises(torch.OutOfMemoryError), memory_cap(cuda, 0.1):
        assert limit.fraction == pytest.approx(0.3)
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert limit.fraction == 0.3
    # No margin, or a CPU: nothing is capped.
    for device, margin in ((cuda, None), (CPU, 0.1)):
        with memory_cap(device, margin) as fraction:
            assert fraction is None and limit.fraction == 0.3
