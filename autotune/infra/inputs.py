"""Reading text from outside (a spec file, a request body, a config file) into plain data, with
the work bounded before anything is validated.

A few hundred bytes of YAML can nest aliases of aliases (a "billion laughs") that expand to
billions of nodes; JSON or YAML nested thousands of levels deep overflows a recursive parser;
an integer of thousands of digits cannot even be printed. Each costs nothing to send and
minutes of a core, gigabytes of memory or a crash to validate or to quote in an error message.
So, in this order:

1. **Size.** A file is read up to ``max_bytes`` and refused past it.
2. **Parse.** YAML is composed with a depth bound that is checked *before* the recursive
   composer descends, and integers longer than ``MAX_DIGITS`` are refused before ``int()``
   converts them. JSON's parser raises on deep nesting, and its integers get the same bound.
3. **Shape.** The loaded data is counted as the tree a validator would walk, every alias once
   per use: more than ``max_nodes`` nodes or ``max_depth`` levels is refused, without walking
   further. A structure that contains itself (``&a [*a]``) is refused the same way.

Every refusal is the caller's error class (:class:`~autotune.errors.SpecError` by default) with
one line naming the source, what was too large, the bound and the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path
from typing import Any, Literal

import yaml

from autotune.errors import AutotuneError, SpecError, short_repr

__all__ = [
    "MAX_DEPTH",
    "MAX_DIGITS",
    "MAX_NODES",
    "MAX_SPEC_BYTES",
    "check_shape",
    "file_problem",
    "load_text",
    "read_text",
]

# A spec nests four levels (space.batch_size.min); 32 leaves room for any real file.
MAX_DEPTH = 32
# A spec has a few dozen values; 10,000 covers long explicit lists and stops alias bombs.
MAX_NODES = 10_000
# The largest number a spec or config holds is a seed (10 digits); 100 is already absurd.
MAX_DIGITS = 100
# A spec is a few hundred bytes; 1 MiB leaves room for comments and stops a runaway file.
MAX_SPEC_BYTES = 1 << 20

Format = Literal["yaml", "json"]
_FEW = "a study spec or a config holds a few dozen values, a few levels deep"


# What a path is when it is not a regular file, as a message says it.
_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file, as the end of a sentence; None for a regular file.

    Told apart without opening anything: opening a named pipe would wait for a writer forever.

    Example:
        >>> file_problem(Path("/dev/null"))
        'is not a regular file (it is a character device)'
        >>> file_problem(Path("/"))
        'is a folder'
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (a part of its path is a file)"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISDIR(mode):
        return "is a folder"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "something else")
    return f"is not a regular file (it is {kind})"


def read_text(
    path: Path,
    source: str,
    *,
    max_bytes: int = MAX_SPEC_BYTES,
    error: type[AutotuneError] = SpecError,
) -> str:
    """A file's text, refused when it is larger than ``max_bytes`` or not UTF-8.

    Raises:
        ``error``: the file is missing, a folder, a device, too large, unreadable or not
            UTF-8 text.
    """
    problem = file_problem(path)
    if problem is not None:
        raise error(f"{source} {problem}; pass a file")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{source} cannot be read ({exc.strerror})") from None
    if len(raw) > max_bytes:
        raise error(
            f"{source} is larger than {max_bytes:,} bytes; a study spec or a config is a few "
            "hundred bytes: is it the right file?"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source} is not UTF-8 text (byte {exc.start})") from None


def load_text(
    text: str,
    fmt: Format,
    source: str,
    *,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
    error: type[AutotuneError] = SpecError,
) -> Any:
    """Parse YAML or JSON text into plain data, the work bounded as the module says.

    Args:
        text: the text.
        fmt: ``yaml`` or ``json``.
        source: what the text is, for messages: ``"study spec 'x.yaml'"``, ``"the body"``.
        max_depth: nesting levels allowed.
        max_nodes: values allowed, counting each alias once per use.
        error: the exception class to raise.

    Returns:
        The data (``None`` for an empty YAML document).

    Raises:
        ``error``: the text is not valid YAML/JSON, nests too deep, expands too far or holds a
            number that is too long; one line naming which.

    Example:
        >>> load_text("a: &x [1, 2]\\nb: *x\\n", "yaml", "a spec")
        {'a': [1, 2], 'b': [1, 2]}
        >>> load_text("a: &x [*x]", "yaml", "a spec")
        Traceback (most recent call last):
        ...
        autotune.errors.SpecError: a spec: an alias refers to the value that contains it (line 1, column 4); write the values out instead
    """
    if fmt == "json":
        data = _load_json(text, source, error)
    else:
        data = _load_yaml(text, source, max_depth, max_nodes, error)
    check_shape(data, source, max_depth=max_depth, max_nodes=max_nodes, error=error)
    return data


def check_shape(
    data: Any,
    source: str,
    *,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
    error: type[AutotuneError] = SpecError,
) -> None:
    """Refuse data a validator would spend too long on: too deep, or too many values.

    The walk stops at the first bound it passes, so it costs at most ``max_nodes`` steps
    whatever the data expands to (shared and self-containing lists included).

    Raises:
        ``error``: naming the bound that was passed.

    Example:
        >>> check_shape({"a": [1, 2, 3]}, "a spec", max_nodes=3)
        Traceback (most recent call last):
        ...
        autotune.errors.SpecError: a spec holds more than 3 values (an alias counts once per use); a study spec or a config holds a few dozen values, a few levels deep
    """
    stack: list[tuple[Any, int]] = [(data, 1)]
    seen = 1
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = itertools.chain(value.keys(), value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = iter(value)
        else:
            continue
        # Counted as they are reached, never more than one past the bound: a huge list costs
        # its first few values, whatever its length.
        first = list(itertools.islice(children, max_nodes - seen + 1))
        seen += len(first)
        if seen > max_nodes:
            raise error(
                f"{source} holds more than {max_nodes:,} values (an alias counts once per use); "
                f"{_FEW}"
            )
        if first and depth >= max_depth:
            raise error(f"{source} nests deeper than {max_depth} levels; {_FEW}")
        stack.extend((child, depth + 1) for child in first)


def _load_json(text: str, source: str, error: type[AutotuneError]) -> Any:
    def bounded_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise _TooLong(len(digits.lstrip("-")))
        return int(digits)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise _Twice(key)
            found[key] = value
        return found

    try:
        return json.loads(text, parse_int=bounded_int, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not valid JSON: {exc}") from None
    except _Twice as exc:
        raise error(f"{source}: {exc}") from None
    except _TooLong as exc:
        raise error(_too_long(source, exc.digits)) from None
    except RecursionError:
        raise error(f"{source} nests thousands of levels deep; {_FEW}") from None


class _TooLong(ValueError):
    def __init__(self, digits: int, where: str = "") -> None:
        super().__init__(digits)
        self.digits = digits
        self.where = where


def _too_long(source: str, digits: int, where: str = "") -> str:
    return (
        f"{source} holds an integer of {digits:,} digits{where}; numbers here have at most "
        f"{MAX_DIGITS} digits"
    )


class _Refused(yaml.YAMLError):
    """Raised while composing: the document passes a bound (message ready to show)."""


class _Twice(ValueError):
    """A key given twice in one mapping: the parser would keep the last one silently."""

    def __init__(self, key: object, where: str = "") -> None:
        super().__init__(
            f"the key {short_repr(key)} is given twice in one mapping{where}; the last one would "
            "silently win: keep one"
        )


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a depth bound checked before each recursive step, an expansion
    bound on aliases, and a digit bound on integers."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > self.max_depth:
            mark = self.peek_event().start_mark
            raise _Refused(f"nests deeper than {self.max_depth} levels ({_where(mark)}); {_FEW}")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        _expanded_size(node, {}, set(), self.max_nodes)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key, _ in node.value:  # as written: merged keys (<<) may be overridden
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in seen:
                        raise _Twice(key.value, f" ({_where(key.start_mark)})")
                    seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


def _expanded_size(node: Any, sizes: dict[int, int], open_: set[int], limit: int) -> int:
    """Nodes of ``node`` as a tree (each alias once per use); refuses past ``limit``.

    Memoized by node identity, so it runs in time linear in the *composed* document, and
    recursion depth is bounded by the composer's depth check.
    """
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise _Refused(
            f"an alias refers to the value that contains it ({_where(node.start_mark)}); write "
            "the values out instead"
        )
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        sizes[key] = 1
        return 1
    open_.add(key)
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_, limit)
        if total > limit:
            raise _Refused(
                f"expands to more than {limit:,} values ({_where(node.start_mark)}): its aliases "
                "repeat too much; write the values out instead"
            )
    open_.discard(key)
    sizes[key] = total
    return total


def _bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    digits = sum(c.isalnum() for c in str(node.value))
    if digits > MAX_DIGITS:
        raise _TooLong(digits, f" ({_where(node.start_mark)})")
    return loader.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def _load_yaml(
    text: str, source: str, max_depth: int, max_nodes: int, error: type[AutotuneError]
) -> Any:
    loader: _BoundedLoader | None = None
    try:
        # The reader checks the text as the loader is made: a control character fails here.
        loader = _BoundedLoader(text)
        loader.max_depth = max_depth
        loader.max_nodes = max_nodes
        return loader.get_single_data()
    except _Refused as exc:
        raise error(f"{source}: {exc}") from None
    except _TooLong as exc:
        raise error(_too_long(source, exc.digits, exc.where)) from None
    except _Twice as exc:
        raise error(f"{source}: {exc}") from None
    except Exception as exc:
        # Beside YAMLError, the safe constructors raise whatever their conversions raise on a
        # malformed scalar: ``2024-13-45`` "month must be in 1..12", ``!!int abc`` a
        # ValueError, an empty ``!!float`` an IndexError. All of them mean: not valid YAML.
        detail = " ".join(str(exc).split())
        if len(detail) > 300:
            detail = detail[:297] + "..."
        raise error(f"{source} is not valid YAML: {detail}") from None
    finally:
        if loader is not None:
            loader.dispose()
