"""The user's objects a reference names, found in the worker: imported or unpickled."""

from __future__ import annotations

import importlib
import os
import pickle
import pickletools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import WorkloadError
from autotune.infra.files import file_mode, make_dirs
from autotune.workloads._factory import is_stdlib

__all__ = ["build", "call", "import_user_module", "reference_for", "resolve"]

# The libraries of autotune's integrations extra, by the module they import as.
_INTEGRATIONS = {
    "lightning": "Lightning",
    "pytorch_lightning": "Lightning",
    "lightning_fabric": "Lightning",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "jsonargparse": "jsonargparse",
    "optuna_dashboard": "optuna-dashboard",
}

# Modules whose objects no other process can import by name.
_UNREACHABLE = ("__main__", "__mp_main__", "builtins")


def import_user_module(what: str, module_name: str) -> Any:
    """Import ``module_name`` for ``what`` (how an error names the reference).

    Raises:
        WorkloadError: the module does not import, or raised while importing.
    """
    # A console script's sys.path lacks the working directory; user packages live there.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in _INTEGRATIONS and not module_name.startswith(missing):
            # The user's module is there; the library its adapter needs is not.
            raise WorkloadError(
                f"{what}: module {module_name!r} needs {_INTEGRATIONS[missing]}, which is not "
                "installed here: install autotune's integrations extra (pip install "
                "'autotune[integrations]'; in autotune's folder, .venv/bin/pip install -e "
                "'.[integrations]')"
            ) from None
        raise WorkloadError(
            f"{what}: cannot import module {module_name!r} ({exc}); check the spelling and that "
            f"its package is in the folder autotune runs in ({os.getcwd()}), installed, or on "
            "PYTHONPATH"
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise WorkloadError(
            f"{what}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None


def _unpickle(what: str, path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise WorkloadError(
            f"{what}: the pickled object {path!r} is gone; run autotune.tune() again to write it"
        )
    try:
        with file.open("rb") as f:
            return pickle.load(f)
    except Exception as exc:  # a class it names that this process cannot import, or worse
        raise WorkloadError(
            f"{what}: cannot load the pickled object {path!r} ({type(exc).__name__}: {exc}); "
            "define the object in a module of your package and pass it from there"
        ) from None


def resolve(field: str, reference: str) -> Any:
    """The object ``reference`` names, for the adapter field ``field`` (e.g.
    ``lightning.module``).

    Raises:
        WorkloadError: naming the field, the reference and what is wrong.

    Example:
        >>> resolve("loop.loss", "torch.nn.functional:cross_entropy").__name__
        'cross_entropy'
    """
    what = f"{field} {reference!r}"
    if reference.startswith("pickle:"):
        return _unpickle(what, reference.removeprefix("pickle:"))
    module_name, _, attr = reference.partition(":")
    if is_stdlib(module_name):
        raise WorkloadError(
            f"{what}: module {module_name!r} is part of Python itself; name a class or function "
            "of your own package (e.g. mypkg.model:LitClassifier)"
        )
    module = import_user_module(what, module_name)
    if not hasattr(module, attr):
        public = sorted(
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name
        )[:12]
        hint = f"; it has {', '.join(public)}" if public else ""
        raise WorkloadError(f"{what}: module {module_name!r} has no attribute {attr!r}{hint}")
    return getattr(module, attr)


def _call_text(fn: Any, args: Mapping[str, Any]) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return f"{name}({shown[:120]}{'...' if len(shown) > 120 else ''})"


def call(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a user's function, turning whatever it raises into one WorkloadError line that
    starts with ``what``.

    Example:
        >>> call("loop.data make_loader(batch_size=8)", int, "x")
        Traceback (most recent call last):
        ...
        autotune.errors.WorkloadError: loop.data make_loader(batch_size=8) raised ValueError: invalid literal for int() with base 10: 'x'
    """
    try:
        return fn(*args, **kwargs)
    except WorkloadError:
        raise
    except Exception as exc:
        raise WorkloadError(f"{what} raised {type(exc).__name__}: {exc}") from None


def build(what: str, fn: Any, args: Mapping[str, Any] | None = None, **more: Any) -> Any:
    """Call a user's class or factory with init args; an error names the call.

    Example:
        >>> build("loop.model", dict, {"a": 1})
        {'a': 1}
    """
    kwargs = {**(args or {}), **more}
    return call(f"{what}: {_call_text(fn, kwargs)}", fn, **kwargs)


def _import_path(obj: Any) -> str | None:
    """``package.module:Name`` for a class or function another process can import by that
    name (defined at the top level of an importable module); None otherwise."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str) or module in _UNREACHABLE:
        return None
    if not name.isidentifier() or getattr(sys.modules.get(module), name, None) is not obj:
        return None  # nested, local (<locals>) or not what the module's name now holds
    if getattr(sys.modules[module], "__file__", None) is None:
        return None  # a module made at run time: no file another process could import
    return f"{module}:{name}"


def _main_names(data: bytes) -> list[str]:
    """The names a plain pickle would look up in ``__main__`` when loaded."""
    found: list[str] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL" and isinstance(arg, str) and arg.split(" ")[0] in _UNREACHABLE:
            found.append(arg.split(" ", 1)[-1])
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] in _UNREACHABLE:
            found.append(strings[-1])
        if isinstance(arg, str):
            strings.append(arg)
    return found


def _dumps(obj: Any, field: str) -> bytes:
    """``obj`` pickled by value where it must be: with cloudpickle when installed (classes and
    functions of ``__main__`` travel whole), else plain pickle, which cannot carry those."""
    label = getattr(obj, "__qualname__", None) or type(obj).__name__
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    try:
        data = cloudpickle.dumps(obj) if cloudpickle is not None else pickle.dumps(obj)
    except Exception as exc:
        raise WorkloadError(
            f"{field}: {label} cannot be sent to the probe worker ({type(exc).__name__}: {exc}); "
            "define it at the top level of a module of your package and pass it from there"
        ) from None
    if cloudpickle is None and (names := sorted(set(_main_names(data)))):
        what = "is defined" if names == [label] else f"needs {', '.join(names)} from"
        raise WorkloadError(
            f"{field}: {label} {what} in the notebook or script (__main__), which the probe "
            "worker, a separate process, cannot import; move it into a module of your package "
            "(e.g. mypkg/model.py) and import it from there, or pip install cloudpickle to send "
            "it by value"
        )
    return data


def reference_for(obj: Any, field: str, folder: Path) -> str:
    """How the worker reaches ``obj``: ``package.module:Name`` when it can import it, else
    ``pickle:PATH`` of a file written in ``folder`` (a class of a notebook, a dataset object).

    The file's name is the field's, not the content's: the same call makes the same reference,
    so a study resumes after its notebook cell ran again.

    Raises:
        WorkloadError: the object cannot be pickled, or (without cloudpickle) needs names from
            ``__main__``.

    Example:
        >>> from torch import nn
        >>> reference_for(nn.Linear, "loop.model", Path("objects"))
        'torch.nn.modules.linear:Linear'
    """
    if isinstance(obj, str):
        return obj
    found = _import_path(obj)
    if found is not None:
        return found
    data = _dumps(obj, field)
    make_dirs(folder)
    path = folder.resolve() / f"{field}.pkl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return f"pickle:{path}"
