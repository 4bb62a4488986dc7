"""The fixed cost of a search: seconds from its start to its first trial, and where they go.

Runs a real search of a study (``studies/tiny.yaml`` by default) on a fresh storage, a few
times, each stopped as its first trial starts, and prints the median of each phase:

- worker start: a fresh interpreter importing torch, until it says it is ready (it overlaps
  opening the storage);
- facts: the worker's answer about the workload and the device;
- ceilings: each mode's batch ceiling (its tries, and what they took);
- reference: the fp32 reference probe;
- to first trial: from the search's start until its first trial asks for a probe.

The worker is spawned first, as ``autotune search`` does (it imports torch while the search
opens the study). With ``--warm`` it also times searches whose worker was started, warm,
beforehand, as a service's is when the service starts. With ``--command`` it also times the
command itself, ``autotune search`` in a fresh process: from its start (its own imports
included) to the search phase's first line.

Goal (CPU, tiny.yaml): at most 3 s to the first trial.

    python benchmarks/fixed_cost.py                      # tiny.yaml on the CPU, 3 runs
    python benchmarks/fixed_cost.py --runs 5 --budget 60s --json fixed.json --command --warm
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loguru import logger

from autotune.execution.probe_worker import ProbeWorker
from autotune.measure.result import ProbeResult
from autotune.schema.spec import Candidate, ProbeSettings, load_spec
from autotune.search import Event, PhaseStarted, SearchStopped, TrialStarted, run_search

ROOT = Path(__file__).resolve().parent.parent
GOAL_SECONDS = 3.0


class TimedWorker(ProbeWorker):
    """A probe worker that notes when it started, answered about the facts, and each probe."""

    def __init__(self, device: str, *, warm: bool = False) -> None:
        super().__init__(device, warm=warm)
        self.marks: dict[str, tuple[float, float]] = {}
        self.probes: list[dict[str, Any]] = []

    def spawn(self) -> None:
        self.marks.setdefault("worker start", (time.perf_counter(), 0.0))
        super().spawn()

    def start(self) -> None:
        super().start()
        began, ready = self.marks["worker start"]
        if not ready:  # the first start: from the spawn until the worker said it was ready
            self.marks["worker start"] = (began, time.perf_counter())

    def facts(self, workload: str, *, timeout: float = 120.0) -> Any:
        began = time.perf_counter()
        try:
            return super().facts(workload, timeout=timeout)
        finally:
            self.marks.setdefault("facts", (began, time.perf_counter()))

    def run(
        self, workload: str, candidate: Candidate, settings: ProbeSettings, **kw: Any
    ) -> ProbeResult:
        began = time.perf_counter()
        result = super().run(workload, candidate, settings, **kw)
        self.probes.append(
            {
                "precision": candidate.precision,
                "batch_size": candidate.batch_size,
                "outcome": result.outcome,
                "seconds": time.perf_counter() - began,
                # Inside the worker: model build, data, warm-up and timed steps.
                "probe_seconds": result.wall_seconds,
                "steps": len(result.losses),
            }
        )
        return result


def one_run(spec_path: Path, device: str, budget: str, *, warm: bool = False) -> dict[str, Any]:
    """One search, stopped as its first trial starts: the seconds of each phase.

    ``warm``: the worker is started, and said it is ready, before the clock starts, as a
    service's is (it starts its device's worker when it starts, and keeps it between studies).
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(spec_path).with_overrides(
            {"device": device, "budget": budget, "storage": f"sqlite:///{tmp}/fixed.db"}
        )
        worker = TimedWorker(spec.device, warm=warm)
        if warm:
            worker.start()
            worker.marks.clear()
        t0 = time.perf_counter()
        worker.spawn()  # as the command does, before the search opens the study
        events: list[tuple[float, Event]] = []
        first_trial: list[float] = []

        def on_event(event: Event) -> None:
            now = time.perf_counter()
            events.append((now, event))
            if isinstance(event, TrialStarted) and not first_trial:
                first_trial.append(now)

        try:
            run_search(
                spec,
                out_dir=Path(tmp) / "out",
                runner=worker,
                on_event=on_event,
                should_stop=lambda: bool(first_trial),
            )
        except SearchStopped:
            pass
        finally:
            worker.close()
    if not first_trial:
        raise RuntimeError("the search ended before its first trial")
    end = first_trial[0]
    # Each phase runs from its PhaseStarted to the next phase's (or the first trial).
    starts = [(t, e) for t, e in events if isinstance(e, PhaseStarted)]
    phases: dict[str, float] = {}
    for i, (t, e) in enumerate(starts):
        until = starts[i + 1][0] if i + 1 < len(starts) else end
        if until > end:
            break
        phases[e.phase] = phases.get(e.phase, 0.0) + until - t
        if e.phase == "ceilings":
            phases[f"ceilings {e.mode}"] = until - t
    first_phase = starts[0][0] if starts else end
    out: dict[str, float] = {}
    for name, (a, b) in worker.marks.items():
        out[name] = b - a
    out["before ceilings"] = first_phase - t0
    out.update(phases)
    out["to first trial"] = end - t0
    return {"seconds": out, "probes": list(worker.probes)}


def command_run(spec_path: Path, device: str, budget: str) -> float:
    """``autotune search`` in a fresh process: seconds from its start to its search phase."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "autotune", "search", str(spec_path), "--device", device]
        args += ["--budget", budget, "--storage", f"sqlite:///{tmp}/fixed.db"]
        args += ["--out", f"{tmp}/out", "--log-json"]
        began = time.perf_counter()
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert proc.stderr is not None
        seconds = None
        for line in proc.stderr:
            if "phase search" in line:
                seconds = time.perf_counter() - began
                break
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if seconds is None:
        raise RuntimeError("the command ended before its search phase")
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "studies" / "tiny.yaml")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="60s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="print every probe of every run")
    parser.add_argument(
        "--command", action="store_true", help="also time `autotune search` from its start"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="also time searches whose worker was started beforehand, as a service's is",
    )
    args = parser.parse_args(argv)
    logger.remove()
    runs = []
    for i in range(args.runs):
        run = one_run(args.spec, args.device, args.budget)
        runs.append(run)
        print(f"run {i + 1}: {run['seconds']['to first trial']:.2f} s to the first trial")
        if args.verbose:
            for p in run["probes"]:
                print(
                    f"    {p['precision']:>5} bs={p['batch_size']:<4} {p['outcome']:<10} "
                    f"{p['seconds']:.2f} s ({p['probe_seconds']:.2f} s in the probe, "
                    f"{p['steps']} steps)"
                )
    names = list(dict.fromkeys(k for r in runs for k in r["seconds"]))
    medians = {
        k: statistics.median(r["seconds"][k] for r in runs if k in r["seconds"]) for k in names
    }
    print(f"\nmedian of {len(runs)} runs, {args.spec.name} on {args.device}, budget {args.budget}:")
    for k, v in medians.items():
        name = f"  {k}" if k.startswith("ceilings ") else k  # a mode's share of the ceilings
        print(f"  {name:<22} {v:6.2f} s")
    # The ceiling tries and the reference's probe.
    probes = statistics.median(len(r["probes"]) for r in runs)
    print(f"  probes before the first trial: {probes:.0f}")
    total = medians["to first trial"]
    print(f"to first trial: {total:.2f} s (goal ≤ {GOAL_SECONDS:.0f} s)")
    out: dict[str, Any] = {"medians": medians, "runs": runs, "goal_seconds": GOAL_SECONDS}
    if args.warm:
        warm = [one_run(args.spec, args.device, args.budget, warm=True) for _ in range(args.runs)]
        out["warm_runs"] = warm
        seconds = [r["seconds"]["to first trial"] for r in warm]
        shown = ", ".join(f"{s:.2f}" for s in seconds)
        print(
            f"with the worker started beforehand (a service's): median "
            f"{statistics.median(seconds):.2f} s to the first trial ({shown})"
        )
    if args.command:
        command = [command_run(args.spec, args.device, args.budget) for _ in range(args.runs)]
        out["command_seconds"] = command
        shown = ", ".join(f"{c:.2f}" for c in command)
        print(
            f"`autotune search` from its start to its search phase: median "
            f"{statistics.median(command):.2f} s ({shown})"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
