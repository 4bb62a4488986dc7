"""diagnose: the failing layer named, the fix recommended, no hooks or state left behind."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import torch
from typer.testing import CliRunner

from autotune.cli import app
from autotune.diagnose import (
    Diagnosis,
    diagnose,
    fp32_modules,
    keep_in_fp32,
    trial_candidate,
    worst_diverged_trial,
)
from autotune.errors import SpecError
from autotune.measure.probe import global_state
from autotune.schema.spec import Candidate
from autotune.testing.workloads import make_oom_workload
from autotune.workloads import Workload, load_workload, synthetic_batches

TESTING = "autotune.testing.workloads"


def workload(name: str) -> Workload:
    return load_workload(name if ":" in name or name.startswith("tiny_m") else f"{TESTING}:{name}")


def run(name: str, precision: str = "fp16", steps: int = 2, **kw: Any) -> Diagnosis:
    wl = workload(name)
    fields = {"batch_size": wl.base_batch_size, "learning_rate": wl.base_lr, **kw}
    return diagnose(wl, Candidate(precision=precision, **fields), "cpu", steps=steps)


def test_fp16_overflow_is_traced_to_amplify() -> None:
    d = run("fp16_overflow")
    assert d.verdict == "fails"
    assert (d.first_nonfinite, d.first_nonfinite_pass, d.first_nonfinite_step) == (
        "amplify",
        "forward",
        0,
    )
    layers = {s.name: s for s in d.layers}
    assert [s.name for s in d.layers] == ["embed", "amplify", "head"]  # execution order
    amplify = layers["amplify"]
    assert amplify.dtype == "float16" and amplify.made_nonfinite and amplify.act_nonfinite > 0
    # The fp32 shadow pass shows how far past the limit it goes: ~0.5 * 0.06 * 8 * 1e6.
    assert amplify.act_max > 10 * 65504 and amplify.act_limit_ratio > 10
    assert layers["embed"].act_nonfinite == 0
    # head's output is non-finite too, but only because its input was: it did not make it.
    assert layers["head"].act_nonfinite > 0 and not layers["head"].made_nonfinite
    rec = d.recommendations[0]
    assert (rec.kind, rec.layers) == ("keep_fp32", ["amplify"])
    assert "`amplify`" in rec.evidence and "65,504" in rec.evidence
    assert "enabled=False" in rec.action and "bf16" in rec.action
    assert fp32_modules(d) == ["amplify"]
    assert d.skipped_steps == d.steps == 2  # the scaler skipped every step: weights untouched


def test_keep_in_fp32_runs_the_named_module_outside_autocast_and_restores_it() -> None:
    wl = workload("fp16_overflow")
    model = wl.build_model()
    x, y = next(wl.make_batches(64, torch.device("cpu"), torch.Generator().manual_seed(0)))

    def loss() -> float:
        with torch.autocast("cpu", dtype=torch.float16):
            return float(wl.loss(model, (x, y)).detach())

    assert not math.isfinite(loss())
    with keep_in_fp32(model, ["amplify"]):
        assert math.isfinite(loss())
        with torch.autocast("cpu", dtype=torch.float16):
            assert model.amplify(x).dtype == torch.float32
    assert "forward" not in vars(model.amplify)
    assert not math.isfinite(loss())
    with pytest.raises(SpecError, match="module 'amplfy' is not in the model.*'amplify'"):
        keep_in_fp32(model, ["amplfy"]).__enter__()


class _FunctionalOverflow(torch.nn.Module):
    """The overflow happens in an op between modules, where no module hook can see it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 1e6)


def test_an_overflow_between_modules_is_placed_before_the_first_bad_module() -> None:
    def make(bs: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(bs, 8, generator=g), torch.randint(0, 4, (bs,), generator=g)

    wl = Workload(
        name="functional_overflow",
        build_model=_FunctionalOverflow,
        make_batches=lambda bs, dev, g: synthetic_batches(make, bs, dev, g, samples=64),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        base_lr=0.01,
        base_batch_size=16,
    )
    d = diagnose(wl, Candidate(precision="fp16", batch_size=16, learning_rate=0.01), "cpu", steps=1)
    assert (d.verdict, d.first_nonfinite) == ("fails", "b")
    rec = d.recommendations[0]
    assert rec.kind == "find_op" and "inputs were already non-finite" in rec.evidence
    assert fp32_modules(d) == []  # keeping `b` in fp32 would not help


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_healthy_workload_is_safe(precision: str) -> None:
    d = run("tiny_mlp", precision, steps=3)
    assert d.verdict == "safe", d.reason
    assert d.first_nonfinite is None and d.first_nonfinite_pass is None
    assert d.recommendations[0].kind == "safe"
    assert d.recommendations[0].action == f"nothing near the limits: {precision} is safe here"
    assert all(s.act_nonfinite == 0 and (s.grad_underflow or 0) < 0.01 for s in d.layers)
    assert fp32_modules(d) == []


def test_tiny_gradients_underflow_and_the_recommended_init_scale_fixes_it() -> None:
    d = run("tiny_gradients", init_scale=2.0**16)
    assert d.verdict == "at_risk", d.reason
    worst = max(s.grad_underflow or 0 for s in d.layers)
    assert worst > 0.1  # most of a layer's gradient values are lost at 2^16
    (rec,) = [r for r in d.recommendations if r.kind == "raise_init_scale"]
    assert rec.init_scale is not None and rec.init_scale > 2.0**16
    assert math.log2(rec.init_scale).is_integer()
    assert "underflow" in rec.evidence and rec.layers and f"`{rec.layers[0]}`" in rec.evidence
    # Following the advice is enough: at the recommended scale nothing is flagged.
    again = run("tiny_gradients", init_scale=rec.init_scale)
    assert again.verdict == "safe", again.reason
    # bf16 has fp32's exponent range: the same gradients do not underflow at all.
    assert run("tiny_gradients", "bf16").verdict == "safe"


def test_hooks_are_removed_and_global_state_restored() -> None:
    built: list[torch.nn.Module] = []
    wl = workload("fp16_overflow")
    make = wl.build_model
    wl.build_model = lambda: built.append(make()) or built[-1]
    before = global_state()
    with torch.no_grad():  # a caller's grad mode comes back too
        d = diagnose(wl, Candidate(precision="fp16", batch_size=16, learning_rate=1e-3), "cpu")
        assert not torch.is_grad_enabled()
    assert d.verdict == "fails"
    after = global_state()
    for key, value in before.items():
        same = (
            torch.equal(value, after[key])
            if isinstance(value, torch.Tensor)
            else value == after[key]
        )
        assert same, key
    (model,) = built
    for name, module in model.named_modules():
        for hooks in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            assert not getattr(module, hooks), (name, hooks)


@pytest.mark.parametrize(
    ("name", "precision", "kw", "verdict", "needle"),
    [
        # Finite values everywhere but the loss explodes: the lr, not the precision.
        ("diverging", "fp32", {"learning_rate": 5.0}, "fails", "learning rate, not the precision"),
        ("oom", "fp16", {"batch_size": 64}, "inconclusive", "out of memory at batch_size=64"),
        ("crash", "bf16", {}, "inconclusive", "the workload raised RuntimeError: boom at step 1"),
    ],
)
def test_failure_is_a_verdict_not_an_exception(
    name: str, precision: str, kw: dict, verdict: str, needle: str
) -> None:
    if name == "oom":
        wl = make_oom_workload(32)
    elif name == "crash":  # the workload's own code raises mid-run, e.g. on NaN input
        wl, calls = workload("tiny_mlp"), []

        def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            calls.append(1)
            if len(calls) > 2:  # step 0 is a shadow and a real pass
                raise RuntimeError("boom")
            return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

        wl.loss = loss
    else:
        wl = workload(name)
    fields = {"batch_size": wl.base_batch_size, "learning_rate": wl.base_lr, **kw}
    d = diagnose(wl, Candidate(precision=precision, **fields), "cpu", steps=3)
    assert d.verdict == verdict
    assert needle in str(d.recommendations[0])


def test_worst_diverged_trial_is_the_earliest_divergence() -> None:
    def trial(n: int, precision: str, outcome: str, losses: list, lr: float = 0.1) -> Any:
        params = {"precision": precision, "batch_size": 32, "init_scale": 1024.0}
        attrs = {"outcome": outcome, "losses": losses, "learning_rate": lr}
        return SimpleNamespace(number=n, params=params, user_attrs=attrs)

    trials = [
        trial(0, "fp16", "completed", [2.0, 1.9]),
        trial(1, "fp16", "diverged", [2.0, 3.0, None]),
        trial(2, "bf16", "diverged", [None]),
        trial(3, "fp16", "diverged", [2.0, None], lr=0.2),
        trial(4, "fp16", "diverged", [2.0, None], lr=0.4),
    ]
    worst = worst_diverged_trial(trials)
    assert worst.number == 4
    assert worst_diverged_trial(trials, "bf16").number == 2
    assert worst_diverged_trial(trials[:1]) is None
    cand = trial_candidate(worst, workload("tiny_mlp"))
    assert (cand.precision, cand.batch_size, cand.learning_rate, cand.init_scale) == (
        "fp16",
        32,
        0.4,
        1024.0,
    )


# ---- the command -------------------------------------------------------------------------------


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["diagnose", *args])
    return result.exit_code, result.stdout, result.stderr


def test_cli_names_the_layer_for_a_workload_reference() -> None:
    code, out, _ = cli(
        f"{TESTING}:fp16_overflow", "--precision", "fp16", "--device", "cpu", "--steps", "2"
    )
    assert code == 1, out  # the precision fails here
    assert "amplify" in out and "verdict: fails" in out
    assert "first non-finite value: `amplify` (forward, step 0)" in out


def test_cli_json_is_the_diagnosis() -> None:
    code, out, _ = cli(
        "tiny_mlp", "--precision", "bf16", "--device", "cpu", "--steps", "2", "--json"
    )
    assert code == 0, out
    d = Diagnosis.model_validate(json.loads(out))
    assert d.verdict == "safe" and d.workload == "autotune.workloads:tiny_mlp"


def _study(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = optuna.create_study(study_name="overflow", storage=url, direction="maximize")
    study.set_user_attr("workload", f"{TESTING}:fp16_overflow")
    dist = {
        "precision": optuna.distributions.CategoricalDistribution(["fp32", "fp16"]),
        "batch_size": optuna.distributions.CategoricalDistribution([16, 32, 64]),
        "init_scale": optuna.distributions.CategoricalDistribution([1024.0, 65536.0]),
    }
    for bs, outcome, losses in ((64, "completed", [2.3]), (16, "diverged", [None])):
        params = {"precision": "fp16", "batch_size": bs, "init_scale": 1024.0}
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=dist,
                state=optuna.trial.TrialState.PRUNED,
                user_attrs={"outcome": outcome, "losses": losses, "learning_rate": 0.002},
            )
        )
    return url


def test_cli_on_a_study_diagnoses_its_worst_diverged_fp16_trial(tmp_path: Path) -> None:
    url = _study(tmp_path)
    code, out, err = cli("overflow", "--storage", url, "--device", "cpu", "--steps", "2", "--json")
    assert code == 1, out + err
    d = Diagnosis.model_validate(json.loads(out))
    assert d.workload == f"{TESTING}:fp16_overflow"
    c = d.candidate
    assert (c.precision, c.batch_size, c.learning_rate, c.init_scale) == ("fp16", 16, 0.002, 1024.0)
    assert d.first_nonfinite == "amplify"
    assert "study 'overflow': diagnosing trial 1" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["nosuch.module:fn"], "cannot import module 'nosuch.module'"),
        (["tiny_mpl"], "'tiny_mpl' is neither a workload"),
        (["nostudy", "--storage", "STUDY"], "'nostudy' is neither a workload"),
        (["tiny_mlp", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["tiny_mlp", "--steps", "0"], "--steps must be at least 1, got --steps 0"),
        (["tiny_mlp", "--batch-size", "0"], "batch_size: must be from 1 to 1,048,576"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    url = _study(tmp_path) if "STUDY" in args else f"sqlite:///{tmp_path / 'none.db'}"
    args = [url if a == "STUDY" else a for a in args]
    extra = [] if "--storage" in args else ["--storage", url]
    code, out, err = cli(*args, *extra, "--device", "cpu")
    assert code == 2, out + err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert not (tmp_path / "none.db").exists()  # a typo leaves no empty database behind
