"""The search against an exhaustive grid, on one small discrete space, in one run.

1. Grid: every point of precision × batch size × lr multiplier is probed (in a worker, exactly
   as the search probes) and checked for loss parity against the fp32 reference; the grid's
   optimum is the fastest feasible point.
2. Search: ``autotune search`` over the same space with a budget of ``--share`` (30%) of the
   grid's wall time.

It prints the search's winner, its throughput *as the grid measured it* (so run-to-run noise does
not flatter either side) as a share of the grid optimum, and its wall time as a share of the
grid's. Goal: at least 95% of the grid optimum in at most 30% of its time.

    python benchmarks/search_vs_grid.py [--workload tiny_convnet] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from autotune.parity import parity_gap
from autotune.precision import resolve_device, unsupported_modes
from autotune.search import lr_for, reference_factor, run_search
from autotune.spec import Candidate, StudySpec
from autotune.worker import ProbeWorker
from autotune.workloads import load_workload, normalize_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny_convnet")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--batch-sizes", default="16,32,64,128,256")
    parser.add_argument("--lr-multipliers", default="0.5,1.0,2.0")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--share", type=float, default=0.3, help="search budget / grid time")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    device = resolve_device(args.device)
    ref_name = normalize_reference(args.workload)
    wl = load_workload(ref_name)
    cut = unsupported_modes(device)
    precisions = [p for p in args.precisions.split(",") if p not in cut]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    multipliers = [float(m) for m in args.lr_multipliers.split(",")]
    tol = 0.05
    spec = StudySpec(
        name="search-vs-grid",
        workload=ref_name,
        device=str(device),
        budget=3600,
        space={
            "precisions": precisions,
            "batch_sizes": batch_sizes,
            "lr_multipliers": multipliers,
            "batch_size": {"min": min(batch_sizes), "max": max(batch_sizes)},
        },
        probe={
            "warmup_steps": args.warmup,
            "steps": args.steps,
            "check_every": 6,
            "time_limit": 60,
        },
        parity_tolerance=tol,
    )

    # 1. The grid.
    grid_start = time.monotonic()
    rows = []
    with ProbeWorker(str(device)) as worker:
        factor = reference_factor(max(batch_sizes), wl.base_batch_size)
        ref_cand = Candidate(
            precision="fp32", batch_size=wl.base_batch_size, learning_rate=wl.base_lr
        )
        ref_settings = spec.probe.model_copy(update={"steps": spec.probe.steps * factor})
        ref = worker.run(ref_name, ref_cand, ref_settings)
        for precision, bs, mult in itertools.product(precisions, batch_sizes, multipliers):
            lr = lr_for(wl.lr_scaling, wl.base_lr, wl.base_batch_size, bs, mult)
            cand = Candidate(precision=precision, batch_size=bs, learning_rate=lr)
            result = worker.run(ref_name, cand, spec.probe)
            gap = parity_gap(result.losses, bs, ref.losses, ref.batch_size) if result.ok else None
            feasible = result.ok and gap is not None and gap[0] <= tol
            rows.append(
                {
                    "precision": precision,
                    "batch_size": bs,
                    "lr_multiplier": mult,
                    "outcome": result.outcome,
                    "throughput": result.throughput,
                    "parity_gap": None if gap is None else gap[0],
                    "feasible": feasible,
                }
            )
    grid_seconds = time.monotonic() - grid_start
    feasible_rows = [r for r in rows if r["feasible"]]
    grid_best = max(feasible_rows, key=lambda r: r["throughput"])

    # 2. The search, on the same space, with a share of the grid's time.
    budget = max(10.0, args.share * grid_seconds)
    with tempfile.TemporaryDirectory() as tmp:
        search_spec = spec.with_overrides(
            {"budget": budget, "storage": f"sqlite:///{tmp}/study.db"}
        )
        search_start = time.monotonic()
        result = run_search(search_spec, out_dir=Path(tmp) / "out")
        search_seconds = time.monotonic() - search_start
    cfg = result.config
    mult = round(
        cfg.learning_rate
        / lr_for(wl.lr_scaling, wl.base_lr, wl.base_batch_size, cfg.batch_size, 1.0),
        6,
    )
    match = next(
        (
            r
            for r in rows
            if r["precision"] == cfg.precision
            and r["batch_size"] == cfg.batch_size
            and abs(r["lr_multiplier"] - mult) < 1e-6
        ),
        None,
    )
    chosen_tp = match["throughput"] if match else 0.0
    # The search's best feasible trial, looked up on the grid too: what the search *found*,
    # before validation decides whether to emit it.
    try:
        best_params = result.study.best_trial.params
    except ValueError:
        best_params = {}
    found = next(
        (
            r
            for r in rows
            if r["precision"] == best_params.get("precision")
            and r["batch_size"] == best_params.get("batch_size")
            and abs(r["lr_multiplier"] - float(best_params.get("lr_multiplier", -1))) < 1e-6
        ),
        None,
    )
    found_tp = found["throughput"] if found else 0.0
    figures = {
        "device": str(device),
        "workload": ref_name,
        "grid_points": len(rows),
        "grid_feasible": len(feasible_rows),
        "grid_seconds": round(grid_seconds, 2),
        "grid_best": grid_best,
        "search_budget_seconds": round(budget, 2),
        "search_seconds": round(search_seconds, 2),
        "search_choice": {
            "precision": cfg.precision,
            "batch_size": cfg.batch_size,
            "lr_multiplier": mult,
            "validated": cfg.evidence.validated,
        },
        "search_choice_grid_throughput": chosen_tp,
        "share_of_grid_optimum": chosen_tp / grid_best["throughput"]
        if grid_best["throughput"]
        else 0.0,
        "share_of_grid_time": search_seconds / grid_seconds,
        "search_best_trial": best_params,
        "search_best_grid_throughput": found_tp,
        "search_best_share_of_grid_optimum": (
            found_tp / grid_best["throughput"] if grid_best["throughput"] else 0.0
        ),
        "search_trials": cfg.evidence.trials.model_dump(),
    }
    print(
        f"device {device}, workload {ref_name}, {len(rows)} grid points ({len(feasible_rows)} feasible)"
    )
    for r in sorted(rows, key=lambda r: -r["throughput"]):
        gap = "—" if r["parity_gap"] is None else f"{r['parity_gap']:+.1%}"
        print(
            f"  {r['precision']:>5} bs={r['batch_size']:<4} lr×{r['lr_multiplier']:<4g} "
            f"{r['throughput']:>10.1f} samples/s  parity {gap:>7}  "
            f"{'feasible' if r['feasible'] else r['outcome'] if r['outcome'] != 'completed' else 'infeasible'}"
        )
    b = grid_best
    print(
        f"grid optimum: {b['precision']} bs={b['batch_size']} lr×{b['lr_multiplier']:g} "
        f"{b['throughput']:.1f} samples/s, grid time {grid_seconds:.1f}s"
    )
    c = figures["search_choice"]
    print(
        f"search choice: {c['precision']} bs={c['batch_size']} lr×{c['lr_multiplier']:g} "
        f"(validated: {c['validated']}), {chosen_tp:.1f} samples/s on the grid, "
        f"search time {search_seconds:.1f}s (budget {budget:.1f}s)"
    )
    print(f"search's best trial: {best_params}, {found_tp:.1f} samples/s on the grid")
    best_share = figures["search_best_share_of_grid_optimum"]
    print(f"share of grid optimum, search's best trial: {best_share:.1%} (goal >= 95%)")
    print(f"share of grid optimum, emitted config:      {figures['share_of_grid_optimum']:.1%}")
    print(f"share of grid time:    {figures['share_of_grid_time']:.1%} (goal <= 30%)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
