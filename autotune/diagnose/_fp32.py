"""Using a diagnosis: the modules it says to keep in fp32, and running them so."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autotune.diagnose._models import Diagnosis
from autotune.errors import SpecError

__all__ = ["fp32_modules", "keep_in_fp32"]


def fp32_modules(diagnosis: Diagnosis) -> list[str]:
    """The module names a diagnosis says to run in fp32, in execution order.

    Args:
        diagnosis: a Diagnosis from :func:`diagnose`.

    Returns:
        The layers of its ``keep_fp32`` recommendations (overflowing or near the limit);
        empty when there is nothing to keep in fp32.

    Example:
        >>> from autotune.diagnose import diagnose
        >>> from autotune.spec import Candidate
        >>> from autotune.workloads import load_workload
        >>> d = diagnose(load_workload("autotune.workloads.testing:fp16_overflow"),
        ...              Candidate(precision="fp16", batch_size=64, learning_rate=1e-3), "cpu",
        ...              steps=1)
        >>> fp32_modules(d)
        ['amplify']
    """
    wanted = {n for r in diagnosis.recommendations if r.kind == "keep_fp32" for n in r.layers}
    return [s.name for s in diagnosis.layers if s.name in wanted]


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
            module.forward = _fp32_forward(module.forward, device_type)  # type: ignore[method-assign]
        yield model
    finally:
        for module, own in reversed(patched):
            if own is not None:
                module.forward = own  # type: ignore[method-assign]
            else:
                del module.forward


def _fp32_forward(inner: Any, device_type: str) -> Any:
    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return inner(*_to_fp32(args), **_to_fp32(kwargs))

    return forward
