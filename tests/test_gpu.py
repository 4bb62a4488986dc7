"""What only a real CUDA device can show. Skipped without one; `make gpu-check` runs them all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotune import load_config
from autotune.ceilings import find_ceiling, memory_budget
from autotune.precision import autocast, backend_flags, get_mode, make_scaler, resolve_device
from autotune.probe import run_probe
from autotune.search import run_search
from autotune.spec import Candidate, ProbeSettings, load_spec
from autotune.worker import InProcessRunner, ProbeWorker
from autotune.workloads import load_workload
from autotune.workloads.testing import CAPPED_BYTES

pytestmark = pytest.mark.gpu

SHORT = ProbeSettings(warmup_steps=2, steps=5, check_every=5, min_time=0)
STUDIES = Path(__file__).resolve().parent.parent / "studies"


def device() -> torch.device:
    return resolve_device("cuda")


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
    large = run_probe(
        wl, Candidate(precision="bf16", batch_size=512, learning_rate=0.4), dev, SHORT
    )
    assert small.ok and large.ok
    assert 0 < small.peak_memory_allocated < large.peak_memory_allocated
    assert large.peak_memory_reserved >= large.peak_memory_allocated


def test_a_real_oom_is_caught_and_the_next_probe_runs() -> None:
    # The cap lives in the worker: loading resnet18_capped there limits that process's allocator
    # to CAPPED_BYTES (2 GiB), so the OOM is real even with 140 GB free. ResNet-18 at 32x32 needs
    # about 0.5 MB a sample in fp32: 8192 samples want about 4 GB.
    capped = "autotune.workloads.testing:resnet18_capped"
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
    dev = device()
    wl = load_workload("tiny_convnet")
    budget = memory_budget(dev, 0.1)
    settings = ProbeSettings(warmup_steps=1, steps=1, check_every=1, min_time=0)

    def try_batch(bs: int):
        return run_probe(
            wl, Candidate(precision="bf16", batch_size=bs, learning_rate=0.1), dev, settings
        )

    ceiling = find_ceiling(try_batch, "bf16", start=256, cap=2**13, budget_bytes=budget)
    assert ceiling.batch_size >= 256
    fitting = [t for t in ceiling.tries if t.fits]
    assert all(t.peak_memory is not None and t.peak_memory <= budget for t in fitting)


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
