"""The package's shape stays as designed: no import cycles, no reaching into private names,
modules small enough to read in one sitting. Read from the source with ``ast``."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from _spec_path import walk

from autotune.schema.enums import Outcome, Role, StudyState

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
# About a few hundred lines each; no module past this.
MAX_LINES = 520
# A function's code fits on a screen: a phase each, as in optuna's study/_optimize.py. Its
# signature is not counted (its length is ruff's PLR0913, with `# noqa: PLR0913 - <reason>`
# where a long one is the point, as a typer command's options), nor its docstring (the Args,
# Returns, Raises and Example a public function owes its reader).
MAX_FUNCTION_LINES = 60
# What lets a longer one stay: `# long: <reason>` on its def line or the line above it.
_LONG_REASON = re.compile(r"#\s*long:\s*\S")


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


def _long_functions(source: str, where: str) -> list[str]:
    """Functions whose code (after the docstring) runs past MAX_FUNCTION_LINES with no
    ``# long: <reason>`` on the def line, the line above the def, or above its decorators."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0]
        if ast.get_docstring(node, clean=False) is not None and len(node.body) > 1:
            first = node.body[1]
        body = (node.end_lineno or node.lineno) - first.lineno + 1
        if body <= MAX_FUNCTION_LINES:
            continue
        top = min([node.lineno] + [d.lineno for d in node.decorator_list])
        marks = {node.lineno, node.lineno - 1, top - 1}
        if not any(0 < n <= len(lines) and _LONG_REASON.search(lines[n - 1]) for n in marks):
            found.append(f"{where}:{node.lineno} {node.name}: {body} lines")
    return found


# Issue 25 item 2 split the long functions by phase; these are left to split. The list only
# shrinks: a function split below the limit must leave it (see the test after the next).
_NOT_YET_SPLIT: set[str] = set()


def _package_long_functions() -> dict[str, str]:
    """``{"path name": finding}`` for every long function of the package without a reason."""
    found = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        where = str(p.relative_to(PACKAGE.parent))
        for hit in _long_functions(p.read_text(), where):
            name = hit.split(" ", 2)[1].rstrip(":")
            found[f"{where} {name}"] = hit
    return found


def test_functions_stay_a_screen_long_or_say_why() -> None:
    long = [hit for key, hit in _package_long_functions().items() if key not in _NOT_YET_SPLIT]
    assert not long, (
        f"functions with over {MAX_FUNCTION_LINES} lines of code: split them by phase, or say "
        "why one reads best whole with `# long: <reason>` on the def line:\n" + "\n".join(long)
    )


def test_functions_left_to_split_are_still_listed_only_while_long() -> None:
    stale = _NOT_YET_SPLIT - _package_long_functions().keys()
    assert not stale, f"split now (or gone): remove from _NOT_YET_SPLIT: {sorted(stale)}"


def _function(body_lines: int, mark: str = "", decorated: bool = False) -> str:
    head = ["@decorator"] if decorated else []
    doc = ['    """A docstring,', '    not counted."""']
    return "\n".join([mark, *head, "def f(", "    x,", "):", *doc] + ["    x += 1"] * body_lines)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        (_function(MAX_FUNCTION_LINES), False),
        (_function(MAX_FUNCTION_LINES + 1), True),
        (_function(MAX_FUNCTION_LINES + 1, "# long: one table, read top to bottom"), False),
        (_function(MAX_FUNCTION_LINES + 1, "# long:"), True),  # a reason, not the word
        (_function(MAX_FUNCTION_LINES + 1, "# long: a table", decorated=True), False),
    ],
    ids=["at-limit", "over", "over-with-reason", "over-no-reason", "decorated-with-reason"],
)
def test_the_function_length_rule_flags_what_it_should(source: str, flagged: bool) -> None:
    assert bool(_long_functions(source, "example.py")) is flagged


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


# ---- the root shows the architecture ----------------------------------------------------------

# At the top, the public face only (tune, session, export, the errors, the version); the models,
# the infrastructure and the views live in the package of their layer.
MAX_ROOT_MODULES = 8
# The two layers under all others, and what each may import of autotune's besides itself: a
# module of the root's (never the package itself, which is the face) or a layer below it.
_FOUNDATIONS = {"infra": {"errors"}, "schema": {"errors", "version", "infra"}}
# File names that repeat across packages only where each does the same job in its package.
_SAME_JOB = {
    "models.py": "a package's pydantic models: what it is told and what it reports",
    "base.py": "the base a package's variants build on: the Workload interface, the Export",
}


def test_the_root_holds_the_public_face_only() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules at autotune/, at most {MAX_ROOT_MODULES}: move what is not the "
        f"public face into the package of its layer: {root}"
    )


def test_the_models_and_the_infrastructure_import_nothing_above_them() -> None:
    bad = [
        f"{name} imports {dep}"
        for name, deps in _graph().items()
        if name.count(".") >= 1 and (layer := name.split(".")[1]) in _FOUNDATIONS
        for dep in sorted(deps)
        if (dep.split(".") + [""])[1] not in _FOUNDATIONS[layer] | {layer}
    ]
    assert not bad, "\n".join(bad)


def test_no_two_modules_of_one_name_do_different_jobs() -> None:
    names: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name != "__init__.py":
            names.setdefault(p.name.lstrip("_"), []).append(str(p.relative_to(PACKAGE)))
    repeated = {n: sorted(paths) for n, paths in names.items() if len(paths) > 1}
    assert not repeated.keys() - _SAME_JOB.keys(), (
        "one name, different jobs; name each module for its own: "
        f"{ {n: repeated[n] for n in repeated.keys() - _SAME_JOB.keys()} }"
    )


# ---- stored keys: one home each ----------------------------------------------------------------

# What a study stores is named in study/study_keys.py, what a trial stores is TrialRecord's fields
# in study/trials.py: only these spell a key. Elsewhere a literal key is a second, drifting copy.
_KEY_HOMES = {PACKAGE / "study" / "study_keys.py", PACKAGE / "study" / "trials.py"}
_USER_ATTR_SETTERS = {"set_user_attr": 0, "set_trial_user_attr": 1}


def _is_user_attrs(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "user_attrs"


def _literal_keys(source: str, where: str) -> list[str]:
    """``where:line key`` for each key spelled as a literal (or an f-string) in
    ``x.user_attrs[...]``, ``x.user_attrs.get(...)``, ``... in x.user_attrs`` or
    ``set_user_attr(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key: ast.AST | None = None
        if isinstance(node, ast.Subscript) and _is_user_attrs(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_user_attrs(c) for c in node.comparators):
            key = node.left
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr == "get" and _is_user_attrs(func.value) and node.args:
                key = node.args[0]
            elif func.attr in _USER_ATTR_SETTERS and len(node.args) > _USER_ATTR_SETTERS[func.attr]:
                key = node.args[_USER_ATTR_SETTERS[func.attr]]
        if isinstance(key, ast.JoinedStr) or (
            isinstance(key, ast.Constant) and isinstance(key.value, str)
        ):
            found.append(f"{where}:{node.lineno} {ast.unparse(key)}")
    return found


def test_stored_keys_are_spelled_only_in_their_home() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in _KEY_HOMES:
            found += _literal_keys(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, (
        "user attributes read or written by a literal key; name it in "
        "autotune/study/study_keys.py (a study's) or read it from TrialRecord (a trial's): "
        + "; ".join(found)
    )


def _outside_study(*texts: str) -> list[str]:
    """``path:line`` of each line outside autotune/study/ that holds one of ``texts``."""
    return [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "study"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(text in line for text in texts)
    ]


def test_only_the_study_layer_touches_user_attributes() -> None:
    # A study's attributes go through study/store.py's StudyStore, a trial's through TrialRecord.
    found = _outside_study("user_attr")
    assert not found, (
        "user attributes touched outside autotune/study/; read and write them through "
        "autotune.study.store.StudyStore (a study's) or TrialRecord (a trial's): "
        + ", ".join(found)
    )


def test_only_the_study_layer_names_optunas_storages() -> None:
    # Where studies are kept is the study layer's: study/storage.py's Storage, open_storage and
    # in_memory_storage for the layers above it.
    found = _outside_study("optuna.storages", "from optuna import storages")
    assert not found, (
        "optuna's storages named outside autotune/study/; use autotune.study.storage's "
        "Storage, open_storage or in_memory_storage: " + ", ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('study.user_attrs.get("spec")', True),
        ('t.user_attrs["outcome"]', True),
        ('"spec" in study.user_attrs', True),
        ('study.set_user_attr(f"ceilings:{host}", {})', True),
        ('storage.set_trial_user_attr(1, "outcome", "oom")', True),
        ("study.user_attrs.get(study_keys.SPEC)", False),
        ("study.set_user_attr(key, {})", False),
        ('params.get("spec")', False),
    ],
)
def test_the_stored_key_rule_flags_what_it_should(source: str, flagged: bool) -> None:
    assert bool(_literal_keys(source, "example.py")) is flagged


# ---- named values: an enum member, not its string -----------------------------------------------

# What an outcome, a study's state or a trial's role is compared with or set to: a member of
# autotune/schema/enums.py. A literal string compares equal today, but is a second, drifting copy
# of the name, and a typo in one is never caught.
_ENUMS = (Outcome, StudyState, Role)
_NAMED = {m.value: f"{e.__name__}.{m.name}" for e in _ENUMS for m in e}
_HOLDERS = {"outcome", "state", "role"}


def _holds_named_value(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in _HOLDERS) or (
        isinstance(node, ast.Attribute) and node.attr in _HOLDERS
    )


def _named_literals(node: ast.AST) -> list[ast.Constant]:
    """The string constants in ``node`` (in the tuple, set or list it is, in either branch of
    the ``... if ... else ...`` it is) that are a named value's string."""
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return [c for e in node.elts for c in _named_literals(e)]
    if isinstance(node, ast.IfExp):
        return _named_literals(node.body) + _named_literals(node.orelse)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _NAMED:
        return [node]
    return []


def _assigned(target: ast.AST, value: ast.AST) -> Iterator[ast.AST]:
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        for t, v in zip(target.elts, value.elts, strict=False):
            yield from _assigned(t, v)
    elif _holds_named_value(target):
        yield value


def _given(node: ast.AST) -> Iterator[ast.AST]:
    """What ``node`` compares with, passes as or assigns to an outcome, a state or a role."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides[:-1], sides[1:], strict=True):
            if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) and _holds_named_value(left):
                yield right
            if isinstance(op, ast.Eq | ast.NotEq) and _holds_named_value(right):
                yield left
    elif isinstance(node, ast.Call):
        yield from (k.value for k in node.keywords if k.arg in _HOLDERS)
    elif isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values, strict=True):
            if isinstance(k, ast.Constant) and k.value in _HOLDERS:
                yield v
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            yield from _assigned(target, node.value)
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        yield from _assigned(node.target, node.value)


def _literal_named_values(source: str, where: str) -> list[str]:
    """``where:line 'oom' -> Outcome.OOM`` for each such string compared with (``==``, ``!=``,
    ``in``), passed as (``outcome=``, ``{"outcome": ...}``) or assigned to an outcome, a state
    or a role."""
    found = [
        c for node in ast.walk(ast.parse(source)) for v in _given(node) for c in _named_literals(v)
    ]
    return [f"{where}:{c.lineno} {c.value!r} -> {_NAMED[c.value]}" for c in found]


def test_outcomes_states_and_roles_are_enum_members_not_strings() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _literal_named_values(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, (
        "an outcome, state or role compared with, passed as or set to a literal string; use the "
        "member of autotune/schema/enums.py: " + "; ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('x.outcome == "oom"', True),
        ('"done" != row.state', True),
        ('outcome in ("completed", "infeasible")', True),
        ('r.state not in {"queued", "running"}', True),
        ('ProbeResult(outcome="unsupported", reason=why)', True),
        ('TrialRecord(**{"role": "amp_recipe"})', True),
        ('r.outcome, r.reason = "diverged", why', True),
        ('state = "paused" if paused else row.state', True),
        ('x.name == "oom"', False),
        ("x.outcome == Outcome.OOM", False),
        ('x.outcome == "faster"', False),  # not a named value
        ('log(event="reused")', False),
    ],
)
def test_the_named_value_rule_flags_what_it_should(source: str, flagged: bool) -> None:
    assert bool(_literal_named_values(source, "example.py")) is flagged


# ---- the spec's path ----------------------------------------------------------------------------

# Following the spec from the search's face (the method: tests/_spec_path.py and
# docs/architecture.md), the most times it may go back up a layer.
MAX_BACK_UP = 5


def test_the_spec_goes_back_up_a_layer_at_most_five_times() -> None:
    path = walk()
    # The walk reaches every phase, or its figures say nothing.
    for phase in ("_hardware.find_ceilings", "_trial.TrialStep.run", "_validation_run.validate"):
        assert f"autotune.search.{phase}" in path.functions, f"the walk misses {phase}"
    assert len(path.back_up) <= MAX_BACK_UP, path.figures()


_MINI = {
    "__init__.py": "",
    "schema/__init__.py": "",
    "schema/spec.py": "class StudySpec:\n    def fingerprint(self) -> str:\n        return ''\n",
    "study/__init__.py": "",
    "study/store.py": "class StudyStore:\n    def read(self) -> int:\n        return 0\n",
    "study/storage.py": (
        "from autotune.schema.spec import StudySpec\nfrom autotune.study.store import StudyStore\n"
        "def open_study(spec: StudySpec) -> StudyStore:\n    spec.fingerprint()\n"
        "    return StudyStore()\n"
        "def fail(store: StudyStore) -> None:\n    store.read()\n"
    ),
    "search/__init__.py": (
        "from autotune.schema.spec import StudySpec\nfrom autotune.study.storage import open_study\n"
        "from autotune.{home} import tidy\n"
        "def run_search(spec: StudySpec) -> None:\n    store = open_study(spec)\n    store.read()\n"
        "    tidy(store)\n    finish(spec)\n"
        "def finish(spec: StudySpec) -> None:\n    return None\n"
    ),
    # The same function in the search, or in the study layer.
    **{
        path: (
            "from autotune.study.storage import fail\nfrom autotune.study.store import StudyStore\n"
            "def tidy(store: StudyStore) -> None:\n    fail(store)\n"
        )
        for path in ("search/_tidy.py", "study/tidy.py")
    },
}


@pytest.mark.parametrize(
    ("home", "faces", "back_up"),
    [
        # open_study (study), tidy (search), fail (study), finish (search): up twice.
        ("search._tidy", False, 2),
        # tidy moved to the layer that owns it: the walk comes back up once, to finish.
        ("study.tidy", False, 1),
        # the store's read and the spec's own method entered too: the walk climbs from the
        # spec's method to the store, and from the study to the search.
        ("study.tidy", True, 2),
    ],
)
def test_the_spec_path_counts_what_it_should(
    tmp_path: Path, home: str, faces: bool, back_up: int
) -> None:
    for name, text in _MINI.items():
        path = tmp_path / "autotune" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("{home}", home))
    found = walk(package=tmp_path / "autotune", faces=faces)
    assert len(found.back_up) == back_up, found.figures()
    assert found.functions[0] == "autotune.search.run_search"
