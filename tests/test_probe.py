"""run_probe: outcomes, honest figures, divergence and OOM detection, and no trace left behind."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.errors import WorkloadError
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags
from autotune.measure.probe import global_state, run_probe
from autotune.measure.result import ProbeResult
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.testing.workloads import make_oom_workload
from autotune.workloads import BUILTINS, Workload, load_workload

SHORT = ProbeSettings(warmup_steps=1, steps=4, check_every=2, min_time=0)


def candidate(
    precision: str = "fp32", batch_size: int = 16, lr: float = 0.05, **kw: Any
) -> Candidate:
    return Candidate(precision=precision, batch_size=batch_size, learning_rate=lr, **kw)


def workload(name: str) -> Workload:
    """A built-in by name, else one of the misbehaving workloads in autotune.testing.workloads."""
    return load_workload(name if name in BUILTINS else f"autotune.testing.workloads:{name}")


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(value, after[key], strict=True)), key
        else:
            assert value == after[key], key


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", None), ("bf16", "bfloat16"), ("fp16", "float16")]
)
def test_each_mode_completes_on_cpu_with_consistent_figures(
    precision: str, dtype: str | None
) -> None:
    r = run_probe(workload("tiny_mlp"), candidate(precision), "cpu", SHORT)
    assert r.outcome == "completed", r.reason
    assert r.ok and r.reason == "" and not r.truncated
    assert r.autocast_dtype == dtype
    assert (r.device, r.workload, r.batch_size) == ("cpu", "autotune.workloads:tiny_mlp", 16)
    assert (r.warmup_steps, r.timed_steps, r.planned_steps) == (1, 4, 4)
    assert len(r.losses) == 1 + 4 and all(math.isfinite(x) for x in r.losses)
    assert r.throughput > 0
    # The throughput is the median of the timed blocks' rates, inside its own interval.
    assert sum(n for n, _ in r.blocks) == r.timed_steps
    assert sum(s for _, s in r.blocks) == pytest.approx(r.timed_seconds)
    rates = sorted(n * r.batch_size / s for n, s in r.blocks)
    assert rates[0] <= r.throughput_low <= r.throughput <= r.throughput_high <= rates[-1]
    assert r.step_time == pytest.approx(r.batch_size / r.throughput)
    assert 0 <= r.check_seconds < r.wall_seconds and r.timed_seconds < r.wall_seconds


def test_tf32_is_unsupported_on_cpu_with_a_reason() -> None:
    before = global_state()
    r = run_probe(workload("tiny_mlp"), candidate("tf32"), "cpu", SHORT)
    assert r.outcome == "unsupported"
    assert "CUDA" in r.reason
    assert (r.throughput, r.losses) == (0.0, [])
    assert_same_state(before, global_state())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="CPU peak memory needs /proc")
def test_cpu_peak_memory_is_reported() -> None:
    r = run_probe(workload("tiny_mlp"), candidate(batch_size=64), "cpu", SHORT)
    assert isinstance(r.peak_memory, int) and r.peak_memory >= 0


def test_fp16_scale_trace_and_skipped_steps() -> None:
    # 2^24 is far above what tiny_mlp's fp16 gradients fit: the scaler skips and halves during
    # warmup until they fit, then trains; growth_interval=2000 never lets it grow back.
    init = 2.0**24
    settings = ProbeSettings(warmup_steps=12, steps=4, check_every=1, min_time=0)
    r = run_probe(workload("tiny_mlp"), candidate("fp16", init_scale=init), "cpu", settings)
    assert r.outcome == "completed", r.reason
    assert [step for step, _ in r.scales] == list(range(16))
    assert 0 < r.skipped_steps <= 12
    assert r.scales[0][1] == init / 2  # the first step already skipped and halved
    drops = sum(b < a for (_, a), (_, b) in zip(r.scales, r.scales[1:], strict=False))
    assert drops == r.skipped_steps - 1
    assert r.scales[-1][1] == init / 2**r.skipped_steps


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_modes_without_a_scaler_have_no_scale_trace(precision: str) -> None:
    r = run_probe(workload("tiny_mlp"), candidate(precision), "cpu", SHORT)
    assert (r.scales, r.skipped_steps) == ([], 0)


@pytest.mark.parametrize(
    ("lr", "outcome"), [(0.01, "completed"), (1.0, "diverged"), (50.0, "diverged")]
)
def test_diverging_workload_blows_up_only_at_high_lr(lr: float, outcome: str) -> None:
    settings = ProbeSettings(warmup_steps=1, steps=20, check_every=5, min_time=0)
    r = run_probe(workload("diverging"), candidate(batch_size=32, lr=lr), "cpu", settings)
    assert r.outcome == outcome, r.reason
    if outcome == "completed":
        assert r.losses[-1] < r.losses[0]
        return
    match = re.search(r"at step (\d+)", r.reason)
    assert match, r.reason
    step = int(match.group(1))
    assert r.losses[step] > settings.loss_blowup_factor * r.losses[0]
    assert r.throughput == 0.0


@pytest.mark.parametrize(
    ("precision", "outcome"), [("fp32", "completed"), ("bf16", "completed"), ("fp16", "diverged")]
)
def test_fp16_overflow_diverges_only_in_fp16(precision: str, outcome: str) -> None:
    r = run_probe(
        workload("fp16_overflow"), candidate(precision, batch_size=32, lr=0.001), "cpu", SHORT
    )
    assert r.outcome == outcome, r.reason
    if outcome == "diverged":
        assert re.fullmatch(r"loss=(nan|inf|-inf) at step \d+", r.reason), r.reason
        assert not math.isfinite(r.losses[-1])
        # Its GradScaler scale is recorded at the check that found it diverging, the step
        # the report's plot ends it at.
        at = int(r.reason.rsplit(" ", 1)[1])
        assert r.scales and r.scales[-1][0] >= at and r.scales[-1][1] > 0


def test_persistent_grad_scaler_skips_are_divergence() -> None:
    # Every other step's gradients are NaN at any scale: half the steps skip, past max_skip_rate.
    settings = ProbeSettings(warmup_steps=1, steps=20, check_every=10, min_time=0)
    r = run_probe(workload("skipping"), candidate("fp16"), "cpu", settings)
    assert r.outcome == "diverged"
    # The first timed block has check_every steps: enough for a verdict at its end.
    assert re.match(
        r"GradScaler skipped [5-6] of 10 steps after warmup \(limit 25%\) at step 10", r.reason
    ), r.reason


def test_grad_scalers_back_off_from_a_high_init_scale_is_warm_up_not_skipping() -> None:
    """GradScaler skips and halves from a scale too high for the gradients until one fits, as
    torch documents: a run warmed one step and not settled (fp16's run alone to its overflow
    horizon) still judges its skip rate only from there, and completes; steps that keep
    skipping after the scale fits still end it."""
    settings = ProbeSettings(warmup_steps=1, steps=20, check_every=5, min_time=0)
    r = run_probe(workload("tiny_mlp"), candidate("fp16", init_scale=2.0**40), "cpu", settings)
    assert r.outcome == "completed", r.reason
    assert r.skipped_steps > 10  # far more than warm-up's one step, and more than 25% of 20
    halvings = r.skipped_steps
    assert r.scales[-1][1] == 2.0**40 / 2**halvings  # each skipped step halved it, none grew it
    r = run_probe(workload("skipping"), candidate("fp16", init_scale=2.0**3), "cpu", settings)
    assert r.outcome == "diverged", r.summary()


def test_non_scalar_loss_is_a_workload_error_naming_the_workload() -> None:
    before = global_state()
    with pytest.raises(
        WorkloadError, match="non_scalar_loss'?: loss must be a scalar tensor, got shape"
    ):
        run_probe(workload("non_scalar_loss"), candidate(), "cpu", SHORT)
    assert_same_state(before, global_state())


def test_oom_is_an_outcome_and_the_next_probe_still_runs() -> None:
    wl = make_oom_workload(64)
    before = global_state()
    r = run_probe(wl, candidate(batch_size=65), "cpu", SHORT)
    assert r.outcome == "oom"
    assert r.reason.startswith("out of memory at batch_size=65, step 0")
    assert r.throughput == 0.0
    assert_same_state(before, global_state())
    again = run_probe(wl, candidate(batch_size=64), "cpu", SHORT)
    assert again.outcome == "completed", again.reason


@pytest.mark.parametrize(
    ("name", "cand"),
    [
        ("tiny_mlp", candidate("fp32")),
        ("tiny_convnet", candidate("fp16", batch_size=8)),
        ("tiny_mlp", candidate("bf16")),
        ("diverging", candidate(batch_size=32, lr=5.0)),
        ("oom_above_64", candidate(batch_size=128)),
    ],
    ids=["fp32", "fp16-conv", "bf16", "diverged", "oom"],
)
def test_probe_leaves_no_trace(name: str, cand: Candidate) -> None:
    before = global_state()
    run_probe(workload(name), cand, "cpu", SHORT)
    after = global_state()
    assert_same_state(before, after)
    # The caller's random stream goes on as if no probe had run.
    torch.set_rng_state(before["cpu_rng"])
    expected = torch.rand(3)
    torch.set_rng_state(after["cpu_rng"])
    assert torch.equal(torch.rand(3), expected)


def test_probe_restores_non_default_global_settings() -> None:
    torch.backends.cudnn.benchmark = True
    try:
        with torch.no_grad():
            before = global_state()
            r = run_probe(workload("tiny_mlp"), candidate(), "cpu", SHORT)
            assert r.outcome == "completed", r.reason
            assert not torch.is_grad_enabled()
            assert_same_state(before, global_state())
    finally:
        torch.backends.cudnn.benchmark = False


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_same_seed_same_losses_other_seed_other_losses(precision: str) -> None:
    wl = workload("tiny_convnet")
    runs = [
        run_probe(
            wl, candidate(precision, batch_size=8), "cpu", SHORT.model_copy(update={"seed": seed})
        )
        for seed in (0, 0, 1)
    ]
    assert runs[0].losses == runs[1].losses
    assert runs[0].losses != runs[2].losses
    assert [r.seed for r in runs] == [0, 0, 1]


@pytest.mark.parametrize("warmup", [0, 1], ids=["stopped-in-timed-window", "stopped-in-warmup"])
def test_time_limit_truncates_but_still_scores(warmup: int) -> None:
    settings = ProbeSettings(warmup_steps=warmup, steps=50, time_limit=0.001, min_time=0)
    r = run_probe(workload("tiny_mlp"), candidate(), "cpu", settings)
    assert r.outcome == "completed", r.reason
    assert r.truncated
    assert r.throughput > 0
    assert r.timed_steps < settings.steps
    assert r.warmup_steps + r.timed_steps == len(r.losses)
    assert r.reason == f"time limit 0.001s reached: scored on {r.timed_steps} of 50 timed steps"
    assert "time limit" in r.summary()


def test_result_survives_a_json_round_trip_with_nan_losses() -> None:
    r = run_probe(
        workload("fp16_overflow"), candidate("fp16", batch_size=32, lr=0.001), "cpu", SHORT
    )
    back = ProbeResult.model_validate_json(r.model_dump_json())
    assert back.outcome == "diverged"
    assert math.isnan(back.losses[-1])
    assert back.summary() == r.summary()
    assert r.summary().startswith("fp16 bs=32 lr=0.001 init_scale=65536 → diverged: loss=nan")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_each_supported_mode_runs_on_the_gpu(precision: str) -> None:
    from autotune.measure.precision import unsupported_modes

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=dev)  # initialise CUDA first so its RNG state is in global_state
    before = global_state()
    r = run_probe(workload("tiny_convnet"), candidate(precision, batch_size=32), dev, SHORT)
    if precision in unsupported_modes(dev):
        assert r.outcome == "unsupported"
        return
    assert r.outcome == "completed", r.reason
    assert r.peak_memory_allocated and r.peak_memory_reserved
    assert r.peak_memory_reserved >= r.peak_memory_allocated
    assert_same_state(before, global_state())


NEW_API_WORKLOAD = """
import torch

from autotune.workloads import tiny_mlp

# What torch's own warning recommends, done at import as training code does.
torch.backends.cuda.matmul.fp32_precision = "tf32"


def build():
    return tiny_mlp()
"""


@pytest.fixture
def new_api_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workload]:
    """A workload whose module sets TF32 through torch's new API at import; the torch flags
    and the import are undone afterwards."""
    saved = snapshot_backend_flags()
    (tmp_path / "new_api_tf32_workload.py").write_text(NEW_API_WORKLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield load_workload("new_api_tf32_workload:build")
    finally:
        sys.modules.pop("new_api_tf32_workload", None)
        restore_backend_flags(saved)


def test_workload_setting_tf32_through_the_new_api_still_probes(new_api_workload: Workload) -> None:
    with pytest.raises(RuntimeError):  # the legacy getter refuses to answer now
        torch.get_float32_matmul_precision()
    before = global_state()
    r = run_probe(new_api_workload, candidate("bf16"), "cpu", SHORT)
    assert r.outcome == "completed", r.reason
    # The workload's own setting is what it finds afterwards.
    assert_same_state(before, global_state())
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
