"""The prepared GPU check, checked here: it must run on the first try, on a machine we reach
only for minutes. Its carried wheels and the machine's own packages cover every runtime
dependency of autotune, and it runs every test file that holds gpu-marked tests."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
# The GPU machine's interpreter: requirement markers are evaluated for it, not for this one.
MACHINE = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# Never carried: the machine's own build of these is the one that matches its driver.
TORCH_STACK = {"torch", "torchvision", "numpy", "triton"}
# What gpu-check.sh itself runs with, besides autotune's dependencies.
CHECK_TOOLS = ["pytest", "pytest-timeout", "lightning", "transformers", "accelerate"]


def _names(path: Path) -> list[str]:
    return [
        ln.split("#")[0].strip() for ln in path.read_text().splitlines() if ln.split("#")[0].strip()
    ]


def carried() -> list[str]:
    return [canonicalize_name(n) for n in _names(SCRIPTS / "gpu-wheels.txt")]


def on_machine() -> dict[str, Version | None]:
    out: dict[str, Version | None] = {}
    for entry in _names(SCRIPTS / "gpu-machine-packages.txt"):
        name, _, version = entry.partition("==")
        out[canonicalize_name(name)] = Version(version) if version else None
    return out


def _matches(req: Requirement) -> list[Requirement]:
    """A carried distribution's own requirements that hold on the machine, for ``req``'s extras
    (its installed metadata here: the wheel is pinned to this very version)."""
    dist = distribution(req.name)
    out = []
    for text in dist.requires or []:
        sub = Requirement(text)
        extras = [""] + sorted(req.extras)
        if sub.marker is None or any(sub.marker.evaluate({**MACHINE, "extra": e}) for e in extras):
            out.append(sub)
    return out


def uncovered() -> tuple[list[str], set[str]]:
    """Walk autotune's runtime requirements: a carried distribution's needs are walked in turn,
    the machine's own are its business. Returns the problems and the carried names reached."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    carry, machine = set(carried()), on_machine()
    todo = [Requirement(r) for r in project["dependencies"]]
    problems: list[str] = []
    reached: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**MACHINE, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in carry:
            try:
                version = distribution(req.name).version
            except PackageNotFoundError:
                problems.append(f"{name} is carried but not installed here: pip install -e .")
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{req} is needed, the carried wheel would be {name}=={version}")
            if name not in reached:
                reached.add(name)
                todo.extend(_matches(req))
        elif name in machine:
            have = machine[name]
            if have is not None and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{req} is needed, the GPU machine has {name}=={have}")
        else:
            problems.append(f"{req} is neither on the GPU machine nor carried")
    return problems, reached


def test_carried_wheels_and_the_machine_cover_every_runtime_dependency() -> None:
    problems, _ = uncovered()
    assert not problems, (
        "; ".join(problems) + " — add the name to scripts/gpu-wheels.txt, then run "
        "scripts/gpu-wheels.sh"
    )


def test_every_carried_wheel_is_needed_once_and_the_torch_stack_stays() -> None:
    names = carried()
    assert len(names) == len(set(names)), "a name twice: two wheels of one name stop the install"
    _, reached = uncovered()
    assert set(names) <= reached, f"carried but needed by nothing: {sorted(set(names) - reached)}"
    assert not (set(names) & TORCH_STACK)
    machine = on_machine()
    assert all(canonicalize_name(t) in machine for t in CHECK_TOOLS)


def _script_list(variable: str) -> list[str]:
    text = (SCRIPTS / "gpu-check.sh").read_text()
    found = re.search(rf"^{variable}=\(([^)]*)\)", text, re.MULTILINE)
    assert found, f"{variable}=(...) is not in scripts/gpu-check.sh"
    return found.group(1).split()


def test_the_gpu_check_runs_every_file_with_gpu_tests() -> None:
    marked = {
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    }
    named = _script_list("GPU_TESTS") + _script_list("EXPORT_TESTS")
    assert all((ROOT / n).is_file() for n in named), named
    assert marked <= set(named), (
        f"gpu tests gpu-check.sh does not run: {sorted(marked - set(named))}"
    )


def test_the_gpu_check_says_so_where_no_gpu_is_visible(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr
