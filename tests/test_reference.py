"""What every figure is divided by, and how much a seed moves: the fp32 reference is trusted only
once measured twice alike, measured again when a trial's speedup is none the device gives, and
its own seed-to-seed spread is allowed in the trial's parity check. On the simulated device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from _sim import WORKLOAD, landscape

from autotune.infra import clock
from autotune.schema.spec import Candidate, parse_spec
from autotune.search import Budget, PhaseStarted, run_search
from autotune.sim import Landscape, SimulatedRunner, simulate
from autotune.study.reference import measurement_used


def spec(budget: str = "2m", **fields: Any) -> Any:
    return parse_spec({"name": "sim", "workload": WORKLOAD, "budget": budget, **fields})


def _search_at_reference(
    tmp_path: Path, runner: SimulatedRunner, budget: str, at_reference: Any
) -> Any:
    """A search on ``runner`` that calls ``at_reference(runner)`` as the reference's phase
    starts (to slow or kill the probes to come)."""

    def on_event(event: object) -> None:
        if isinstance(event, PhaseStarted) and event.phase == "reference":
            at_reference(runner)

    with clock.use(runner.clock):
        return run_search(
            spec(budget),
            out_dir=tmp_path,
            runner=runner,
            budget=Budget(spec(budget).budget),
            on_event=on_event,
            storage=optuna.storages.InMemoryStorage(),
        )


def _search_with_slow_reference(
    tmp_path: Path, land: Landscape, slowdowns: list[float], budget: str = "2m"
) -> Any:
    """A search whose first reference probes run ``slowdowns`` times slower: the first is the
    long curve run, as a neighbour's burst or a warm-up the reference alone suffers slows it."""

    def slow(runner: SimulatedRunner) -> None:
        for i, factor in enumerate(slowdowns):
            runner.slow_at[runner.probes + 1 + i] = factor

    return _search_at_reference(tmp_path, SimulatedRunner(land), budget, slow)


def _assert_speedups_true_and_named(result: Any, land: Landscape) -> None:
    study = result.store.study
    fp32 = land.throughput(Candidate(precision="fp32", batch_size=64, learning_rate=0.1))
    measured = [t for t in study.trials if t.user_attrs.get("speedup") is not None]
    assert len(measured) >= 3
    for t in measured:
        cand = Candidate(
            precision=t.params["precision"],
            batch_size=t.params["batch_size"],
            learning_rate=t.user_attrs["learning_rate"],
        )
        truth = land.truth(cand).speedup
        assert t.user_attrs["speedup"] == pytest.approx(truth, rel=0.1), (t.number, t.params)
        used = measurement_used(study.user_attrs, t.user_attrs)
        assert used is not None, f"trial {t.number} does not name its reference measurement"
        assert used.throughput == t.user_attrs["reference_throughput"]
        assert used.throughput == pytest.approx(fp32, rel=0.1)
    # The slow first measurement is kept, as measured; no trial divided by it.
    assert result.reference.measurements[0].throughput < fp32 / 2


@pytest.mark.parametrize("slowdown", [3.0, 20.0])
def test_a_reference_first_measured_slow_is_measured_again_before_any_trial_divides_by_it(
    tmp_path: Path, slowdown: float
) -> None:
    """The long first run measured 3x (or 20x) too slow: before the first trial's speedup is
    stored the reference is measured again until two measurements agree, so the speedups are
    the device's and each trial names the measurement it divided by."""
    land = landscape()
    result = _search_with_slow_reference(tmp_path, land, [slowdown])
    _assert_speedups_true_and_named(result, land)


def test_a_reference_slow_twice_alike_is_measured_again_when_a_trial_disagrees(
    tmp_path: Path,
) -> None:
    """A burst over the reference's first two measurements: they agree with each other, but
    fp16 at the reference's own batch then reads ~30x, which no precision change gives — the
    reference is measured again before that speedup is stored. (10 minutes: slowed, the first
    run takes its whole time limit, 15% of a shorter budget, and a first run is confirmed only
    where six runs of its length are left; unconfirmed, the next trial is the one the second
    burst slows.)"""
    land = landscape()
    result = _search_with_slow_reference(tmp_path, land, [20.0, 20.0], "10m")
    assert len(result.reference.measurements) >= 3  # the first, its confirmation, the one after
    _assert_speedups_true_and_named(result, land)


# ---- parity: the reference's own seed-to-seed spread ------------------------------------------


def _first_trials(gap: float, seed_spread: float, seeds: range) -> list[Any]:
    """The search's one trial of bf16 at the base batch, seed by seed, on a device whose bf16
    curve lies ``gap`` above fp32's (the curves settle within a probe, so the gap at the probe's
    horizon is that) and moves ``seed_spread`` from seed to seed."""
    land = landscape(
        **{
            "modes.bf16.parity_gap": gap,
            "loss.seed_spread": seed_spread,
            "loss.samples_scale": 1000.0,
            "parity.gap_per_batch_ratio": 0.0,
        }
    )
    one_point = spec("1m", space={"precisions": ["bf16"], "batch_sizes": [64]})
    out = []
    for seed in seeds:
        study = simulate(one_point, land, seed=seed).store.study
        out.append(next(t for t in study.trials if t.user_attrs.get("duplicate_of") is None))
    return out


def _kept(trial: Any) -> bool:
    return trial.user_attrs.get("outcome") == "completed"


def test_a_candidate_at_the_tolerance_keeps_parity_in_most_seeds_given_the_seed_spread() -> None:
    """tiny's case: bf16's gap sits at the 5% tolerance and a seed moves it by ~4% (tiny's
    measured spread). A bare 5% check drops it on about every other seed; allowing the
    reference's own seed-to-seed spread, measured from its repeats, keeps it in most."""
    trials = _first_trials(0.05, 0.04, range(80))
    kept = sum(_kept(t) for t in trials)
    assert kept >= 0.6 * len(trials), f"kept in {kept} of {len(trials)} seeds"


def test_a_candidate_clearly_beyond_tolerance_and_spread_is_still_dropped() -> None:
    trials = _first_trials(0.13, 0.01, range(8))
    assert not any(_kept(t) for t in trials)
    checked = [t for t in trials if t.user_attrs["outcome"] == "infeasible"]
    assert checked and all("(tolerance 5% + seed noise" in t.user_attrs["reason"] for t in checked)


def test_a_reference_whose_worker_dies_is_measured_again_not_a_failed_study(
    tmp_path: Path,
) -> None:
    """A 15-second budget measures no ceiling, so the reference is a fresh worker's first
    run; the worker dies under it (as one stopped at its hard limit by a neighbour's burst
    does). The search measures it once more and ends with a config inside its budget,
    instead of failing the study for want of a baseline."""

    def kill(runner: SimulatedRunner) -> None:
        runner.crash_at = frozenset({runner.probes + 1})

    result = _search_at_reference(tmp_path, SimulatedRunner(landscape()), "15s", kill)
    assert result.config is not None
    assert result.reference is not None and result.reference.measurements
    assert result.elapsed <= 15.0
