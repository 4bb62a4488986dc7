"""The model knobs beside the precision (fp32 islands, channels_last, torch.compile): what they
mean without a model, their failures and pay-off. No torch here; applying them to a model is
:mod:`autotune.measure.model_knobs`, whose names load from here on first use."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from autotune.infra.lazy import lazy
from autotune.schema.spec import Candidate

if TYPE_CHECKING:
    from autotune.measure.model_knobs import (
        apply_knobs,
        compiled_graphs,
        keep_in_fp32,
        mark_batch_dynamic,
    )

__all__ = [
    "NothingCompiled",
    "apply_knobs",
    "break_even_steps",
    "compiled_graphs",
    "compile_failure",
    "is_compile_error",
    "keep_in_fp32",
    "knob_notes",
    "mark_batch_dynamic",
    "poisons_context",
]

# Where torch's compiler stack raises from: dynamo, AOT autograd, inductor and FX.
_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx")
# Applied to a model, with torch: loaded on first use (autotune.measure.model_knobs).
_ON_A_MODEL = frozenset({"apply_knobs", "compiled_graphs", "keep_in_fp32", "mark_batch_dynamic"})


class NothingCompiled(RuntimeError):
    """A compiled model's first step captured no graph: torch.compile fell back to eager (a
    module it skips, a recompile limit reached), so its speed would be eager speed."""


__getattr__ = lazy(__name__, dict.fromkeys(_ON_A_MODEL, "autotune.measure.model_knobs"))


def is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from torch's compiler stack (tracing, lowering, code generation),
    not from running the model: a compiled candidate that raises it failed to compile.

    Example:
        >>> from torch._dynamo.exc import Unsupported
        >>> is_compile_error(Unsupported("generic_jump"))
        True
        >>> is_compile_error(ValueError("label 11 is out of range"))
        False
    """
    # Without looking at torch._dynamo itself: importing it costs a second and a half.
    if isinstance(exc, NothingCompiled):
        return True
    dynamo = sys.modules.get("torch._dynamo.exc")
    if dynamo is not None and isinstance(exc, dynamo.TorchDynamoException):
        return True
    return type(exc).__module__.startswith(_COMPILER_MODULES) or _raised_in_compiled_code(exc)


def _raised_in_compiled_code(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the code torch's compiler generated (its asserts on the
    strides it compiled for: a channels_last ResNet-18's compiled backward failed so on an
    H200), not by the model's own code, which the compiled code calls back into."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    # Inductor writes each compiled graph to a module of its cache, named by its hash, and
    # runs its ``call`` from there.
    return "inductor" in code.co_filename and code.co_name == "call"


# What leaves a CUDA context unusable ("sticky" errors): after one, every later CUDA call in the
# process fails too, so the worker must be replaced. torch raises AcceleratorError for any
# CUDA runtime error; older builds raise a RuntimeError carrying one of these messages.
_STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc error",
    "cuda context is corrupted",
)


def poisons_context(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling (torch's compiler
    wraps the errors it meets), leaves the process's CUDA context unusable (restart it).

    Example:
        >>> poisons_context(RuntimeError("CUDA error: device-side assert triggered"))
        True
        >>> poisons_context(ValueError("label 11 is out of range"))
        False
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        link = todo.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if _sticky(link):
            return True
        # The compiler's wrappers keep the error they wrap as inner_exception, raised "from None".
        inner = getattr(link, "inner_exception", None)
        todo += [link.__cause__, link.__context__]
        if isinstance(inner, BaseException):
            todo.append(inner)
    return False


def _sticky(exc: BaseException) -> bool:
    # Without importing torch: an error torch raised means torch is loaded (and a process
    # without it, the search's parent, has no CUDA context to lose).
    torch = sys.modules.get("torch")
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    out_of_memory = getattr(torch, "OutOfMemoryError", ())
    if not isinstance(exc, RuntimeError) or isinstance(exc, out_of_memory):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _STICKY_CUDA_ERRORS)


def compile_failure(candidate: Candidate, exc: BaseException) -> str | None:
    """The reason a compiled candidate failed to compile, or None when ``exc`` is not a
    compiler error, poisons the CUDA context (:func:`poisons_context`), or the
    candidate does not compile: an outcome, not a crash.

    Example:
        >>> from torch._dynamo.exc import Unsupported
        >>> cand = Candidate(precision="fp32", batch_size=8, learning_rate=0.1, compile=True)
        >>> compile_failure(cand, Unsupported("generic_jump"))
        'torch.compile (mode=default) failed: Unsupported: generic_jump'
    """
    if not candidate.compile or not is_compile_error(exc):
        return None
    if poisons_context(exc):
        # A CUDA error met while compiling (inductor runs kernels to pick the fastest): the
        # process's context is lost, which the caller handles; the candidate may well compile.
        return None
    if isinstance(exc, NothingCompiled):
        return f"torch.compile (mode={candidate.compile_mode}) compiled nothing: {exc}"
    # The compiler's own error is often on the line after its wrapper's ("backend raised:").
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2])[:300]
    return f"torch.compile (mode={candidate.compile_mode}) failed: {type(exc).__name__}: {text}"


def break_even_steps(
    compile_seconds: float,
    batch_size: int,
    reference_throughput: float,
    speedup_eager: float,
    speedup_compiled: float,
) -> int | None:
    """Training steps after which compiling has paid for itself: the compile time over the
    time each step saves (step times from speedups over one reference throughput). None when
    the compiled run is not faster: it never pays off.

    Example:
        >>> break_even_steps(30.0, 128, 1000.0, 1.2, 1.5)  # 0.107 s vs 0.085 s a step
        1407
    """
    if speedup_compiled <= speedup_eager or reference_throughput <= 0:
        return None
    step = batch_size / reference_throughput
    saved = step / speedup_eager - step / speedup_compiled
    return math.ceil(compile_seconds / saved)


def knob_notes(fp32_modules: Iterable[str], compile_mode: str | None, library: str) -> list[str]:
    """What a person must do by hand for the knobs a library cannot express: the fp32 modules
    (no trainer has a per-module precision setting), and torch.compile (``compile_mode`` None:
    the library compiles by itself, or nothing is compiled).

    Example:
        >>> knob_notes(["amplify"], None, "Lightning")[0][:60]
        'tuned with amplify kept in fp32 inside the autocast region ('
    """
    notes = []
    modules = list(fp32_modules)
    if modules:
        notes.append(
            f"tuned with {', '.join(modules)} kept in fp32 inside the autocast region "
            f"(fp32_modules): {library} has no per-module precision setting; wrap the model "
            f"with autotune.diagnose.keep_in_fp32(model, {modules!r}) for training, or prepare "
            "it with autotune.session(cfg).prepare(model)"
        )
    if compile_mode is not None:
        notes.append(
            f"tuned with torch.compile (mode={compile_mode!r}): {library} takes no compile "
            f"setting; compile the model's forward before training, "
            f"model.forward = torch.compile(model.forward, mode={compile_mode!r}) (the search "
            "marked the batch dimension dynamic; autotune.session(cfg).prepare_batch does too), "
            "with torch._functorch.config.backward_pass_autocast = 'off' so the compiled "
            "backward runs outside autocast as it was measured (torch's default traces it "
            "under the forward's autocast)"
        )
    return notes
