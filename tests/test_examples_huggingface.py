"""examples/huggingface as a user runs it: ``autotune search`` on its spec, which names the
project's model, dataset and TrainingArguments directly, then the config trained through
transformers' Trainer (the example's train.py) and through accelerate (train_accelerate.py),
where a hook inside each step reads back the tuned batch size, lr and its schedule, and autocast
dtype. A real CPU worker with a budget of seconds; the test waits on what the run leaves behind,
never on how many trials the budget bought, and asserts on whatever mode and values the config
says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _steps import StepReader, assert_trained_as_tuned, linear, training_process

import autotune
from autotune.schema.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "huggingface" / "tune.yaml"
STEPS = 3  # training steps the tuned config runs, in each library


def test_huggingface_example_searched_from_the_command_line_and_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = tmp_path / "study"
    argv = [
        sys.executable, "-m", "autotune", "search", str(SPEC), "--budget", "25s", "--device", "cpu",
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

    # The emitted config trains the project through transformers' Trainer (train.py's main) and
    # through accelerate (train_accelerate.py's), and a hook inside each step reads back what it
    # runs. The hook is on the model's encoder, which its forward calls: the forward itself is
    # what accelerate wraps in autocast, so a hook on the whole model runs outside it.
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import transformers

    from examples.huggingface import train, train_accelerate

    best = str(out / "best.json")
    reader = StepReader()

    class ReadSteps(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reader.attach(kw["model"].bert, kw["optimizer"])

    with training_process():
        trainer = train.main(
            [best, "--max-steps", str(STEPS), "--output-dir", str(tmp_path / "trainer")],
            [ReadSteps()],
        )
    assert trainer.state.global_step == STEPS
    # The tuned batch size and autocast dtype in every step, the tuned lr at the first, then
    # lower as the recorded linear schedule decays it over the run.
    assert_trained_as_tuned(reader.steps, cfg, linear(cfg.learning_rate, STEPS))

    reader = StepReader()
    with training_process():
        train_accelerate.main(
            [best, "--max-steps", str(STEPS)],
            [lambda model, optimizer: reader.attach(model.bert, optimizer)],
        )
    assert_trained_as_tuned(reader.steps, cfg, linear(cfg.learning_rate, STEPS))
