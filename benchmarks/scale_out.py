"""Scale-out: trials per minute with 1, 2 and 4 workers on one PostgreSQL study, in one run.

The workload (``autotune.testing.workloads:sleepy``) sleeps a fixed time per step and does
almost no compute, so a probe's length is known and workers on this machine do not compete for
its cores: what is measured is the coordination — the shared sampler, the storage, the
heartbeats — not the hardware.

    python benchmarks/scale_out.py [--workers 1,2,4] [--budget 40] [--step-seconds 0.1]

Prints trials/min per worker count and the scaling efficiency
``trials/min at 4 / (4 x trials/min at 1)``. Goal: >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.testing.pgtest import throwaway_postgres

SPEC = """\
name: scale
workload: autotune.testing.workloads:sleepy
device: cpu
budget: {budget}s
space:
  precisions: [fp32]
  batch_size: {{min: 8, max: 64}}
  lr_multiplier: {{min: 0.25, max: 4.0}}
probe: {{warmup_steps: 1, steps: {steps}, check_every: {steps}, time_limit: 30s}}
validation: {{top_k: 1, steps: 2}}
parity_tolerance: 100.0
"""


def probed_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Finished trials that ran a probe (not copies of a twin, not cut by a ceiling)."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if t.user_attrs.get("duplicate_of") is None and t.user_attrs.get("timed_steps")
    ]


def run(url: str, n: int, spec_path: Path, step_seconds: float) -> dict:
    env = {**os.environ, "AUTOTUNE_SLEEPY_SECONDS": str(step_seconds)}
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "autotune",
                    "worker",
                    str(spec_path),
                    "--storage",
                    url,
                    "--out",
                    f"{out}/w{i}",
                    "--device",
                    "cpu",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        errors = [p.communicate()[1] for p in procs]
    for p, err in zip(procs, errors, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a worker failed:\n{err[-2000:]}")
    study = optuna.load_study(study_name="scale", storage=url)
    trials = probed_trials(study)
    if not trials:
        return {
            "workers": n,
            "trials": 0,
            "minutes": 0.0,
            "trials_per_minute": 0.0,
            "workers_seen": 0,
        }
    start = min(t.datetime_start for t in trials)
    end = max(t.datetime_complete for t in trials)
    minutes = (end - start).total_seconds() / 60
    return {
        "workers": n,
        "trials": len(trials),
        "minutes": round(minutes, 3),
        "trials_per_minute": len(trials) / minutes if minutes else 0.0,
        "workers_seen": len({t.user_attrs.get("worker") for t in trials}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--budget", type=float, default=40.0, help="seconds per worker count")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    rows = []
    with throwaway_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "scale.yaml"
        spec_path.write_text(SPEC.format(budget=args.budget, steps=args.steps))
        for n in counts:
            url = server.create_database(f"scale_{n}")
            rows.append(run(url, n, spec_path, args.step_seconds))
            r = rows[-1]
            print(
                f"{n} worker(s): {r['trials']} probed trials in {r['minutes'] * 60:.1f}s "
                f"= {r['trials_per_minute']:.1f} trials/min ({r['workers_seen']} workers seen)",
                flush=True,
            )
    by_n = {r["workers"]: r["trials_per_minute"] for r in rows}
    result = {"rows": rows, "probe_seconds": (args.steps + 1) * args.step_seconds}
    if 1 in by_n and max(by_n) > 1 and by_n[1]:
        top = max(by_n)
        result["efficiency"] = by_n[top] / (top * by_n[1])
        print(f"scaling efficiency at {top} workers: {result['efficiency']:.2f} (goal >= 0.9)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
