"""The tuning service's queue and scheduling, on a simulated box: the real service, scheduler and
search over simulated GPUs on one event clock (``autotune.sim.run_box``). Each test is minutes
of a shared GPU box, run in seconds, and waits for nothing real."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.sim import Arrival, BoxReport, run_box

LAND = "t4-resnet18"


def by_name(report: BoxReport) -> dict:
    return {s.name: s for s in report.studies}


def test_studies_queue_for_a_free_gpu_and_every_trial_is_kept() -> None:
    report = run_box(
        [Arrival(0, "ada", "a", 60), Arrival(0, "bo", "b", 60), Arrival(0, "cy", "c", 60)],
        LAND,
        devices=2,
    )
    s = by_name(report)
    assert {x.state for x in report.studies} == {"done"}
    assert all(x.speedup is not None and x.speedup >= 1.0 for x in report.studies)
    # Two GPUs: the third study starts once one of the first two has ended.
    first_end = min(s["a"].finished, s["b"].finished)
    assert s["c"].waited >= first_end - 1.0 > 0
    assert max(s["a"].waited, s["b"].waited) < s["c"].waited
    assert report.lost() == []
    assert all(x.trials > 0 for x in report.studies)
    # A device is busy only while it is held; held time is counted a look (30 s) at a time.
    look = 30.0 / report.seconds
    for device, busy in report.utilisation.items():
        assert 0 < busy <= report.held[device] + look <= 1.0 + look


def test_a_higher_priority_study_takes_the_gpu_at_the_next_trial_and_the_other_resumes() -> None:
    report = run_box(
        [Arrival(0, "ada", "low", 120), Arrival(30, "bo", "urgent", 120, priority=10)],
        LAND,
        devices=1,
    )
    s = by_name(report)
    # The urgent study did not wait for the other's budget: only for its trial in flight.
    assert s["urgent"].waited < 30
    assert s["low"].runs == 2 and s["urgent"].runs == 1
    assert s["low"].state == s["urgent"].state == "done"
    # The pre-empted study kept its budget: it ends after the urgent one, its budget spent once.
    assert s["low"].finished > s["urgent"].finished
    assert s["low"].budget_used <= 120 + 30
    assert report.lost() == []


def test_cancels_end_queued_and_running_studies_and_keep_their_trials() -> None:
    report = run_box(
        [
            Arrival(0, "ada", "running", 600, cancel_after=90),
            Arrival(10, "bo", "queued", 120, cancel_after=5),
            Arrival(20, "cy", "next", 120),
        ],
        LAND,
        devices=1,
    )
    s = by_name(report)
    assert s["running"].state == "cancelled" and s["running"].trials > 0
    assert s["running"].finished < 600
    assert s["queued"].state == "cancelled" and s["queued"].waited is None
    assert s["queued"].trials == 0
    assert s["next"].state == "done" and s["next"].speedup is not None
    assert report.lost() == []


def test_a_worker_that_dies_mid_probe_fails_that_trial_and_the_study_goes_on(
    tmp_path: Path,
) -> None:
    report = run_box([Arrival(0, "ada", "a", 120)], LAND, devices=1, crashes={0: frozenset({16})},
                     workdir=tmp_path)  # fmt: skip
    assert report.crashes == 1
    [a] = report.studies
    assert a.state == "done" and a.speedup is not None
    study = optuna.load_study(study_name="a", storage=f"sqlite:///{tmp_path / 'box.db'}")
    died = [t for t in study.trials if "worker process died" in t.user_attrs.get("reason", "")]
    assert len(died) == 1 and died[0].state == TrialState.FAIL
    assert report.lost() == []


def test_a_busy_gpu_holds_the_queue_in_priority_order_and_a_waiting_study_off_its_budget() -> None:
    report = run_box(
        [Arrival(0, "ada", "a", 120), Arrival(1, "bo", "b", 120, priority=5)],
        LAND,
        devices=1,
        busy={0: [(0, 100), (150, 250)]},
    )
    s = by_name(report)
    # Nothing starts while a colleague's job holds the GPU; then the higher priority first.
    assert s["b"].waited >= 99
    assert s["a"].waited > s["b"].waited
    assert s["a"].state == s["b"].state == "done"
    # b was held off mid-study (150-250 s): the wait is not charged to its budget (its run
    # lasts what it spent of its budget and most of the hold on top).
    assert s["b"].finished - (1 + s["b"].waited) >= s["b"].budget_used + 90
    assert s["b"].budget_used <= 120 + 30
    assert report.lost() == []
