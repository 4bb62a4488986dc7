"""The model knobs applied to a model, through :func:`apply_knobs`: fp32 islands, channels_last,
torch.compile (what each does: :mod:`autotune.measure.knobs`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autotune.errors import SpecError
from autotune.schema.spec import Candidate

__all__ = ["apply_knobs", "compiled_graphs", "keep_in_fp32", "mark_batch_dynamic"]


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_fp32(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_fp32(v) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def keep_in_fp32(
    model: nn.Module, names: Iterable[str], *, device_type: str | None = None
) -> Iterator[nn.Module]:
    """Run the named submodules in fp32 inside an autocast region, for the block.

    Each named module's forward runs with autocast disabled and its floating inputs cast to
    fp32, so its output is fp32; the ops after it are autocast again. Restored on exit.

    Args:
        model: the model; ``names`` are as in ``model.named_modules()`` (``""`` is the model).
        names: the modules to keep in fp32, e.g. ``fp32_modules(diagnosis)``.
        device_type: the autocast device type; the model's parameters' device type by default.

    Returns:
        A context manager yielding the model.

    Raises:
        SpecError: a name that is not a module of the model, listing some that are.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> with keep_in_fp32(model, ["1"]), torch.autocast("cpu", torch.bfloat16):
        ...     model[0](torch.ones(1, 4)).dtype, model(torch.ones(1, 4)).dtype
        (torch.bfloat16, torch.float32)
    """
    modules = dict(model.named_modules())
    names = list(dict.fromkeys(names))
    for name in names:
        if name not in modules:
            known = ", ".join(repr(n) for n in list(modules)[1:9])
            raise SpecError(
                f"module {name!r} is not in the model; use names from model.named_modules(), "
                f"e.g. {known}"
            )
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
    # (module, its own instance-level forward if it had one): what to put back.
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in names:
            module = modules[name]
            patched.append((module, vars(module).get("forward")))
            module.forward = _fp32_forward(module.forward, device_type)
        yield model
    finally:
        for module, own in reversed(patched):
            if own is not None:
                module.forward = own
            else:
                del module.forward


def _fp32_forward(inner: Any, device_type: str) -> Any:
    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return inner(*_to_fp32(args), **_to_fp32(kwargs))

    return forward


def apply_knobs(
    model: nn.Module,
    candidate: Candidate,
    device: torch.device,
    stack: contextlib.ExitStack,
    *,
    channels_last: bool,
    fresh_compile: bool = False,
) -> nn.Module:
    """Move a model to the device and turn the candidate's knobs on it, in this order: fp32
    islands, channels_last, torch.compile (so the compiled graph holds the other two).

    Args:
        model: the model.
        candidate: its ``fp32_modules``, ``compile`` and ``compile_mode``.
        device: where the model goes.
        stack: what undoes the islands when it closes (the compiled model stays compiled).
        channels_last: the memory format, resolved by the caller (a candidate's None means the
            workload's preference, which only the caller knows).
        fresh_compile: drop torch's in-process compile caches first, so this compilation costs
            what it costs a fresh training process (the on-disk cache still serves it).

    Returns:
        The same model, moved and prepared.

    Raises:
        SpecError: an fp32 module name that is not in the model.

    Example:
        >>> cand = Candidate(precision="bf16", batch_size=8, learning_rate=0.1,
        ...                  fp32_modules=["1"])
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> with contextlib.ExitStack() as stack, torch.autocast("cpu", torch.bfloat16):
        ...     m = apply_knobs(model, cand, torch.device("cpu"), stack, channels_last=False)
        ...     m(torch.ones(1, 4)).dtype
        torch.float32
    """
    model = model.to(device)
    if candidate.fp32_modules:
        stack.enter_context(keep_in_fp32(model, candidate.fp32_modules, device_type=device.type))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if candidate.compile:
        if fresh_compile:
            torch._dynamo.reset()
        # The bound forward, not model.compile(): on torch 2.11 model.compile() of a torch.nn
        # builtin (nn.Sequential) captures nothing and runs eager. This captures on every
        # supported torch, and the module keeps its type and its state_dict keys.
        model.forward = _backward_outside_autocast(
            torch.compile(model.forward, mode=candidate.compile_mode)
        )
    return model


def _backward_outside_autocast(compiled: Any) -> Any:
    """Trace a compiled forward with its backward outside autocast, as eager runs it.

    torch's default for compiled regions (``backward_pass_autocast="same_as_forward"``) traces
    the backward under the forward's autocast: an fp32 island's backward then ran in fp16, and
    ResNet-scale weights (1e5) overflowed to inf in every compiled step of a run that trains
    eagerly. The setting is read when a graph is traced (a new batch size traces again), so
    every call carries it: set and put back by hand, 3 us a step where the config's own patch
    context took 13 us inside the timed window.
    """
    import torch._functorch.config as functorch_config

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        saved = functorch_config.backward_pass_autocast
        functorch_config.backward_pass_autocast = "off"
        try:
            return compiled(*args, **kwargs)
        finally:
            functorch_config.backward_pass_autocast = saved

    return forward


def compiled_graphs() -> int:
    """Graphs torch's compiler has captured in this process so far (it never counts down: a
    compiled run's first step that adds none compiled nothing).

    Example:
        >>> compiled_graphs() >= 0
        True
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_batch_dynamic(batch: Any) -> Any:
    """Mark dimension 0 of every tensor in a batch (a tensor, or a tuple/list/dict of them) as
    dynamic for torch.compile, so the next batch size reuses the compiled graph. A graph whose
    code needs the size fixed still specializes it: this only allows, it never forces.

    Example:
        >>> x = mark_batch_dynamic(torch.ones(4, 3))
        >>> x.shape
        torch.Size([4, 3])
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(batch, 0)
        return batch
    if isinstance(batch, dict):
        for value in batch.values():
            mark_batch_dynamic(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            mark_batch_dynamic(value)
    return batch
