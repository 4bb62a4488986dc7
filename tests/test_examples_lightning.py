"""examples/lightning as a user runs it: tuned from a notebook-style script with
``autotune.tune()`` on the project's own classes, then trained with the config through
Lightning's Trainer (the example's train.py), where a hook inside each step reads back the tuned
batch size, lr and its schedule, and autocast dtype. A real CPU worker with a budget of seconds;
the test waits on what the run leaves behind (a config, its workload), never on how many trials
the budget bought, and asserts on whatever mode and values the config says."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from _steps import StepReader, assert_trained_as_tuned, cosine, training_process

import autotune
from autotune.errors import ExportWarning
from autotune.schema.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3  # training steps the tuned config runs


def test_lightning_example_tuned_from_a_notebook_and_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "study"
    script = textwrap.dedent(
        f"""
        import autotune
        from examples.lightning.data import CIFARData
        from examples.lightning.model import LitClassifier

        cfg = autotune.tune(
            module=LitClassifier,
            datamodule=CIFARData,
            module_args={{"channels": 16}},
            datamodule_args={{"samples": 4096}},
            budget="25s",  # the worker imports Lightning: 6 s of it on a busy CPU
            device="cpu",
            storage="sqlite:///{tmp_path / "s.db"}",
            out="{out}",
            progress=False,
            spec={{
                "space": {{"precisions": ["fp32", "bf16"], "batch_size": {{"min": 32, "max": 64}}}},
                "probe": {{"warmup_steps": 1, "steps": 6, "check_every": 3, "min_time": "0.2s"}},
                "validation": {{"steps": 6}},
            }},
        )
        print("tuned:", cfg.precision, cfg.batch_size, cfg.learning_rate)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # What a notebook shows: the phases as lines, then the result.
    assert "tuning LitClassifier on cpu for 25s" in done.stdout
    assert "reference at" in done.stdout and "tuned: " in done.stdout
    cfg = autotune.load_config(out / "best.json")
    # The closing line is the config the call returned (not the search's best trial), and says
    # when it fell back.
    closing = done.stdout.splitlines()[-2]
    assert closing.startswith("done: ") and f"config {cfg.precision} bs={cfg.batch_size}" in closing
    assert cfg.evidence.validated or "back to the fp32 reference" in closing
    # The notebook's objects and the spec's names are the same workload, so the same study.
    assert cfg.workload == load_spec(ROOT / "examples/lightning/tune.yaml").workload
    assert (cfg.optimizer, cfg.study) == ("SGD", "LitClassifier")
    # Tuned under its configure_optimizers' cosine decay; its own Trainer run builds it again.
    assert cfg.lr_schedule == "CosineAnnealingLR"
    assert (out / "report.html").is_file()

    # The emitted config trains the project through Lightning's own Trainer (train.py's main),
    # and a hook inside each step reads back what it runs.
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    import lightning as L

    from examples.lightning import train

    reader = StepReader()

    class ReadSteps(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # training_step calls the module under the precision plugin's autocast.
            reader.attach(pl_module, trainer.optimizers[0])

    with training_process(), warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # the run's lr and batch are the tuned ones
        trainer = train.main([str(out / "best.json"), "--max-steps", str(STEPS)], [ReadSteps()])
    assert trainer.global_step == STEPS
    # The tuned batch size and autocast dtype in every step, the tuned lr at the first, then
    # lower as the module's CosineAnnealingLR (T_max: the run's steps) decays it.
    assert_trained_as_tuned(reader.steps, cfg, cosine(cfg.learning_rate, STEPS))
