"""Batch-size ceilings: the exact sizes tried, the cap, the margin, and real OOM probes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from autotune.measure.ceilings import find_ceiling, memory_budget
from autotune.measure.probe import run_probe
from autotune.measure.result import ProbeResult
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.testing.workloads import make_oom_workload

MIB = 2**20
TWO_STEPS = ProbeSettings(warmup_steps=0, steps=2, min_time=0)


def fake_try(fits_up_to: int, *, outcome_above: str = "oom") -> Callable[[int], ProbeResult]:
    """A try that needs ``bs`` MiB and ends ``outcome_above`` for sizes above ``fits_up_to``."""

    def try_batch(bs: int) -> ProbeResult:
        cand = Candidate(precision="fp32", batch_size=bs, learning_rate=0.1)
        if bs > fits_up_to:
            return ProbeResult(
                candidate=cand, workload="fake", device="cpu", outcome=outcome_above, reason="x"
            )
        return ProbeResult(
            candidate=cand,
            workload="fake",
            device="cpu",
            outcome="completed",
            peak_memory_allocated=bs * MIB,
        )

    return try_batch


def test_real_oom_probes_give_the_exact_ceiling_and_sizes() -> None:
    wl = make_oom_workload(64)

    def try_batch(bs: int) -> ProbeResult:
        cand = Candidate(precision="fp32", batch_size=bs, learning_rate=0.05)
        return run_probe(wl, cand, "cpu", TWO_STEPS)

    ceiling = find_ceiling(try_batch, "fp32", start=16, cap=1024)
    assert ceiling.sizes_tried == [16, 32, 64, 128, 96, 80, 72]
    assert (ceiling.batch_size, ceiling.limited_by, ceiling.precision) == (64, "memory", "fp32")
    assert [t.fits for t in ceiling.tries] == [True, True, True, False, False, False, False]
    assert {t.outcome for t in ceiling.tries if not t.fits} == {"oom"}
    assert all("out of memory at batch_size=" in t.note for t in ceiling.tries if not t.fits)
    # Four OOMs in this process, and a probe at the ceiling still runs.
    assert try_batch(ceiling.batch_size).outcome == "completed"


@pytest.mark.parametrize(
    ("limit", "start", "cap", "sizes", "batch_size", "limited_by"),
    [
        (64, 16, 1024, [16, 32, 64, 128, 96, 80, 72], 64, "memory"),
        (100, 16, 1024, [16, 32, 64, 128, 96, 112, 104], 96, "memory"),
        (10_000, 16, 100, [16, 32, 64, 100], 100, "cap"),
        (10_000, 2048, 512, [512], 512, "cap"),
        (5, 16, 1024, [16, 8, 4, 6, 5], 5, "memory"),
        (0, 1, 1024, [1], 0, "memory"),
    ],
    ids=[
        "bisect",
        "bisect-off-grid",
        "cap",
        "start-above-cap",
        "below-granularity",
        "nothing-fits",
    ],
)
def test_sizes_tried_and_ceiling(
    limit: int, start: int, cap: int, sizes: list[int], batch_size: int, limited_by: str
) -> None:
    ceiling = find_ceiling(fake_try(limit), "bf16", start=start, cap=cap)
    assert ceiling.sizes_tried == sizes
    assert (ceiling.batch_size, ceiling.limited_by) == (batch_size, limited_by)
    assert max(ceiling.sizes_tried) <= cap


def test_granularity_sets_where_the_search_stops() -> None:
    ceiling = find_ceiling(fake_try(100), "bf16", start=16, cap=1024, granularity=32)
    assert ceiling.sizes_tried == [16, 32, 64, 128, 96]
    assert ceiling.batch_size == 96


@pytest.mark.parametrize(
    ("budget_mib", "sizes", "batch_size"),
    [(40, [16, 32, 64, 48, 40], 40), (0.000001, [16, 8, 4, 2, 1], 0)],
    ids=["margin-between-sizes", "tiny-budget"],
)
def test_margin_limits_the_ceiling(budget_mib: float, sizes: list[int], batch_size: int) -> None:
    ceiling = find_ceiling(
        fake_try(10_000), "fp16", start=16, cap=1024, budget_bytes=int(budget_mib * MIB)
    )
    assert ceiling.sizes_tried == sizes
    assert (ceiling.batch_size, ceiling.limited_by) == (batch_size, "margin")
    failed = [t for t in ceiling.tries if not t.fits]
    assert failed and all(t.outcome == "completed" for t in failed)
    assert all("leaves less than the margin free" in t.note for t in failed)


def test_margin_is_skipped_when_peak_memory_is_unknown() -> None:
    def try_batch(bs: int) -> ProbeResult:
        cand = Candidate(precision="fp32", batch_size=bs, learning_rate=0.1)
        return ProbeResult(candidate=cand, workload="fake", device="cpu", outcome="completed")

    ceiling = find_ceiling(try_batch, "fp32", start=16, cap=64, budget_bytes=1)
    assert (ceiling.batch_size, ceiling.limited_by) == (64, "cap")


@pytest.mark.parametrize(("outcome", "fits"), [("crashed", False), ("diverged", True)])
def test_crash_does_not_fit_and_divergence_does(outcome: str, fits: bool) -> None:
    # A diverged probe still ran the step in memory; a crashed one says nothing about memory.
    ceiling = find_ceiling(fake_try(32, outcome_above=outcome), "fp16", start=16, cap=128)
    assert ceiling.batch_size == (128 if fits else 32)
    assert ceiling.sizes_tried == ([16, 32, 64, 128] if fits else [16, 32, 64, 48, 40])


def test_a_margin_held_by_other_processes_stops_the_ceiling_as_busy() -> None:
    # A try that had no room at all says nothing about its size: no smaller size is tried.
    from autotune.measure.oom import MARGIN_TAKEN

    def try_batch(bs: int) -> ProbeResult:
        cand = Candidate(precision="fp32", batch_size=bs, learning_rate=0.1)
        reason = f"out of memory at batch_size={bs}, step 0: {MARGIN_TAKEN}: 1.0 GiB free"
        return ProbeResult(
            candidate=cand, workload="fake", device="cuda", outcome="oom", reason=reason
        )

    ceiling = find_ceiling(try_batch, "fp32", start=64, cap=1024)
    assert (ceiling.sizes_tried, ceiling.limited_by) == ([64], "busy")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="CPU memory needs /proc/meminfo")
def test_cpu_memory_budget_shrinks_with_the_margin() -> None:
    loose = memory_budget(torch.device("cpu"), 0.05)
    tight = memory_budget(torch.device("cpu"), 0.5)
    assert loose is not None and tight is not None
    assert loose > tight >= 0
