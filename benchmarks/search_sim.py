"""The search itself, on the simulated device: how close it gets to the true optimum, how often
it misses a real win or claims a false one, at a share of what an exhaustive grid would take.

For every shipped landscape (``autotune/sim/landscapes/*.yaml``, or ``--landscapes a,b``), for
``--seeds`` seeds, at budgets of ``--shares`` of the grid's time, it runs the real search
(:func:`autotune.sim.simulate`: ``run_search`` over a simulated device on a virtual clock) with
the spec::

    {"name": ..., "workload": landscape.workload, "budget": share * grid seconds,
     "space": {"precisions": <the landscape's supported modes>}}

everything else at its default (batch ladder 16..1024, the default init_scale range, lr
multiplier 1), and scores the emitted config against the landscape's noise-free truth
(:meth:`Landscape.truth`).

What the grid would take (``--grid``):

- ``probes``: the virtual seconds a fresh
  :class:`~autotune.sim.SimulatedRunner` takes to start its worker, run the fp32 reference
  once (the search's own reference probe: ``probe.steps`` times the reference factor) and then
  one probe, at the spec's probe settings, of every grid point: every supported precision x
  every batch size of the ladder that fits in memory (with the spec's memory margin), fp16 at
  each of the space's init_scale choices, at lr multiplier 1. Simulated, not estimated
  from throughput x steps: each probe's warm-up, first step, ``min_time`` and noise included.
  No trial overhead, no parity check, no validation: the cheapest grid there is.
- ``paired`` (the default: a grid whose figures a person could trust): the same, but every
  point measured paired with the fp32 reference (interleaved
  blocks in one run, as ``benchmarks/search_vs_grid.py``'s grid and the search's validation
  measure it), so the grid's figures carry the evidence a config does.

The true optimum: the best noise-free speedup among the grid's points that fit, do not diverge
and whose noise-free parity gap is within the spec's ``parity_tolerance``; when it does not
reach the spec's ``min_speedup``, the fp32 reference itself (1.0x: falling back is right).

Per landscape and share it prints:

- share of optimum (median, 10th percentile): the emitted config's true speedup over the
  optimum (a fallback to fp32 at the base batch: 1.0 / optimum);
- ``missed_win_rate``: runs that fell back to fp32 although the optimum is a real win (>= 1.10x);
- ``false_claim_rate``: validated configs whose true speedup is below 1.0x, or outside the
  claimed interval ``evidence.speedup_low..speedup_high`` (a fallback claims 1.0x: never false);
- ``unsafe_rate`` (extra): validated configs that by the truth do not fit, diverge or lie
  outside the parity tolerance;
- budget used (median share of the budget the run took, to the config written) and the fixed
  cost before the first trial (median virtual seconds);
- the most frequent choices, and the wall time of the whole benchmark and of one ``simulate``.

Goals (the issue's): at 30% median >= 98% of the optimum and p10 >= 90% on every landscape; at
10% median >= 90%; no false claims; missed real wins <= 5%.

Strategies (``--strategy tpe,random,...``; each runs the same seeds, landscapes and budgets, and
is set up inside the benchmark's own processes, the product untouched):

- ``tpe``: the search as the product runs it (optuna's TPESampler after the informed first
  trials, probes stopped early once clearly slower or off parity);
- ``random``: optuna's RandomSampler in place of TPE (same seed), all else as shipped;
- ``no-informed``: no informed first trials (the AMP recipe at the base batch, the next batch
  up, each mode's ceiling): the sampler chooses from the first trial on;
- ``no-early-stop``: the spec's ``probe.early_stop: false``: every probe measured to its end.

It prints the table per strategy, then per share a comparison: each figure averaged over the
landscapes (the mean of the per-landscape medians, p10s and rates). The goals, the phases and
the fallbacks are those of the first strategy listed. The JSON keeps, per landscape, the figures
of the first strategy, and under ``"strategies"`` every strategy's per-landscape figures and
averages.

    python benchmarks/search_sim.py [--landscapes a100-resnet18,t4-resnet18] [--seeds 100]
        [--shares 0.1,0.3] [--jobs 2] [--grid probes|paired] [--strategy tpe,random]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
from loguru import logger

from autotune import clock
from autotune.search import reference_factor
from autotune.search._space import Space
from autotune.sim import Landscape, SimulatedRunner, load_landscape, shipped_landscapes, simulate
from autotune.spec import StudySpec, parse_spec

# A real win: the optimum beats fp32 by this much (a fallback then misses it).
REAL_WIN = 1.10
GOALS = {
    "median_at_30": 0.98,
    "p10_at_30": 0.90,
    "median_at_10": 0.90,
    "false_claim_rate": 0.0,
    "missed_win_rate": 0.05,
}


# ---- the strategies -----------------------------------------------------------------------------

STRATEGIES = {
    "tpe": "as shipped: TPESampler after the informed first trials, early-stopped probes",
    "random": "optuna's RandomSampler in place of TPE",
    "no-informed": "no informed first trials: the sampler from the first trial on",
    "no-early-stop": "probe.early_stop false: every probe measured to its end",
}

# What the strategies replace, as the product has it (restored for ``tpe``).
_RUN = importlib.import_module("autotune.search._run_search")
_TPE_SAMPLER = optuna.samplers.TPESampler
_ENQUEUE_FIRST_TRIALS = _RUN._enqueue_first_trials


def _random_sampler(seed: int | None = None, **_: Any) -> optuna.samplers.BaseSampler:
    """Stands in for ``TPESampler(seed=..., n_startup_trials=...)`` in ``open_study``."""
    return optuna.samplers.RandomSampler(seed=seed)


def _no_first_trials(*_: Any, **__: Any) -> None:
    """Stands in for ``_enqueue_first_trials``: nothing enqueued, the sampler decides."""


def use_strategy(name: str) -> None:
    """Set this process up for the strategy ``name``, undoing any other's set-up first.

    Monkeypatches, for this benchmark's processes only (never the product's code on disk):
    ``random`` replaces ``optuna.samplers.TPESampler``, the name
    ``autotune.study.storage.open_study`` builds its sampler by, which patches optuna globally in
    this process: fine for a benchmark process that runs nothing else; ``no-informed`` replaces
    ``autotune.search._run_search._enqueue_first_trials`` (looked up at call time by
    ``run_search``). ``no-early-stop`` is a spec setting (:func:`spec_for`), nothing patched. One
    search runs at a time in a process, so each run sets its own strategy up before it starts.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
    sampler = _random_sampler if name == "random" else _TPE_SAMPLER
    setattr(optuna.samplers, "TPESampler", sampler)  # noqa: B010 (a class's name, rebound)
    first = _no_first_trials if name == "no-informed" else _ENQUEUE_FIRST_TRIALS
    setattr(_RUN, "_enqueue_first_trials", first)  # noqa: B010


# ---- the spec, the grid and the truth -----------------------------------------------------------


def precisions_of(land: Landscape) -> list[str]:
    return [p for p in land.modes if p not in land.unsupported]


def spec_for(land: Landscape, budget: float, strategy: str = "tpe") -> StudySpec:
    raw: dict[str, Any] = {
        "name": f"sim-{land.name}",
        "workload": land.workload,
        "budget": budget,
        "space": {"precisions": precisions_of(land)},
    }
    if strategy == "no-early-stop":
        raw["probe"] = {"early_stop": False}
    return parse_spec(raw)


def space_of(land: Landscape, spec: StudySpec) -> Space:
    f = land.facts
    return Space.of(
        spec,
        precisions_of(land),
        rule=f.lr_scaling,
        base_lr=f.base_lr,
        base_batch=f.base_batch_size,
        channels_last=f.channels_last,
    )


def grid(land: Landscape, how: str = "probes") -> dict[str, Any]:
    """The grid's simulated time, its points and the true optimum (see the module docstring)."""
    spec = spec_for(land, 3600.0)
    space = space_of(land, spec)
    runner = SimulatedRunner(land, seed=0)
    ref = space.candidate("fp32", space.base_batch)
    factor = reference_factor(max(space.ladder), space.base_batch)
    probe = spec.probe
    points = []
    with clock.use(runner.clock):
        runner.start()
        ref_settings = probe.model_copy(
            update={"steps": probe.steps * factor, "time_limit": probe.time_limit * factor}
        )
        runner.run(land.workload, ref, ref_settings)
        for precision in space.precisions:
            for bs in space.ladder:
                cand = space.candidate(precision, bs)
                truth = land.truth(cand, margin=spec.memory_margin)
                if not truth.fits:
                    continue
                # Every point of the space the search chooses from: fp16 at each init_scale.
                scales = space.scales if precision == "fp16" else [0.0]
                for scale in scales:
                    point = space.candidate(precision, bs, init_scale=scale)
                    if how == "paired":
                        runner.compare(land.workload, point, ref, probe)
                    else:
                        runner.run(land.workload, point, probe)
                ok = truth.feasible and truth.parity_gap <= spec.parity_tolerance
                points.append(
                    {
                        "precision": precision,
                        "batch_size": bs,
                        "speedup": truth.speedup,
                        "parity_gap": truth.parity_gap,
                        "feasible": ok,
                    }
                )
        seconds = runner.clock.monotonic()
    best = max((p for p in points if p["feasible"]), key=lambda p: p["speedup"], default=None)
    # A win smaller than the spec's min_speedup is no win: there the fp32 fallback is the answer.
    if best is not None and best["speedup"] < spec.validation.min_speedup:
        best = None
    optimum = best["speedup"] if best else 1.0
    return {
        "seconds": seconds,
        "points": len(points),
        "optimum": optimum,
        "optimum_point": f"{best['precision']} bs={best['batch_size']}" if best else "fp32 bs=base",
        "parity_tolerance": spec.parity_tolerance,
    }


# ---- one search ---------------------------------------------------------------------------------

_LANDSCAPES: dict[str, Landscape] = {}


def _quiet() -> None:
    logger.remove()
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def one_run(task: tuple[str, float, int, float, float, str]) -> dict[str, Any]:
    """One search on one landscape at one budget with one strategy, scored against the truth."""
    name, share, seed, budget, optimum, strategy = task
    land = _LANDSCAPES.get(name) or _LANDSCAPES.setdefault(name, load_landscape(name))
    use_strategy(strategy)
    spec = spec_for(land, budget, strategy)
    t0 = time.perf_counter()
    run = simulate(spec, land, seed=seed)
    real = time.perf_counter() - t0
    cfg = run.config
    ev = cfg.evidence
    outcomes = Counter(
        str(t.user_attrs.get("outcome") or t.state.name.lower()) for t in run.study.trials
    )
    row: dict[str, Any] = {
        "landscape": name,
        "strategy": strategy,
        "share": share,
        "seed": seed,
        "budget": budget,
        "seconds": run.seconds,
        "budget_used": run.seconds / budget,
        "fixed_cost": run.fixed_cost,
        "real_seconds": real,
        "trials": len(run.study.trials),
        "outcomes": dict(outcomes),
        "validated": ev.validated,
        "choice": f"{cfg.precision} bs={cfg.batch_size}",
        "claimed": ev.speedup,
        "claimed_low": ev.speedup_low,
        "claimed_high": ev.speedup_high,
        "note": ev.validation_note,
        # Simulated seconds per phase: start, ceilings, reference, search, validation, writing.
        "spent": run.spent,
    }
    if not ev.validated:
        # The fp32 reference at the base batch: 1.0x by definition, claimed as such.
        row.update(
            true_speedup=1.0,
            unsafe=False,
            below_1x=False,
            outside_interval=False,
            interval_miss=0.0,
            false_claim=False,
        )
        row["choice"] = "fp32 fallback"
    else:
        truth = land.truth(cfg.candidate(), margin=spec.memory_margin)
        lo, hi = ev.speedup_low, ev.speedup_high
        outside = lo is None or hi is None or not lo <= truth.speedup <= hi
        # How far the truth lies outside the claimed interval (relative; 0 inside it).
        miss = (
            0.0
            if not outside
            else 1.0
            if lo is None or hi is None
            else (max(lo / truth.speedup - 1, truth.speedup / hi - 1) if truth.speedup else 1.0)
        )
        row.update(
            true_speedup=truth.speedup,
            true_parity_gap=truth.parity_gap,
            unsafe=not truth.feasible or truth.parity_gap > spec.parity_tolerance,
            below_1x=truth.speedup < 1.0,
            outside_interval=outside,
            interval_miss=miss,
            false_claim=truth.speedup < 1.0 or outside,
        )
    row["share_of_optimum"] = row["true_speedup"] / optimum
    row["missed_win"] = optimum >= REAL_WIN and not ev.validated
    return row


# ---- the figures --------------------------------------------------------------------------------


def p10(values: list[float]) -> float:
    """The 10th percentile (linear between the order statistics, as numpy's default)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = 0.1 * (len(xs) - 1)
    i = int(pos)
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (pos - i)


def _gist(note: str) -> str:
    """A fallback's note without its per-candidate details."""
    cut = min((i for i in (note.find(" ("), note.find(":")) if i >= 0), default=len(note))
    return note[:cut]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    shares = [r["share_of_optimum"] for r in rows]
    choices = Counter(r["choice"] for r in rows)
    notes = Counter(_gist(r["note"]) for r in rows if not r["validated"])
    return {
        "median_share_of_optimum": statistics.median(shares),
        "p10_share_of_optimum": p10(shares),
        "missed_win_rate": sum(r["missed_win"] for r in rows) / n,
        "false_claim_rate": sum(r["false_claim"] for r in rows) / n,
        "claim_below_1x_rate": sum(r["below_1x"] for r in rows) / n,
        "truth_outside_interval_rate": sum(r["outside_interval"] for r in rows) / n,
        "max_interval_miss": max(r["interval_miss"] for r in rows),
        "unsafe_rate": sum(r["unsafe"] for r in rows) / n,
        "fallback_rate": sum(not r["validated"] for r in rows) / n,
        "median_budget_used": statistics.median(r["budget_used"] for r in rows),
        "median_fixed_cost_s": statistics.median(r["fixed_cost"] for r in rows),
        "median_trials": statistics.median(r["trials"] for r in rows),
        "median_spent_s": {
            phase: statistics.median(r["spent"].get(phase, 0.0) for r in rows)
            for phase in dict.fromkeys(k for r in rows for k in r["spent"])
        },
        "seeds": n,
        "choices": dict(choices.most_common(4)),
        "fallback_notes": dict(notes.most_common(3)),
        "median_real_seconds": statistics.median(r["real_seconds"] for r in rows),
        "max_real_seconds": max(r["real_seconds"] for r in rows),
    }


def goal_checks(report: dict[str, Any], names: list[str], shares: list[float]) -> list[dict]:
    """Each goal of the issue, for every landscape and share it applies to: met or not."""
    checks = []
    for name in names:
        for share in shares:
            s = report[name][str(share)]
            wanted = []
            if abs(share - 0.3) < 1e-9:
                wanted += [
                    ("median >= 98%", s["median_share_of_optimum"] >= GOALS["median_at_30"]),
                    ("p10 >= 90%", s["p10_share_of_optimum"] >= GOALS["p10_at_30"]),
                ]
            if abs(share - 0.1) < 1e-9:
                wanted.append(
                    ("median >= 90%", s["median_share_of_optimum"] >= GOALS["median_at_10"])
                )
            wanted += [
                ("false claims 0", s["false_claim_rate"] <= GOALS["false_claim_rate"]),
                ("missed wins <= 5%", s["missed_win_rate"] <= GOALS["missed_win_rate"]),
            ]
            checks += [
                {"landscape": name, "share": share, "goal": g, "met": bool(ok)} for g, ok in wanted
            ]
    return checks


def table(report: dict[str, Any], names: list[str], shares: list[float]) -> str:
    head = (
        f"{'landscape':<17} {'share':>5} {'optimum':>16} {'median':>7} {'p10':>7} "
        f"{'missed':>7} {'false':>6} {'unsafe':>6} {'fallbk':>6} {'budget':>6} {'fixed':>6} "
        f"{'trials':>6}  most frequent choices"
    )
    lines = [head, "-" * len(head)]
    for name in names:
        entry = report[name]
        for share in shares:
            s = entry[str(share)]
            top = ", ".join(f"{c} {k / s['seeds']:.0%}" for c, k in s["choices"].items())
            lines.append(
                f"{name:<17} {share:>5.0%} "
                f"{entry['optimum']:>5.2f}x {entry['optimum_point']:<10} "
                f"{s['median_share_of_optimum']:>7.1%} {s['p10_share_of_optimum']:>7.1%} "
                f"{s['missed_win_rate']:>7.1%} {s['false_claim_rate']:>6.1%} "
                f"{s['unsafe_rate']:>6.1%} {s['fallback_rate']:>6.0%} "
                f"{s['median_budget_used']:>6.0%} {s['median_fixed_cost_s']:>5.1f}s "
                f"{s['median_trials']:>6g}  {top}"
            )
    return "\n".join(lines)


# The figures the strategies are compared by, averaged over the landscapes.
COMPARED = (
    "median_share_of_optimum",
    "p10_share_of_optimum",
    "missed_win_rate",
    "false_claim_rate",
    "unsafe_rate",
    "fallback_rate",
)


def averages(
    entries: dict[str, Any], names: list[str], shares: list[float]
) -> dict[str, dict[str, Any]]:
    """Per share, each compared figure's mean over the landscapes, and the goals met there."""
    checks = goal_checks(entries, names, shares)
    out = {}
    for share in shares:
        figures: dict[str, Any] = {
            k: statistics.fmean(entries[n][str(share)][k] for n in names) for k in COMPARED
        }
        these = [c for c in checks if abs(c["share"] - share) < 1e-9]
        figures["goals_met"] = sum(c["met"] for c in these)
        figures["goals"] = len(these)
        figures["landscapes"] = len(names)
        out[str(share)] = figures
    return out


def ranked(strategies: dict[str, Any], share: float) -> list[str]:
    """The strategies at ``share``, best first: by the mean median share of the optimum, then
    the mean p10, then the fewer missed wins and false claims."""
    key = str(share)

    def score(name: str) -> tuple[float, ...]:
        a = strategies[name]["averages"][key]
        return (
            round(a["median_share_of_optimum"], 6),
            round(a["p10_share_of_optimum"], 6),
            -a["missed_win_rate"],
            -a["false_claim_rate"],
        )

    return sorted(strategies, key=score, reverse=True)


def comparison(strategies: dict[str, Any], shares: list[float]) -> str:
    """Per share, one line per strategy (its averages, the difference to the first strategy
    listed) and which won."""
    first = next(iter(strategies))
    width = max(len(n) for n in strategies)
    lines = []
    for share in shares:
        key = str(share)
        base = strategies[first]["averages"][key]
        for name, st in strategies.items():
            a = st["averages"][key]
            line = (
                f"  {share:>4.0%}  {name:<{width}}  median {a['median_share_of_optimum']:6.1%}  "
                f"p10 {a['p10_share_of_optimum']:6.1%}  missed {a['missed_win_rate']:5.1%}  "
                f"false {a['false_claim_rate']:5.1%}  unsafe {a['unsafe_rate']:5.1%}  "
                f"fallback {a['fallback_rate']:4.0%}  goals {a['goals_met']}/{a['goals']}"
            )
            if name != first:
                dm = a["median_share_of_optimum"] - base["median_share_of_optimum"]
                dp = a["p10_share_of_optimum"] - base["p10_share_of_optimum"]
                line += f"  (vs {first}: median {dm * 100:+.1f} pts, p10 {dp * 100:+.1f} pts)"
            lines.append(line)
        order = ranked(strategies, share)
        best = strategies[order[0]]["averages"][key]
        if len(order) > 1:
            runner_up = strategies[order[1]]["averages"][key]
            dm = best["median_share_of_optimum"] - runner_up["median_share_of_optimum"]
            dp = best["p10_share_of_optimum"] - runner_up["p10_share_of_optimum"]
            if abs(dm) < 5e-4 and abs(dp) < 5e-4:
                lines.append(
                    f"  {share:>4.0%}  best: none: {order[0]} and {order[1]} tie on the median "
                    "and the p10 (to 0.1 pts)"
                )
            else:
                lines.append(
                    f"  {share:>4.0%}  best: {order[0]} (median {dm * 100:+.1f} pts, p10 "
                    f"{dp * 100:+.1f} pts over {order[1]}, the next)"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landscapes", default=None, help="names, comma-separated (all shipped)")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--shares", default="0.1,0.3", help="search budget / grid time")
    parser.add_argument("--jobs", type=int, default=2, help="processes running seeds")
    parser.add_argument(
        "--grid",
        choices=["probes", "paired"],
        default="paired",
        help="what the grid's time counts: one probe per point, or one paired run per point",
    )
    parser.add_argument(
        "--strategy",
        default="tpe",
        help="strategies, comma-separated: " + ", ".join(STRATEGIES) + " (the first one's "
        "figures are the report's own)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    strategies = list(dict.fromkeys(x.strip() for x in args.strategy.split(",") if x.strip()))
    unknown = [x for x in strategies if x not in STRATEGIES]
    if unknown or not strategies:
        parser.error(f"--strategy: unknown {', '.join(unknown)}; one of {', '.join(STRATEGIES)}")
    primary = strategies[0]
    t_start = time.perf_counter()
    names = args.landscapes.split(",") if args.landscapes else list(shipped_landscapes())
    shares = [float(s) for s in args.shares.split(",")]
    seeds = list(range(1, args.seeds + 1))
    _quiet()
    try:
        lands = {n: load_landscape(n) for n in names}
        grids = {n: grid(lands[n], args.grid) for n in names}
        tasks = [
            (n, share, seed, share * grids[n]["seconds"], grids[n]["optimum"], st)
            for st in strategies
            for n in names
            for share in shares
            for seed in seeds
        ]
        if args.jobs > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(args.jobs, initializer=_quiet) as pool:
                rows = list(pool.imap_unordered(one_run, tasks, chunksize=4))
        else:
            rows = [one_run(t) for t in tasks]
    finally:
        use_strategy("tpe")  # this process as shipped again (jobs 1 ran the searches here)
        logger.remove()
        logger.add(sys.stderr)
    wall = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "strategy": (
            "autotune.sim.simulate: the real run_search (default spec but the landscape's "
            "precisions) on the simulated device and a virtual clock; budget = share x the "
            f"grid's simulated time (grid: {args.grid}; one "
            + ("paired run" if args.grid == "paired" else "probe")
            + " per supported precision x fitting batch of the ladder 16..1024, default "
            "init_scale, lr x1, plus worker start and the fp32 reference); scored against "
            f"Landscape.truth; the figures per landscape: strategy {primary} "
            f"({STRATEGIES[primary]})"
        ),
    }
    per: dict[str, dict[str, Any]] = {}
    for st in strategies:
        per[st] = {}
        for n in names:
            g = grids[n]
            entry: dict[str, Any] = {
                "kind": lands[n].kind,
                "device": lands[n].device,
                "grid_seconds": g["seconds"],
                "grid_points": g["points"],
                "optimum": g["optimum"],
                "optimum_point": g["optimum_point"],
            }
            for share in shares:
                entry[str(share)] = summarize(
                    [
                        r
                        for r in rows
                        if r["strategy"] == st and r["landscape"] == n and r["share"] == share
                    ]
                )
                entry[str(share)]["budget_s"] = share * g["seconds"]
            per[st][n] = entry
    report.update(per[primary])
    report["strategies"] = {
        st: {
            "description": STRATEGIES[st],
            "averages": averages(per[st], names, shares),
            "landscapes": {n: {str(sh): per[st][n][str(sh)] for sh in shares} for n in names},
        }
        for st in strategies
    }
    checks = goal_checks(report, names, shares)
    real = [r["real_seconds"] for r in rows]
    report["goals"] = checks
    report["wall_seconds"] = wall
    report["simulate_seconds"] = {
        "median": statistics.median(real),
        "mean": statistics.fmean(real),
        "max": max(real),
        "runs": len(real),
    }
    print(
        f"search on the simulated device: {len(names)} landscapes x {len(shares)} shares x "
        f"{args.seeds} seeds x {len(strategies)} strateg{'y' if len(strategies) == 1 else 'ies'}"
        f" ({', '.join(strategies)}), {args.jobs} jobs; grid = {args.grid}"
    )
    for n in names:
        g = grids[n]
        print(
            f"  {n} ({lands[n].kind}, {lands[n].device}): grid {g['points']} points in "
            f"{g['seconds']:.1f}s simulated; optimum {g['optimum']:.2f}x ({g['optimum_point']}); "
            + ", ".join(f"{s:.0%} = {s * g['seconds']:.1f}s" for s in shares)
        )
    for st in strategies:
        print(f"\nstrategy {st}: {STRATEGIES[st]}")
        print(table(per[st], names, shares))
    print(
        "\nshare of optimum: median and 10th percentile of the emitted config's true speedup over "
        f"the optimum; missed: fell back to fp32 while the optimum is >= {REAL_WIN:.2f}x; false: "
        "true speedup < 1.0x or outside the claimed interval; unsafe: by the truth out of memory, "
        "diverging or off parity; budget: median share of the budget used; fixed: median "
        "simulated seconds before the first trial"
    )
    of_primary = f", strategy {primary}" if len(strategies) > 1 else ""
    if len(strategies) > 1:
        print(
            "\nstrategies compared (each figure: the mean over the "
            f"{len(names)} landscapes of the landscape's own; best: by the mean median, then "
            "the mean p10):"
        )
        print(comparison(report["strategies"], shares))
    print(f"\nwhere the time went{of_primary} (median simulated seconds per phase):")
    for n in names:
        for share in shares:
            s = report[n][str(share)]
            spent = ", ".join(f"{k} {v:.1f}" for k, v in s["median_spent_s"].items() if v)
            print(f"  {n} {share:.0%} of {s['budget_s']:.1f}s: {spent}")
    print(f"\nwhy the fp32 fallbacks{of_primary} (the validation note's gist, runs):")
    for n in names:
        for share in shares:
            notes = report[n][str(share)]["fallback_notes"]
            if notes:
                print(
                    f"  {n} {share:.0%} fallbacks: "
                    + "; ".join(f"{k} ({c})" for k, c in notes.items())
                )
    print(f"\ngoals{of_primary}:")
    order = ["median >= 98%", "p10 >= 90%", "median >= 90%", "false claims 0", "missed wins <= 5%"]
    for goal in [g for g in order if any(c["goal"] == g for c in checks)]:
        these = [c for c in checks if c["goal"] == goal]
        missed = [f"{c['landscape']} {c['share']:.0%}" for c in these if not c["met"]]
        print(
            f"  {goal}: "
            + (
                "met"
                if not missed
                else f"NOT met ({len(missed)}/{len(these)}: {', '.join(missed)})"
            )
        )
    for n in names:
        for share in shares:
            s = report[n][str(share)]
            if s["false_claim_rate"]:
                print(
                    f"  {n} {share:.0%} false claims: {s['claim_below_1x_rate']:.0%} below 1.0x, "
                    f"{s['truth_outside_interval_rate']:.0%} with the truth outside the claimed "
                    f"interval (by at most {s['max_interval_miss']:.2%})"
                )
    sim = report["simulate_seconds"]
    print(
        f"\nwall time: {wall:.1f}s for {len(rows)} searches on {args.jobs} processes; one simulate: "
        f"median {sim['median']:.2f}s, mean {sim['mean']:.2f}s, max {sim['max']:.2f}s"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
