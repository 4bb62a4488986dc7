"""examples/huggingface as a user runs it: ``autotune search`` on its spec, which names the
project's model, dataset and TrainingArguments directly, then the config trained through
transformers' Trainer. A real CPU worker with a budget of seconds; the test waits on what the
run leaves behind, never on how many trials the budget bought."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import autotune
from autotune.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "huggingface" / "tune.yaml"


def test_huggingface_example_searched_from_the_command_line_and_trained(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = tmp_path / "study"
    argv = [
        sys.executable, "-m", "autotune", "search", str(SPEC), "--budget", "8s", "--device", "cpu",
        "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(out),
        "--set", "space.precisions=[fp32, bf16]", "--set", "space.batch_size.max=64",
        "--set", "probe.min_time=0.2s", "--set", "probe.steps=6", "--set", "validation.steps=6",
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    cfg = autotune.load_config(out / "best.json")
    workload = load_spec(SPEC).workload
    assert cfg.workload == workload
    assert json.loads(workload)["huggingface"]["training_args"].endswith(":training_args")
    # AdamW, as the Trainer builds it from the example's TrainingArguments (weight_decay=0).
    assert cfg.optimizer == "AdamW" and cfg.optimizer_kwargs["weight_decay"] == 0.0
    # Tuned under the arguments' schedule (transformers' default linear decay), which the best.json
    # records and the export hands back to the Trainer, so training decays as the search did.
    assert json.loads((out / "best.json").read_text())["lr_schedule"] == "linear"
    assert autotune.export(cfg, "hf").kwargs["lr_scheduler_type"] == "linear"
    assert (out / "report.html").is_file()

    trained = subprocess.run(
        [sys.executable, "-m", "examples.huggingface.train", str(out / "best.json"),
         "--max-steps", "2", "--output-dir", str(tmp_path / "trainer")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "train_loss" in trained.stdout + trained.stderr
