"""Names a module loads on first use: the module stays light to import (no torch, no web
service), and what needs more loads when it is first asked for.

Each package or module that defers names sets ``__getattr__ = lazy(__name__, {name: module})``;
the loaded value is kept in its namespace, so the next access is an ordinary one.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy"]


def lazy(module: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module``: each name of ``where`` is loaded from the
    module it maps to (a full dotted name) on first use.

    Example:
        >>> import types
        >>> box = types.ModuleType("box")
        >>> sys.modules["box"] = box
        >>> box.__getattr__ = lazy("box", {"sqrt": "math"})
        >>> box.sqrt(9.0), "sqrt" in vars(box)
        (3.0, True)
        >>> del sys.modules["box"]
    """

    def __getattr__(name: str) -> Any:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        # Into the namespace itself, past a module type's own __setattr__ (the package's).
        vars(sys.modules[module])[name] = value
        return value

    return __getattr__
