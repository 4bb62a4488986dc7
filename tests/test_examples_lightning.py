"""examples/lightning as a user runs it: tuned from a notebook-style script with
``autotune.tune()`` on the project's own classes, then trained with the config through
Lightning's Trainer. A real CPU worker with a budget of seconds; the test waits on what the
run leaves behind (a config, its workload), never on how many trials the budget bought."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import autotune
from autotune.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def test_lightning_example_tuned_from_a_notebook_and_trained(tmp_path: Path) -> None:
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
            budget="8s",
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
    assert "tuning LitClassifier on cpu for 8s" in done.stdout
    assert "reference at" in done.stdout and "tuned: " in done.stdout
    cfg = autotune.load_config(out / "best.json")
    # The notebook's objects and the spec's names are the same workload, so the same study.
    assert cfg.workload == load_spec(ROOT / "examples/lightning/tune.yaml").workload
    assert (cfg.optimizer, cfg.study) == ("SGD", "LitClassifier")
    # Tuned under its configure_optimizers' cosine decay; its own Trainer run builds it again.
    assert cfg.lr_schedule == "CosineAnnealingLR"
    assert (out / "report.html").is_file()

    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.lightning.train",
            str(out / "best.json"),
            "--max-steps",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "max_steps=2` reached" in trained.stdout + trained.stderr
