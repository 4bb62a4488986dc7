"""Probe runners: the worker process returns the same results, re-raises user errors, and
survives crashes and hangs. One worker is shared by the module: each start costs seconds."""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from autotune.errors import SpecError, WorkloadError
from autotune.execution.limits import MEMORY_ENV, machine_memory
from autotune.execution.probe_worker import InProcessRunner, ProbeWorker, poisons_context
from autotune.execution.runner import StartTooSlow
from autotune.measure.probe import run_probe
from autotune.measure.result import ProbeResult
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, ProbeSettings
from autotune.testing.workloads import HUNGRY_ENV
from autotune.workloads import load_workload

SHORT = ProbeSettings(warmup_steps=1, steps=4, check_every=2, min_time=0)
CRASHING = "autotune_test_crashing_workload:crashes"


@pytest.fixture(scope="module")
def crashing_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A workload whose loss raises a plain exception: a bug in user code, not a user mistake.

    It is on sys.path and PYTHONPATH before the worker starts, so the worker can import it too.
    """
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "autotune_test_crashing_workload.py").write_text(
        textwrap.dedent(
            """
            import atexit, os
            from autotune.workloads import tiny_mlp

            EXIT_MARK = os.path.join(os.path.dirname(__file__), "exit-hook-ran")

            def _mark():
                with open(EXIT_MARK, "w") as f:
                    f.write(str(os.getpid()))

            def with_exit_hook():
                # What a user's workload may leave to the end of the process: a clean-up.
                atexit.register(_mark)
                return tiny_mlp()

            def chatty():
                # Prints 100 kB at every step, to stdout and to stderr.
                import sys
                wl = tiny_mlp()
                inner = wl.loss

                def loss(model, batch):
                    sys.stdout.write("progress " + "." * 100_000 + "\\n")
                    print("a warning of the workload's", file=sys.stderr)
                    return inner(model, batch)

                wl.loss = loss
                return wl

            def dies():
                # What a native library says before it takes the process down.
                wl = tiny_mlp()

                def loss(model, batch):
                    print("OpenBLAS error: Memory allocation still failed", flush=True)
                    os._exit(1)

                wl.loss = loss
                return wl

            def crashes():
                wl = tiny_mlp()

                def loss(model, batch):
                    raise ValueError("label 11 is out of range for 10 classes")

                wl.loss = loss
                return wl
            """
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
        )
        yield
    sys.modules.pop("autotune_test_crashing_workload", None)


@pytest.fixture(scope="module")
def worker(crashing_module: None) -> Iterator[ProbeWorker]:
    with ProbeWorker("cpu") as w:
        yield w


def cand(precision: str = "fp32", batch_size: int = 16, lr: float = 0.05) -> Candidate:
    return Candidate(precision=precision, batch_size=batch_size, learning_rate=lr)


def test_worker_result_matches_an_in_process_probe(worker: ProbeWorker) -> None:
    remote = worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    local = run_probe(load_workload("tiny_mlp"), cand(), "cpu", SHORT)
    assert isinstance(remote, ProbeResult)
    assert remote.outcome == local.outcome == Outcome.COMPLETED
    assert remote.workload == local.workload == "autotune.workloads:tiny_mlp"
    assert remote.losses == pytest.approx(local.losses, rel=1e-5)
    assert remote.throughput > 0


@pytest.mark.parametrize(
    ("ref", "candidate", "outcome"),
    [
        ("autotune.testing.workloads:fp16_overflow", cand("fp16", 32, 0.001), Outcome.DIVERGED),
        ("autotune.testing.workloads:oom_above_64", cand("fp32", 128), Outcome.OOM),
        (CRASHING, cand(), Outcome.CRASHED),
    ],
)
def test_failures_come_back_as_outcomes_and_the_worker_lives_on(
    worker: ProbeWorker, ref: str, candidate: Candidate, outcome: Outcome
) -> None:
    worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    pid = worker.pid
    r = worker.run(ref, candidate, SHORT, timeout=60)
    assert r.outcome == outcome, r.reason
    if outcome == Outcome.DIVERGED:
        assert math.isnan(r.losses[-1])  # NaN survives the trip between processes
    if outcome == Outcome.CRASHED:
        assert r.reason == "ValueError: label 11 is out of range for 10 classes"
    assert worker.pid == pid


def test_a_workloads_output_is_kept_with_its_probe_not_printed(
    worker: ProbeWorker, capfd: pytest.CaptureFixture[str]
) -> None:
    """A workload printing every step filled the terminal and the service's log (1.6 GB in
    30 s): its output is counted, its end kept with the probe, and none reaches the parent's."""
    worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    capfd.readouterr()
    r = worker.run("autotune_test_crashing_workload:chatty", cand(), SHORT, timeout=60)
    assert r.outcome == Outcome.COMPLETED, r.reason
    steps = SHORT.warmup_steps + SHORT.steps
    assert r.output_bytes >= steps * 100_000
    assert r.output.endswith("a warning of the workload's\n") and len(r.output) <= 2048
    printed = capfd.readouterr()
    assert "progress" not in printed.out + printed.err
    # The next probe's output is its own.
    assert worker.run("tiny_mlp", cand(), SHORT, timeout=60).output_bytes == 0


def test_a_worker_that_dies_says_its_last_words_in_the_reason(worker: ProbeWorker) -> None:
    r = worker.run("autotune_test_crashing_workload:dies", cand(), SHORT, timeout=60)
    assert r.outcome == Outcome.CRASHED
    assert "exit code 1" in r.reason
    assert "its last output: OpenBLAS error: Memory allocation still failed" in r.reason
    assert worker.run("tiny_mlp", cand(), SHORT, timeout=60).outcome == Outcome.COMPLETED


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("no_such_package_xyz.mod:fn", "cannot import module 'no_such_package_xyz.mod'"),
        ("autotune.testing.workloads:non_scalar_loss", "loss must be a scalar tensor"),
    ],
    ids=["bad-reference", "broken-contract"],
)
def test_user_errors_are_raised_in_the_parent(worker: ProbeWorker, ref: str, expected: str) -> None:
    with pytest.raises(WorkloadError, match=expected) as info:
        worker.run(ref, cand(), SHORT, timeout=60)
    assert ref.split(":")[0] in str(info.value)
    assert worker.run("tiny_mlp", cand(), SHORT, timeout=60).outcome == Outcome.COMPLETED


def test_hard_timeout_kills_the_probe_and_the_next_run_restarts_the_worker(
    worker: ProbeWorker,
) -> None:
    worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    pid, starts = worker.pid, worker.starts
    endless = ProbeSettings(warmup_steps=1, steps=100_000, min_time=0)
    started = time.perf_counter()
    r = worker.run("tiny_gpt", cand(batch_size=8, lr=0.003), endless, timeout=2)
    assert time.perf_counter() - started < 10
    assert r.outcome == Outcome.CRASHED
    assert "hard time limit of 2s" in r.reason
    assert r.timed_out
    assert (r.planned_steps, r.batch_size) == (100_000, 8)
    after = worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    assert after.outcome == Outcome.COMPLETED, after.reason
    assert worker.pid != pid
    assert worker.starts == starts + 1


def test_a_poisoned_cuda_context_restarts_the_worker_and_the_outcome_says_so(
    worker: ProbeWorker,
) -> None:
    worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    pid, starts = worker.pid, worker.starts
    r = worker.run("autotune.testing.workloads:cuda_context_lost", cand(), SHORT, timeout=60)
    assert r.outcome == Outcome.CRASHED
    assert "illegal memory access" in r.reason
    assert "the probe worker was restarted" in r.reason
    # The poisoned process is gone; the next probe runs in a fresh one.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    after = worker.run("tiny_mlp", cand(), SHORT, timeout=60)
    assert after.outcome == Outcome.COMPLETED, after.reason
    assert worker.pid != pid and worker.starts == starts + 1


@pytest.mark.parametrize(
    ("error", "poisons"),
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUDA error: unspecified launch failure"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), False),
        (ValueError("label 11 is out of range for 10 classes"), False),
    ],
    ids=["illegal-access", "device-assert", "launch-failure", "oom", "shape-bug", "user-bug"],
)
def test_only_errors_that_corrupt_the_context_restart_the_worker(
    error: Exception, poisons: bool
) -> None:
    assert poisons_context(error) is poisons


def test_in_process_runner_turns_a_crash_into_an_outcome(crashing_module: None) -> None:
    runner = InProcessRunner("cpu")
    r = runner.run(CRASHING, cand(), SHORT)
    assert r.outcome == Outcome.CRASHED
    assert r.reason == "ValueError: label 11 is out of range for 10 classes"
    with pytest.raises(WorkloadError, match="loss must be a scalar tensor"):
        runner.run("autotune.testing.workloads:non_scalar_loss", cand(), SHORT)
    assert runner.run("tiny_mlp", cand(), SHORT).outcome == Outcome.COMPLETED


def test_close_ends_the_worker_process_after_its_exit_hooks(worker: ProbeWorker) -> None:
    """The worker leaves without the interpreter's teardown (seconds of a core), but what a
    workload registered for the end of the process still runs."""
    import autotune_test_crashing_workload as user_code

    mark = Path(user_code.EXIT_MARK)
    mark.unlink(missing_ok=True)
    r = worker.run("autotune_test_crashing_workload:with_exit_hook", cand(), SHORT, timeout=60)
    assert r.outcome == Outcome.COMPLETED, r.reason
    pid = worker.pid
    assert pid is not None
    worker.close()
    assert worker.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert mark.read_text() == str(pid)


def test_a_worker_closed_while_it_starts_is_stopped_at_once() -> None:
    """A command that fails before its first request (a storage it cannot open) closes a
    worker still importing torch: it is killed then, not waited for to the end of its start."""
    starting = ProbeWorker("cpu")
    starting.spawn()
    proc = starting._proc
    assert proc is not None
    starting.close()
    assert starting.pid is None
    # Killed: not left to finish importing torch, see its pipe closed and exit by itself.
    assert proc.returncode == -signal.SIGKILL


def test_a_worker_not_ready_within_its_start_s_share_is_stopped_and_says_so() -> None:
    """A budget that leaves its worker's start a moment: the wait ends then (not after 120 s),
    the process is killed, and the caller hears the start was too slow; a later start begins
    afresh."""
    w = ProbeWorker("cpu")
    try:
        w.spawn()
        proc = w._proc
        assert proc is not None
        with pytest.raises(StartTooSlow) as raised:
            w.start(within=0.01)  # importing torch takes longer than this anywhere
        assert raised.value.seconds == pytest.approx(0.01)
        assert proc.returncode == -signal.SIGKILL
        w.start()
        assert w.pid is not None and w.pid != proc.pid
    finally:
        w.close()


def test_a_warm_worker_loads_the_compiler_front_end_before_it_is_ready_and_a_plain_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service's worker starts before it has work: it pays for torch's compiler front end
    (which any optimizer imports, a second of a core) then, not in its first study's time. A
    command's worker, which the search waits on anyway, does not pay it before its first probe.
    Each worker says at its exit, through a start-up hook on its path, whether it had it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import atexit, os, sys

            def _say():
                loaded = "torch._dynamo" in sys.modules
                with open(os.environ["AUTOTUNE_TEST_LOADED"], "a") as f:
                    f.write(f"{os.getpid()} {loaded}\\n")

            atexit.register(_say)
            """
        )
    )
    said = tmp_path / "loaded.txt"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("AUTOTUNE_TEST_LOADED", str(said))
    loaded = {}
    for warm in (True, False):
        w = ProbeWorker("cpu", warm=warm)
        w.start()
        pid = w.pid
        w.close()
        lines = dict(line.split() for line in said.read_text().splitlines())
        loaded[warm] = lines[str(pid)]
    assert loaded == {True: "True", False: "False"}


# ---- the worker's memory limit ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_workload_past_the_workers_memory_limit_is_an_oom_naming_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A workload that allocates 8 GiB reached 16.8 GB resident on a 24 GB machine: under
    AUTOTUNE_WORKER_MEMORY=6G its allocation fails in the worker, which lives on."""
    monkeypatch.setenv(MEMORY_ENV, "6G")
    monkeypatch.setenv(HUNGRY_ENV, str(8 * 2**30))
    with ProbeWorker("cpu") as limited:
        r = limited.run("autotune.testing.workloads:hungry", cand(), SHORT, timeout=120)
        assert r.outcome == Outcome.OOM, r.reason
        assert "the worker may map at most 6.0 GiB (AUTOTUNE_WORKER_MEMORY" in r.reason
        pid = limited.pid
        assert limited.run("tiny_mlp", cand(), SHORT, timeout=60).outcome == Outcome.COMPLETED
        assert limited.pid == pid


@pytest.mark.parametrize(
    ("device", "value", "limit"),
    [
        ("cpu", None, "default"),
        ("cpu", "8G", 8 * 2**30),
        ("cpu", "512MiB", 512 * 2**20),
        ("cpu", "0", None),
        # CUDA reserves address space far beyond its use: an address-space limit breaks it.
        ("cuda:0", None, None),
        ("cuda:0", "8G", None),
    ],
    ids=["cpu-default", "cpu-8G", "cpu-512MiB", "cpu-none", "cuda", "cuda-set"],
)
def test_the_worker_memory_limit_is_three_quarters_of_the_machine_or_the_variable(
    monkeypatch: pytest.MonkeyPatch, device: str, value: str | None, limit: int | str | None
) -> None:
    if value is None:
        monkeypatch.delenv(MEMORY_ENV, raising=False)
    else:
        monkeypatch.setenv(MEMORY_ENV, value)
    total = machine_memory()
    assert total is not None
    expected = int(total * 0.75) if limit == "default" else limit
    assert ProbeWorker(device).memory_limit == expected  # no process is started


@pytest.mark.timeout(180)
def test_an_auto_worker_without_a_gpu_runs_under_the_memory_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``device: auto``, the spec's default, started its worker with no limit at all: a leaking
    workload reached 13.3 GB under a 3G setting. Where auto finds no GPU it is the CPU's."""
    monkeypatch.setenv(MEMORY_ENV, "6G")
    with ProbeWorker("auto") as w:
        w.start()
        with open(f"/proc/{w.pid}/limits") as f:
            line = next(row for row in f if row.startswith("Max address space"))
    limited = not torch.cuda.is_available()
    assert line.split()[3] == (str(6 * 2**30) if limited else "unlimited")
    assert w.memory_limit == (6 * 2**30 if limited else None)


@pytest.mark.timeout(180)
def test_a_memory_limit_too_small_to_start_torch_is_refused_with_the_figure_that_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AUTOTUNE_WORKER_MEMORY=3G failed with "OpenBLAS error" and a traceback; a limit the
    worker cannot start under is one line naming the variable and a size that works."""
    monkeypatch.setenv(MEMORY_ENV, "1G")
    with ProbeWorker("cpu") as w, pytest.raises(SpecError) as info:
        w.run("tiny_mlp", cand(), SHORT, timeout=60)
    said = str(info.value)
    assert said.startswith("AUTOTUNE_WORKER_MEMORY=1.0 GiB is too small for the probe worker")
    enough = re.search(r"at least AUTOTUNE_WORKER_MEMORY=(\d+)G", said)
    assert enough, said
    monkeypatch.setenv(MEMORY_ENV, f"{enough[1]}G")  # and that figure does work
    with ProbeWorker("cpu") as w:
        assert w.run("tiny_mlp", cand(), SHORT, timeout=60).outcome == Outcome.COMPLETED
    # The service, whose every study would fail, refuses it before it starts.
    from typer.testing import CliRunner

    from autotune.cli import app

    monkeypatch.setenv(MEMORY_ENV, "1G")
    served = CliRunner().invoke(app, ["serve", "--devices", "cpu", "--storage", "sqlite://"])
    assert served.exit_code == 2, served.output
    assert "AUTOTUNE_WORKER_MEMORY=1.0 GiB is too small" in served.output
    assert "Traceback" not in served.output


@pytest.mark.parametrize("value", ["lots", "8X", "-1G"])
def test_a_bad_worker_memory_variable_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(MEMORY_ENV, value)
    with pytest.raises(SpecError, match=f"AUTOTUNE_WORKER_MEMORY must be a size like 8G.*{value}"):
        ProbeWorker("cpu")
