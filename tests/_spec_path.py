"""Following the spec through the search's calls, read from the source with ``ast``.

Run it to print the figures: ``python tests/_spec_path.py [--list] [--faces]``. The method (docs/architecture.md,
"How the spec travels"):

1. Start at the search's face, ``autotune.search.run_search``.
2. In each function, take its calls in source order and follow those that hand on the spec or
   an object carrying it: an argument whose static type is a carrier, or a method called on one.
   The carriers are the spec, the search's context, the study store and a raw ``optuna.Study``,
   and any autotune class that holds one of them in a field. A method of a lower layer's object
   (the store's reads and writes, the spec's fingerprint, called from the search) answers with
   a value, as a field read does: the spec goes no further, and the walk does not go in
   (``--faces`` follows those too).
3. Depth first, each function once. The walk is the list of functions entered; a step is one
   function entered after the face.
4. Where two functions in a row sit in different modules the walk enters a module; it returns
   when it enters one it has been in before, and goes back up a layer when the module's layer
   (``LAYERS``, from the package order of docs/architecture.md) is above the one it left.

Static types come from annotations (parameters, fields, return types) and from assignments of a
constructor's or an annotated function's result; a call whose target these do not name is not
followed. The walk is deterministic: the same source gives the same figures.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
ENTRY = "autotune.search.run_search"
# The layers, lowest first, as docs/architecture.md orders the packages: what every layer leans
# on, the models, the study's storage, measuring (workloads, probes, the worker process, the
# diagnosis), the search, and what drives the search (the command, the service, the simulator,
# the report, the public face). A package not named is at the top.
LAYERS = {
    "infra": 0,
    "errors": 0,
    "version": 0,
    "schema": 1,
    "study": 2,
    "workloads": 3,
    "measure": 3,
    "diagnose": 3,
    "execution": 3,
    "search": 4,
}
TOP = 5
CARRIERS = {
    "autotune.schema.spec.StudySpec",
    "autotune.search._context.SearchContext",
    "autotune.study.store.StudyStore",
    "optuna.Study",
}


def layer(module: str) -> int:
    """The layer of ``autotune.<package>...`` (a root module is named like a package)."""
    parts = module.split(".")
    return LAYERS.get(parts[1] if len(parts) > 1 else "", TOP)


@dataclass
class _Module:
    name: str
    tree: ast.Module
    names: dict[str, str] = field(default_factory=dict)  # local name -> qualified


@dataclass
class _Class:
    module: str
    node: ast.ClassDef
    attrs: dict[str, ast.expr] = field(default_factory=dict)  # attribute -> annotation


class _Index:
    """Every autotune module's functions, classes and imported names."""

    def __init__(self, package: Path = PACKAGE) -> None:
        self.modules: dict[str, _Module] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.owner: dict[str, str] = {}  # function -> module
        self.classes: dict[str, _Class] = {}
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text())
            self.modules[name] = module = _Module(name, tree)
            self._read(module, path.name == "__init__.py")

    def _read(self, module: _Module, is_pkg: bool) -> None:
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self._function(f"{module.name}.{node.name}", node, module.name)
            elif isinstance(node, ast.ClassDef):
                self._class(module.name, node)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    module.names[(a.asname or a.name).split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = module.name if is_pkg else module.name.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rsplit(".", 1)[0]
                    base = f"{pkg}.{base}" if base else pkg
                for a in node.names:
                    module.names[a.asname or a.name] = f"{base}.{a.name}"

    def _function(self, qual: str, node: ast.FunctionDef | ast.AsyncFunctionDef, mod: str) -> None:
        self.functions[qual] = node
        self.owner[qual] = mod

    def _class(self, module: str, node: ast.ClassDef) -> None:
        qual = f"{module}.{node.name}"
        cls = self.classes[qual] = _Class(module, node)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                cls.attrs[item.target.id] = item.annotation
            elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                self._function(f"{qual}.{item.name}", item, module)
                if any(_named(d, "property") for d in item.decorator_list) and item.returns:
                    cls.attrs[item.name] = item.returns
        init = next((i for i in node.body if getattr(i, "name", "") == "__init__"), None)
        if isinstance(init, ast.FunctionDef):
            params = {a.arg: a.annotation for a in init.args.args + init.args.kwonlyargs}
            for stmt in ast.walk(init):
                target, annotation = None, None
                if isinstance(stmt, ast.AnnAssign):
                    target, annotation = stmt.target, stmt.annotation
                elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target = stmt.targets[0]
                    if isinstance(stmt.value, ast.Name):
                        annotation = params.get(stmt.value.id)
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and annotation is not None
                ):
                    cls.attrs.setdefault(target.attr, annotation)

    def resolve(self, qual: str, depth: int = 0) -> str:
        """Follow re-exports to where a name is defined (``optuna.study.Study``: ``optuna.Study``)."""
        if qual.startswith("optuna.") and qual.endswith(".Study"):
            return "optuna.Study"
        if qual in self.functions or qual in self.classes or qual in self.modules or depth > 9:
            return qual
        mod, _, name = qual.rpartition(".")
        if mod in self.modules and name in self.modules[mod].names:
            return self.resolve(self.modules[mod].names[name], depth + 1)
        return qual

    def name_in(self, module: str, name: str) -> str | None:
        mod = self.modules[module]
        if f"{module}.{name}" in self.functions or f"{module}.{name}" in self.classes:
            return f"{module}.{name}"
        if name in mod.names:
            return self.resolve(mod.names[name])
        return None


def _named(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


class _Types:
    """Static types of expressions inside one function."""

    def __init__(self, index: _Index, module: str, fn: str | None = None) -> None:
        self.index, self.module = index, module
        self.env: dict[str, str | None] = {}
        if fn is not None:
            self._read(fn)

    def _read(self, fn: str) -> None:
        index, node = self.index, self.index.functions[fn]
        cls = fn.rsplit(".", 1)[0]
        args = node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            if a.arg == "self" and cls in index.classes:
                self.env["self"] = cls
            elif a.annotation is not None:
                self.env[a.arg] = self.annotation(a.annotation)
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                self.env.setdefault(stmt.target.id, self.annotation(stmt.annotation))
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                self._assign(stmt.targets[0], stmt.value)
            elif isinstance(stmt, ast.withitem) and isinstance(stmt.optional_vars, ast.Name):
                self.env.setdefault(stmt.optional_vars.id, self.of(stmt.context_expr))

    def _assign(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.env.setdefault(target.id, self.of(value))
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
            returns = self._returns(value)
            if isinstance(returns, ast.Subscript) and isinstance(returns.slice, ast.Tuple):
                for t, a in zip(target.elts, returns.slice.elts, strict=False):
                    if isinstance(t, ast.Name):
                        self.env.setdefault(t.id, self.annotation(a))

    def annotation(self, node: ast.expr | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self.annotation(ast.parse(node.value, mode="eval").body)
        if isinstance(node, ast.BinOp):  # X | None
            return self.annotation(node.left) or self.annotation(node.right)
        if isinstance(node, ast.Name):
            return self.index.name_in(self.module, node.id)
        if isinstance(node, ast.Attribute):
            base = self.annotation(node.value)
            return self.index.resolve(f"{base}.{node.attr}") if base else None
        return None

    def callee(self, call: ast.Call) -> tuple[str | None, str | None]:
        """``(function or class, receiver type)`` a call names, where the types say."""
        func = call.func
        if isinstance(func, ast.Name):
            return self.index.name_in(self.module, func.id) or self.env.get(func.id), None
        if isinstance(func, ast.Attribute):
            receiver = self.of(func.value)
            if receiver in self.index.modules:
                return self.index.resolve(f"{receiver}.{func.attr}"), None
            if receiver in self.index.classes:
                return self._method(receiver, func.attr), receiver
            return None, receiver
        return None, None

    def _method(self, cls: str, name: str, depth: int = 0) -> str | None:
        if f"{cls}.{name}" in self.index.functions:
            return f"{cls}.{name}"
        info = self.index.classes.get(cls)
        for base in info.node.bases if info and depth < 5 else []:
            found = _annotation_type(self.index, info.module, base)
            if found in self.index.classes and (m := self._method(found, name, depth + 1)):
                return m
        return None

    def _returns(self, call: ast.Call) -> ast.expr | None:
        target, _ = self.callee(call)
        node = self.index.functions.get(target or "")
        return node.returns if node is not None else None

    def of(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            found = self.index.name_in(self.module, node.id)
            return found if found in self.index.modules else None
        if isinstance(node, ast.Attribute):
            base = self.of(node.value)
            if base in self.index.modules:
                return self.index.resolve(f"{base}.{node.attr}")
            info = self.index.classes.get(base or "")
            if info is not None and node.attr in info.attrs:
                return _annotation_type(self.index, info.module, info.attrs[node.attr])
            return None
        if isinstance(node, ast.Call):
            target, _ = self.callee(node)
            if target in self.index.classes:
                return target
            fn = self.index.functions.get(target or "")
            if fn is not None and fn.returns is not None:
                return _annotation_type(self.index, self.index.owner[target or ""], fn.returns)
        return None


def _calls(node: ast.AST) -> list[ast.Call]:
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _carriers(index: _Index) -> set[str]:
    """The carrier types, and every autotune class holding one in a field (to a fixed point)."""
    found = set(CARRIERS)
    while True:
        more = {
            qual
            for qual, cls in index.classes.items()
            if qual not in found
            and any(_annotation_type(index, cls.module, a) in found for a in cls.attrs.values())
        }
        if not more:
            return found
        found |= more


def _annotation_type(index: _Index, module: str, node: ast.expr) -> str | None:
    return _Types(index, module).annotation(node)


@dataclass
class Walk:
    """The functions the spec is handed to, in the order a depth-first reader meets them."""

    functions: list[str]
    modules: list[str]

    @property
    def steps(self) -> int:
        return len(self.functions) - 1

    @property
    def entries(self) -> list[tuple[str, str]]:
        """``(left, entered)`` for each move from one module to another."""
        return [(a, b) for a, b in zip(self.modules, self.modules[1:], strict=False) if a != b]

    @property
    def returns(self) -> int:
        seen = {self.modules[0]}
        count = 0
        for _, entered in self.entries:
            count += entered in seen
            seen.add(entered)
        return count

    @property
    def back_up(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.entries if layer(b) > layer(a)]

    def figures(self) -> str:
        entered = Counter(b for _, b in self.entries)
        lines = [
            f"steps {self.steps}, modules {len(set(self.modules))}, module entries "
            f"{len(self.entries)}, returns to a module left {self.returns}, back up a layer "
            f"{len(self.back_up)}",
            "most entered: "
            + ", ".join(f"{m.removeprefix('autotune.')} {n}" for m, n in entered.most_common(5)),
            "back up a layer:",
            *(
                f"  {a.removeprefix('autotune.')} -> {b.removeprefix('autotune.')}"
                for a, b in self.back_up
            ),
        ]
        return "\n".join(lines)


def walk(entry: str = ENTRY, package: Path = PACKAGE, *, faces: bool = False) -> Walk:
    """The spec's path from ``entry`` through autotune's functions (see the module's method).

    ``faces``: go into the methods of a lower layer's objects too (the store's reads and
    writes, the spec's own methods), as if each were a move of the spec.
    """
    index = _Index(package)
    carriers = _carriers(index)
    order: list[str] = []
    if entry not in index.functions:
        # A face that re-exports the function: the walk starts where it is defined.
        module, _, name = entry.rpartition(".")
        entry = index.modules[module].names.get(name, entry) if module in index.modules else entry

    def followed(fn: str, call: ast.Call, types: _Types) -> str | None:
        target, receiver = types.callee(call)
        if target in index.classes:
            target = f"{target}.__init__" if f"{target}.__init__" in index.functions else None
        if target is None or target not in index.functions or target in order:
            return None
        args = [*call.args, *(k.value for k in call.keywords)]
        if any(types.of(a) in carriers for a in args):
            return target
        if receiver not in carriers:
            return None
        # A lower layer's object asked for a value (a store's read, the spec's fingerprint).
        asked = layer(index.classes[receiver].module) < layer(index.owner[fn])
        return target if faces or not asked else None

    def visit(fn: str) -> None:
        order.append(fn)
        types = _Types(index, index.owner[fn], fn)
        for call in _calls(index.functions[fn]):
            if (target := followed(fn, call, types)) is not None:
                visit(target)

    visit(entry)
    return Walk(order, [index.owner[f] for f in order])


if __name__ == "__main__":
    import sys

    result = walk(faces="--faces" in sys.argv)
    print(result.figures())
    if "--list" in sys.argv:
        print("the walk:", *(f.removeprefix("autotune.") for f in result.functions), sep="\n  ")
