"""What only a real CUDA device can show. Skipped without one; `make gpu-check` runs them all."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from autotune import load_config
from autotune.execution.probe_worker import InProcessRunner, ProbeWorker
from autotune.measure.ceilings import find_ceiling, memory_budget
from autotune.measure.memory import memory_cap
from autotune.measure.precision import (
    autocast,
    backend_flags,
    get_mode,
    make_scaler,
    resolve_device,
)
from autotune.measure.probe import run_probe
from autotune.measure.step import StepEngine
from autotune.measure.timed import TimedRun
from autotune.schema.spec import Candidate, ProbeSettings, load_spec
from autotune.search import run_search
from autotune.testing.workloads import CAPPED_BYTES
from autotune.workloads import load_workload

pytestmark = pytest.mark.gpu

SHORT = ProbeSettings(warmup_steps=2, steps=5, check_every=5, min_time=0)
STUDIES = Path(__file__).resolve().parent.parent / "studies"


def device() -> torch.device:
    return resolve_device("cuda")


def margin_leaving(dev: torch.device, nbytes: int) -> float:
    """The memory margin that leaves this process ``nbytes`` of the device (its cache emptied
    first): on a 141 GB device, a margin at which memory binds long before any batch cap."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return (free + torch.cuda.memory_reserved(dev) - nbytes) / total


def relative_matmul_error(dev: torch.device) -> float:
    """fp32 matmul error against fp64: about 1e-6 in IEEE fp32, about 1e-3 with TF32."""
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(1024, 1024, device=dev, generator=gen)
    b = torch.randn(1024, 1024, device=dev, generator=gen)
    exact = a.double() @ b.double()
    return ((a @ b).double() - exact).abs().max().item() / exact.abs().max().item()


def test_tf32_is_really_on_in_tf32_mode_and_off_in_fp32() -> None:
    dev = device()
    if torch.cuda.get_device_capability(dev) < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0+")
    with backend_flags(get_mode("fp32")):
        ieee = relative_matmul_error(dev)
    with backend_flags(get_mode("tf32")):
        tf32 = relative_matmul_error(dev)
    assert ieee < 1e-5
    assert tf32 > 10 * ieee


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_autocast_modes_compute_in_their_dtype_on_cuda(precision: str, dtype: torch.dtype) -> None:
    dev = device()
    mode = get_mode(precision)
    model = torch.nn.Linear(64, 64).to(dev)
    with backend_flags(mode), autocast(mode, dev):
        out = model(torch.randn(8, 64, device=dev))
    assert out.dtype == dtype
    assert make_scaler(mode, dev).is_enabled() == (precision == "fp16")


def test_peak_memory_is_measured_and_grows_with_the_batch() -> None:
    dev = device()
    wl = load_workload("resnet18")
    small = run_probe(
        wl, Candidate(precision="bf16", batch_size=64, learning_rate=0.05), dev, SHORT
    )
    # The same lr at both batches: the linear rule's 0.4 at bs=512 diverges by step 3 on an H200
    # (no warm-up in a probe), and this test is about memory.
    large = run_probe(
        wl, Candidate(precision="bf16", batch_size=512, learning_rate=0.05), dev, SHORT
    )
    assert small.ok and large.ok
    assert 0 < small.peak_memory_allocated < large.peak_memory_allocated
    assert large.peak_memory_reserved >= large.peak_memory_allocated


def test_a_real_oom_is_caught_and_the_next_probe_runs() -> None:
    # The cap lives in the worker: loading resnet18_capped there limits that process's allocator
    # to CAPPED_BYTES (2 GiB), so the OOM is real even with 140 GB free. ResNet-18 at 32x32 needs
    # about 0.5 MB a sample in fp32: 8192 samples want about 4 GB.
    capped = "autotune.testing.workloads:resnet18_capped"
    huge = Candidate(precision="fp32", batch_size=8192, learning_rate=0.1)
    with ProbeWorker(str(device())) as worker:
        r = worker.run(capped, huge, SHORT, timeout=180)
        assert r.outcome == "oom", r.summary()
        assert "out of memory" in r.reason
        pid = worker.pid
        # Freed: the worker's allocator gave back what the failed probe took.
        assert worker.memory is not None and worker.memory.reserved < CAPPED_BYTES / 4
        ok = worker.run(
            capped,
            Candidate(precision="fp32", batch_size=128, learning_rate=0.1),
            SHORT,
            timeout=180,
        )
        assert ok.outcome == "completed", ok.summary()
        # In the same process: the OOM was recovered from, not ended by a restart.
        assert worker.pid == pid
        assert ok.peak_memory_reserved is not None and ok.peak_memory_reserved <= CAPPED_BYTES


def test_the_ceiling_finder_on_a_real_device_leaves_the_margin_free() -> None:
    # A margin that leaves CAPPED_BYTES (2 GiB): ResNet-18 needs about 0.5 MB a sample, so the
    # margin binds in the thousands, far below the cap. Each try runs under the margin, as a
    # probe does, and the process's own limit is back after each.
    dev = device()
    wl = load_workload("resnet18")
    prior = torch.cuda.get_per_process_memory_fraction(dev)
    margin = margin_leaving(dev, CAPPED_BYTES)
    budget = memory_budget(dev, margin)
    assert budget is not None and budget > 0
    settings = ProbeSettings(warmup_steps=1, steps=1, check_every=1, min_time=0)

    def try_batch(bs: int):
        cand = Candidate(precision="bf16", batch_size=bs, learning_rate=0.1)
        with memory_cap(dev, margin):
            return run_probe(wl, cand, dev, settings)

    cap = 2**15
    ceiling = find_ceiling(try_batch, "bf16", start=256, cap=cap, budget_bytes=budget)
    assert 256 <= ceiling.batch_size < cap, ceiling.tries
    assert ceiling.limited_by in ("memory", "margin"), ceiling.tries
    fitting = [t for t in ceiling.tries if t.fits]
    assert all(t.peak_memory is not None and t.peak_memory <= budget for t in fitting)
    assert torch.cuda.get_per_process_memory_fraction(dev) == pytest.approx(prior)


def test_a_probe_runs_out_of_memory_at_the_margin_and_the_cap_is_lifted_after() -> None:
    # The probe's policy runs under the margin its settings carry (TimedRun.memory_margin).
    dev = device()
    wl = load_workload("resnet18")
    prior = torch.cuda.get_per_process_memory_fraction(dev)
    margin = margin_leaving(dev, CAPPED_BYTES)
    # About 4 GB in fp32: more than the margin leaves, far less than the device has free.
    huge = Candidate(precision="fp32", batch_size=8192, learning_rate=0.1)
    with StepEngine(wl, huge, dev) as engine:
        run = TimedRun(engine, SHORT, time.perf_counter())
        run.memory_margin = margin
        oom = engine.run(lambda e: run.measure())
    assert oom is not None
    assert torch.cuda.get_per_process_memory_fraction(dev) == pytest.approx(prior)
    small = Candidate(precision="fp32", batch_size=128, learning_rate=0.1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    with StepEngine(wl, small, dev) as engine:
        run = TimedRun(engine, SHORT, time.perf_counter())
        run.memory_margin = margin
        assert engine.run(lambda e: run.measure()) is None
        assert run.outcome == "completed", run.reason
        # The allocator never held more than the margin left (give or take the device's own
        # free memory moving meanwhile).
        assert torch.cuda.max_memory_reserved(dev) <= CAPPED_BYTES + 64 * 2**20


def test_a_margin_other_processes_hold_is_no_room_at_all_not_a_batch_that_failed() -> None:
    # A margin of more than is free (as when neighbours hold it): the run does not start under a
    # cap of 0, it says the margin is taken, and the process's limit is untouched.
    from autotune.measure.oom import MARGIN_TAKEN

    dev = device()
    prior = torch.cuda.get_per_process_memory_fraction(dev)
    free, total = torch.cuda.mem_get_info(dev)
    small = Candidate(precision="fp32", batch_size=16, learning_rate=0.1)
    with StepEngine(load_workload("tiny_mlp"), small, dev) as engine:
        run = TimedRun(engine, SHORT, time.perf_counter())
        run.memory_margin = min(0.999, free / total + 0.001)
        oom = engine.run(lambda e: run.measure())
    assert oom is not None and MARGIN_TAKEN in oom
    assert torch.cuda.get_per_process_memory_fraction(dev) == pytest.approx(prior)


def test_a_training_run_keeps_the_memory_margin_free() -> None:
    # As a probe does: a run that needs more than the margin leaves runs out of memory.
    from autotune.train import TrainSettings, train

    dev = device()
    prior = torch.cuda.get_per_process_memory_fraction(dev)
    settings = TrainSettings(
        steps=2, warmup_steps=1, memory_margin=margin_leaving(dev, CAPPED_BYTES)
    )
    huge = Candidate(precision="fp32", batch_size=8192, learning_rate=0.1)
    assert train(load_workload("resnet18"), huge, dev, settings).outcome == "oom"
    assert torch.cuda.get_per_process_memory_fraction(dev) == pytest.approx(prior)


def test_a_ceiling_trys_peak_leaves_out_the_cudnn_algorithm_search() -> None:
    # With cudnn.benchmark, cuDNN tries its algorithms in the first step of a new shape, with
    # as large a workspace as it can get. The try's peak counts from after that step: the
    # same try again, its algorithms cached (no search), has the same peak.
    dev = device()
    wl = load_workload("resnet18")
    try_settings = ProbeSettings(warmup_steps=1, steps=1, check_every=1, min_time=0)
    # A size no other test runs: its first step searches.
    cand = Candidate(precision="bf16", batch_size=200, learning_rate=0.1)
    searched = run_probe(wl, cand, dev, try_settings)
    cached = run_probe(wl, cand, dev, try_settings)
    assert searched.ok and cached.ok, (searched.summary(), cached.summary())
    assert searched.peak_memory_reserved is not None and cached.peak_memory_reserved is not None
    assert searched.peak_memory_reserved <= 1.1 * cached.peak_memory_reserved


def test_a_training_runs_peak_leaves_out_the_cudnn_algorithm_search() -> None:
    # As a ceiling try's: a training run's peak counts from after its first step, so a size
    # whose first step searches cuDNN's algorithms has the peak of one whose search is cached.
    from autotune.train import TrainSettings, train

    dev = device()
    wl = load_workload("resnet18")
    cand = Candidate(
        precision="bf16", batch_size=208, learning_rate=0.1
    )  # a size no other test runs
    settings = TrainSettings(steps=4, warmup_steps=2, check_every=2)
    searched, cached = (train(wl, cand, dev, settings) for _ in range(2))
    assert searched.peak_memory_bytes is not None and cached.peak_memory_bytes is not None
    assert searched.peak_memory_bytes <= 1.1 * cached.peak_memory_bytes


def test_a_compiled_probe_with_cuda_graphs_gives_their_memory_back() -> None:
    # CUDA graphs keep memory pools that outlive the model; a later eager probe in the same
    # worker would see them in its reserved peak and find a lower ceiling.
    dev = device()
    wl = load_workload("tiny_convnet")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(dev)
    graphs = Candidate(
        precision="bf16",
        batch_size=16384,  # about 40 kB a sample: pools of hundreds of MB
        learning_rate=0.1,
        compile=True,
        compile_mode="reduce-overhead",
    )
    r = run_probe(wl, graphs, dev, SHORT)
    assert r.ok, r.summary()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(dev) - before < 128 * 2**20


def test_a_fused_optimizers_skipped_steps_are_counted_on_cuda() -> None:
    # GradScaler calls a fused optimizer every step; its kernel skips a non-finite one itself.
    def fused_adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, fused=True)

    dev = device()
    wl = dataclasses.replace(load_workload("tiny_mlp"), build_optimizer=fused_adamw)
    overflow = Candidate(precision="fp16", batch_size=32, learning_rate=0.01, init_scale=2.0**60)
    with StepEngine(wl, overflow, dev) as engine:
        engine.build()
        block = engine.run_steps(3)
        engine.read_losses()
        assert (engine.skipped, engine.applied, block.skipped) == (3, 0, 3)
    for precision in ("fp32", "bf16"):
        cand = Candidate(precision=precision, batch_size=32, learning_rate=0.01)
        with StepEngine(wl, cand, dev) as engine:
            engine.build()
            assert engine.run_steps(3).skipped == 0 and engine.skipped == 0


def test_a_built_in_fp16_step_reads_nothing_back_to_the_host() -> None:
    # The built-in AdamW is fused on CUDA: GradScaler's inf check stays on the device (an
    # unfused optimizer reads it back every step), and so does the skip count. (The built-in
    # SGD is not fused: torch's fused SGD mistrains on skipped steps; the test below.)
    dev = device()
    cand = Candidate(precision="fp16", batch_size=8, learning_rate=0.01)
    with StepEngine(load_workload("tiny_gpt"), cand, dev) as engine:
        engine.build()
        engine.step()  # first-use costs (cuDNN's search, the loss check) outside the check
        engine.sync()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(engine.read_losses()) == 4


@pytest.mark.parametrize("name", ["resnet18", "tiny_convnet", "tiny_mlp"])
def test_a_built_in_sgd_trains_on_after_grad_scalers_skipped_first_steps(name: str) -> None:
    # With torch's fused SGD (as these were built until 2026-12-04), every fp16 ResNet-18 run
    # whose scale started above its gradients' range went to NaN within five steps on an H200:
    # the skipped first step left the momentum buffer uninitialized.
    dev = device()
    wl = load_workload(name)
    cand = Candidate(precision="fp16", batch_size=32, learning_rate=wl.base_lr, init_scale=2.0**30)
    with StepEngine(wl, cand, dev) as engine:
        engine.build()
        assert engine.defect is None
        engine.run_steps(40)
        losses = engine.read_losses()
        assert engine.skipped >= 1 and engine.applied >= 5, (engine.skipped, engine.applied)
        assert all(math.isfinite(v) for v in losses), losses
        assert engine.model is not None
        assert all(bool(torch.isfinite(p).all()) for p in engine.model.parameters())


def test_a_cuda_graphs_models_losses_read_back_after_later_replays() -> None:
    # With CUDA graphs the loss a compiled step returns lives in the graph's pool, which the
    # next replay overwrites: the engine keeps copies, and reads every step's own value.
    dev = device()
    cand = Candidate(
        precision="bf16",
        batch_size=64,
        learning_rate=0.05,
        compile=True,
        compile_mode="reduce-overhead",
    )
    base = load_workload("tiny_mlp")

    class WithLoss(torch.nn.Module):  # the loss inside the compiled forward, as in transformers
        def __init__(self) -> None:
            super().__init__()
            self.net = base.build_model()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(x), y)

    wl = dataclasses.replace(base, build_model=WithLoss, loss=lambda model, batch: model(*batch))
    with StepEngine(wl, cand, dev) as engine:
        engine.build()
        for _ in range(6):
            engine.step()
        losses = engine.read_losses()
    assert len(losses) == 6 and all(x == x for x in losses)
    assert len(set(losses)) > 1  # each step's own loss, not the last replay's six times


def test_a_short_search_on_the_gpu_writes_a_validated_config(tmp_path: Path) -> None:
    spec = load_spec(STUDIES / "tiny.yaml").with_overrides(
        {"storage": f"sqlite:///{tmp_path / 's.db'}", "device": "cuda", "budget": "30s"}
    )
    result = run_search(spec, out_dir=tmp_path / "out", runner=InProcessRunner(str(device())))
    cfg = load_config(result.path)
    assert cfg.environment.capability is not None
    assert cfg.evidence.trials.complete >= 3
    assert cfg.evidence.baseline_throughput > 0
    if cfg.precision != "fp32":
        assert cfg.evidence.validated
