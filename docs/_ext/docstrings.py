"""Reads autotune's docstrings as the API pages render them (a griffe extension, docs only).

The code's docstrings are Google style with two habits from reST that Markdown reads otherwise:
an ``Example:`` section (Google's parser takes only ``Examples:`` as doctest examples, and
renders the rest as Markdown, where ``>>>`` is a quote and ``m[0](x)`` a link), and roles such
as ``:class:`~autotune.measure.step.StepEngine``` and ``::`` before a literal block. The text is
rewritten when an object is loaded; the code is not touched.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

# "Example:" alone on its line opens a section of examples, as "Examples:" does.
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
# :role:`~a.b.name` -> `name`; :role:`a.b.name` -> `a.b.name`.
_ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")
# "...::" ending a line introduces a literal block in reST; Markdown needs only the indent.
_LITERAL = re.compile(r"::$", re.M)


def _role(match: re.Match[str]) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


def markdown_docstring(text: str) -> str:
    """The docstring as the Markdown the API pages render."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(_role, text)
    return _LITERAL.sub(":", text)


class ReadDocstrings(Extension):
    """Rewrites each loaded object's docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
