"""Landscape schema version 2 on the simulated device: each new shape does what it says, and a
version 1 file loads and behaves as before. Budgets and times here are simulated seconds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from _sim import WORKLOAD, landscape

from autotune.errors import SpecError
from autotune.infra.clock import VirtualClock
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, EarlyStop, ProbeSettings, parse_spec
from autotune.search._knob_trials import islands_plan
from autotune.sim import Landscape, SimulatedRunner, load_landscape, shipped_landscapes, simulate
from autotune.sim._engine import Bursts, SimEngine


def v2(**changes: Any) -> Landscape:
    return landscape(schema_version=2, **changes)


def fp16(batch: int = 64, **fields: Any) -> Candidate:
    return Candidate(precision="fp16", batch_size=batch, learning_rate=0.1 * batch / 64, **fields)


def counted(steps: int, **fields: Any) -> ProbeSettings:
    """A probe of exactly ``steps`` timed steps after the 3 warm-up steps."""
    return ProbeSettings(steps=steps, min_time=0, early_stop=False, **fields)


# ---- versions ------------------------------------------------------------------------------


def test_every_shipped_landscape_is_version_1_and_loads_unchanged() -> None:
    for name in shipped_landscapes():
        land = load_landscape(name)
        assert land.schema_version == 1
        assert land.model_dump() == Landscape.model_validate(land.model_dump()).model_dump()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"noise.burst_blocks": 3}, "noise.burst_blocks need schema_version: 2"),
        ({"fp16.skip_rate": 0.1}, "fp16.skip_rate need schema_version: 2"),
        ({"parity.gap_onset_samples": 5000.0}, "parity.gap_onset_samples need"),
        ({"parity.diverge_lr_above": 1.5}, "parity.diverge_lr_above need"),
        (
            {"knobs.compile_modes": {"max-autotune": {"speedup": 1.3, "seconds": 90.0}}},
            "knobs.compile_modes need",
        ),
    ],
)
def test_a_version_1_file_that_states_a_version_2_shape_is_refused_naming_it(
    tmp_path: Path, changes: dict, needle: str
) -> None:
    data = landscape().model_dump(mode="json", exclude={"schema_version"})
    for path, value in changes.items():
        section, field = path.split(".")
        data[section][field] = value
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=needle):
        load_landscape(path)
    data["schema_version"] = 2
    path.write_text(yaml.safe_dump(data))
    assert load_landscape(path).schema_version == 2


def test_an_unknown_schema_version_names_the_versions_read(tmp_path: Path) -> None:
    path = tmp_path / "v3.yaml"
    path.write_text("schema_version: 3\n")
    with pytest.raises(SpecError, match="reads versions 1 and 2"):
        load_landscape(path)


def test_an_overflow_with_no_islands_never_happens_in_version_1_and_no_module_fixes_it_in_2() -> (
    None
):
    changes = {"fp16.diverges_at_step": 40}
    assert not landscape(**changes).diverges(fp16())
    land = v2(**changes)
    assert land.diverges(fp16()) and land.diverges(fp16(fp32_modules=["fc"]))
    found = SimulatedRunner(land).diagnose(WORKLOAD, fp16())
    assert found is not None
    assert islands_plan(found)[1].startswith("not tried: the overflow is in functional code")


# ---- fp16 over batch, lr, init_scale and step ----------------------------------------------


def test_a_late_overflow_lets_a_short_probe_complete_and_a_longer_one_diverge() -> None:
    land = v2(**{"fp16.diverges_at_step": 50, "fp16.islands": ["layer4"]})
    runner = SimulatedRunner(land)
    short = runner.run(WORKLOAD, fp16(), counted(30))
    assert short.outcome == Outcome.COMPLETED
    long = runner.run(WORKLOAD, fp16(), counted(80))
    assert long.outcome == Outcome.DIVERGED and "loss=inf at step 50" in long.reason
    # The truth is a long run's: the short probe's verdict does not make it safe.
    assert land.truth(fp16()).diverges and not land.truth(fp16(fp32_modules=["layer4"])).diverges


def test_the_overflow_step_follows_batch_and_lr_and_spares_batches_below_its_minimum() -> None:
    land = v2(
        **{
            "fp16.diverges_at_step": 200,
            "fp16.islands": ["layer4"],
            "fp16.diverge_batch_exponent": -1.0,
            "fp16.diverge_lr_exponent": -1.0,
            "fp16.diverge_min_batch": 64,
        }
    )
    assert land.overflow_step(fp16(64)) == 200
    assert land.overflow_step(fp16(256)) == 50  # 4x the batch: 4x the rule's lr per step
    lr2 = fp16(64).model_copy(update={"learning_rate": 0.2})
    assert land.overflow_step(lr2) == 100
    assert land.overflow_step(fp16(32)) is None and not land.diverges(fp16(32))
    bf16 = Candidate(precision="bf16", batch_size=256, learning_rate=0.4)
    assert land.overflow_step(bf16) is None


def test_an_init_scale_above_the_safe_one_backs_off_in_a_probes_warm_up() -> None:
    """At 2^16 with 2^7 safe, nine steps skip while the scale backs off, as GradScaler does: a
    probe runs them as warm-up (a probe that timed them called a run diverged that recovers)
    and ends at the safe scale; started there, none skip, and diagnose names that scale."""
    land = v2(**{"fp16.safe_init_scale": 128.0})
    runner = SimulatedRunner(land)
    backed = runner.run(WORKLOAD, fp16(), counted(10))
    assert backed.outcome == Outcome.COMPLETED, backed.reason
    assert backed.skipped_steps == 9 and backed.scales[-1][1] == 128.0
    safe = runner.run(WORKLOAD, fp16(init_scale=128.0), counted(10))
    assert safe.outcome == Outcome.COMPLETED and safe.skipped_steps == 0
    assert land.truth(fp16()).feasible
    found = runner.diagnose(WORKLOAD, fp16())
    assert found is not None
    lower = [r for r in found["recommendations"] if r["kind"] == "lower_init_scale"]
    assert lower and lower[0]["init_scale"] == 128.0


def test_a_back_off_of_slow_steps_starts_none_that_would_end_past_the_time_limit() -> None:
    """fp16 at 30 samples/s (2 s a step) backing off twelve halvings to 2^4: a search's probe
    with a 12 s limit starts no back-off step its time cannot hold (one started at 10 s ran to
    14 s), as no warm-up step does."""
    land = landscape(**{"fp16.safe_init_scale": 2.0**4})
    mode = land.modes["fp16"]
    slow = mode.model_copy(update={"throughput": dict.fromkeys(mode.throughput, 30.0)})
    land = land.model_copy(update={"modes": {**land.modes, "fp16": slow}})
    settings = ProbeSettings(steps=20, warmup_steps=3, min_time=0, time_limit=12.0)
    result = SimulatedRunner(land).run(
        land.workload, fp16(64), settings, early_stop=EarlyStop(below=1.0)
    )
    assert result.wall_seconds <= settings.time_limit, result.summary()


def test_a_first_step_is_judged_as_a_step_only_past_the_first_use_costs_allowed() -> None:
    """A first step that took 12 s of first-use costs (a GPU loading and tuning a mode's
    kernels) before millisecond steps: judged by its time alone it would read as a step at
    5 samples/s and stop a candidate running thousands. A search's probe judges a first step
    only past the first-use costs its rule allows (a CPU's: none is passed on a GPU); a step
    still hopeless past them stops the probe after it, without a second."""
    land = landscape(**{"timing.first_step_seconds": 12.0})
    settings = ProbeSettings(steps=20, warmup_steps=3, min_time=0, time_limit=60.0)
    runner = SimulatedRunner(land)
    best = 4 * runner.run(land.workload, fp16(64), settings).throughput
    gpu = runner.run(land.workload, fp16(64), settings, early_stop=EarlyStop(below=best / 5))
    assert gpu.outcome == Outcome.COMPLETED, gpu.reason
    # The same first step where only 1 s of first-use costs is allowed: hopeless, stopped.
    rule = EarlyStop(below=best / 5, first_use=1.0)
    cpu = runner.run(land.workload, fp16(64), settings, early_stop=rule)
    assert cpu.outcome == Outcome.SLOWER and cpu.reason.startswith("its first step took")
    assert cpu.timed_steps + cpu.warmup_steps == 1  # its first step alone


@pytest.mark.parametrize(("rate", "diverges"), [(0.3, True), (0.01, True), (1e-5, False)])
def test_lasting_skips_diverge_where_they_outrun_the_scalers_regrowth(
    rate: float, diverges: bool
) -> None:
    land = v2(**{"fp16.skip_rate": rate})
    assert land.diverges(fp16()) is diverges
    # The engine over a long run agrees: the scale falls below 1, or it holds.
    engine = SimEngine(land, fp16(), VirtualClock(), seed=0, noise=random.Random(0))
    engine.build()
    for _ in range(400):
        engine.run_steps(50)
    assert (engine.scale() < 1) is diverges
    if rate >= 0.25:
        result = SimulatedRunner(land).run(WORKLOAD, fp16(), counted(40))
        assert result.outcome == Outcome.DIVERGED


# ---- speed, compile, noise -------------------------------------------------------------------


def test_throughput_may_peak_at_a_middle_batch_and_fall_after() -> None:
    peaked = {16: 2000.0, 64: 6000.0, 256: 9000.0, 1024: 7000.0}
    land = v2(**{"modes.fp16.throughput": peaked})
    rates = {b: land.throughput(fp16(b)) for b in (128, 256, 512, 1024, 2048)}
    assert rates[128] < rates[256] > rates[512] > rates[1024] == rates[2048]
    assert land.truth(fp16(256)).speedup > land.truth(fp16(1024)).speedup


def test_compile_time_and_gain_are_per_compile_mode() -> None:
    modes = {"max-autotune": {"speedup": 1.4, "seconds": 200.0}}
    land = v2(
        **{
            "knobs.compile_speedup": 1.1,
            "knobs.compile_seconds": 40.0,
            "knobs.compile_modes": modes,
        }
    )
    default = fp16(compile=True)
    tuned = fp16(compile=True, compile_mode="max-autotune")
    plain = fp16()
    assert land.throughput(default) == pytest.approx(1.1 * land.throughput(plain))
    assert land.throughput(tuned) == pytest.approx(1.4 * land.throughput(plain))
    assert land.truth(tuned).compile_seconds == 200.0 and land.truth(plain).compile_seconds == 0
    runner = SimulatedRunner(land)
    first = {
        c.compile_mode: runner.run(WORKLOAD, c, counted(20)).compile_seconds
        for c in (default, tuned)
    }
    assert first == {
        "default": pytest.approx(40.0, abs=2),
        "max-autotune": pytest.approx(200.0, abs=2),
    }


def test_a_neighbours_bursts_last_their_blocks_and_hit_both_arms_of_a_pair() -> None:
    land = v2(
        **{
            "noise.block_cv": 0.0,
            "noise.burst_probability": 0.05,
            "noise.burst_slowdown": 3.0,
            "noise.burst_blocks": 4,
        }
    )
    clock, bursts, rng = VirtualClock(), Bursts(), random.Random(1)
    arms = [
        SimEngine(land, c, clock, seed=0, noise=rng, bursts=bursts)
        for c in (fp16(), Candidate(precision="fp32", batch_size=64, learning_rate=0.1))
    ]
    for e in arms:
        e.build()
        e.run_steps(20)  # past the warm-up: every block of 5 steps takes the same time
    slow: list[bool] = []
    steady = [e.run_steps(5).seconds for e in arms]
    for _ in range(300):
        for e, base in zip(arms, steady, strict=True):
            slow.append(e.run_steps(5).seconds > 2 * base)
    runs, n = [], 0
    for s in [*slow, False]:
        if s:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs and all(r % 4 == 0 for r in runs)  # back-to-back bursts join
    # The blocks alternate between the arms, so every burst slows both: one neighbour.
    assert 0.05 < sum(slow) / len(slow) < 0.4


# ---- parity ---------------------------------------------------------------------------------


def test_a_lasting_gap_with_an_onset_shows_only_after_its_samples() -> None:
    quiet = {"loss.step_noise": 0.0, "loss.seed_spread": 0.0, "modes.fp16.parity_gap": 0.04}
    land = v2(**quiet, **{"parity.gap_onset_samples": 20000.0})
    clock = VirtualClock()

    def ratios(land: Landscape) -> list[float]:
        curves = []
        for c in (fp16(), Candidate(precision="fp32", batch_size=64, learning_rate=0.1)):
            e = SimEngine(land, c, clock, seed=0, noise=random.Random(0))
            e.build()
            e.run_steps(500)
            curves.append(e.read_losses())
        return [a / b - 1 for a, b in zip(*curves, strict=True)]

    onset, always = ratios(land), ratios(v2(**quiet))
    # At 2,000 samples (step 31) a tenth of the way in: almost none of the gap shows yet.
    assert onset[31] < 0.1 * always[31]
    # From 20,000 samples (step 312) on, all of it, as without an onset.
    assert onset[400] == pytest.approx(always[400]) == pytest.approx(0.04, rel=0.05)
    assert land.truth(fp16()).parity_gap == pytest.approx(0.04)


# ---- fp32 islands ---------------------------------------------------------------------------


def test_the_simulated_diagnosis_names_the_islands_and_the_search_tries_them() -> None:
    land = v2(**{"fp16.diverges_at_step": 30, "fp16.islands": ["layer4.1.conv2", "fc"]})
    found = SimulatedRunner(land).diagnose(WORKLOAD, fp16())
    assert found is not None and found["verdict"] == "at_risk"
    assert islands_plan(found) == (
        ["layer4.1.conv2", "fc"],
        "tried: fp16 with layer4.1.conv2, fc kept in fp32",
    )
    early = SimulatedRunner(v2(**{"fp16.diverges_at_step": 1, "fp16.islands": ["fc"]}))
    assert early.diagnose(WORKLOAD, fp16())["first_nonfinite"] == "fc"  # type: ignore[index]
    spec = parse_spec(
        {
            "name": "sim",
            "workload": WORKLOAD,
            "budget": "4m",
            "space": {"precisions": ["fp32", "fp16"]},
            "probe": {"steps": 40},
        }
    )
    run = simulate(spec, land, seed=1)
    tried = [t for t in run.store.trials() if t.user_attrs.get("fp32_modules")]
    assert tried and tried[0].user_attrs["fp32_modules"] == ["layer4.1.conv2", "fc"]
    assert any(t.user_attrs.get("outcome") != "diverged" for t in tried)


def test_a_loss_floor_as_noisy_as_a_recorded_gpus_does_not_make_the_reference_diverge() -> None:
    # Recorded on an H200: resnet18's loss falls from ~2.5 to a floor near 0.04 whose step-to-step
    # noise is 73%. The real reference never diverged; a simulated one whose first loss drew that
    # noise (0.6 for a curve at 3.9) read a later step as "above 10x the initial".
    land = landscape(
        **{"loss.initial": 3.9, "loss.final": 0.04, "loss.samples_scale": 900.0},
        **{"loss.step_noise": 0.73},
    )
    fp32 = Candidate(precision="fp32", batch_size=128, learning_rate=0.1)
    for seed in range(300):
        engine = SimEngine(land, fp32, VirtualClock(), seed=seed, noise=random.Random(seed))
        engine.build()
        engine.run_steps(12)
        first, *rest = engine.pending
        assert max(rest) < 10 * first, seed
        # The floor keeps its measured noise: the curve is not smoothed.
        engine.run_steps(200)
        tail = engine.pending[-200:]
        assert max(tail) > 2 * min(tail)


def test_an_lr_past_the_stable_one_diverges_at_every_batch_and_a_kept_lr_does_not() -> None:
    land = v2(**{"parity.diverge_lr_above": 1.5})
    rule = Candidate(precision="bf16", batch_size=128, learning_rate=0.2)  # the rule's, at 2x
    kept = Candidate(precision="bf16", batch_size=128, learning_rate=0.1)
    assert land.diverges(rule) and not land.diverges(kept)
    assert land.diverges(Candidate(precision="bf16", batch_size=16, learning_rate=0.2))
    result = SimulatedRunner(land).run(WORKLOAD, rule, counted(20))
    assert result.outcome == Outcome.DIVERGED
    # The kept lr learns less a sample: its lasting gap is the rule's cost of a halving.
    assert land.parity_gap(kept) == pytest.approx(land.parity_gap(rule) + 0.05)
