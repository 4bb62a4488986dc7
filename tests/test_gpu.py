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
from autotune.worker import InProcessRunner
from autotune.workloads import load_workload

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
    dev = device()
    wl = load_workload("resnet18")
    free, _ = torch.cuda.mem_get_info(dev)
    # Activations of ResNet-18 at 32x32 take roughly 6 MB a sample in fp32: ask for more than fits.
    huge = int(free / 2e6) + 1024
    before = torch.cuda.memory_allocated(dev)
    r = run_probe(wl, Candidate(precision="fp32", batch_size=huge, learning_rate=0.1), dev, SHORT)
    assert r.outcome == "oom", r.summary()
    assert "out of memory" in r.reason
    # Freed: nothing from the failed probe stays allocated, and the next probe completes.
    assert torch.cuda.memory_allocated(dev) <= before + 2**20
    ok = run_probe(wl, Candidate(precision="fp32", batch_size=128, learning_rate=0.1), dev, SHORT)
    assert ok.outcome == "completed"


def test_the_ceiling_finder_on_a_real_device_leaves_the_margin_free() -> None:
    dev = device()
    wl = load_workload("tiny_convnet")
    budget = memory_budget(dev, 0.1)
    settings = ProbeSettings(warmup_steps=1, steps=1, check_every=1, min_time=0)

    def try_batch(bs: int):
        return run_probe(
            wl, Candidate(precision="bf16", batch_size=bs, learning_rate=0.1), dev, settings
        )

    ceiling = find_ceiling(try_batch, "bf16", start=256, cap=2**16, budget_bytes=budget)
    assert ceiling.batch_size >= 256
    fitting = [t for t in ceiling.tries if t.fits]
    assert all(t.peak_memory is not None and t.peak_memory <= budget for t in fitting)


def test_a_short_search_on_the_gpu_writes_a_validated_config(tmp_path: Path) -> None:
    spec = load_spec(STUDIES / "tiny.yaml").with_overrides(
        {"storage": f"sqlite:///{tmp_path / 's.db'}", "device": "cuda", "budget": "40s"}
    )
    result = run_search(spec, out_dir=tmp_path / "out", runner=InProcessRunner(str(device())))
    cfg = load_config(result.path)
    assert cfg.environment.capability is not None
    assert cfg.evidence.trials.complete >= 3
    assert cfg.evidence.baseline_throughput > 0
    if cfg.precision != "fp32":
        assert cfg.evidence.validated
