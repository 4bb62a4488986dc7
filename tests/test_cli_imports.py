"""``autotune --help`` answers without loading torch, optuna, the storage or the web service;
a search's parent and the service never load torch at all.

Those take seconds to import; a command loads what it needs once it runs. Torch is the probe
worker's: the process that runs a search, or serves, hands every probe to it. Each check runs
in a fresh interpreter, since this test process has long imported all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "optuna", "sqlalchemy", "fastapi", "uvicorn")

# Renders the root help and every command's help, noting which heavy modules each one loaded.
_HELP_EVERY_COMMAND = f"""
import json, sys
from typer.main import get_command
from typer.testing import CliRunner
import autotune.cli

HEAVY = {HEAVY!r}
loaded = {{}}
def note(what):
    loaded[what] = sorted(m for m in HEAVY if m in sys.modules)
note("import autotune.cli")
runner = CliRunner()
group = get_command(autotune.cli.app)
for args in [["--help"]] + [[name, "--help"] for name in group.commands]:
    result = runner.invoke(autotune.cli.app, args)
    assert result.exit_code == 0 and "Usage" in result.output, (args, result.output)
    note("autotune " + " ".join(args))
print(json.dumps(loaded))
"""


# What a search's parent and the service import, in the order the commands reach them.
PARENT_MODULES = (
    "autotune.cli._search",
    "autotune.search",
    "autotune.execution.probe_worker",
    "autotune.report.progress",
    "autotune.report",
    "autotune.cli._service",
    "autotune.service",
    "autotune.study.storage",
)

# Imports each module in turn; when torch is first asked for, notes the chain of autotune
# modules being imported then (outermost first), and which of PARENT_MODULES it came from.
_IMPORT_EACH = f"""
import importlib, json, sys

class FirstTorch:
    chain = None
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and FirstTorch.chain is None:
            frame, chain = sys._getframe(1), []
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if frame.f_code.co_name == "<module>" and module.startswith("autotune"):
                    chain.append(module)
                frame = frame.f_back
            FirstTorch.chain = chain[::-1]
        return None

sys.meta_path.insert(0, FirstTorch())
found = {{}}
for module in {PARENT_MODULES!r}:
    importlib.import_module(module)
    if FirstTorch.chain is not None:
        found = {{"module": module, "chain": FirstTorch.chain}}
        break
if not found:
    # What the parent runs before any probe: a built-in checked and named, the worker's client.
    from autotune.execution.probe_worker import ProbeWorker
    from autotune.service import WorkloadPolicy
    from autotune.workloads import normalize_reference
    WorkloadPolicy([]).check("tiny_convnet"), normalize_reference("tiny_mlp"), ProbeWorker("cpu")
    # And what a submit of a testing workload checks (the service's first submit of `sleepy`).
    WorkloadPolicy([]).check("autotune.testing.workloads:sleepy")
    if "torch" in sys.modules:
        found = {{"module": "checking a built-in workload", "chain": FirstTorch.chain}}
print(json.dumps(found))
"""


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_of_every_command_loads_no_heavy_module() -> None:
    loaded = json.loads(_python(_HELP_EVERY_COMMAND))
    assert "autotune search --help" in loaded and "autotune serve --help" in loaded
    heavy = {what: mods for what, mods in loaded.items() if mods}
    assert not heavy, f"loaded at start-up or for --help: {heavy}"


def test_a_searchs_parent_and_the_service_load_no_torch() -> None:
    found = json.loads(_python(_IMPORT_EACH).splitlines()[-1])
    assert not found, (
        f"importing {found['module']} loaded torch, through "
        f"{' → '.join(found['chain']) or 'no autotune module'}; only the probe worker may"
    )


def test_the_builtin_names_known_without_torch_are_the_builtins() -> None:
    from autotune.workloads import BUILTIN_NAMES, BUILTINS
    from autotune.workloads._factory import TESTING_NAMES, module_factories

    assert list(BUILTINS) == list(BUILTIN_NAMES)
    assert module_factories("autotune.workloads") == sorted(BUILTIN_NAMES)
    assert module_factories("autotune.testing.workloads") == sorted(TESTING_NAMES)


def test_python_dash_m_help_loads_no_heavy_module() -> None:
    out = _python(
        "import os, runpy, sys\n"
        "sys.argv = ['autotune', '--help']\n"
        # The command ends its process at once (autotune.infra.leave): here it raises, to look after.
        "os._exit = sys.exit\n"
        "try:\n"
        "    runpy.run_module('autotune', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert out.splitlines()[-1] == "[]", out


@pytest.mark.parametrize(
    "first", ["import autotune", "import autotune.amp_session, autotune.exports"]
)
def test_public_names_load_on_use_and_the_functions_keep_their_names(first: str) -> None:
    # `autotune.session` and `autotune.export` are plainly the functions: their modules have names
    # of their own, and the package is an ordinary module (no module type of its own).
    out = _python(
        f"{first}\n"
        "import inspect, types, autotune\n"
        "missing = [n for n in autotune.__all__ if getattr(autotune, n, None) is None]\n"
        "print(missing, inspect.isfunction(autotune.session), inspect.isfunction(autotune.export))\n"
        "from autotune import TunedConfig, session\n"
        "print(TunedConfig.__module__, session.__module__, type(autotune) is types.ModuleType)"
    )
    assert out.splitlines() == ["[] True True", "autotune.schema.config autotune.amp_session True"]


def test_version_prints_the_version_without_a_command() -> None:
    import autotune

    done = subprocess.run(
        [sys.executable, "-m", "autotune", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == autotune.__version__
