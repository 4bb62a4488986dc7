"""What counts as a workload factory: the rules a reference passes before anything is called."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune.workloads._base import Workload

__all__ = [
    "BUILTIN_MODULES",
    "BUILTIN_NAMES",
    "TESTING_NAMES",
    "builtin_factories",
    "factory_problem",
    "is_stdlib",
    "library_of",
    "module_factories",
]

BUILTIN_MODULES = ("autotune.workloads", "autotune.testing.workloads")
# The built-in workloads' names (autotune.workloads._builtin's factories, in this order): known
# without importing torch, so the search's parent and the service name and check them without it.
BUILTIN_NAMES = ("resnet18", "tiny_gpt", "tiny_convnet", "tiny_mlp")
# The testing workloads' names (autotune.testing.workloads's factories), known without torch as
# well: the service checks a spec naming one (``sleepy``) without importing torch on a submit,
# which took seconds (over 10 s on a slow CPU beside a busy process) on its first.
TESTING_NAMES = (
    "cuda_context_lost",
    "diverging",
    "drifting",
    "fp16_overflow",
    "hungry",
    "non_scalar_loss",
    "oom_above_64",
    "resnet18_capped",
    "skipping",
    "sleepy",
    "tiny_gradients",
)


def is_stdlib(module: str) -> bool:
    """Whether ``module`` belongs to Python itself: built into the interpreter or stdlib.

    Example:
        >>> is_stdlib("os.path"), is_stdlib("mypkg.train")
        (True, False)
    """
    top = module.split(".")[0]
    return top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ())


def library_of(module: str) -> str | None:
    """The library autotune runs on (a requirement of it, an extra's or a requirement's, e.g.
    ``torch``) that ``module`` belongs to, found without importing it; None for anything else,
    e.g. the user's own package.

    Example:
        >>> library_of("torch.cuda"), library_of("mypkg.train")
        ('torch', None)
    """
    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    origin = (spec.origin or "") if spec is not None else ""
    places = [origin, *(spec.submodule_search_locations or [])] if spec is not None else []
    if not any(
        part in ("site-packages", "dist-packages") for p in places for part in Path(p).parts
    ):
        return None  # not installed: the user's own code (the path their project is on)
    libraries = _libraries()
    if _norm(top) in libraries:  # most are named as their module (torch, numpy, optuna)
        return _norm(top)
    # The rest (yaml is pyyaml's, PIL pillow's): every installed distribution's modules.
    owners = metadata.packages_distributions().get(top, [])
    return next((d for d in owners if _norm(d) in libraries), None)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def _libraries() -> frozenset[str]:
    """autotune's requirements, its extras' and theirs, all the way down (normalized names)."""
    seen: set[str] = set()
    todo = ["autotune"]
    while todo:
        try:
            wanted = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for line in wanted:
            name = _norm(re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0])
            if name and name not in seen:
                seen.add(name)
                todo.append(name)
    return frozenset(seen)


def _required(fn: Any) -> list[str]:
    """The parameters ``fn`` cannot be called without."""
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _declared_return(fn: Any) -> Any:
    """``fn``'s declared return type; ``inspect.Parameter.empty`` when undeclared or when the
    annotation cannot be resolved (then the call's result is checked instead)."""
    try:
        return typing.get_type_hints(fn).get("return", inspect.Parameter.empty)
    except Exception:  # an annotation naming what the module never imports, or worse
        return inspect.Parameter.empty


def builtin_factories(module: str) -> list[str]:
    """The workload factories a built-in module offers: its public functions that take no
    argument and are declared to return a :class:`~autotune.workloads.Workload`.

    Anything else there (``load_workload``, the ``Workload`` class, ``make_oom_workload(limit)``)
    is callable, but not a workload: it is refused before anything runs.

    Example:
        >>> builtin_factories("autotune.workloads")
        ['resnet18', 'tiny_convnet', 'tiny_gpt', 'tiny_mlp']
    """
    # By name: the service checks a reference to one without loading torch.
    known = {BUILTIN_MODULES[0]: BUILTIN_NAMES, BUILTIN_MODULES[1]: TESTING_NAMES}
    if module in known:
        return sorted(known[module])
    return module_factories(module)


def module_factories(module: str) -> list[str]:
    """:func:`builtin_factories` found by importing ``module`` and reading its functions (the
    names kept without torch are checked against it)."""
    mod = importlib.import_module(module)
    out = []
    for name in getattr(mod, "__all__", ()):
        fn = getattr(mod, name, None)
        if not inspect.isfunction(fn):
            continue
        try:
            required = _required(fn)
        except (TypeError, ValueError):
            continue
        if _declared_return(fn) is Workload and not required:
            out.append(name)
    return sorted(out)


def factory_problem(target: Any, module: str) -> str | None:
    """Why ``target`` (an attribute of ``module``, a user's module) is not a workload factory,
    as the end of a sentence; None when it is one.

    Example:
        >>> import os
        >>> factory_problem(os.abort, "mypkg")
        'is a builtin_function_or_method, not a function'
        >>> import json
        >>> factory_problem(json.dumps, "mypkg")
        "is json.dumps, defined outside package 'mypkg'"
    """
    if isinstance(target, Workload):
        return None
    if not inspect.isfunction(target):
        what = "class" if inspect.isclass(target) else type(target).__name__
        return f"is a {what}, not a function"
    top = module.split(".")[0]
    home = getattr(target, "__module__", None) or "?"
    if home.split(".")[0] != top:
        return f"is {home}.{target.__qualname__}, defined outside package {top!r}"
    try:
        required = _required(target)
    except (TypeError, ValueError):
        required = []
    if required:
        return f"needs arguments ({', '.join(required)})"
    declared = _declared_return(target)
    if declared is not inspect.Parameter.empty and not (
        inspect.isclass(declared) and issubclass(declared, Workload)
    ):
        return f"is declared to return {getattr(declared, '__name__', declared)}, not a Workload"
    return None
