"""`autotune worker` processes on one study, as the distributed tests start them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SPEC = """\
name: dist
workload: autotune.testing.workloads:sleepy
device: cpu
budget: {budget}
space:
  precisions: [fp32]
  batch_sizes: [16, 32, 64]
  lr_multipliers: [0.5, 1.0, 2.0]
probe: {{warmup_steps: 1, steps: {steps}, check_every: 2, min_time: 0, early_stop: false, time_limit: 20s}}
validation: {{top_k: 1, steps: 2}}
parity_tolerance: 0.5
"""


def start_worker(spec: Path, storage: str, out: Path, sleep: float) -> subprocess.Popen:
    env = {**os.environ, "AUTOTUNE_SLEEPY_SECONDS": str(sleep), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "worker",
            str(spec),
            "--storage",
            storage,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def resume(spec: Path, storage: str, out: Path, budget: str) -> None:
    """Run the study again, as a user would: `autotune search` with the same spec."""
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "search", str(spec), "--storage", storage,
         "--out", str(out), "--budget", budget],
        cwd=ROOT,
        env={**os.environ, "AUTOTUNE_SLEEPY_SECONDS": "0.05"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def write_spec(tmp_path: Path, budget: str, steps: int) -> Path:
    path = tmp_path / "dist.yaml"
    path.write_text(SPEC.format(budget=budget, steps=steps))
    return path
