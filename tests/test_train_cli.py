"""Training runs under a config: the library's train/compare and `autotune train` as users run it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _configs import FAST, make_config, write_config
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import SpecError
from autotune.measure.precision import snapshot_backend_flags
from autotune.schema.spec import Candidate, load_spec
from autotune.train import TrainSettings, compare, parse_train_settings, train
from autotune.train._training_run import RandomStreams
from autotune.workloads import Workload, load_workload, synthetic_batches

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr if result.stderr_bytes else ""


# ---- the library ------------------------------------------------------------------------


def test_a_run_reports_consistent_figures_and_leaves_no_trace() -> None:
    wl = load_workload("tiny_mlp")
    rng, flags = torch.get_rng_state(), snapshot_backend_flags()
    seen: list[tuple[int, int]] = []
    r = train(
        wl,
        make_config("bf16", batch_size=32, learning_rate=0.05),
        "cpu",
        TrainSettings(steps=8, check_every=4, warmup_steps=2),
        on_progress=lambda label, done, total, loss: seen.append((done, total)),
    )
    assert r.outcome == "completed" and r.ok
    assert (r.steps, r.samples, r.warmup_steps, r.timed_steps) == (8, 256, 2, 6)
    assert r.throughput == pytest.approx(6 * 32 / r.timed_seconds)
    assert r.seconds_per_epoch == pytest.approx(8192 / r.throughput)
    assert r.wall_seconds >= r.timed_seconds
    assert len(r.losses) == 8 and r.first_loss == r.losses[0]
    assert r.final_loss == pytest.approx(r.losses[-1])  # the last tenth of 8 steps: one
    assert r.accuracy is not None and 0 <= r.accuracy <= 1
    assert r.memory_source in ("cpu_rss", "unavailable")
    # Progress after the warm-up and after every block (a run is cut into about forty).
    assert seen == [(i, 8) for i in range(2, 9)]
    # The caller's random state and backend flags are as they were.
    assert torch.equal(torch.get_rng_state(), rng)
    assert snapshot_backend_flags() == flags


def test_the_same_seed_gives_the_same_run() -> None:
    wl = load_workload("tiny_mlp")
    cand = Candidate(precision="fp32", batch_size=16, learning_rate=0.05)
    a = train(wl, cand, "cpu", TrainSettings(steps=4, eval_samples=0))
    b = train(wl, cand, "cpu", TrainSettings(steps=4, eval_samples=0))
    assert a.losses == b.losses and a.accuracy is None


def test_compare_with_steps_gives_the_baseline_the_same_samples() -> None:
    wl = load_workload(FAST)  # base batch 64, lr 0.05
    cmp = compare(
        wl, make_config("bf16", batch_size=128), "cpu", TrainSettings(steps=3), against="fp32"
    )
    t, b = cmp.tuned, cmp.baseline
    assert b is not None and cmp.against == "fp32"
    assert (t.precision, t.batch_size, t.steps) == ("bf16", 128, 3)
    assert (b.precision, b.batch_size, b.learning_rate, b.steps) == ("fp32", 64, 0.05, 6)
    assert t.samples == b.samples == 384
    # Paired: the speedup is the median of the per-pair block ratios; three pairs are too few
    # for a 95% interval, and none is claimed.
    assert 1 <= cmp.pairs < 6 and cmp.speedup is not None
    assert cmp.speedup_low is None and cmp.speedup_high is None
    assert cmp.accuracy_delta == pytest.approx(t.accuracy - b.accuracy)


def test_a_95_percent_interval_is_claimed_from_six_pairs_on() -> None:
    """Five steps (three timed, after the warm-up) are three pairs, whose ratios' range is no
    95% interval: the speedup is given without one; ten steps are eight pairs, and give it."""
    wl = load_workload(FAST)
    tuned = make_config("bf16", batch_size=128)
    few = compare(wl, tuned, "cpu", TrainSettings(steps=5, eval_samples=0), against="fp32")
    assert few.pairs < 6 and few.speedup is not None
    assert (few.speedup_low, few.speedup_high) == (None, None)
    enough = compare(wl, tuned, "cpu", TrainSettings(steps=10, eval_samples=0), against="fp32")
    assert enough.pairs >= 6
    assert enough.speedup_low <= enough.speedup <= enough.speedup_high


def test_compare_against_amp_runs_fp16_with_the_default_scaler() -> None:
    wl = load_workload(FAST)
    settings = TrainSettings(epochs=1, samples_per_epoch=256, eval_samples=0)
    cmp = compare(wl, make_config("bf16", batch_size=128), "cpu", settings, against="amp")
    b = cmp.baseline
    assert b is not None
    assert (b.precision, b.init_scale, b.batch_size, b.steps) == ("fp16", 65536.0, 64, 4)
    assert cmp.tuned.steps == 2 and cmp.tuned.samples == b.samples == 256


def test_a_diverging_run_stops_with_the_reason() -> None:
    wl = load_workload("autotune.testing.workloads:diverging")  # explodes above lr ~0.5
    r = train(wl, Candidate(precision="fp32", batch_size=32, learning_rate=5.0), "cpu",
              TrainSettings(steps=200, check_every=10))  # fmt: skip
    assert r.outcome == "diverged"
    assert r.reason.startswith("loss=") and "at step" in r.reason
    assert r.steps < 200


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"steps": 5, "epochs": 2}, "give one of steps, epochs or samples, got steps=5, epochs=2"),
        ({"steps": 0}, "steps: Input should be greater than 0, got steps=0"),
        ({"samples_per_epoch": -1}, "samples_per_epoch: Input should be greater than 0"),
    ],
)
def test_bad_train_options_are_named(fields: dict, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        parse_train_settings(**fields)


def test_the_user_workload_example_loads_and_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/mypkg as docs/own-model.md runs it: PYTHONPATH=examples, mypkg.train:workload."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = load_spec(ROOT / "studies" / "mypkg.yaml")
    assert spec.workload == "mypkg.train:workload"
    wl = load_workload(spec.workload)
    assert wl.reference == "mypkg.train:workload"
    r = train(wl, Candidate(precision="bf16", batch_size=64, learning_rate=1e-3), "cpu",
              TrainSettings(steps=3, eval_samples=128))  # fmt: skip
    assert r.ok and r.accuracy is not None and all(map(math.isfinite, r.losses))


def _dropout_workload(masks: list[torch.Tensor]) -> Workload:
    """A linear model that, every forward, drops out a vector of ones and records the mask."""

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kept = self.drop(torch.ones(256, device=x.device))
            masks.append((kept == 0).cpu())
            return self.linear(x) + 0 * kept.sum()

    def make(batch_size: int, gen: torch.Generator) -> Any:
        return torch.randn(batch_size, 8, generator=gen), torch.randint(
            0, 4, (batch_size,), generator=gen
        )

    return Workload(
        name="dropout",
        build_model=Masked,
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen, samples=64),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        base_lr=0.05,
        base_batch_size=16,
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_consecutive_blocks_draw_new_dropout_masks_and_a_rerun_the_same(device: str) -> None:
    """A run is cut into timed blocks; on the device, too, each block must go on drawing where
    the last one stopped (it used to replay the same dropout masks in every block on CUDA)."""
    cand = Candidate(precision="fp32", batch_size=16, learning_rate=0.05)
    settings = TrainSettings(steps=5, check_every=1, warmup_steps=1, eval_samples=0)
    runs = []
    for _ in range(2):
        masks: list[torch.Tensor] = []
        r = train(_dropout_workload(masks), cand, device, settings)
        assert r.ok and r.steps == 5 and len(masks) == 5
        runs.append(masks)
    first = runs[0]
    # The warm-up step and four one-step blocks: five different masks, as in one plain loop.
    assert all(not torch.equal(a, b) for i, a in enumerate(first) for b in first[i + 1 :])
    # The same seed gives the same masks again.
    assert all(torch.equal(a, b) for a, b in zip(first, runs[1], strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_random_streams_carry_each_devices_state_from_block_to_block(device: str) -> None:
    dev = torch.device(device)
    streams = [RandomStreams(7, [torch.device("cpu"), dev]) for _ in range(2)]
    # The uninterrupted sequence: the same draws from one generator seeded with 7.
    gen = torch.Generator(dev).manual_seed(7)
    plain = [torch.rand(4, device=dev, generator=gen) for _ in range(3)]
    before = _global_state(dev)
    drawn: list[list[torch.Tensor]] = [[], []]
    callers: list[torch.Tensor] = []
    for _ in range(3):  # two runs' blocks interleave, and the caller draws between them
        for own, out in zip(streams, drawn, strict=True):
            with own.own():
                out.append(torch.rand(4, device=dev))
            callers.append(torch.rand(4, device=dev))
    for out in drawn:
        assert all(torch.equal(a, b) for a, b in zip(out, plain, strict=True))
    # The caller's stream went on as if no run had drawn in between.
    _set_global_state(dev, before)
    assert all(torch.equal(c, torch.rand(4, device=dev)) for c in callers)


def _global_state(dev: torch.device) -> torch.Tensor:
    return torch.get_rng_state() if dev.type == "cpu" else torch.cuda.get_rng_state(dev)


def _set_global_state(dev: torch.device, state: torch.Tensor) -> None:
    if dev.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, dev)


# ---- the command --------------------------------------------------------------------------


def test_train_with_compare_prints_both_rows_and_the_ratios(tmp_path: Path) -> None:
    path = write_config(tmp_path / "best.json", make_config("bf16", batch_size=128, workload=FAST))
    code, out, err = run_cli(
        "train", "--config", str(path), "--steps", "5", "--compare", "fp32", "--device", "cpu"
    )
    assert code == 0, out + err
    lines = out.splitlines()
    header = next(ln for ln in lines if "samples/s" in ln)
    for column in ("run", "steps", "time", "samples/s", "peak mem", "final loss", "accuracy"):
        assert column in header
    tuned = next(ln for ln in lines if ln.strip().startswith("tuned "))
    base = next(ln for ln in lines if ln.strip().startswith("fp32 "))
    ratio = next(ln for ln in lines if ln.strip().startswith("ratio "))
    assert tuned.split()[1] == "5" and base.split()[1] == "10"  # same samples: 640 each
    assert ratio.count("x") >= 4 and "pts" in ratio
    assert "tuned: bf16 bs=128 lr=0.1" in out and "fp32: fp32 bs=64 lr=0.05" in out
    assert "tuned vs fp32:" in out
    # Not a terminal: plain progress lines instead of a live bar, on stderr.
    assert "tuned: step 5/5" in err and "fp32: step 10/10" in err
    assert "step 5/5" not in out


def test_train_compare_with_too_few_pairs_shows_no_95_percent_interval(tmp_path: Path) -> None:
    """Five steps are a few pairs: the summary gives the speedup but no "95% interval" made of
    a few ratios' range, and says to run longer for one."""
    path = write_config(tmp_path / "best.json", make_config("bf16", batch_size=128, workload=FAST))
    code, out, err = run_cli(
        "train", "--config", str(path), "--steps", "5", "--compare", "fp32", "--device", "cpu"
    )
    assert code == 0, out + err
    assert "tuned vs fp32:" in out and "95% interval" not in out
    assert "pairs of blocks: too few for a 95% interval" in err
    assert "run longer (more steps or epochs)" in err


def test_train_json_has_both_runs_and_the_ratios(tmp_path: Path) -> None:
    path = write_config(tmp_path / "best.json", make_config("fp32", batch_size=64, workload=FAST))
    code, out, err = run_cli("train", "-c", str(path), "--steps", "2", "--compare", "amp", "--json")
    assert code == 0, out + err
    data = json.loads(out)  # stdout is the JSON alone: `autotune train ... --json > out.json`
    assert "tuned: step 2/2" in err
    assert data["tuned"]["steps"] == 2 and data["baseline"]["precision"] == "fp16"
    assert {"speedup", "memory_ratio", "loss_ratio", "accuracy_delta"} <= set(data)


def _bad_json(tmp_path: Path) -> Path:
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1, "study": ')
    return path


def _bad_workload(tmp_path: Path) -> Path:
    return write_config(tmp_path / "w.json", make_config(workload="nopkg.missing:workload"))


def _bad_loss(tmp_path: Path) -> Path:
    # Fails inside training, after the session opened: the flags must still come back.
    ref = "autotune.testing.workloads:non_scalar_loss"
    return write_config(tmp_path / "l.json", make_config(workload=ref, batch_size=16))


def _good(tmp_path: Path) -> Path:
    return write_config(tmp_path / "good.json", make_config(workload=FAST))


@pytest.mark.parametrize(
    ("make", "extra", "needle"),
    [
        (lambda p: p / "missing.json", [], "does not exist; run `autotune search`"),
        (_bad_json, [], "is not valid JSON"),
        (_bad_workload, [], "cannot import module 'nopkg.missing'"),
        (_bad_loss, [], "loss must be a scalar tensor, got shape (16,)"),
        (_good, ["--steps", "5", "--epochs", "1"], "give one of steps, epochs or samples"),
        (_good, ["--compare", "fp8"], "unknown baseline compare='fp8'; use fp32 or amp"),
        (_good, ["--device", "tpu"], "device 'tpu' is not"),
    ],
)
def test_bad_input_is_one_error_line_and_no_flag_changed(
    tmp_path: Path, make, extra: list[str], needle: str
) -> None:
    before = snapshot_backend_flags()
    code, out, err = run_cli("train", "--config", str(make(tmp_path)), "--steps", "2", *extra)
    assert code == 2, out + err
    assert err.startswith("error: ") and needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out
    assert snapshot_backend_flags() == before


def test_train_compare_measures_a_compiled_config_with_compiling_outside_the_clock(
    tmp_path: Path,
) -> None:
    """`autotune train --compare` on a compiled config: the tuned run compiles in its untimed
    warm-up (even with no warm-up asked for), and the output says what compiling took."""
    # The graph the probe tests compile too: torch's compile cache serves it again.
    cfg = make_config("fp32", batch_size=32, learning_rate=0.05, compile=True)
    path = write_config(tmp_path / "best.json", cfg)
    code, out, err = run_cli(
        "train", "-c", str(path), "--steps", "3", "--warmup-steps", "0", "--compare", "fp32",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0, out + err
    assert "tuned: fp32 bs=32 lr=0.05 compile" in out
    assert "after 1 warmup step(s)" in out
    text = " ".join(out.split())  # the console wraps long lines
    said = text.split("compile: tuned compiled (torch.compile mode=default) in ")[1]
    assert float(said.split()[0]) > 0
    assert said.split(" s ", 1)[1].startswith("in its untimed warm-up")


# ---- what a config's workload may name ------------------------------------------------------

USER_PACKAGE = {
    "__init__.py": "",
    "train.py": (
        "from json import dumps\n"
        "from os import abort\n\n"
        "from _configs import fast_mlp\n\n"
        "from autotune.workloads import Workload\n\n\n"
        "def workload() -> Workload:\n"
        "    return fast_mlp()\n\n\n"
        "def sized(batch_size):\n"
        "    return fast_mlp()\n\n\n"
        "def count() -> int:\n"
        "    return 3\n\n\n"
        "class Model:\n"
        "    pass\n"
    ),
}


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``trainpkg.train`` in the working directory, as a user's own package lives."""
    package = tmp_path / "trainpkg"
    package.mkdir()
    for name, text in USER_PACKAGE.items():
        (package / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("trainpkg", "trainpkg.train"):
        sys.modules.pop(name, None)


@pytest.mark.timeout(120)
def test_a_config_naming_os_abort_is_refused_before_anything_is_called(tmp_path: Path) -> None:
    """It used to import os and call abort(): exit 134, no message."""
    path = write_config(tmp_path / "best.json", make_config("fp32", workload="os:abort"))
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "train", "--config", str(path), "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 2, done.stderr
    assert "workload 'os:abort': module 'os' is part of Python itself" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("workload", "needle"),
    [
        ("subprocess:run", "module 'subprocess' is part of Python itself"),
        # A library's own zero-argument function: it ran (torch.cuda:init initialised CUDA).
        ("torch.cuda:init", "module 'torch.cuda' belongs to torch, a library autotune runs on"),
        ("yaml:warnings", "module 'yaml' belongs to PyYAML, a library autotune runs on"),
        ("autotune.cli:main", "autotune's workloads live in autotune.workloads"),
        ("autotune.workloads:load_workload", "has no workload 'load_workload'; it has resnet18"),
        ("trainpkg.train:abort", "'abort' is a builtin_function_or_method, not a function"),
        ("trainpkg.train:dumps", "'dumps' is json.dumps, defined outside package 'trainpkg'"),
        ("trainpkg.train:fast_mlp", "defined outside package 'trainpkg'"),
        ("trainpkg.train:sized", "'sized' needs arguments (batch_size)"),
        ("trainpkg.train:count", "'count' is declared to return int, not a Workload"),
        ("trainpkg.train:Model", "'Model' is a class, not a function"),
        ("trainpkg.train:nope", "has no attribute 'nope'; it has count, sized, workload"),
    ],
    ids=[
        "stdlib",
        "a-library",
        "a-library-named-otherwise",
        "autotune-internals",
        "builtin-non-factory",
        "imported-builtin",
        "imported-stdlib-function",
        "imported-from-elsewhere",
        "needs-arguments",
        "returns-int",
        "a-class",
        "missing",
    ],
)
def test_a_config_workload_that_is_not_a_factory_is_one_error_line(
    user_package: Path, workload: str, needle: str
) -> None:
    path = write_config(user_package / "best.json", make_config("fp32", workload=workload))
    code, out, err = run_cli("train", "--config", str(path), "--steps", "2", "--device", "cpu")
    assert code == 2, out + err
    assert err.startswith("error: ") and needle in " ".join(err.split())
    assert "Traceback" not in out + err


def test_a_users_own_package_in_the_working_directory_still_trains(user_package: Path) -> None:
    cfg = make_config("fp32", workload="trainpkg.train:workload", batch_size=64)
    path = write_config(user_package / "best.json", cfg)
    code, out, err = run_cli("train", "--config", str(path), "--steps", "2", "--device", "cpu")
    assert code == 0, out + err
    assert "trainpkg.train:workload on cpu" in " ".join(out.split())


def test_compare_charges_each_run_its_own_peak_not_the_process_s_first_costs() -> None:
    """Two identical fp32 runs compared: whichever ran first was charged the process's
    one-time growth (tiny_mlp: 163 MiB against 5 MiB, "30x the peak memory"); each run's own
    peak is measured after both have paid them, so the two agree."""
    cand = Candidate(precision="fp32", batch_size=64, learning_rate=0.05)
    cmp = compare(
        load_workload("tiny_mlp"),
        cand,
        "cpu",
        TrainSettings(steps=4, eval_samples=0),
        against="fp32",
    )
    tuned, base = cmp.tuned.peak_memory_bytes, cmp.baseline.peak_memory_bytes
    if tuned is None or base is None or cmp.tuned.memory_source != "cpu_rss":
        pytest.skip("this process's peak resident memory cannot be read here")
    assert max(tuned, base) <= 2 * max(min(tuned, base), 8 * 2**20)


def _result(label: str, precision: str, **fields: Any) -> Any:
    from autotune.train._models import TrainResult

    return TrainResult(
        label=label,
        workload="tiny",
        device="cpu",
        precision=precision,
        batch_size=64,
        learning_rate=0.1,
        steps=100,
        samples=6400,
        samples_per_epoch=6400,
        warmup_steps=2,
        **fields,
    )


def test_the_verdict_names_accuracy_and_says_when_loss_and_accuracy_disagree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tuned run whose final loss kept within 5% of fp32's while its accuracy fell from
    55.2% to 11.7%: the verdict names the accuracy and says the metrics disagree. The ratio
    row divides the rows' own figures (24.8 s against 20.1 s an epoch: 1.23x), and where the
    paired estimate lies elsewhere the verdict says why."""
    from rich.console import Console

    import autotune.cli._train as train_cli
    from autotune.train._models import Comparison

    out = Console(width=400, record=True)
    monkeypatch.setattr(train_cli, "console", out)
    cmp = Comparison(
        tuned=_result(
            "tuned",
            "bf16",
            throughput=258.1,
            seconds_per_epoch=24.8,
            final_loss=1.01,
            accuracy=0.117,
        ),  # fmt: skip
        baseline=_result(
            "fp32", "fp32", throughput=318.4, seconds_per_epoch=20.1, final_loss=1.0, accuracy=0.552
        ),  # fmt: skip
        against="fp32",
        paired_speedup=1.01,
        speedup_low=0.97,
        speedup_high=1.05,
        pairs=12,
    )
    train_cli._print_table(cmp, per_epoch=True)
    text = out.export_text()
    ratio = next(ln for ln in text.splitlines() if ln.strip().startswith("ratio"))
    assert "1.23x" in ratio and "0.81x" in ratio
    assert "accuracy 11.7% against 55.2% (-43.5 pts)" in text
    assert "the metrics disagree" in text
    assert "the runs' own rates give 0.81x, outside the paired interval" in text
    # An interval around 1.0x: no "1.01x faster" the pairs cannot tell from no difference.
    assert "no difference in speed the pairs can tell" in text and "1.01x faster" not in text
    apart = cmp.model_copy(update={"speedup_low": 1.02})
    out = Console(width=400, record=True)
    monkeypatch.setattr(train_cli, "console", out)
    train_cli._print_table(apart, per_epoch=True)
    assert "1.01x faster on the same samples (speedup 1.01x" in out.export_text()
    agree = cmp.model_copy(update={"tuned": cmp.tuned.model_copy(update={"accuracy": 0.55})})
    out = Console(width=400, record=True)
    monkeypatch.setattr(train_cli, "console", out)
    train_cli._print_table(agree, per_epoch=True)
    assert "the metrics disagree" not in out.export_text()
