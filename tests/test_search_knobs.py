"""The search over torch.compile, its mode and channels_last, against a runner whose figures are
known in advance: what the search records, prunes, flips and writes into the config."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from autotune.execution.facts import WorkerFacts
from autotune.execution.messages import CompareRequest, DiagnoseRequest, ProbeRequest
from autotune.execution.probe_worker import InProcessRunner
from autotune.measure.knobs import break_even_steps
from autotune.measure.result import PairedResult, ProbeResult
from autotune.report import knob_gains
from autotune.schema.spec import Candidate, ProbeSettings, StudySpec
from autotune.search import run_search

# What the fake machine does: bf16 doubles the speed, compiling adds half after 2 s of
# compiling, channels_last a tenth; its compiler cannot compile the model in nchw.
_COMPILE_SECONDS = 2.0


def _throughput(c: Candidate) -> float:
    tp = 1000.0 * math.sqrt(c.batch_size / 32) * (2.0 if c.precision == "bf16" else 1.0)
    return tp * (1.5 if c.compile else 1.0) * (1.1 if c.channels_last else 1.0)


def _base(request: ProbeRequest, device: str) -> dict:
    """What every result of a fake runner says of the probe it answers."""
    return {
        "candidate": request.candidate,
        "workload": request.workload,
        "device": device,
        "batch_size": request.candidate.batch_size,
        "planned_steps": request.settings.steps,
        "seed": request.settings.seed,
    }


class KnownRunner(InProcessRunner):
    """Answers every probe at once with the figures above; losses follow samples seen, so every
    candidate keeps parity."""

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        candidate, settings = request.candidate, request.settings
        steps = settings.warmup_steps + settings.steps
        base = _base(request, "cpu")
        if candidate.compile and not candidate.channels_last:
            return ProbeResult(
                **base,
                outcome="compile_failed",
                reason="torch.compile (mode=default) failed: BackendCompilerFailed: no nchw",
            )
        tp = _throughput(candidate)
        return ProbeResult(
            **base,
            outcome="completed",
            throughput=tp,
            throughput_low=0.98 * tp,
            throughput_high=1.02 * tp,
            blocks=[(settings.steps // 4, settings.steps // 4 * candidate.batch_size / tp)] * 4,
            timed_steps=settings.steps,
            warmup_steps=settings.warmup_steps,
            losses=[2.0 * math.exp(-(i + 1) * candidate.batch_size / 4000) for i in range(steps)],
            compile_seconds=_COMPILE_SECONDS if candidate.compile else None,
            wall_seconds=0.01 + (_COMPILE_SECONDS if candidate.compile else 0.0),
        )

    def answer_compare(self, request: CompareRequest, timeout: float | None) -> PairedResult:
        c = self.run(request.workload, request.candidate, request.settings)
        r = self.run(request.workload, request.reference, request.settings)
        if not c.ok:
            return PairedResult(candidate=c, reference=r)
        s = c.throughput / r.throughput
        return PairedResult(
            candidate=c,
            reference=r,
            speedup=s,
            speedup_low=0.97 * s,
            speedup_high=1.03 * s,
            pairs=8,
        )

    def answer_diagnose(self, request: DiagnoseRequest, timeout: float) -> dict | None:
        return None

    def facts(self, workload: str) -> WorkerFacts:
        # Looked up once: finding a device's unsupported modes takes seconds on a busy CPU.
        if workload not in _FACTS:
            _FACTS[workload] = super().facts(workload)
        return _FACTS[workload]


_FACTS: dict[str, WorkerFacts] = {}


def _storage(tmp: Path) -> str:
    """SQLite in memory-backed files where the system has them: a trial commits a few dozen
    times, and on a disk each commit waits for it."""
    shm = Path("/dev/shm")
    where = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp
    return f"sqlite:///{where / 'study.db'}"


def _finished(result: Any) -> bool:
    """The trials these tests read: a compile failure, and each knob measured both ways."""
    done = [t for t in result.store.trials() if t.state.is_finished()]
    return any(t.user_attrs.get("outcome") == "compile_failed" for t in done) and {
        g.knob for g in knob_gains(done) if g.without is not None
    } == {"compile", "channels_last"}


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("knobs")
    spec = StudySpec(
        name="knobs",
        workload="autotune.workloads:tiny_convnet",
        device="cpu",
        budget="30s",
        storage=_storage(tmp),
        space={
            "precisions": ["bf16"],
            "batch_sizes": [32, 64],
            "batch_size": {"min": 32, "max": 64},
            "lr_multipliers": [1.0],
            "compile": [False, True],
            "channels_last": [False, True],
        },
        probe={"warmup_steps": 2, "steps": 8, "time_limit": "5s"},
    )
    runner = KnownRunner("cpu")
    for _ in range(3):
        result = run_search(spec, out_dir=tmp / "out", runner=runner)
        if _finished(result):
            break
        # Too busy to get there in one budget: the same command again resumes the study.
    return result


def test_compile_and_channels_last_are_searched_and_recorded(searched: Any) -> None:
    # What ran (a trial queued and never run holds no parameters).
    trials = [t for t in searched.store.trials() if t.state.is_finished() and t.params]
    compiled = [t for t in trials if t.params.get("compile")]
    assert compiled and any(not t.params.get("compile") for t in trials)
    assert {t.params.get("channels_last") for t in trials} == {False, True}
    for t in compiled:
        if not t.params["channels_last"]:
            # A compiler failure is an outcome with its reason: pruned, the sampler learns.
            assert t.state == TrialState.PRUNED
            assert t.user_attrs["outcome"] == "compile_failed"
            assert "BackendCompilerFailed" in t.user_attrs["reason"]
        elif t.user_attrs.get("duplicate_of") is None and t.state == TrialState.COMPLETE:
            # The compile time is on the trial, never in its throughput.
            assert t.user_attrs["compile_seconds"] == _COMPILE_SECONDS
    assert any(t.user_attrs.get("outcome") == "compile_failed" for t in compiled)


def test_the_config_records_the_knobs_and_what_compiling_costs(searched: Any) -> None:
    cfg = searched.config
    assert cfg.evidence.validated
    assert (cfg.precision, cfg.batch_size, cfg.compile, cfg.compile_mode, cfg.channels_last) == (
        "bf16",
        64,
        True,
        "default",
        True,
    )
    ev = cfg.evidence
    assert ev.compile_seconds == _COMPILE_SECONDS
    eager = _throughput(
        Candidate(precision="bf16", batch_size=64, learning_rate=1, channels_last=True)
    )
    assert ev.uncompiled_throughput == pytest.approx(eager)
    # Speedups over the fp32 reference (1,000 samples/s): 1.5x the step rate, paid back after
    # compile time / time saved per step.
    steps = break_even_steps(_COMPILE_SECONDS, 64, 1000.0, eager / 1000.0, 1.5 * eager / 1000.0)
    assert ev.compile_break_even_steps == steps and steps > 0


def test_the_gain_of_each_knob_is_measured_at_the_same_point(searched: Any) -> None:
    gains = {g.knob: g for g in knob_gains(searched.store.trials())}
    assert set(gains) == {"compile", "channels_last"}
    assert gains["compile"].gain == pytest.approx(0.5)
    # The best channels_last trial is compiled; without channels_last it failed to compile.
    cl = gains["channels_last"]
    assert cl.with_trial.params["compile"] and cl.gain is None
    assert cl.without_outcome == "compile_failed"
    # Same mode and batch on both sides of each comparison.
    for g in gains.values():
        on, off = g.with_trial.params, g.without.params  # type: ignore[union-attr]
        assert (on["precision"], on["batch_size"]) == (off["precision"], off["batch_size"])
    assert gains["compile"].compile_seconds == _COMPILE_SECONDS
    assert gains["compile"].break_even_steps is not None


def test_a_spec_without_the_knobs_asks_for_no_knob_parameter(tmp_path: Path) -> None:
    spec = StudySpec(
        name="plain",
        workload="autotune.workloads:tiny_convnet",
        device="cpu",
        budget="30s",
        storage=_storage(tmp_path),
        space={"precisions": ["bf16"], "batch_sizes": [32], "lr_multipliers": [1.0]},
        probe={"warmup_steps": 1, "steps": 4, "time_limit": "5s"},
    )
    result = run_search(spec, out_dir=tmp_path / "out", runner=KnownRunner("cpu"))
    params = {k for t in result.store.trials() for k in t.params}
    assert params == {"precision", "batch_size", "lr_multiplier"}
    assert not result.config.compile and result.config.fp32_modules == []
    # The workload's own memory format, as before the knob existed.
    assert result.config.channels_last is True


class CompilingRunner(InProcessRunner):
    """A GPU whose compiles take ``compile_seconds[mode]``: a probe whose hard limit leaves too
    little for its compile is killed, as the worker kills it (crashed, timed out)."""

    def __init__(self, compile_seconds: dict[str, float]) -> None:
        super().__init__("cuda:0")
        self.compile_seconds = compile_seconds
        self.timeouts: list[float] = []

    def answer_probe(self, request: ProbeRequest, timeout: float | None) -> ProbeResult:
        assert timeout is not None
        self.timeouts.append(timeout)
        base = _base(request, "cuda:0")
        compiling = self.compile_seconds[request.candidate.compile_mode]
        if request.settings.time_limit + compiling > timeout:
            return ProbeResult(**base, outcome="crashed", reason="killed", timed_out=True)
        return ProbeResult(
            **base, outcome="completed", throughput=1000.0, compile_seconds=compiling
        )


def _gpu_context(runner: CompilingRunner, tmp_path: Path) -> Any:
    from autotune.search._budget import Budget
    from autotune.search._context import SearchContext
    from autotune.search._space import Space

    spec = StudySpec(
        name="modes",
        workload="autotune.workloads:tiny_convnet",
        device="cpu",
        budget="2h",
        storage=_storage(tmp_path),
        space={"precisions": ["bf16"], "batch_sizes": [32], "lr_multipliers": [1.0]},
    )
    facts = WorkerFacts.model_construct(workload=spec.workload, device="cuda:0")
    space = Space.of(spec, ["bf16"], rule="linear", base_lr=0.1, base_batch=32)
    return SearchContext(spec=spec, runner=runner, budget=Budget(7200.0), facts=facts, space=space)


def test_a_max_autotune_compile_is_not_killed_for_outlasting_a_default_one(
    tmp_path: Path,
) -> None:
    """After a 20 s default compile, a 5-minute max-autotune compile still finishes, and its
    time does not stretch the limit a default compile gets."""
    runner = CompilingRunner({"default": 20.0, "max-autotune": 300.0})
    ctx = _gpu_context(runner, tmp_path)
    settings = ProbeSettings(time_limit=30.0)

    def probe(mode: str) -> ProbeResult:
        c = Candidate(
            precision="bf16", batch_size=32, learning_rate=0.1, compile=True, compile_mode=mode
        )
        return ctx.run_probe(c, settings)

    assert probe("default").outcome == "completed"
    assert probe("default").outcome == "completed"
    after_default = runner.timeouts[-1]
    first = probe("max-autotune")
    assert first.outcome == "completed", first.reason
    assert probe("max-autotune").outcome == "completed"
    # A default compile is still limited by what default compiles took: a hang shows early.
    assert probe("default").outcome == "completed"
    assert runner.timeouts[-1] == after_default < settings.time_limit + 300.0
