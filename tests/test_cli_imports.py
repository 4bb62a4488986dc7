"""``autotune --help`` answers without loading torch, optuna, the storage or the web service.

Those take seconds to import; a command loads what it needs once it runs. Each check runs in a
fresh interpreter, since this test process has long imported all of them.
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


def test_python_dash_m_help_loads_no_heavy_module() -> None:
    out = _python(
        "import runpy, sys\n"
        "sys.argv = ['autotune', '--help']\n"
        "try:\n"
        "    runpy.run_module('autotune', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert out.splitlines()[-1] == "[]", out


@pytest.mark.parametrize("first", ["import autotune", "import autotune.session, autotune.export"])
def test_public_names_load_on_use_and_the_functions_keep_their_names(first: str) -> None:
    # Loading the module `autotune.session` (or `.export`) must not put it where the function is.
    out = _python(
        f"{first}\n"
        "import inspect, autotune\n"
        "missing = [n for n in autotune.__all__ if getattr(autotune, n, None) is None]\n"
        "print(missing, inspect.isfunction(autotune.session), inspect.isfunction(autotune.export))\n"
        "from autotune import TunedConfig, session\n"
        "print(TunedConfig.__module__, session.__module__)"
    )
    assert out.splitlines() == ["[] True True", "autotune.config autotune.session"]


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
