"""docker/: no engine runs here, so check what a broken deployment would trip over first."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main
import yaml
from _docs import page

from autotune.cli import app

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def cli_options(*path: str) -> set[str]:
    """Every option name a (sub)command of the `autotune` CLI accepts."""
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in param.opts}


def test_compose_parses_with_the_three_services() -> None:
    doc = compose()
    assert set(doc["services"]) == {"postgres", "autotune", "dashboard"}
    pg = doc["services"]["postgres"]
    assert "pgdata" in doc["volumes"]
    assert any(v.startswith("pgdata:") for v in pg["volumes"])
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    svc = doc["services"]["autotune"]
    assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert svc["env_file"] == "autotune.env"


def test_the_service_command_uses_only_options_autotune_serve_accepts() -> None:
    command = compose()["services"]["autotune"]["command"]
    assert command[:2] == ["autotune", "serve"]
    accepted = cli_options("serve")
    used = [a for a in command[2:] if a.startswith("--")]
    assert used and set(used) <= accepted, set(used) - accepted
    args = dict(zip(command[2::2], command[3::2], strict=False))
    # It listens beyond loopback, so the token must come from the env file.
    assert args["--host"] == "0.0.0.0"
    assert args["--storage"].startswith("postgresql://autotune:${POSTGRES_PASSWORD}@postgres:5432/")
    port = args["--port"]
    assert f"{port}:{port}" in compose()["services"]["autotune"]["ports"]
    example = (DOCKER / "autotune.env.example").read_text()
    assert re.search(r"^AUTOTUNE_TOKEN=", example, re.M)
    assert re.search(r"^POSTGRES_PASSWORD=", example, re.M)


def test_the_token_variable_is_the_one_the_cli_reads() -> None:
    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    envvars = {str(p.envvar) for p in command.params if getattr(p, "envvar", None)}
    source = (Path(__file__).resolve().parent.parent / "autotune").rglob("*.py")
    mentioned = any("AUTOTUNE_TOKEN" in f.read_text() for f in source)
    assert "AUTOTUNE_TOKEN" in envvars or mentioned


def test_the_dashboard_reads_the_same_database() -> None:
    doc = compose()
    service_url = dict(
        zip(
            doc["services"]["autotune"]["command"][2::2],
            doc["services"]["autotune"]["command"][3::2],
            strict=False,
        )
    )["--storage"]
    dashboard_url = doc["services"]["dashboard"]["command"][0]
    strip = re.compile(r"^postgresql(\+\w+)?://")
    assert strip.sub("", service_url) == strip.sub("", dashboard_url)


def test_the_dockerfile_command_exists_and_runs_as_a_non_root_user() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM \S*(pytorch|cuda)\S*", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    cmd = re.search(r"^CMD (\[.*\])", text, re.M)
    assert cmd is not None
    argv = yaml.safe_load(cmd.group(1))
    assert argv[:2] == ["autotune", "serve"]
    accepted = cli_options("serve")
    assert {a for a in argv[2:] if a.startswith("--")} <= accepted
    # What it copies exists.
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        matches = list(Path(DOCKER.parent).glob(src))
        assert matches, f"Dockerfile copies {src}, which does not exist"
    # The extra it installs is declared.
    import tomllib

    pyproject = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())
    extras = re.findall(r"pip install [^\n]*\.\[(\w+)\]", text)
    assert extras and all(e in pyproject["project"]["optional-dependencies"] for e in extras)


def systemd_unit() -> dict[str, dict[str, str]]:
    """docker/autotune.service as section → key → value (continuation lines joined)."""
    text = (DOCKER / "autotune.service").read_text().replace("\\\n", " ")
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        out[section][key.strip()] = value.strip()
    return out


def test_the_systemd_unit_restarts_on_failure_and_drains_on_stop() -> None:
    from autotune.schema.spec import ProbeSettings
    from autotune.service._scheduler import DRAIN_GRACE

    unit = systemd_unit()
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure"
    assert svc["RestartPreventExitStatus"] == "2"  # a configuration mistake: no restart loop
    # SIGTERM to the service alone, which drains; its workers are stopped by it, not by systemd.
    assert svc["KillSignal"] == "SIGTERM" and svc["KillMode"] == "mixed"
    # Longer than the longest drain: a ceiling try that is never cut, after the probe grace.
    longest = ProbeSettings().time_limit + 15 + DRAIN_GRACE
    assert float(svc["TimeoutStopSec"]) > longest
    assert unit["Install"]["WantedBy"] == "multi-user.target"

    argv = svc["ExecStart"].split()
    assert argv[0].endswith("/autotune") and argv[1] == "serve"
    used = {a for a in argv[2:] if a.startswith("--")}
    assert used <= cli_options("serve"), used - cli_options("serve")
    args = dict(zip(argv[2::2], argv[3::2], strict=False))
    # It listens beyond loopback, so it needs a token: from a file, never on the command line.
    assert args["--host"] == "0.0.0.0" and args["--token-file"].startswith("/")
    assert "--token" not in args and "AUTOTUNE_TOKEN" not in svc.get("Environment", "")
    assert "docker/autotune.service" in page("docs/service.md")
