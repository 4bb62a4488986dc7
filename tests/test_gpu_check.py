"""The prepared GPU check, checked here: it must run on the first try, on a machine we reach
only for minutes. Its carried wheels and the machine's own packages cover every runtime
dependency of autotune, and it runs every test file that holds gpu-marked tests."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from _docs import page
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


# ---- the check's plan, run dry here: no GPU, no wheels ----------------------------------------

CHECK = SCRIPTS / "gpu-check.sh"
SESSION = 900  # device seconds a session has, start-up and every call counted
CALL_LIMIT = 600  # the longest one call may run
CALLS = ["tests-core", "tests-integrations", "bench"]
CALL_LINE = re.compile(r"^\s+\d+\. (\S+): (\d+) s \(timeout_s (\d+)\): (.+)$")
STAGE_LINE = re.compile(r"^\s+(\S+) \(cap (\d+) s(?:, log \S+)?\):( .*)?$")


def gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CHECK), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


def plan() -> tuple[dict[str, dict], dict[str, int]]:
    """The plan as printed: per call its total, timeout and stage caps; and the device time."""
    done = gpu_check("--plan", env={"PYTHON": "/nonexistent/python3"})
    assert done.returncode == 0, done.stderr
    calls: dict[str, dict] = {}
    for line in done.stdout.splitlines():
        if found := CALL_LINE.match(line):
            name, total, timeout, stages = found.groups()
            caps = {}
            for part in stages.split(" + "):
                stage, cap = part.rsplit(" ", 1)
                caps[stage] = int(cap)
            calls[name] = {"total": int(total), "timeout": int(timeout), "caps": caps}
    found = re.search(
        r"start-up (\d+) s \+ calls (\d+) s \+ (\d+) x (\d+) s = (\d+) s of the session's (\d+) s",
        done.stdout,
    )
    assert found, done.stdout
    start_up, calls_total, n, per_call, planned, session = map(int, found.groups())
    time = {"start_up": start_up, "calls": calls_total, "n": n, "per_call": per_call}
    return calls, {**time, "planned": planned, "session": session}


def dry_run(call: str) -> dict[str, tuple[int, list[str]]]:
    """The stages a call would run: name -> (cap, command), from a dry run with no GPU."""
    done = gpu_check(call, "out", env={"PYTHON": "/nonexistent/python3", "GPU_CHECK_DRY_RUN": "1"})
    assert done.returncode == 0, done.stderr
    stages = {}
    for line in done.stdout.split(f"dry run of {call}", 1)[1].splitlines():
        if found := STAGE_LINE.match(line):
            name, cap, command = found.groups()
            stages[name] = (int(cap), shlex.split(command) if name != "setup" else [])
    return stages


def test_the_plan_is_printed_dry_and_each_call_fits_its_timeout_with_a_third_to_spare() -> None:
    calls, _ = plan()
    assert list(calls) == CALLS
    for name, call in calls.items():
        assert sum(call["caps"].values()) <= call["total"], name
        assert 3 * call["total"] <= 2 * call["timeout"] <= 2 * CALL_LIMIT, name
        # What the dry run would run is what the plan says.
        assert {k: cap for k, (cap, _) in dry_run(name).items()} == call["caps"], name


def test_the_calls_and_a_machine_start_fit_two_thirds_of_the_device_time_with_a_rerun_to_spare():
    calls, time = plan()
    assert time["session"] == SESSION
    assert time["n"] == len(calls)
    assert time["calls"] == sum(c["total"] for c in calls.values())
    assert time["planned"] == time["start_up"] + time["calls"] + time["n"] * time["per_call"]
    assert 3 * time["planned"] <= 2 * SESSION
    # The longest call again, on a fresh machine, still fits what is left.
    longest = max(c["total"] for c in calls.values())
    assert time["start_up"] + longest + time["per_call"] <= SESSION - time["planned"]


def test_every_stage_runs_in_all_within_its_timeout() -> None:
    calls, _ = plan()
    stages = dry_run("all")
    for call in calls.values():
        for stage, cap in call["caps"].items():
            assert stages[stage][0] == cap
    done = gpu_check("--plan")
    found = re.search(r"all: (\d+) s \(timeout (\d+)\)", done.stdout)
    assert found, done.stdout
    total, timeout = map(int, found.groups())
    assert sum(cap for cap, _ in stages.values()) <= total
    # For a machine of your own: within one call's limit, no third to spare.
    assert total <= timeout <= CALL_LIMIT


def test_the_landscape_call_fits_the_rerun_room_and_records_what_the_simulator_loads() -> None:
    """The fourth call, run when the three passed, records the device's landscape: its
    arguments are the recorder's, and it fits the room kept for a rerun on the warm machine."""
    _, time = plan()
    done = gpu_check("--plan", env={"PYTHON": "/nonexistent/python3"})
    found = re.search(
        r"in the rerun's room on the warm machine: landscape: (\d+) s \(timeout_s (\d+)\)",
        done.stdout,
    )
    assert found, done.stdout
    total, timeout = map(int, found.groups())
    assert total + time["per_call"] <= SESSION - time["planned"]
    assert 3 * total <= 2 * timeout <= 2 * CALL_LIMIT
    stages = dry_run("landscape")
    (command,) = [c for name, (_, c) in stages.items() if name == "landscape"]
    args = command[[i for i, a in enumerate(command) if a.endswith("record_landscape.py")][0] + 1 :]
    recorder = _benchmark("record_landscape")
    seen = {}

    def record(parsed, command):  # the first thing main does after parsing its arguments
        seen["args"] = parsed
        raise SystemExit(0)

    recorder.record = record
    with pytest.raises(SystemExit):
        recorder.main(args)
    assert seen["args"].device == "cuda" and seen["args"].compile
    assert str(seen["args"].out).endswith("landscape/gpu-resnet18.yaml")


def test_the_gpu_check_runs_every_file_with_gpu_tests() -> None:
    marked = {
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    }
    named = [
        arg
        for call in CALLS
        for _, command in dry_run(call).values()
        if "pytest" in command
        for arg in command
        if arg.startswith("tests/")
    ]
    assert all((ROOT / n).is_file() for n in named), named
    assert marked <= set(named), (
        f"gpu tests gpu-check.sh does not run: {sorted(marked - set(named))}"
    )
    # Each pytest stage prints its slowest tests.
    assert all(
        "--durations=20" in command
        for call in CALLS
        for _, command in dry_run(call).values()
        if "pytest" in command
    )


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arguments(script: str) -> list[str]:
    (command,) = [
        c
        for _, c in dry_run("bench").values()
        if any(a.endswith(f"benchmarks/{script}") for a in c)
    ]
    return command[[i for i, a in enumerate(command) if a.endswith(script)][0] + 1 :]


def _parsed(parse, script: str):
    args = _arguments(script)
    try:
        return parse(args)
    except SystemExit:  # argparse's exit: an argument the benchmark does not take
        pytest.fail(f"benchmarks/{script} does not take the arguments gpu-check.sh gives: {args}")


def test_the_benchmarks_get_arguments_they_take_sized_to_their_stage() -> None:
    trust = _parsed(_benchmark("trust")._parse, "trust.py")
    assert len(trust.studies.split(",")) == 1
    assert len(trust.seeds.split(",")) == 1
    assert trust.epochs == 1 and trust.budget_scale <= 0.25
    assert trust.json is not None
    probe = _parsed(_benchmark("probe_overhead")._parse, "probe_overhead.py")
    assert probe.repeats == 1 and probe.seconds <= 5

    class Parsed(Exception):
        pass

    amp_table = _benchmark("amp_table")

    def parsed(device: str) -> None:  # the first thing main does after parsing its arguments
        raise Parsed

    amp_table.resolve_device = parsed
    with pytest.raises(Parsed):
        _parsed(amp_table.main, "amp_table.py")


def test_without_wheels_where_the_machine_lacks_a_dependency_it_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    # The machine's Python: no pydantic, as on the GPU machine; and no wheels brought along.
    (tmp_path / "lacking").mkdir()
    (tmp_path / "lacking" / "pydantic.py").write_text(
        "raise ImportError('No module named pydantic', name='pydantic')\n"
    )
    (tmp_path / "whl").mkdir()
    done = gpu_check(
        "tests-core",
        str(tmp_path / "out"),
        env={
            "PYTHON": sys.executable,
            "PYTHONPATH": str(tmp_path / "lacking"),
            "GPU_CHECK_WHEELS": str(tmp_path / "whl"),
        },
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot import pydantic" in lines[0] and "gpu-wheels.sh" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_dry_run_needs_no_python_gpu_or_wheels_and_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "whl").mkdir()
    for args, env in [
        (["--plan", "bench"], {}),
        (["bench"], {"GPU_CHECK_DRY_RUN": "1"}),
    ]:
        done = gpu_check(
            *args,
            str(tmp_path / "out"),
            env={
                "PYTHON": str(tmp_path / "no-python"),
                "GPU_CHECK_WHEELS": str(tmp_path / "whl"),
                **env,
            },
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("gpu-check plan:")
        assert "dry run of bench, nothing runs" in done.stdout
        assert "benchmarks/trust.py" in done.stdout
        assert not (tmp_path / "out").exists()


def test_the_plan_says_how_to_make_each_call_carry_the_wheels() -> None:
    done = gpu_check("--plan", env={"PYTHON": "/nonexistent/python3"})
    assert 'carry [".whl"]' in done.stdout
    assert "timeout_s" in done.stdout and "hand the machine back" in done.stdout


def test_an_unknown_call_is_one_line_naming_the_calls() -> None:
    done = gpu_check("gpu-check-out")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "unknown call 'gpu-check-out'" in done.stderr
    assert all(c in done.stderr for c in [*CALLS, "all"])


def test_the_docs_give_the_plans_totals_and_timeouts() -> None:
    calls, _ = plan()
    text = page("docs/gpu-check.md")
    for name, call in calls.items():
        assert re.search(
            rf"^\| `{name}` \|.*\| {call['total']} s \| {call['timeout']} s \|$", text, re.M
        ), name


def test_the_gpu_check_says_so_where_no_gpu_is_visible(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    # No wheels: a checkout's own .whl/ holds the GPU machine's cp312 ones, not this Python's.
    (tmp_path / "whl").mkdir()
    env = {"PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "whl")}
    done = gpu_check("tests-core", str(tmp_path / "out"), env=env)
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr
    assert done.stderr.count("\n") == 1
