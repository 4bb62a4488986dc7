"""The package's shape stays as designed: no import cycles, no reaching into private names,
modules small enough to read in one sitting. Read from the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
# About a few hundred lines each; no module past this.
MAX_LINES = 520


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` for every import in the file, also inside functions
    (and under TYPE_CHECKING): a cycle through a late import is still a cycle."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The autotune modules an import statement loads (``from pkg import mod`` loads mod)."""
    found = []
    if target in modules:
        found.append(target)
    for n in names:
        if f"{target}.{n}" in modules:
            found.append(f"{target}.{n}")
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, names, _ in _imports(path, name):
            for dep in _resolve(target, names, modules):
                if dep != name:
                    graph[name].add(dep)
    return graph


def _package_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def test_no_import_cycles_between_modules() -> None:
    graph = _graph()
    # A package's __init__ re-exports its own private modules; those edges point down only.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names() -> None:
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for target, names, line in _imports(path, name):
            if not target.startswith("autotune"):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            # A private module is imported only by its own package (its face and siblings).
            parts = target.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    if not (name == owner or name.startswith(owner + ".")):
                        bad.append(f"{where}: imports private module {target}")
                    break
            for n in names:
                if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in modules:
                    bad.append(f"{where}: imports private name {n} from {target}")
    assert not bad, "\n".join(bad)


def test_modules_stay_small_enough_to_read_in_one_sitting() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_search_and_diagnose_are_packages_with_a_face() -> None:
    for pkg in ("search", "diagnose"):
        face = PACKAGE / pkg / "__init__.py"
        assert face.is_file(), f"autotune/{pkg} is not a package"
        tree = ast.parse(face.read_text())
        exported = next(
            (
                ast.literal_eval(node.value)
                for node in tree.body
                if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            ),
            None,
        )
        assert exported, f"autotune/{pkg}/__init__.py has no __all__"
