"""`autotune search` and `autotune probe` as a user runs them: exit codes and messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

import autotune
from autotune.cli import app

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "studies" / "tiny.yaml"


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def write_spec(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(body)
    return path


# (A budget that leaves the worker's start its time beside a busy neighbour: a bad workload
# is named once the worker has imported torch; a start the budget ran out in would stop it
# before.)
GOOD = "name: x\nworkload: tiny_convnet\ndevice: cpu\nbudget: 1m\n"


@pytest.mark.parametrize(
    ("body", "args", "needle"),
    [
        (GOOD + "colour: blue\n", [], "colour: unknown field"),
        (GOOD, ["--budget", "-5m"], "budget must be positive, got budget='-5m'"),
        (GOOD, ["--budget", "abc"], "budget must be a duration like 30m"),
        (GOOD, ["--budget", "0"], "budget must be positive"),
        (
            GOOD + "space: {batch_size: {min: 512, max: 64}}\n",
            [],
            "space.batch_size: min must not be above max",
        ),
        (
            GOOD + "space: {lr_multiplier: {min: 2.0, max: 0.5}}\n",
            [],
            "space.lr_multiplier: min must not be above max",
        ),
        (
            GOOD + "space: {precisions: [fp8]}\n",
            [],
            "Input should be 'fp32', 'tf32', 'fp16' or 'bf16'",
        ),
        (GOOD, ["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
        (GOOD, ["--set", "probe.stepz=3"], "unknown spec field 'probe.stepz'"),
        ("name: [unclosed\n", [], "is not valid YAML"),
        (GOOD, ["--workload", "nosuch.module:fn"], "cannot import module 'nosuch.module'"),
        (GOOD, ["--storage", "nosuchdb://u:pw@h/db"], "cannot be opened"),
    ],
)
def test_bad_input_is_one_clear_message_and_exit_2(
    tmp_path: Path, body: str, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Invoked in a process that imported autotune an hour ago: the command's budget counts
    # from the command (from the import, the worker's start had no time, and a bad workload
    # read "the 60s budget ran out while the probe worker started").
    monkeypatch.setattr(autotune, "STARTED", autotune.STARTED - 3600)
    spec = write_spec(tmp_path, body)
    extra = [] if "--storage" in args else ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
    code, out = run_cli("search", str(spec), "--out", str(tmp_path / "out"), *extra, *args)
    assert code == 2, out
    assert needle in out
    assert "Traceback" not in out


def test_missing_spec_file_is_named(tmp_path: Path) -> None:
    code, out = run_cli("search", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope.yaml" in out and "does not exist" in out


def test_existing_study_with_another_space_is_refused_and_kept(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="x", storage=db, direction="maximize")
    study.set_user_attr("space_fingerprint", "something-else")
    study.enqueue_trial({"precision": "fp32"})
    spec = write_spec(tmp_path, GOOD)
    code, out = run_cli("search", str(spec), "--storage", db, "--out", str(tmp_path / "out"))
    assert code == 2
    assert "already exists" in out and "--name x-2" in out
    assert len(optuna.load_study(study_name="x", storage=db).trials) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--precision", "fp64"], "precision: Input should be 'fp32', 'tf32', 'fp16' or 'bf16'"),
        (["--batch-size", "0", "--steps", "0"], "steps: must be from 1 to 100,000"),
        (["--device", "cuda:7"], "device 'cuda:7' does not exist"),
        (
            ["--workload", "autotune.testing.workloads:non_scalar_loss"],
            "loss must be a scalar tensor",
        ),
    ],
)
def test_probe_bad_input(args: list[str], needle: str) -> None:
    if "cuda:7" in args and sys.modules["torch"].cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    code, out = run_cli("probe", "--workload", "tiny_mlp", *args)
    assert code == 2, out
    assert needle in out
    assert "Traceback" not in out


def test_probe_prints_what_it_measured() -> None:
    code, out = run_cli(
        "probe", "--workload", "tiny_mlp", "--device", "cpu", "--steps", "4", "--warmup", "1"
    )
    assert code == 0, out
    assert "fp32 bs=64" in out and "samples/s" in out and "timed steps" in out


def test_ctrl_c_stops_cleanly_and_the_same_command_resumes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 's.db'}"
    cmd = [
        sys.executable,
        "-m",
        "autotune",
        "search",
        str(TINY),
        "--budget",
        "60s",
        "--device",
        "cpu",
        "--storage",
        db,
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # Wait until the search phase has finished a trial, then press Ctrl-C.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            study = optuna.load_study(study_name="tiny", storage=db)
        except KeyError:
            continue
        if any(t.state.is_finished() for t in study.trials):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "run the same command again to resume" in err
    assert "Traceback" not in err
    study = optuna.load_study(study_name="tiny", storage=db)
    done = [t for t in study.trials if t.state.is_finished()]
    assert done
    # Nothing is left RUNNING forever.
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
