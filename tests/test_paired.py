"""Paired measurement: interleaved blocks keep a speedup honest while the machine drifts."""

from __future__ import annotations

import time

import pytest
import torch

from autotune.measure.memory import PeakMemory
from autotune.measure.paired import PAIR_SLACK, run_paired
from autotune.measure.probe import run_probe
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.testing.workloads import drifting
from autotune.workloads import load_workload

SETTINGS = ProbeSettings(warmup_steps=1, steps=4, min_time=0.3, precision=0.02, time_limit=30)


def fp32(batch_size: int) -> Candidate:
    return Candidate(precision="fp32", batch_size=batch_size, learning_rate=0.05)


class VirtualClock:
    """Time that passes only when the workload sleeps: the drift is exact, whatever else the
    machine does, and the test takes no real time for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    virtual = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", virtual)
    return virtual


def test_a_drifting_machine_does_not_move_the_paired_speedup(clock: VirtualClock) -> None:
    # Steps sleep a fixed, growing time whatever the batch: bs=32 is exactly 2x bs=16 at any
    # moment, while the machine slows down by its whole speed every second.
    def workload():  # noqa: ANN202
        return drifting(0.004, 1.0, clock=clock, sleep=clock.sleep)

    result = run_paired(workload(), fp32(32), fp32(16), "cpu", SETTINGS)
    assert result.ok, (result.candidate.reason, result.reference.reason)
    assert result.pairs >= 6
    assert result.speedup_low <= 2.0 <= result.speedup_high
    assert result.speedup == pytest.approx(2.0, rel=0.03)
    # Each arm keeps its own figures, and the reference saw at least the candidate's horizon.
    c, r = result.candidate, result.reference
    assert c.throughput_low <= c.throughput <= c.throughput_high
    assert len(r.losses) * r.batch_size >= (SETTINGS.warmup_steps + SETTINGS.steps) * c.batch_size
    # Measured one after the other on the same drifting machine, the same two settings read as
    # a different speedup: the reason validation pairs them.
    machine = workload()
    first = run_probe(machine, fp32(32), "cpu", SETTINGS)
    second = run_probe(machine, fp32(16), "cpu", SETTINGS)
    assert first.throughput / second.throughput > 2.0 * 1.2


def test_the_candidate_runs_on_alone_to_its_horizon_once_the_pairs_are_measured(
    clock: VirtualClock,
) -> None:
    """fp16's verdict needs its loss over hundreds of steps, parity and the speedup far fewer:
    the pairs stop when they are enough and the candidate alone takes the rest of its steps."""
    settings = SETTINGS.model_copy(update={"alone_steps": 120})
    result = run_paired(drifting(0.004, 1.0, clock=clock, sleep=clock.sleep), fp32(32), fp32(16),
                        "cpu", settings)  # fmt: skip
    assert result.ok and result.pairs >= 6
    assert result.speedup_low <= 2.0 <= result.speedup_high
    assert len(result.candidate.losses) >= 120
    assert len(result.reference.losses) * 16 < 120 * 32  # the reference did not run along
    assert not result.candidate.truncated


def test_pairs_stop_where_another_would_end_past_what_follows_their_time_limit(
    clock: VirtualClock,
) -> None:
    """Pairs that run to their time limit (their interval never tight enough), blocks of 2 s
    each: the last pair started ran its blocks to 36.4 s of a 35 s limit, past the second a
    pair's callers keep after it (a CPU search ended at 180.1 s of a 180 s budget).
    They stop where the next would end past that, and still measure the 2x."""
    settings = SETTINGS.model_copy(update={"min_time": 100.0, "precision": 0.001, "time_limit": 35})
    result = run_paired(drifting(0.2, 0.0, clock=clock, sleep=clock.sleep), fp32(32), fp32(16),
                        "cpu", settings)  # fmt: skip
    assert result.ok and result.pairs >= 6
    assert result.speedup == pytest.approx(2.0, rel=0.03)
    assert result.candidate.wall_seconds <= settings.time_limit + PAIR_SLACK


def test_an_arm_that_diverges_ends_the_pair_with_its_reason() -> None:
    wl = load_workload("autotune.testing.workloads:fp16_overflow")
    cand = Candidate(precision="fp16", batch_size=32, learning_rate=0.001)
    ref = Candidate(precision="fp32", batch_size=32, learning_rate=0.001)
    result = run_paired(wl, cand, ref, "cpu", SETTINGS)
    assert result.candidate.outcome == "diverged" and "loss=" in result.candidate.reason
    assert not result.ok and result.speedup is None


def test_an_unsupported_arm_is_named_on_both_sides() -> None:
    tf32 = Candidate(precision="tf32", batch_size=16, learning_rate=0.05)
    result = run_paired(load_workload("tiny_mlp"), tf32, fp32(16), "cpu", SETTINGS)
    assert result.candidate.outcome == "unsupported"
    assert result.reference.outcome == "unsupported"
    assert "the candidate arm" in result.reference.reason


def test_the_candidates_peak_memory_is_reported_and_the_references_left_out() -> None:
    probe = PeakMemory(torch.device("cpu"))
    probe.start()
    if probe.source == "unavailable":
        pytest.skip("this system cannot reset its peak resident memory")
    settings = ProbeSettings(warmup_steps=2, steps=2, min_time=0)
    result = run_paired(load_workload("tiny_mlp"), fp32(32), fp32(16), "cpu", settings)
    assert result.ok, result.summary()
    # Measured while the candidate ran alone; both arms alive together would be both peaks.
    assert result.candidate.peak_memory_allocated is not None
    assert result.candidate.peak_memory == result.candidate.peak_memory_allocated >= 0
    assert result.reference.peak_memory is None
