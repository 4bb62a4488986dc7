"""The knobs beside the precision — fp32 islands, channels_last, torch.compile — as a probe
measures them and a training loop's session applies them. Compiling is slow on a CPU: the
tests that compile use the smallest models and the fewest steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from autotune.amp_session import AmpSession
from autotune.errors import SpecError
from autotune.execution.runner import InProcessRunner, poisons_context
from autotune.measure.knobs import compile_failure
from autotune.measure.paired import run_paired
from autotune.measure.probe import global_state, run_probe
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.workloads import load_workload, tiny_convnet, tiny_mlp

SHORT = ProbeSettings(warmup_steps=0, steps=4, check_every=2, min_time=0)


def cand(precision: str = "fp32", batch_size: int = 16, lr: float = 0.05, **kw: Any) -> Candidate:
    return Candidate(precision=precision, batch_size=batch_size, learning_rate=lr, **kw)


def overflow() -> Any:
    return load_workload("autotune.testing.workloads:fp16_overflow")


def test_fp32_islands_make_an_overflowing_fp16_run_train() -> None:
    """fp16 overflows in the module `amplify`; kept in fp32, the same candidate trains."""
    plain = run_probe(overflow(), cand("fp16", 32, 0.001), "cpu", SHORT)
    assert plain.outcome == "diverged"
    islands = run_probe(overflow(), cand("fp16", 32, 0.001, fp32_modules=["amplify"]), "cpu", SHORT)
    assert islands.outcome == "completed", islands.reason
    assert all(torch.isfinite(torch.tensor(islands.losses)))
    assert "fp32[amplify]" in islands.summary()


def test_a_compiled_probe_compiles_outside_its_timed_blocks() -> None:
    """Even with no warm-up steps asked for, the compiling step is untimed, and its time is
    recorded apart; the run leaves the global state as it found it."""
    before = global_state()
    r = run_probe(tiny_mlp(), cand(batch_size=32, compile=True), "cpu", SHORT)
    assert r.outcome == "completed", r.reason
    assert r.compile_seconds is not None and r.compile_seconds > 0
    assert r.warmup_steps >= 1 and r.timed_steps >= SHORT.steps
    # The timed blocks are the whole timed phase; compiling is in the wall time only.
    assert r.timed_seconds == pytest.approx(sum(s for _, s in r.blocks))
    assert r.wall_seconds >= r.timed_seconds + r.compile_seconds
    assert "compiled in" in r.summary()
    after = global_state()
    assert before["flags"] == after["flags"] and before["grad_enabled"] == after["grad_enabled"]


def test_a_compiled_sequential_model_captures_a_graph_and_its_losses_are_copies() -> None:
    """tiny_mlp is an nn.Sequential, of which model.compile() captured nothing on torch 2.11:
    the engine's compiled step must add a graph to Dynamo's counters, on every torch. And the
    losses it keeps in a CUDA-graph mode are copies: the graph's outputs live in memory the
    next replay overwrites, so what is read back must not point into it (on a CPU the mode
    compiles without graphs; what the engine keeps is the same)."""
    from torch._dynamo.utils import counters

    from autotune.measure.step import StepEngine
    from autotune.workloads import cross_entropy_loss

    returned: list[torch.Tensor] = []

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        returned.append(cross_entropy_loss(model, batch))
        return returned[-1]

    workload = dataclasses.replace(tiny_mlp(), loss=loss)
    graphs = cand(batch_size=8, compile=True, compile_mode="reduce-overhead")
    with StepEngine(workload, graphs, torch.device("cpu")) as engine:
        before = counters["stats"]["unique_graphs"]
        assert engine.run(lambda e: (e.build(), e.run_steps(2))) is None
        assert counters["stats"]["unique_graphs"] > before
        assert isinstance(engine.model, nn.Sequential)  # the module keeps its type and keys
        assert next(iter(engine.model.state_dict())) == "0.weight"
        kept = engine.pending[-1]
        assert kept.untyped_storage().data_ptr() != returned[-1].untyped_storage().data_ptr()
        assert engine.read_losses() == pytest.approx([x.item() for x in returned])


def test_a_compile_that_captures_nothing_is_refused_not_measured_as_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile that falls back to eager (what model.compile() did to an nn.Sequential on
    torch 2.11) would measure eager speed as compiled: the candidate fails to compile."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    r = run_probe(tiny_mlp(), cand(batch_size=32, compile=True), "cpu", SHORT)
    assert r.outcome == "compile_failed"
    assert r.reason.startswith("torch.compile (mode=default) compiled nothing")
    assert r.throughput == 0.0 and r.compile_seconds is None


def test_an_eager_probe_records_no_compile_time() -> None:
    r = run_probe(tiny_mlp(), cand(batch_size=32), "cpu", SHORT)
    assert r.outcome == "completed" and r.compile_seconds is None


def test_a_compiler_failure_is_an_outcome_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler on this machine")

    monkeypatch.setattr(compile_fx, "compile_fx", refuse)
    r = run_probe(tiny_mlp(), cand(batch_size=32, compile=True), "cpu", SHORT)
    assert r.outcome == "compile_failed"
    assert r.reason.startswith("torch.compile (mode=default) failed")
    assert "no C++ compiler on this machine" in r.reason
    assert r.throughput == 0.0
    # In a paired run, the candidate arm fails the same way; the reference arm is not blamed.
    settings = SHORT.model_copy(update={"min_time": 0.0, "time_limit": 20.0})
    paired = run_paired(
        tiny_mlp(), cand(batch_size=32, compile=True), cand(batch_size=32), "cpu", settings
    )
    assert paired.candidate.outcome == "compile_failed" and not paired.ok
    assert "no C++ compiler" in paired.candidate.reason


ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_a_poisoned_context_while_compiling_is_no_compile_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA error that poisons the context, raised while inductor compiles (it runs kernels
    to pick the fastest), is a crash that needs a fresh process, not a compile failure."""
    import torch._inductor.compile_fx as compile_fx

    def illegal_access(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(ILLEGAL_ACCESS)

    monkeypatch.setattr(compile_fx, "compile_fx", illegal_access)
    r = InProcessRunner("cpu").run("tiny_mlp", cand(batch_size=32, compile=True), SHORT)
    assert r.outcome == "crashed"
    assert ILLEGAL_ACCESS in r.reason
    assert "cannot be used after this error" in r.reason


def _compiler_error_from(inner: Exception, message: str = "compiling the graph failed") -> Any:
    """A compiler error raised while handling ``inner``, as torch raises them (``from None``:
    the inner error is only the suppressed context)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        try:
            raise inner
        except Exception:
            raise TorchDynamoException(message) from None
    except TorchDynamoException as exc:
        return exc


@pytest.mark.parametrize("how", ["context", "cause", "inductor"])
def test_a_compiler_error_hiding_a_poisoning_cuda_error_is_poisoning(how: str) -> None:
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    inner = RuntimeError(ILLEGAL_ACCESS)
    if how == "context":
        exc = _compiler_error_from(inner)
    elif how == "cause":
        exc = TorchDynamoException("compiling the graph failed")
        exc.__cause__ = inner
    else:
        exc = InductorError(inner, None)
    compiled = cand(batch_size=32, compile=True)
    assert compile_failure(compiled, exc) is None
    assert poisons_context(exc)
    # A compiler error with an ordinary error inside stays a compile failure.
    plain = _compiler_error_from(RuntimeError("no C++ compiler on this machine"))
    assert compile_failure(compiled, plain) is not None
    assert not poisons_context(plain)


def test_channels_last_is_the_candidates_when_it_says_so() -> None:
    from autotune.measure.step import StepEngine

    for wanted in (False, True):
        # A large batch: the data pool is made of fewer, larger batches, sooner.
        with StepEngine(
            tiny_convnet(), cand(batch_size=512, channels_last=wanted), torch.device("cpu")
        ) as e:
            e.build()
            x, _ = e.next_batch()
            conv = e.model.features[0].weight  # type: ignore[union-attr]
            assert x.is_contiguous(memory_format=torch.channels_last) is wanted
            assert conv.is_contiguous(memory_format=torch.channels_last) is wanted


class _Traced(nn.Module):
    """Remembers, call by call, whether its forward ran under torch.compile."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.compiled: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.compiled.append(torch.compiler.is_compiling())
        return self.inner(x)


def test_the_session_prepares_the_model_as_tuned_and_undoes_the_islands_at_close() -> None:
    model = _Traced()
    tuned = cand("bf16", 8, fp32_modules=["inner"], compile=True)
    with AmpSession(tuned, "cpu") as amp:
        prepared = amp.prepare(model)
        assert prepared is model and amp.prepare(model) is model  # prepared once
        x = amp.prepare_batch(torch.ones(3, 4))
        with torch.no_grad(), amp.autocast():
            out = model(x)
        # The island: fp32 inside the bf16 autocast region; the forward ran compiled.
        assert out.dtype == torch.float32
        assert model.compiled == [True]
        assert "compile=default" in repr(amp) and "inner" in repr(amp)
    # Closed: the module's own forward is back.
    assert "forward" not in vars(model.inner)


def test_an_fp32_module_the_model_lacks_is_named() -> None:
    with (
        AmpSession(cand("bf16", 8, fp32_modules=["amplfy"]), "cpu") as amp,
        pytest.raises(SpecError, match="module 'amplfy' is not in the model"),
    ):
        amp.prepare(nn.Sequential(nn.Linear(4, 4)))


def test_an_assert_in_compiled_code_is_a_failed_compile_not_a_crash(tmp_path: Any) -> None:
    """A compiled graph's own assert (on an H200, inductor's stride check in a channels_last
    ResNet-18's compiled backward) fails the compile: the candidate is not retried as a crash.
    The same error raised by the model's code is the model's."""
    generated = tmp_path / "torchinductor_root" / "c4" / "c4dxxdj47ix.py"
    generated.parent.mkdir(parents=True)
    source = "def call(args):\n    assert False, 'expected size 512==512, stride 9==1 at dim=1'\n"
    generated.write_text(source)
    namespace: dict[str, Any] = {}
    exec(compile(source, str(generated), "exec"), namespace)
    compiled = cand(compile=True)
    try:
        namespace["call"]([])
    except AssertionError as exc:
        reason = compile_failure(compiled, exc)
        assert reason is not None and "AssertionError: expected size 512==512" in reason
        assert compile_failure(cand(), exc) is None  # an eager candidate compiled nothing
    try:
        raise AssertionError("the model's own check")
    except AssertionError as exc:
        assert compile_failure(compiled, exc) is None


def test_a_compiled_fp16_run_keeps_its_islands_backward_in_fp32() -> None:
    """The island's backward runs in fp32 compiled as it does eagerly: torch traces a compiled
    backward under the forward's autocast by default, so `amplify`'s 1e5-scale weights went to
    fp16 there, every step overflowed and the run diverged (first seen on an H200; the same
    on a CPU)."""
    settings = ProbeSettings(warmup_steps=1, steps=12, check_every=12, min_time=0)
    r = run_probe(
        overflow(), cand("fp16", 64, 0.001, fp32_modules=["amplify"], compile=True), "cpu", settings
    )
    assert r.outcome == "completed", r.reason
    assert r.skipped_steps == 0 and r.compile_seconds is not None


@pytest.mark.gpu
def test_compile_and_islands_on_the_gpu() -> None:
    """On CUDA: a compiled fp16 probe with the overflowing module in fp32 completes, compiles
    outside its timed blocks, and is faster per step than its first (compiling) step."""
    dev = torch.device("cuda", torch.cuda.current_device())
    settings = ProbeSettings(warmup_steps=1, steps=20, check_every=10, min_time=0.2)
    r = run_probe(
        overflow(), cand("fp16", 64, 0.001, fp32_modules=["amplify"], compile=True), dev, settings
    )
    assert r.outcome == "completed", r.reason
    assert r.compile_seconds is not None and r.compile_seconds > 0
    assert r.timed_seconds == pytest.approx(sum(s for _, s in r.blocks))
    paired = run_paired(
        tiny_convnet(), cand("bf16", 64, compile=True, channels_last=True), cand(), dev, settings
    )
    assert paired.ok, paired.summary()
    assert paired.candidate.compile_seconds is not None


class _FunctionalOverflow(nn.Module):
    """fp16 overflows in an op between two modules, not inside either."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * 1e6  # past 65,504 in fp16: no module to keep in fp32
        return self.head(h / 1e6)


def test_an_overflow_between_modules_gets_no_fp32_islands_and_says_why() -> None:
    import json

    from autotune.diagnose import diagnose
    from autotune.search._knob_trials import islands_plan
    from autotune.workloads import Workload, synthetic_batches

    def make(bs: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(bs, 64, generator=g), torch.randint(0, 10, (bs,), generator=g)

    wl = Workload(
        name="functional_overflow",
        build_model=_FunctionalOverflow,
        make_batches=lambda bs, dev, g: synthetic_batches(make, bs, dev, g, samples=256),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        base_lr=0.001,
        base_batch_size=32,
    )
    found = json.loads(diagnose(wl, cand("fp16", 32, 0.001), "cpu", steps=1).model_dump_json())
    modules, said = islands_plan(found)
    assert modules == []
    assert said.startswith("not tried: the overflow is in functional code between modules")
