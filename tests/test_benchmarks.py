"""The GPU benchmark also runs on a CPU, small, so its arithmetic is tested here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _configs import make_config, write_config

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_amp_table_runs_on_cpu_pairs_its_rows_and_its_figures_add_up(tmp_path: Path) -> None:
    amp_table = load("amp_table")
    cfg = write_config(
        tmp_path / "best.json",
        make_config(
            "bf16", workload="autotune.workloads:tiny_convnet", batch_size=64, learning_rate=0.4
        ),
    )
    out = amp_table.main(
        [
            "--device",
            "cpu",
            "--workload",
            "tiny_convnet",
            "--config",
            str(cfg),
            "--samples",
            "512",
            "--json",
            str(tmp_path / "t.json"),
            "--markdown",
            str(tmp_path / "t.md"),
        ]
    )
    rows = {r["setup"]: r for r in out["rows"]}
    assert set(rows) == {"fp32", "plain AMP recipe", "autotune"}
    assert rows["fp32"]["settings"].startswith("fp32 bs=32")
    assert rows["plain AMP recipe"]["settings"].startswith("fp16 bs=32")
    assert rows["autotune"]["settings"].startswith("bf16 bs=64")
    for r in rows.values():
        assert r["outcome"] == "completed"
        assert r["samples"] >= 512
        # Time for the samples is what the throughput says it is.
        assert abs(r["seconds"] * r["throughput"] - r["samples"]) < 1e-6 * r["samples"]
        # TFLOP/s = FLOPs per sample x samples/s; no peak is known for a CPU.
        assert r["tflops"] > 0 and r["peak_tflops"] is None and r["share_of_peak"] is None
    # fp32 is the reference: 1.0x by construction, not a second timing of itself.
    fp32 = rows["fp32"]
    assert (fp32["speedup"], fp32["speedup_low"], fp32["speedup_high"]) == (1.0, 1.0, 1.0)
    for name in ("plain AMP recipe", "autotune"):
        r = rows[name]
        # Paired: one ratio per block both runs took, with its interval.
        assert r["pairs"] == min(r["timed_blocks"], fp32["timed_blocks"]) >= 2
        assert r["speedup_low"] < r["speedup"] < r["speedup_high"]
    tuned = rows["autotune"]
    assert out["goals"]["tuned_vs_fp32"] == tuned["speedup"]
    assert out["goal_intervals"]["tuned_vs_fp32"] == [
        tuned["speedup_low"],
        tuned["speedup_high"],
        tuned["pairs"],
    ]
    low, high, pairs = out["goal_intervals"]["tuned_vs_amp"]
    assert low < out["goals"]["tuned_vs_amp"] < high and pairs >= 2
    table = (tmp_path / "t.md").read_text()
    assert "peak unknown" in table and table.count("\n| ") == 4
    assert "| 1.00x (reference) |" in table
    for name in ("plain AMP recipe", "autotune"):
        r = rows[name]
        assert (
            f"| {r['speedup']:.2f}x ({r['speedup_low']:.2f}–{r['speedup_high']:.2f}, "
            f"{r['pairs']} pairs) |" in table
        )
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["samples"] == 512


def test_a_row_that_ends_early_is_marked_unpaired() -> None:
    amp_table = load("amp_table")
    r = {"setup": "autotune", "speedup": None, "outcome": "diverged"}
    assert amp_table.speed_text(r) == "unpaired (diverged)"
    assert amp_table.speed_text({**r, "outcome": "completed"}) == "unpaired"


def _trust_row(validated: bool, **fields: object) -> dict[str, object]:
    """A row as trust.one_run writes it: a fallback has no claim and no full run of its own."""
    row: dict[str, object] = {
        "study": "tiny", "seed": 1, "winner": "bf16 bs=64 lr=0.4" if validated else "fp32 bs=32",
        "mode": "bf16" if validated else "fp32", "batch_size": 64 if validated else 32,
        "validated": validated, "claimed": 1.5 if validated else 1.0,
        "claimed_low": 1.4 if validated else None, "claimed_high": 1.6 if validated else None,
        "false_claim": False,
    }  # fmt: skip
    if validated:
        row.update(measured=1.55, measured_low=1.5, measured_high=1.6, error=0.03)
        row.update(loss_ratio=1.01, parity_held=True, measured_in_claimed_interval=True)
    else:
        row.update(measured=None, error=None, loss_ratio=None, parity_held=None)
        row.update(measured_in_claimed_interval=None)
    return {**row, **fields}


def test_trust_counts_a_fallback_that_passed_over_a_real_win() -> None:
    """After a fallback the full run trains the candidate the search passed over: a win it
    missed (>= 1.10x in full, parity kept) is counted and named; parity is counted over the
    validated runs only (a fallback's config is the reference)."""
    trust = load("trust")
    missed = _trust_row(False, passed_over="bf16 bs=64 lr=0.4", passed_over_measured=1.6,
                        passed_over_low=1.5, passed_over_high=1.7,
                        passed_over_loss_ratio=1.02, missed_win=True)  # fmt: skip
    rightly = _trust_row(False, passed_over="fp16 bs=32 lr=0.2", passed_over_measured=1.02,
                         passed_over_loss_ratio=0.99, missed_win=False)  # fmt: skip
    rows = [_trust_row(True), missed, rightly]
    total = trust.summarize(rows)
    assert total["fallbacks_where_a_candidate_beat_fp32"] == 1
    assert (total["validated"], total["parity_held"]) == (1, 1)
    text = trust.markdown(rows, total, "note")
    assert "full runs that kept parity: 1 of 1 validated" in text
    assert (
        "missed a real win (the candidate passed over >= 1.10x in full, keeping parity): 1" in text
    )
    assert (
        "passed over bf16 bs=64 lr=0.4: 1.60x (1.50–1.70) in full, loss ratio 1.020, MISSED WIN"
        in text
    )
    assert "passed over fp16 bs=32 lr=0.2: 1.02x in full, loss ratio 0.990 |" in text


def test_trust_judges_a_full_runs_parity_within_the_tolerance_plus_the_seed_band() -> None:
    """On tiny one seed's final loss moves 2-17% with the seed alone, beyond the 5% tolerance:
    a full run is off parity only past the tolerance plus that band, which fp32 trained once
    more with another seed measures, and the verdict is printed with its band."""
    import argparse

    from autotune.train import TrainSettings, baseline_candidate, train
    from autotune.workloads import tiny_mlp

    trust = load("trust")
    assert trust._held(1.09, 0.05, 0.06) and not trust._held(1.09, 0.05, 0.02)
    assert not trust._held(1.09, 0.05, None) and trust._held(1.04, 0.05, None)
    wl = tiny_mlp()
    settings = TrainSettings(steps=20, seed=1)
    fp32 = train(wl, baseline_candidate(wl, "fp32"), "cpu", settings)
    band = trust._seed_band(wl, settings, argparse.Namespace(device="cpu"), fp32)
    assert band is not None and band > 0  # another seed, another final loss
    row = _trust_row(True, loss_ratio=1.09, seed_band=0.06, parity_held=True)
    assert "held (1.090; seed band 6.0%)" in trust.markdown([row], trust.summarize([row]), "n")


def test_after_a_fallback_trust_checks_the_fastest_candidate_the_search_measured() -> None:
    """Judged off parity at the probe's horizon or not, the fastest candidate measured to the
    end is the one the full run checks; never the fallback's own settings, a trial cut short,
    or the config's own record."""
    import optuna

    trust = load("trust")
    done, cut = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED

    def trial(precision: str, bs: int, tp: float, state=done, constraints=(), **attrs: object):
        return optuna.trial.create_trial(
            params={"precision": precision, "batch_size": bs},
            distributions={
                "precision": optuna.distributions.CategoricalDistribution(["fp32", "bf16"]),
                "batch_size": optuna.distributions.IntDistribution(16, 256),
            },
            value=tp if state == done else None,
            state=state,
            user_attrs={"throughput": tp, **attrs},
            system_attrs={"constraints": list(constraints)} if constraints else None,
        )

    # Infeasible: its loss 24% behind the reference's at the probe's horizon.
    off_parity = trial("bf16", 64, 15_000.0, constraints=(0.24,))
    trials = [
        trial("fp32", 32, 16_000.0),  # the reference's settings
        trial("bf16", 128, 30_000.0, state=cut),  # stopped early
        trial("fp32", 32, 17_000.0, tuned_config=True),  # the config's record
        off_parity,
        trial("fp32", 64, 14_000.0),
    ]
    measured = trust._measured(trials, ("fp32", 32))
    assert max(measured, key=lambda t: t.user_attrs["throughput"]) is off_parity
    assert {(t.params["precision"], t.params["batch_size"]) for t in measured} == {
        ("bf16", 64),
        ("fp32", 64),
    }


def test_flops_per_sample_match_a_hand_count() -> None:
    """One linear layer, 64 features to 10: 2*64*10 FLOPs forward; backward needs only the weight
    gradient (the input needs none), another 2*64*10."""
    amp_table = load("amp_table")
    from autotune.workloads import tiny_mlp

    wl = tiny_mlp()
    wl.build_model = lambda: torch.nn.Linear(64, 10)
    flops = amp_table.flops_per_sample(wl, torch.device("cpu"), "fp32")
    forward = 2 * 64 * 10
    assert flops == forward * 2


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA A10", "fp32", 31.2),
        # Other parts with similar names: their own peaks are not in the table.
        ("NVIDIA H200 NVL", "bf16", None),
        ("NVIDIA H100 NVL", "bf16", None),
        ("NVIDIA L40", "fp16", None),
        ("NVIDIA A10G", "fp16", None),
        ("Tesla V100-PCIE-16GB", "fp16", None),
        ("Some Future GPU", "fp16", None),
        # A mode the part has no tensor-core rate for.
        ("Tesla T4", "bf16", None),
    ],
)
def test_peak_table_matches_device_names_exactly(
    monkeypatch: pytest.MonkeyPatch, name: str, precision: str, peak: float | None
) -> None:
    amp_table = load("amp_table")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    assert amp_table.dense_peak(torch.device("cuda", 0), precision) == peak
    assert amp_table.dense_peak(torch.device("cpu"), precision) is None


def test_search_sim_scores_the_search_against_the_landscape(tmp_path: Path) -> None:
    """The simulated-device benchmark runs as a script and writes every figure it promises."""
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "search_sim.py"),
            "--landscapes",
            "a100-resnet18",
            "--seeds",
            "2",
            "--shares",
            "0.3",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wall time" in done.stdout and "goals:" in done.stdout
    report = json.loads(out.read_text())
    assert report["strategy"]
    entry = report["a100-resnet18"]
    assert entry["kind"] in ("recorded", "modelled") and entry["device"]
    assert set(entry) >= {"kind", "device", "0.3"} and "0.1" not in entry
    s = entry["0.3"]
    assert s["seeds"] == 2
    assert 0 < s["p10_share_of_optimum"] <= s["median_share_of_optimum"] <= 1.0 + 1e-9
    for rate in ("missed_win_rate", "false_claim_rate"):
        assert 0.0 <= s[rate] <= 1.0
    assert 0 < s["median_budget_used"] < 2.0
    assert 0 < s["median_fixed_cost_s"] <= entry["0.3"]["budget_s"] * 2
    # Where the time went: every phase of the search, adding up to about the budget used.
    spent = s["median_spent_s"]
    assert {"ceilings", "reference", "search", "validation"} <= set(spent), spent
    assert 0.5 * s["budget_s"] * s["median_budget_used"] <= sum(spent.values())
