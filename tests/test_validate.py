"""Validation selects on what it re-measured: shortlists, parity, lower bounds, fallbacks."""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.result import PairedResult, ProbeResult
from autotune.search._validate import Rerun, rejection_summary, select, shortlist, with_gap
from autotune.spec import Candidate
from autotune.trials import TrialRecord

_DISTS = {
    "precision": CategoricalDistribution(["fp32", "fp16", "bf16"]),
    "batch_size": CategoricalDistribution([32, 64, 128, 256]),
    "lr_multiplier": FloatDistribution(0.5, 2.0, log=True),
}


def trial(
    number: int,
    speedup: float,
    *,
    precision: str = "bf16",
    batch_size: int = 64,
    gap: float = 0.0,
    tolerance: float = 0.05,
    half_width: float = 0.05,
    **attrs: object,
) -> FrozenTrial:
    rec = TrialRecord(
        outcome="completed" if gap <= tolerance else "infeasible",
        learning_rate=0.1,
        throughput=1000.0 * speedup,
        speedup=speedup,
        speedup_low=speedup * (1 - half_width),
        speedup_high=speedup * (1 + half_width),
        parity_gap=gap,
        **attrs,
    )
    t = create_trial(
        value=speedup,
        params={"precision": precision, "batch_size": batch_size, "lr_multiplier": 1.0},
        distributions=_DISTS,
        user_attrs=rec.to_attrs(),
        system_attrs={"constraints:parity": gap - tolerance},
    )
    t.number = number
    return t


def probe(cand: Candidate, throughput: float, losses: list[float], **kw: object) -> ProbeResult:
    return ProbeResult(
        candidate=cand,
        workload="w",
        device="cpu",
        outcome=kw.pop("outcome", "completed"),  # type: ignore[arg-type]
        throughput=throughput,
        losses=losses,
        batch_size=cand.batch_size,
        **kw,  # type: ignore[arg-type]
    )


REF = Candidate(precision="fp32", batch_size=32, learning_rate=0.1)


def paired(
    t: FrozenTrial, speedup: float, low: float, high: float, *, loss_scale: float = 1.0
) -> Rerun:
    cand = Candidate(
        precision=t.params["precision"], batch_size=t.params["batch_size"], learning_rate=0.1
    )
    ref_losses = [2.0 - 0.01 * i for i in range(80)]
    steps = 80 * 32 // cand.batch_size
    cand_losses = [(2.0 - 0.01 * i * cand.batch_size / 32) * loss_scale for i in range(steps)]
    result = PairedResult(
        candidate=probe(cand, 1000.0 * speedup, cand_losses),
        reference=probe(REF, 1000.0, ref_losses),
        speedup=speedup,
        speedup_low=low,
        speedup_high=high,
        pairs=12,
    )
    return with_gap(Rerun(t, result))


def test_the_shortlist_skips_infeasible_twins_and_candidates_that_cannot_clearly_win() -> None:
    trials = [
        trial(0, 2.0),
        trial(1, 3.0, gap=0.2),  # fastest, but learns worse: infeasible
        trial(2, 1.6, batch_size=128),
        trial(3, 1.02, batch_size=32, half_width=0.1),  # does not even look 5% faster
        trial(4, 2.0, duplicate_of=0),  # a twin's copied measurement
    ]
    picked = shortlist(trials, top_k=2, min_speedup=1.05, parity_tolerance=0.05)
    assert [t.number for t in picked] == [0, 2]


def test_the_fastest_candidate_with_a_clear_parity_margin_is_validated_too() -> None:
    trials = [
        trial(0, 2.0, gap=0.049),
        trial(1, 1.9, gap=0.04, batch_size=128),
        trial(2, 1.5, gap=0.0, batch_size=256),
    ]
    picked = shortlist(trials, top_k=2, min_speedup=1.05, parity_tolerance=0.05)
    assert [t.number for t in picked] == [0, 1, 2]


def test_a_candidate_that_re_measures_lower_but_still_clearly_faster_is_accepted_at_its_new_figure() -> (
    None
):
    t = trial(0, 6.14)  # the search's figure: the max of many noisy ones
    rerun = paired(t, 3.44, 3.30, 3.60)
    chosen = select([rerun], min_speedup=1.05, parity_tolerance=0.05)
    assert chosen.winner is rerun and not chosen.rejected
    assert chosen.winner.paired.speedup == 3.44


def test_a_true_tie_falls_back() -> None:
    t = trial(0, 1.3)
    chosen = select([paired(t, 1.01, 0.97, 1.04)], min_speedup=1.05, parity_tolerance=0.05)
    assert chosen.winner is None
    (why,) = chosen.rejected
    assert (why.stage, why.kind) == ("validation", "speed")
    assert "1.01x (0.97–1.04)" in str(why) and "does not clear 1.05x" in str(why)


def test_the_best_lower_bound_wins_not_the_best_point() -> None:
    a = paired(trial(0, 2.5), 2.2, 1.5, 2.9)  # higher point, wide interval
    b = paired(trial(1, 2.0, batch_size=128), 2.0, 1.9, 2.1)  # tighter, better lower bound
    chosen = select([a, b], min_speedup=1.05, parity_tolerance=0.05)
    assert chosen.winner is b and chosen.accepted == [a, b]


def test_a_rerun_that_loses_parity_is_rejected_with_the_gap_and_the_noise_allowed() -> None:
    bad = paired(trial(0, 2.0), 2.0, 1.9, 2.1, loss_scale=1.2)
    chosen = select([bad], min_speedup=1.05, parity_tolerance=0.05, seed_noise=0.01)
    assert chosen.winner is None
    (why,) = chosen.rejected
    assert why.kind == "parity"
    assert "tolerance 5% + seed noise 1.0%" in why.detail


def test_a_rerun_that_diverges_or_had_no_time_is_named() -> None:
    t = trial(0, 2.0)
    cand = Candidate(precision="bf16", batch_size=64, learning_rate=0.1)
    diverged = Rerun(
        t,
        PairedResult(
            candidate=probe(cand, 0.0, [2.0, float("nan")], outcome="diverged", reason="loss=nan"),
            reference=probe(REF, 1000.0, [2.0, 1.9]),
        ),
    )
    chosen = select([diverged, Rerun(trial(1, 1.9), None)], min_speedup=1.05, parity_tolerance=0.05)
    assert chosen.winner is None
    assert [r.kind for r in chosen.rejected] == ["diverged"]
    assert any("no time left" in n for n in chosen.notes)


def test_rejections_in_the_search_are_grouped_by_mode_and_outcome() -> None:
    pruned = create_trial(
        state=TrialState.PRUNED,
        params={"precision": "fp16", "batch_size": 64, "lr_multiplier": 1.0},
        distributions=_DISTS,
        user_attrs=TrialRecord(outcome="diverged", reason="loss=nan at step 3").to_attrs(),
    )
    summary = rejection_summary([pruned, pruned, trial(2, 2.0, gap=0.1)])
    assert [str(r) for r in summary] == [
        "fp16: 2 diverged (e.g. loss=nan at step 3)",
        "bf16: 1 infeasible",
    ]
