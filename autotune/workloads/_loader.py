"""Load a workload from a reference: a built-in name or ``package.module:function``."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Any

from autotune.errors import WorkloadError
from autotune.workloads._base import Workload
from autotune.workloads._builtin import BUILTINS

__all__ = ["is_reference", "load_workload", "normalize_reference"]

_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def is_reference(text: str) -> bool:
    """Whether ``text`` has the shape of a workload reference: ``package.module:function``.

    Example:
        >>> is_reference("mypkg.train:workload"), is_reference("mypkg/train.py")
        (True, False)
    """
    return _REF.match(text) is not None


def normalize_reference(reference: str) -> str:
    """``resnet18`` → ``autotune.workloads:resnet18``; full references pass through."""
    reference = reference.strip()
    if reference in BUILTINS:
        return f"autotune.workloads:{reference}"
    return reference


def _candidates(module: Any) -> list[str]:
    """What a reference into ``module`` could name: its public functions and workloads, all of
    them (its ``__all__`` when it has one, else what it defines itself, not what it imports)."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n for n, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__
        ]
    return sorted(
        n
        for n in names
        if not n.startswith("_")
        and (
            isinstance(getattr(module, n, None), Workload)
            or inspect.isfunction(getattr(module, n, None))
        )
    )


def load_workload(reference: str) -> Workload:
    """Import and build the workload a reference names.

    Args:
        reference: a built-in name (``resnet18``, ``tiny_gpt``, ``tiny_convnet``, ``tiny_mlp``)
            or ``package.module:function`` where ``function()`` returns a :class:`Workload`
            (the attribute may also be a Workload itself).

    Returns:
        The workload, with ``reference`` set to the normalized reference.

    Raises:
        WorkloadError: naming the reference and what is wrong: its shape, a module that does
            not import, a missing attribute, or a wrong return type.

    Example:
        >>> load_workload("tiny_mlp").name
        'tiny_mlp'
    """
    ref = normalize_reference(reference)
    if not _REF.match(ref):
        raise WorkloadError(
            f"workload reference {reference!r} must look like package.module:function "
            f"or be a built-in ({', '.join(BUILTINS)})"
        )
    module_name, attr = ref.split(":")
    # A console script's sys.path lacks the working directory; user packages live there.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise WorkloadError(
            f"workload {reference!r}: cannot import module {module_name!r} ({exc}); check the "
            "spelling and that its package is installed or on PYTHONPATH"
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise WorkloadError(
            f"workload {reference!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        public = _candidates(module)
        hint = f"; it has {', '.join(public)}" if public else ""
        raise WorkloadError(
            f"workload {reference!r}: module {module_name!r} has no attribute {attr!r}{hint}"
        )
    target = getattr(module, attr)
    if isinstance(target, Workload):
        workload = target
    elif callable(target):
        try:
            workload = target()
        except Exception as exc:
            raise WorkloadError(
                f"workload {reference!r}: calling {attr}() raised {type(exc).__name__}: {exc}"
            ) from None
    else:
        raise WorkloadError(
            f"workload {reference!r}: {attr!r} is a {type(target).__name__}, expected a function "
            "returning autotune.Workload"
        )
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload {reference!r}: {attr}() returned {type(workload).__name__}, expected "
            "autotune.Workload"
        )
    workload.reference = ref
    return workload
