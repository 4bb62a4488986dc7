"""Load a workload from a reference: a built-in name or ``package.module:function``."""

from __future__ import annotations

import inspect
import re
from typing import Any

from autotune.errors import WorkloadError
from autotune.workloads._adapters import adapter_workload, check_adapter, is_adapter_reference
from autotune.workloads._base import Workload
from autotune.workloads._factory import (
    BUILTIN_MODULES,
    BUILTIN_NAMES,
    builtin_factories,
    factory_problem,
    is_stdlib,
    library_of,
)
from autotune.workloads._objects import import_user_module, resolve

__all__ = ["check_factory", "is_reference", "load_workload", "normalize_reference"]

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
    if reference in BUILTIN_NAMES:
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


def _shape(reference: str) -> tuple[str, str, str]:
    """``(normalized reference, module, attribute)``; WorkloadError for a malformed one."""
    ref = normalize_reference(reference)
    if not _REF.match(ref):
        raise WorkloadError(
            f"workload reference {reference!r} must look like package.module:function "
            f"or be a built-in ({', '.join(BUILTIN_NAMES)})"
        )
    module_name, attr = ref.split(":")
    return ref, module_name, attr


def _import(reference: str, module_name: str) -> Any:
    return import_user_module(f"workload {reference!r}", module_name)


def _no_attribute(reference: str, module: Any, attr: str) -> WorkloadError:
    public = _candidates(module)
    hint = f"; it has {', '.join(public)}" if public else ""
    return WorkloadError(
        f"workload {reference!r}: module {module.__name__!r} has no attribute {attr!r}{hint}"
    )


def check_factory(reference: str) -> str:
    """Check that a reference names a workload factory, calling nothing (see
    :mod:`autotune.workloads._factory` for the rules). Its module is imported: a user's
    package can only be checked that way; a standard-library one is refused before that.

    An adapter reference (``{"lightning": {...}}``) passes when each object it names imports.

    Args:
        reference: a built-in name or ``package.module:function``, e.g. from a config file.

    Returns:
        The normalized reference.

    Raises:
        WorkloadError: naming the reference and why it is not a workload factory.

    Example:
        >>> check_factory("tiny_mlp")
        'autotune.workloads:tiny_mlp'
        >>> check_factory("os:abort")
        Traceback (most recent call last):
        ...
        autotune.errors.WorkloadError: workload 'os:abort': module 'os' is part of Python itself, not a workload; name a function of your own package (e.g. mypkg.train:workload) or a built-in (resnet18, tiny_gpt, tiny_convnet, tiny_mlp)
    """
    if is_adapter_reference(reference):
        return check_adapter(reference)
    if reference.startswith("pickle:"):
        return reference  # written by autotune.tune(); loading it runs what it holds
    ref, module_name, attr = _shape(reference)
    builtins = f"a built-in ({', '.join(BUILTIN_NAMES)})"
    if is_stdlib(module_name):
        raise WorkloadError(
            f"workload {reference!r}: module {module_name!r} is part of Python itself, not a "
            f"workload; name a function of your own package (e.g. mypkg.train:workload) or "
            f"{builtins}"
        )
    if (library := library_of(module_name)) is not None:
        raise WorkloadError(
            f"workload {reference!r}: module {module_name!r} belongs to {library}, a library "
            f"autotune runs on, not a workload; name a function of your own package (e.g. "
            f"mypkg.train:workload) or {builtins}"
        )
    if module_name.split(".")[0] == "autotune" and module_name not in BUILTIN_MODULES:
        raise WorkloadError(
            f"workload {reference!r}: autotune's workloads live in "
            f"{' and '.join(BUILTIN_MODULES)}; name {builtins} or a function of your own package"
        )
    module = _import(reference, module_name)
    if module_name in BUILTIN_MODULES:
        names = builtin_factories(module_name)
        if attr not in names:
            raise WorkloadError(
                f"workload {reference!r}: {module_name} has no workload {attr!r}; it has "
                f"{', '.join(names)}"
            )
        return ref
    if not hasattr(module, attr):
        raise _no_attribute(reference, module, attr)
    problem = factory_problem(getattr(module, attr), module_name)
    if problem is not None:
        raise WorkloadError(
            f"workload {reference!r}: {attr!r} {problem}; a workload factory is a function of "
            "your package that takes no argument and returns autotune.Workload"
        )
    return ref


def load_workload(reference: str) -> Workload:
    """Import and build the workload a reference names.

    Args:
        reference: a built-in name (``resnet18``, ``tiny_gpt``, ``tiny_convnet``, ``tiny_mlp``),
            ``package.module:function`` where ``function()`` returns a :class:`Workload`
            (the attribute may also be a Workload itself), or an adapter reference naming the
            user's own classes (a spec's ``workload: {lightning: ...}``, as its JSON text).

    Returns:
        The workload, with ``reference`` set to the normalized reference.

    Raises:
        WorkloadError: naming the reference and what is wrong: its shape, a module that does
            not import, a missing attribute, or a wrong return type.

    Example:
        >>> load_workload("tiny_mlp").name
        'tiny_mlp'
    """
    if is_adapter_reference(reference):
        return adapter_workload(reference)
    if reference.startswith("pickle:"):
        # A workload function autotune.tune() sent by value from a notebook.
        ref, target, attr = reference, resolve("workload", reference), "workload"
    else:
        ref, module_name, attr = _shape(reference)
        module = _import(reference, module_name)
        if not hasattr(module, attr):
            raise _no_attribute(reference, module, attr)
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
