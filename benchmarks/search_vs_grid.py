"""The search against an exhaustive grid, measured the same way, on small discrete spaces.

1. Grid: every point of precision × batch size × lr multiplier (× torch.compile × channels_last
   with ``--compile`` / ``--channels-last``) is measured *paired* with the fp32 reference
   (interleaved blocks in one worker, as validation measures), and checked for loss parity
   against the reference arm at equal samples seen; the grid's optimum is the feasible point
   with the best paired speedup. A compiled point compiles in its untimed warm-up; the grid
   records what compiling took.
2. Search: ``run_search`` over the same space with a budget of a share of the grid's wall time
   (30% and 10% by default), once per seed.

For each workload, share and seed it prints the emitted config, its speedup *as the grid
measured it* (so run-to-run noise flatters neither side) as a share of the grid optimum's, the
wall time used against the budget, and where the search's time went, phase by phase. Goals:
>= 95% of the grid optimum in <= 30% of its time and >= 90% in 10% (median over seeds); the
fixed cost before the first trial <= 3 s on a CPU; wall time within 95-105% of the budget.
With knobs, it also prints the gain each knob brought: on the grid, the best feasible point with
it against the same point without it; in each search, the same from its own trials.

    python benchmarks/search_vs_grid.py [--workloads tiny_convnet,tiny_gpt] [--seeds 1,2,3]
        [--shares 0.3,0.1] [--device cpu] [--compile] [--channels-last] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.execution.probe_worker import ProbeWorker
from autotune.measure.parity import parity_gap
from autotune.report import knob_lines
from autotune.schema.spec import Candidate, StudySpec
from autotune.search import lr_for, run_search
from autotune.workloads import normalize_reference

TOLERANCE = 0.05


def spec_for(args: argparse.Namespace, workload: str, facts: Any) -> StudySpec:
    precisions = [p for p in args.precisions.split(",") if p not in facts.unsupported]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    knobs: dict[str, Any] = {}
    if args.compile:
        knobs["compile"] = [False, True]
    if args.channels_last:
        knobs["channels_last"] = [False, True]
    return StudySpec(
        name="search-vs-grid",
        workload=workload,
        device=facts.device,
        budget=3600,
        space={
            "precisions": precisions,
            "batch_sizes": sizes,
            "lr_multipliers": [float(m) for m in args.lr_multipliers.split(",")],
            "batch_size": {"min": min(sizes), "max": max(sizes)},
            **knobs,
        },
        probe={"warmup_steps": 2, "steps": args.steps, "check_every": 10, "time_limit": 60},
        validation={"steps": 2 * args.steps},
        parity_tolerance=TOLERANCE,
    )


def grid(spec: StudySpec, worker: ProbeWorker, facts: Any) -> tuple[list[dict], float]:
    """Every point, paired with the reference; rows and the grid's wall time."""
    t0 = time.monotonic()
    ref = Candidate(precision="fp32", batch_size=facts.base_batch_size, learning_rate=facts.base_lr)
    rule = facts.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
    rows = []
    settings = spec.probe.model_copy(update={"seed": 0})
    layouts = spec.space.channels_last or [None]
    for precision, bs, mult, compiled, layout in itertools.product(
        spec.space.precisions,
        spec.space.batch_sizes,
        spec.space.lr_multipliers,
        spec.space.compile,
        layouts,
    ):
        lr = lr_for(rule, facts.base_lr, facts.base_batch_size, bs, mult)
        cand = Candidate(
            precision=precision,
            batch_size=bs,
            learning_rate=lr,
            compile=compiled,
            channels_last=layout,
        )
        # A compiled point may take minutes to compile on a GPU: its limit grows by that much.
        paired = worker.compare(
            spec.workload,
            cand,
            ref,
            settings,
            timeout=settings.time_limit + (600 if compiled else 15),
        )
        gap = None
        if paired.ok:
            c, r = paired.candidate, paired.reference
            found = parity_gap(c.losses, c.batch_size, r.losses, r.batch_size)
            gap = None if found is None else found[0]
        rows.append(
            {
                "precision": precision,
                "batch_size": bs,
                "lr_multiplier": mult,
                "compile": compiled,
                "channels_last": layout,
                "compile_seconds": paired.candidate.compile_seconds,
                "outcome": paired.candidate.outcome,
                "speedup": paired.speedup or 0.0,
                "speedup_low": paired.speedup_low,
                "speedup_high": paired.speedup_high,
                "parity_gap": gap,
                "feasible": paired.ok and gap is not None and gap <= TOLERANCE,
            }
        )
        knob = (" compile" if compiled else "") + (
            "" if layout is None else " channels_last" if layout else " nchw"
        )
        print(
            f"  grid {precision:>5} bs={bs:<4} lr×{mult:<4g}{knob} "
            + (
                f"{paired.speedup:.2f}x ({paired.speedup_low:.2f}–{paired.speedup_high:.2f})"
                if paired.ok
                else paired.candidate.outcome
            )
            + ("" if gap is None else f"  parity {gap:+.1%}"),
            flush=True,
        )
    return rows, time.monotonic() - t0


def lookup(
    rows: list[dict],
    precision: str,
    batch_size: int,
    mult: float,
    compiled: bool = False,
    layout: bool | None = None,
) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["precision"] == precision
            and r["batch_size"] == batch_size
            and abs(r["lr_multiplier"] - mult) < 1e-6
            and r.get("compile", False) == compiled
            and r.get("channels_last") in (None, layout)
        ),
        None,
    )


def grid_knob_gains(rows: list[dict]) -> list[str]:
    """For each knob the grid turned: the best feasible point with it, against the same point
    (mode, batch, lr, the other knob) without it."""
    out = []
    for knob in ("compile", "channels_last"):
        on = [r for r in rows if r["feasible"] and r.get(knob)]
        if not on:
            continue
        best = max(on, key=lambda r: r["speedup"])
        twin = next(
            (
                r
                for r in rows
                if r.get(knob) is False
                and all(r.get(k) == best.get(k) for k in best if k in _POINT and k != knob)
            ),
            None,
        )
        text = (
            f"{knob}: {best['precision']} bs={best['batch_size']} lr×{best['lr_multiplier']:g} "
            f"{best['speedup']:.2f}x"
        )
        if twin is None:
            text += "; not measured without it"
        elif twin["feasible"]:
            text += (
                f" vs {twin['speedup']:.2f}x without ({best['speedup'] / twin['speedup'] - 1:+.0%})"
            )
        else:
            text += f"; without it: {twin['outcome']}"
        if knob == "compile" and best.get("compile_seconds") is not None:
            text += f"; compiling took {best['compile_seconds']:.1f}s"
        out.append(text)
    return out


# What names a grid point.
_POINT = ("precision", "batch_size", "lr_multiplier", "compile", "channels_last")


def one_search(
    spec: StudySpec, rows: list[dict], budget: float, seed: int, facts: Any, best: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_spec = spec.with_overrides(
            {"budget": budget, "seed": seed, "storage": f"sqlite:///{tmp}/study.db"}
        )
        t0 = time.monotonic()
        result = run_search(run_spec, out_dir=Path(tmp) / "out")
        seconds = time.monotonic() - t0
        # Read while the study's storage is still there.
        gains = knob_lines(result.store.trials())
    cfg = result.config
    rule = facts.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
    mult = round(
        cfg.learning_rate / lr_for(rule, facts.base_lr, facts.base_batch_size, cfg.batch_size, 1.0),
        6,
    )
    if not cfg.evidence.validated:
        chosen = 1.0  # the fp32 reference, by definition 1.0x on the grid
    else:
        row = lookup(rows, cfg.precision, cfg.batch_size, mult, cfg.compile, cfg.channels_last)
        chosen = row["speedup"] if row and row["feasible"] else 0.0
    spent = result.spent
    return {
        "seed": seed,
        "budget": round(budget, 1),
        "wall": round(seconds, 1),
        "wall_share_of_budget": seconds / budget,
        "choice": f"{cfg.precision} bs={cfg.batch_size} lr×{mult:g}"
        + (" compile" if cfg.compile else "")
        + (" channels_last" if cfg.channels_last and spec.space.channels_last else ""),
        "knob_gains": gains,
        "validated": cfg.evidence.validated,
        "claimed": cfg.evidence.speedup,
        "grid_speedup": chosen,
        "share_of_optimum": chosen / best if best else 0.0,
        "trials": cfg.evidence.trials.model_dump(),
        "spent": {k: round(v, 2) for k, v in spent.items()},
        # Before the first trial: the worker and facts, the ceilings, the reference's first run.
        "fixed_cost": round(
            spent.get("start", 0.0) + spent.get("ceilings", 0.0) + spent.get("reference", 0.0), 2
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tiny_convnet,tiny_gpt")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--batch-sizes", default="16,32,64,128,256")
    parser.add_argument("--lr-multipliers", default="0.5,1.0,2.0")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--shares", default="0.3,0.1", help="search budget / grid time")
    parser.add_argument(
        "--compile", action="store_true", help="search and grid torch.compile: [false, true]"
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="search and grid channels_last: [false, true] (4-d inputs)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"workloads": {}}
    for name in args.workloads.split(","):
        workload = normalize_reference(name)
        with ProbeWorker(args.device) as worker:
            facts = worker.facts(workload)
            spec = spec_for(args, workload, facts)
            print(
                f"{workload} on {facts.device}: grid of {len(spec.space.precisions)} modes",
                flush=True,
            )
            rows, grid_seconds = grid(spec, worker, facts)
        feasible = [r for r in rows if r["feasible"]]
        optimum = max(feasible, key=lambda r: r["speedup"], default=None)
        best = max(optimum["speedup"] if optimum else 0.0, 1.0)
        entry: dict[str, Any] = {
            "grid_seconds": round(grid_seconds, 1),
            "grid_points": len(rows),
            "grid_feasible": len(feasible),
            "grid_optimum": optimum,
            "searches": {},
        }
        entry["grid_knob_gains"] = grid_knob_gains(rows)
        for line in entry["grid_knob_gains"]:
            print(f"  grid, what the knob brought: {line}", flush=True)
        print(
            f"grid: {len(rows)} points ({len(feasible)} feasible) in {grid_seconds:.1f}s; optimum "
            + (
                f"{optimum['precision']} bs={optimum['batch_size']} lr×{optimum['lr_multiplier']:g} "
                f"{optimum['speedup']:.2f}x"
                if optimum
                else "none feasible (fp32 itself: 1.00x)"
            ),
            flush=True,
        )
        for share in (float(s) for s in args.shares.split(",")):
            runs = [
                one_search(spec, rows, share * grid_seconds, int(seed), facts, best)
                for seed in args.seeds.split(",")
            ]
            for r in runs:
                print(
                    f"  share {share:.0%} seed {r['seed']}: {r['choice']} "
                    f"({'validated' if r['validated'] else 'fp32 fallback'}, claimed "
                    f"{r['claimed']:.2f}x), {r['share_of_optimum']:.1%} of the optimum on the "
                    f"grid; wall {r['wall']}s of {r['budget']}s; fixed cost {r['fixed_cost']}s; "
                    f"spent {r['spent']}",
                    flush=True,
                )
                for line in r["knob_gains"]:
                    print(f"    what the knob brought: {line}", flush=True)
            entry["searches"][str(share)] = {
                "runs": runs,
                "median_share_of_optimum": statistics.median(r["share_of_optimum"] for r in runs),
                "median_wall_share_of_budget": statistics.median(
                    r["wall_share_of_budget"] for r in runs
                ),
                "median_fixed_cost": statistics.median(r["fixed_cost"] for r in runs),
            }
            s = entry["searches"][str(share)]
            goal = 0.95 if share >= 0.3 else 0.90
            print(
                f"{workload}, {share:.0%} of the grid's time: median {s['median_share_of_optimum']:.1%} "
                f"of the optimum (goal >= {goal:.0%}); wall {s['median_wall_share_of_budget']:.0%} "
                f"of the budget (goal 95-105%); fixed cost {s['median_fixed_cost']}s (goal <= 3s)",
                flush=True,
            )
        report["workloads"][workload] = entry
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
