"""The search against an exhaustive grid, measured the same way, on small discrete spaces.

1. Grid: every point of precision × batch size × lr multiplier is measured *paired* with the
   fp32 reference (interleaved blocks in one worker, as validation measures), and checked for
   loss parity against the reference arm at equal samples seen; the grid's optimum is the
   feasible point with the best paired speedup.
2. Search: ``run_search`` over the same space with a budget of a share of the grid's wall time
   (30% and 10% by default), once per seed.

For each workload, share and seed it prints the emitted config, its speedup *as the grid
measured it* (so run-to-run noise flatters neither side) as a share of the grid optimum's, the
wall time used against the budget, and where the search's time went, phase by phase. Goals:
>= 95% of the grid optimum in <= 30% of its time and >= 90% in 10% (median over seeds); the
fixed cost before the first trial <= 3 s on a CPU; wall time within 95-105% of the budget.

    python benchmarks/search_vs_grid.py [--workloads tiny_convnet,tiny_gpt] [--seeds 1,2,3]
        [--shares 0.3,0.1] [--device cpu] [--json out.json]
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

from autotune.parity import parity_gap
from autotune.search import lr_for, run_search
from autotune.spec import Candidate, StudySpec
from autotune.worker import ProbeWorker
from autotune.workloads import normalize_reference

TOLERANCE = 0.05


def spec_for(args: argparse.Namespace, workload: str, facts: Any) -> StudySpec:
    precisions = [p for p in args.precisions.split(",") if p not in facts.unsupported]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
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
    for precision, bs, mult in itertools.product(
        spec.space.precisions, spec.space.batch_sizes, spec.space.lr_multipliers
    ):
        lr = lr_for(rule, facts.base_lr, facts.base_batch_size, bs, mult)
        cand = Candidate(precision=precision, batch_size=bs, learning_rate=lr)
        paired = worker.compare(spec.workload, cand, ref, settings)
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
                "outcome": paired.candidate.outcome,
                "speedup": paired.speedup or 0.0,
                "speedup_low": paired.speedup_low,
                "speedup_high": paired.speedup_high,
                "parity_gap": gap,
                "feasible": paired.ok and gap is not None and gap <= TOLERANCE,
            }
        )
        print(
            f"  grid {precision:>5} bs={bs:<4} lr×{mult:<4g} "
            + (
                f"{paired.speedup:.2f}x ({paired.speedup_low:.2f}–{paired.speedup_high:.2f})"
                if paired.ok
                else paired.candidate.outcome
            )
            + ("" if gap is None else f"  parity {gap:+.1%}"),
            flush=True,
        )
    return rows, time.monotonic() - t0


def lookup(rows: list[dict], precision: str, batch_size: int, mult: float) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["precision"] == precision
            and r["batch_size"] == batch_size
            and abs(r["lr_multiplier"] - mult) < 1e-6
        ),
        None,
    )


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
    cfg = result.config
    rule = facts.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
    mult = round(
        cfg.learning_rate / lr_for(rule, facts.base_lr, facts.base_batch_size, cfg.batch_size, 1.0),
        6,
    )
    if not cfg.evidence.validated:
        chosen = 1.0  # the fp32 reference, by definition 1.0x on the grid
    else:
        row = lookup(rows, cfg.precision, cfg.batch_size, mult)
        chosen = row["speedup"] if row and row["feasible"] else 0.0
    spent = result.spent
    return {
        "seed": seed,
        "budget": round(budget, 1),
        "wall": round(seconds, 1),
        "wall_share_of_budget": seconds / budget,
        "choice": f"{cfg.precision} bs={cfg.batch_size} lr×{mult:g}",
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
