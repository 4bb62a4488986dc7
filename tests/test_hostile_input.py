"""Hostile or absurd input never freezes, crashes or strands anything: the spec and config
loaders, the command line and the client. Each case is one clear line and a non-zero exit.

The slow-input cases are bounded by the test's own timeout (pytest-timeout): a regression
shows as a timed-out test, never as a timing assertion.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _configs import make_config, write_config
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import ConfigError, ServiceError, SpecError, StorageError
from autotune.infra.inputs import MAX_SPEC_BYTES, load_text
from autotune.schema.config import load_config
from autotune.schema.spec import load_spec
from autotune.service import ServiceClient
from autotune.study.storage import open_storage

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "studies" / "tiny.yaml"


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """A YAML "billion laughs": each level lists the previous one ``width`` times; no
    ``name`` or ``workload``, so the spec is also invalid (the error message must not render
    the expansion)."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


# ---- the spec loader ---------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (billion_laughs(), "expands to more than 10,000 values"),
        ("space: &s {precisions: [*s]}\n", "an alias refers to the value that contains it"),
        ("space: " + "[" * 30_000 + "\n", "nests deeper than 32 levels"),
        ("space:\n" + "".join("  " * i + "- \n" for i in range(1, 200)), "nests deeper than 32"),
        ("seed: " + "9" * 4301 + "\n", "an integer of 4,301 digits (line 1, column 7)"),
        ("seed: 0x" + "f" * 5000 + "\n", "an integer of 5,002 digits"),
        ("seed: 1" + ":1" * 3000 + "\n", "digits"),
        ("name: x\nworkload: tiny_mlp\nseed: -1\n", "seed must be between 0 and 4294967295"),
        ("name: x\nworkload: tiny_mlp\nseed: 4294967296\n", "got seed=4294967296"),
        ("name: x\nworkload: tiny_mlp\nbudget: 0.0001\n", "budget must be at least 4s"),
        ("name: x\nworkload: tiny_mlp\nbudget: [1, 2]\n", "budget must be a duration"),
        ("# " + "x" * MAX_SPEC_BYTES + "\n", "is larger than 1,048,576 bytes"),
        (
            "name: x\nworkload: tiny_mlp\nparity_tolerance: .inf\n",
            "parity_tolerance: must be a finite number, got parity_tolerance=inf",
        ),
        (
            "name: x\nworkload: tiny_mlp\nvalidation:\n  min_speedup: .nan\n",
            "validation.min_speedup: must be a finite number, got min_speedup=nan",
        ),
        (
            "name: x\nworkload: tiny_mlp\nprobe:\n  loss_blowup_factor: 1e400\n",
            "probe.loss_blowup_factor: must be a finite number, got loss_blowup_factor='1e400'",
        ),
        ("name: x\nworkload: tiny_mlp\nbudget: 1e9\n", "budget must be at most 168h (7 days)"),
        ("name: x\nworkload: tiny_mlp\nbudget: .inf\n", "budget must be a finite duration"),
    ],
    ids=[
        "alias-bomb",
        "self-alias",
        "deep-flow",
        "deep-block",
        "4301-digits",
        "hex-digits",
        "sexagesimal",
        "seed-negative",
        "seed-too-large",
        "budget-too-small",
        "budget-a-list",
        "huge-file",
        "parity-inf",
        "min-speedup-nan",
        "blowup-1e400",
        "budget-31-years",
        "budget-inf",
    ],
)
def test_spec_loader_refuses_in_one_line(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(body)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert needle in message
    assert len(message) < 600  # a message, not a rendering of the input


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "spec.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda tmp: tmp, "is a folder"),
        (lambda tmp: Path("/dev/null"), "is not a regular file (it is a character device)"),
        (_fifo, "is not a regular file (it is a named pipe)"),
        (lambda tmp: tmp / "missing.yaml", "does not exist"),
    ],
    ids=["folder", "dev-null", "named-pipe", "missing"],
)
def test_a_spec_path_that_is_not_a_file_says_what_it_is(
    tmp_path: Path, make: Callable[[Path], Path], needle: str
) -> None:
    """A folder or /dev/null is not reported as missing; a named pipe is refused, not waited
    on."""
    path = make(tmp_path)
    with pytest.raises(SpecError, match=re.escape(f"study spec {str(path)!r} {needle}")):
        load_spec(path)
    code, out = run_cli("search", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and needle in out and "Traceback" not in out
    code, out = run_cli("submit", str(path), "--server", "http://127.0.0.1:9")
    assert code == 2 and needle in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda tmp: Path("/dev/null"), "is not a regular file (it is a character device)"),
        (_fifo, "is not a regular file (it is a named pipe)"),
    ],
    ids=["dev-null", "named-pipe"],
)
@pytest.mark.timeout(30)
def test_a_config_path_that_is_not_a_file_says_what_it_is(
    tmp_path: Path, make: Callable[[Path], Path], needle: str
) -> None:
    path = make(tmp_path)
    code, out = run_cli("train", "--config", str(path), "--steps", "2", "--device", "cpu")
    assert code == 2 and needle in out and "Traceback" not in out


def test_aliases_within_bounds_still_work(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        "name: x\nworkload: tiny_mlp\nspace:\n  lr_multiplier: &r {min: 0.5, max: 2.0}\n"
        "  init_scale: *r\n"
    )
    spec = load_spec(path)
    assert spec.space.init_scale.max == 2.0


@pytest.mark.timeout(60)
def test_cli_alias_bomb_is_one_line(tmp_path: Path) -> None:
    """The 342-byte spec that hung `autotune search`: refused at once, one line, exit 2."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "search", str(bomb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert done.returncode == 2, done.stderr
    assert "expands to more than 10,000 values" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seed", "99999999999"], "seed must be between 0 and 4294967295"),
        (["--seed", "-1"], "got seed=-1"),
        (["--budget", "0.0001"], "budget must be at least 4s"),
        (["--budget", "1e9"], "budget must be at most 168h (7 days)"),
        (["--set", "parity_tolerance=.inf"], "parity_tolerance: must be a finite number"),
        (["--storage", "sqlite:///"], "is an in-memory database"),
        (["--storage", "sqlite:///:memory:"], "is an in-memory database"),
        (["--set", "space=" + "[" * 40 + "]" * 40], "--set space: nests deeper than 32"),
        (["--set", "seed=" + "1" * 5000], "an integer of 5,000 digits"),
    ],
    ids=[
        "seed-large",
        "seed-negative",
        "budget",
        "budget-1e9",
        "parity-inf",
        "memory",
        "memory-2",
        "set-deep",
        "set-digits",
    ],
)
def test_search_flags_refuse_in_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    code, out = run_cli("search", str(TINY), "--out", str(tmp_path / "out"), *args)
    assert code == 2, out
    assert needle in out and "Traceback" not in out


def test_in_memory_storage_is_refused() -> None:
    for url in ("sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite+pysqlite:///"):
        with pytest.raises(StorageError, match="in-memory database: nothing would be saved"):
            open_storage(url)


# ---- the config loader -------------------------------------------------------------------


def _config_text(**changes: Any) -> str:
    data = make_config("fp32").model_dump(mode="json")
    data.update(changes)
    return json.dumps(data)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_config_text(batch_size=10**400), "an integer of 401 digits"),
        (_config_text(batch_size=2**40), "batch_size: Input should be less than or equal to"),
        (_config_text(batch_size="32"), "batch_size: Input should be a valid integer"),
        (_config_text(batch_size=True), "batch_size: Input should be a valid integer"),
        (_config_text(batch_size=32.0), "batch_size: Input should be a valid integer"),
        (_config_text(learning_rate=1e308), "learning_rate: Input should be less than or equal"),
        (_config_text(learning_rate="0.1"), "learning_rate: Input should be a valid number"),
        (_config_text(channels_last="yes"), "channels_last: Input should be a valid boolean"),
        (_config_text(channels_last=1), "channels_last: Input should be a valid boolean"),
        ("[" * 100_000 + "]" * 100_000, "nests thousands of levels deep"),
        ('{"a": ' * 40 + "1" + "}" * 40, "nests deeper than 32 levels"),
        ('{"schema_version": ' + "1" * 4301 + "}", "an integer of 4,301 digits"),
        ('{"schema_version": 1', "is not valid JSON"),
    ],
    ids=[
        "batch-10^400",
        "batch-2^40",
        "batch-text",
        "batch-bool",
        "batch-float",
        "lr-1e308",
        "lr-text",
        "channels-last-text",
        "channels-last-int",
        "100k-deep",
        "40-deep",
        "4301-digits",
        "truncated",
    ],
)
def test_config_loader_refuses_in_one_line(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "best.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, device="cpu")
    assert needle in str(info.value)
    assert len(str(info.value)) < 600


def test_a_good_config_still_loads(tmp_path: Path) -> None:
    path = write_config(tmp_path / "best.json", make_config("bf16", batch_size=2**20))
    assert load_config(path, device="cpu").batch_size == 2**20


@pytest.mark.parametrize(
    ("batch", "needle"),
    [(10**400, "an integer of 401 digits"), (2**40, "batch_size: Input should be less than")],
    ids=["10^400", "2^40"],
)
def test_train_refuses_an_impossible_batch_in_one_line(
    tmp_path: Path, batch: int, needle: str
) -> None:
    path = tmp_path / "best.json"
    path.write_text(_config_text(batch_size=batch))
    code, out = run_cli("train", "--config", str(path), "--steps", "2", "--device", "cpu")
    assert code == 2 and needle in out and "Traceback" not in out


def test_train_says_out_of_memory_when_the_cpu_allocator_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that passes the bounds but not the CPU allocator (which raises a RuntimeError,
    not torch's OutOfMemoryError): one line, exit 1. Faked: really asking for it would take
    the memory of the machine the tests share."""
    import autotune.train

    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 8796093022208 bytes. Error code 12 (Cannot allocate "
            "memory)"
        )

    monkeypatch.setattr(autotune.train, "compare", no_memory)
    path = write_config(tmp_path / "best.json", make_config("fp32", batch_size=2**20))
    code, out = run_cli("train", "--config", str(path), "--steps", "2", "--device", "cpu")
    assert code == 1, out
    assert "out of memory: batch_size=1048576" in out and "8,192.0 GiB" in out
    assert "Traceback" not in out


# ---- the client's token ------------------------------------------------------------------


def test_client_refuses_a_non_ascii_token_in_one_line() -> None:
    with pytest.raises(ServiceError, match="position 3"):
        ServiceClient("http://127.0.0.1:9", "abø-token-0123456789")
    code, out = run_cli(
        "status", "--server", "http://127.0.0.1:9", "--token", "tøken-0123456789abc"
    )
    assert code == 2 and "printable ASCII" in out and "Traceback" not in out


def test_token_help_says_it_shows_in_the_process_list() -> None:
    code, out = run_cli("submit", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "process list" in flat and "AUTOTUNE_TOKEN" in flat


# ---- what a reference into a module can name ------------------------------------------------


def test_missing_workload_lists_every_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "it has …" list is the module's whole offer, not its first eight names."""
    from autotune.errors import WorkloadError
    from autotune.workloads import load_workload

    names = [f"factory_{i:02d}" for i in range(12)]
    (tmp_path / "many_workloads.py").write_text(
        "import json\n" + "".join(f"def {n}():\n    pass\n" for n in names)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError) as info:
        load_workload("many_workloads:nope")
    assert f"it has {', '.join(names)}" in str(info.value)
    assert "json" not in str(info.value).split("it has")[1]


def test_load_text_counts_aliases_once_per_use() -> None:
    # a2 lists a1 9 times, a1 lists a0 9 times: about a thousand values, from 30 written.
    text = billion_laughs(levels=3)
    assert load_text(text, "yaml", "x", max_nodes=2000)["a2"][8][8][8] == "lol"
    with pytest.raises(SpecError, match="expands to more than 500 values"):
        load_text(text, "yaml", "x", max_nodes=500)
