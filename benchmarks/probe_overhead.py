"""How much of a probe is measurement, and what its divergence check costs.

Runs the ``resnet18`` workload and prints two figures with their goals:

1. timed share: the share of a probe's wall time (``ProbeResult.wall_seconds``: model build,
   data, warmup, timed steps) spent inside its timed steps (``timed_seconds``).
   GPU goal: at least 85%.
2. check cost: step time with divergence checks every ``check_every`` steps (the default, 10)
   against step time with a single check at the end (``check_every`` above the step count),
   probes alternated in the same process; and ``check_seconds`` as a share of ``timed_seconds``.
   GPU goal: at most 2%.

Usage:
    python benchmarks/probe_overhead.py                      # cuda if visible, else cpu
    python benchmarks/probe_overhead.py --device cpu --steps 30 --json overhead.json

Time: two short warm-up probes, then ``2 * --repeats`` probes of about ``--seconds`` each
(defaults: about 2.5 minutes on a GPU, 20 seconds on a CPU). For a quicker GPU check use
``--seconds 10 --repeats 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from autotune.measure.precision import resolve_device
from autotune.measure.probe import run_probe
from autotune.measure.result import ProbeResult
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.workloads import load_workload

TIMED_SHARE_GOAL = 0.85
CHECK_COST_GOAL = 0.02
DEFAULT_CHECK_EVERY = ProbeSettings().check_every


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument(
        "--precision",
        default=None,
        help="default fp16 on cuda (it reads the scale at each check), fp32 on cpu",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="default 128 on cuda (the workload's base), 32 on cpu",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps; default 10 on cuda, 2 on cpu"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps; default: as many as fill --seconds"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="target timed seconds per probe; default 30 on cuda, 3 on cpu",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="probe pairs for the check-cost comparison (default 2)",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write the figures here"
    )
    return p.parse_args(argv)


def _probe(
    workload: Any, cand: Candidate, device: torch.device, settings: ProbeSettings
) -> ProbeResult:
    result = run_probe(workload, cand, device, settings)
    if result.outcome != "completed" or result.truncated:
        sys.exit(f"probe did not complete cleanly, so its figures mean nothing: {result.summary()}")
    return result


def _figures(r: ProbeResult, settings: ProbeSettings) -> dict[str, Any]:
    return {
        "check_every": settings.check_every,
        "wall_seconds": r.wall_seconds,
        "timed_seconds": r.timed_seconds,
        "check_seconds": r.check_seconds,
        "step_time": r.step_time,
        "throughput": r.throughput,
        "timed_share": r.timed_seconds / r.wall_seconds,
        "check_share": r.check_seconds / r.timed_seconds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    precision = args.precision or ("fp16" if gpu else "fp32")
    batch_size = args.batch_size or (128 if gpu else 32)
    warmup = args.warmup if args.warmup is not None else (10 if gpu else 2)
    seconds = args.seconds or (30.0 if gpu else 3.0)
    workload = load_workload("resnet18")
    cand = Candidate(precision=precision, batch_size=batch_size, learning_rate=workload.base_lr)

    # 0. Warm the process up, then calibrate: the first probe pays one-time start-up (CUDA
    #    context, kernel selection) that a persistent worker pays once, not per probe; the
    #    second sizes the steps.
    _probe(workload, cand, device, ProbeSettings(warmup_steps=1, steps=1))
    calib = _probe(workload, cand, device, ProbeSettings(warmup_steps=warmup, steps=10))
    steps = args.steps or max(20, round(seconds / calib.step_time))
    limit = max(120.0, 4 * steps * calib.step_time)
    checked = ProbeSettings(
        warmup_steps=warmup, steps=steps, check_every=DEFAULT_CHECK_EVERY, time_limit=limit
    )
    unchecked = checked.model_copy(update={"check_every": steps + 1})
    print(
        f"resnet18 on {device} ({torch.cuda.get_device_name(device) if gpu else 'cpu'}), "
        f"{precision} bs={batch_size}, {warmup} warmup + {steps} timed steps "
        f"(~{steps * calib.step_time:.1f}s), {args.repeats} probe pairs"
    )

    # 1. Alternate the two settings so drift (clocks, heat, neighbours) hits both alike.
    runs: dict[str, list[ProbeResult]] = {"checked": [], "unchecked": []}
    for _ in range(args.repeats):
        runs["checked"].append(_probe(workload, cand, device, checked))
        runs["unchecked"].append(_probe(workload, cand, device, unchecked))

    # 2. Medians over the repeats.
    timed_share = statistics.median(r.timed_seconds / r.wall_seconds for r in runs["checked"])
    step_checked = statistics.median(r.step_time for r in runs["checked"])
    step_unchecked = statistics.median(r.step_time for r in runs["unchecked"])
    check_cost = (step_checked - step_unchecked) / step_unchecked
    check_share = statistics.median(r.check_seconds / r.timed_seconds for r in runs["checked"])

    where = "" if gpu else "  [GPU goal; on cpu for reference only]"
    print(
        f"timed share      {timed_share:6.1%} of probe wall time in timed steps   "
        f"goal >= {TIMED_SHARE_GOAL:.0%}  {'met' if timed_share >= TIMED_SHARE_GOAL else 'MISSED'}{where}"
    )
    print(
        f"check cost       {check_cost:+6.2%} step time, check_every={DEFAULT_CHECK_EVERY} vs {steps + 1} "
        f"({step_checked * 1e3:.2f} vs {step_unchecked * 1e3:.2f} ms/step)   "
        f"goal <= {CHECK_COST_GOAL:.0%}  {'met' if check_cost <= CHECK_COST_GOAL else 'MISSED'}{where}"
    )
    print(
        f"check_seconds    {check_share:6.2%} of timed seconds (host time in checks)   "
        f"goal <= {CHECK_COST_GOAL:.0%}  {'met' if check_share <= CHECK_COST_GOAL else 'MISSED'}{where}"
    )
    for name, rs in runs.items():
        walls = ", ".join(f"{r.wall_seconds:.2f}" for r in rs)
        steps_ms = ", ".join(f"{r.step_time * 1e3:.2f}" for r in rs)
        print(f"  {name:9s} wall s: {walls}   ms/step: {steps_ms}")

    report: dict[str, Any] = {
        "workload": "resnet18",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if gpu else "cpu",
        "torch": torch.__version__,
        "precision": precision,
        "batch_size": batch_size,
        "warmup_steps": warmup,
        "steps": steps,
        "repeats": args.repeats,
        "timed_share": timed_share,
        "timed_share_goal": TIMED_SHARE_GOAL,
        "check_cost": check_cost,
        "check_share": check_share,
        "check_cost_goal": CHECK_COST_GOAL,
        "step_time_checked": step_checked,
        "step_time_unchecked": step_unchecked,
        "probes": {
            name: [_figures(r, s) for r in rs]
            for (name, rs), s in zip(runs.items(), (checked, unchecked), strict=True)
        },
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return report


if __name__ == "__main__":
    main()
