"""Search progress: the live view on a terminal, plain lines elsewhere, a clean stop on Ctrl-C,
and `autotune search` output with no control characters when it is not a terminal."""

from __future__ import annotations

import io
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli import run_tiny_search
from loguru import logger
from rich.console import Console

from autotune.measure.ceilings import Ceiling
from autotune.report.progress import SearchProgress
from autotune.schema.spec import Candidate
from autotune.search import (
    Budget,
    CeilingFound,
    Event,
    HardwareChecked,
    PhaseStarted,
    Standing,
    TrialFinished,
    TrialStarted,
)

ROOT = Path(__file__).resolve().parent.parent
# Anything below 0x20 but newline and tab, and DEL: escapes, carriage returns, backspaces.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

REF = {"precision": "fp32", "batch_size": 32, "lr_multiplier": 1.0}
BF16 = {"precision": "bf16", "batch_size": 64, "lr_multiplier": 1.2}


def standing(best: dict | None, best_tp: float | None, ref_tp: float | None = 1000.0) -> Standing:
    speedup = best_tp / ref_tp if best_tp and ref_tp else None
    return Standing(
        best=speedup,
        best_params=best,
        best_throughput=best_tp,
        best_speedup=speedup,
        reference_throughput=ref_tp,
    )


def cand(precision: str, bs: int, lr: float = 0.2, init_scale: float = 65536.0) -> Candidate:
    return Candidate(precision=precision, batch_size=bs, learning_rate=lr, init_scale=init_scale)


# One short search, as run_search reports it: every kind of event and outcome once.
EVENTS: list[Event] = [
    HardwareChecked(modes=["fp32", "fp16", "bf16"], cut={"tf32": "a CUDA feature"}),
    PhaseStarted(phase="ceilings", mode="fp32"),
    CeilingFound(mode="fp32", ceiling=Ceiling(precision="fp32", batch_size=128, limited_by="cap")),
    PhaseStarted(phase="ceilings", mode="bf16"),
    CeilingFound(mode="bf16", ceiling=Ceiling(precision="bf16", batch_size=64, limited_by="memory")),
    PhaseStarted(phase="search"),
    TrialStarted(number=0, candidate=cand("fp32", 32)),
    TrialFinished(number=0, outcome="completed", throughput=1000.0, speedup=1.0,
                  standing=standing(REF, 1000.0)),
    TrialStarted(number=1, candidate=cand("fp16", 256, init_scale=1024.0)),
    TrialFinished(number=1, outcome="oom", reason="out of memory at batch_size=256",
                  standing=standing(REF, 1000.0)),
    TrialStarted(number=2, candidate=cand("bf16", 64, 0.48)),
    TrialFinished(number=2, outcome="completed", throughput=1500.0, speedup=1.5, gap=0.01,
                  standing=standing(BF16, 1500.0)),
    TrialStarted(number=3, candidate=cand("bf16", 64, 0.48)),  # a twin: no result follows
    TrialStarted(number=4, candidate=cand("fp16", 32)),
    TrialFinished(number=4, outcome="infeasible", throughput=1700.0, speedup=1.7, gap=0.07,
                  standing=standing(BF16, 1500.0)),
    TrialStarted(number=5, candidate=cand("bf16", 32)),
    TrialFinished(number=5, outcome="crashed", reason="worker process died"),
    PhaseStarted(phase="validation"),
]  # fmt: skip


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """Log messages emitted during the test (the test process's other handlers untouched)."""
    out: list[str] = []
    handler = logger.add(lambda m: out.append(m.record["message"]), level="DEBUG")
    yield out
    logger.remove(handler)


def feed(progress: SearchProgress, events: list[Event] = EVENTS) -> None:
    for event in events:
        progress(event)


def test_plain_mode_logs_each_result_with_the_standing(messages: list[str]) -> None:
    progress = SearchProgress(
        Budget(60.0), console=Console(file=io.StringIO()), parity_tolerance=0.05
    )
    assert progress.live is False  # a StringIO is not a terminal
    with progress:
        feed(progress)
    c = progress.counts
    assert (c["complete"], c["infeasible"], c["pruned"], c["failed"], c["reused"]) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert "modes to search: fp32, fp16, bf16 (cut: tf32)" in messages
    assert any(m.startswith("phase ceilings (bf16) at") for m in messages)
    assert any(m.startswith("phase validation at") for m in messages)
    assert "new best: bf16 bs=64 lr×1.2 at 1,500.0 samples/s, 1.50x the fp32 reference" in messages
    assert (
        "trial 4 infeasible: loss +7.0% vs the fp32 reference at equal samples seen (tolerance 5%)"
        in messages
    )
    assert any("trial 3 has the parameters of an earlier trial" in m for m in messages)
    status = [m for m in messages if m.startswith("progress: ")]
    assert len(status) == 5  # one per result
    assert "3 complete (1 infeasible) · 1 pruned (oom 1) · 1 failed · 1 reused" in status[-1]
    assert "best bf16 bs=64 lr×1.2 at 1,500.0 samples/s, 1.50x the fp32 reference" in status[-1]


def test_live_view_shows_the_state_and_stops_cleanly_on_ctrl_c(messages: list[str]) -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=110, color_system=None)
    progress = SearchProgress(
        Budget(60.0, started=time.monotonic() - 30),
        console=console,
        title="tiny · tiny_convnet",
        device="auto",
    )
    assert progress.live is True
    # The spec said auto; the worker says which device that is.
    cut = {"tf32": "a CUDA feature"}
    answered = HardwareChecked(modes=["fp32", "fp16", "bf16"], cut=cut, device="cpu")
    with pytest.raises(KeyboardInterrupt), progress:
        feed(progress, [answered, *EVENTS[1:-1]])
        progress(TrialStarted(number=6, candidate=cand("bf16", 128)))
        time.sleep(0.3)  # at least one refresh from the live view's thread
        raise KeyboardInterrupt
    assert progress._live is None
    out = screen.getvalue()
    # The last frame says how it ended, with the numbers, and the cursor is given back.
    last = out[out.rfind("autotune search") :]
    assert last.startswith("autotune search · tiny · tiny_convnet on cpu")
    assert "interrupted" in last
    assert "3 complete (1 infeasible) · 1 pruned (oom 1) · 1 failed · 1 reused" in last
    assert "fp32 ≤128 · fp16 · bf16 ≤64   cut: tf32" in last
    assert "best    bf16 bs=64 lr×1.2 at 1,500.0 samples/s, 1.50x the fp32 reference" in last
    # 30 s were spent when the view opened; a busy machine shows more by the last frame.
    spent = re.search(r"(\d+)s of 1m00s", last)
    assert spent and 30 <= int(spent.group(1)) < 60, last
    assert "\x1b[?25h" in out[-50:]
    # In live mode the per-result status lines stay off the log: the view shows them.
    assert not [m for m in messages if m.startswith("progress: ")]


@pytest.mark.timeout(200)
def test_logging_during_a_live_view_does_not_deadlock() -> None:
    """Log lines print through the console the live view redraws from another thread: the
    progress lock must never be held while waiting for the console's."""
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100, color_system=None)
    # What the CLI's log sink does: print each line through the console.
    handler = logger.add(lambda m: console.print(str(m).rstrip("\n")), level="DEBUG")
    try:
        progress = SearchProgress(Budget(60.0), console=console)
        done = threading.Event()

        def run() -> None:
            with progress:
                for _ in range(15):
                    feed(progress)
                    time.sleep(0.02)
            done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        # A deadlock never ends; a busy machine's 15 redraws can take many seconds.
        assert done.wait(150), "the live view and the logger deadlocked"
    finally:
        logger.remove(handler)
    assert "new best: bf16 bs=64" in screen.getvalue()


def test_search_output_has_no_control_characters_when_not_a_terminal(tmp_path: Path) -> None:
    """`autotune search | tee` or CI: plain lines, no escapes, no live view; files written."""
    out_dir = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    proc = run_tiny_search(
        tmp_path, out_dir, env={**env, "TERM": "xterm-256color", "COLUMNS": "80"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        bad = CONTROL.findall(text)
        assert not bad, f"{name} holds control characters {sorted(set(bad))!r}"
    assert "╭" not in proc.stderr  # the live view's frame: never drawn into a pipe
    assert re.search(r"\| INFO    \| phase search at \d+s of 25s", proc.stderr)
    assert "config written to" in proc.stdout and "report written to" in proc.stdout
    assert (out_dir / "best.json").is_file() and (out_dir / "report.html").is_file()
    log = (out_dir / "search.log").read_text()
    assert "| INFO    | autotune.search." in log and "phase search at" in log


def test_a_notebooks_closing_line_is_the_config_and_says_when_it_fell_back() -> None:
    """A search whose best trial (bf16, 1.82x) validation refused returns the fp32 reference: the
    closing line says so and why, not "best bf16 ... 1.82x"; a validated config shows its
    speedup with its interval."""
    from _configs import make_config

    from autotune.report.notebook import NotebookProgress
    from autotune.search import Budget, Standing, TrialFinished

    def closing(config: object) -> str:
        out = io.StringIO()
        with NotebookProgress(Budget(60.0), bar=False, out=out) as progress:
            best = Standing(best_params={"precision": "bf16", "batch_size": 64}, best_speedup=1.82)
            progress(TrialFinished(number=0, outcome="completed", standing=best))
            progress.config_written(config)  # type: ignore[arg-type]
        return out.getvalue().strip().splitlines()[-1]

    fell_back = make_config("fp32", batch_size=32)
    fell_back.evidence.validated = False
    fell_back.evidence.validation_note = "bf16 bs=64: loss parity +7.0% (upper bound +8.1%)"
    line = closing(fell_back)
    assert line.startswith("done: 1 trials") and "1.82x" not in line
    assert "config fp32 bs=32 lr=0.1: fell back to the fp32 reference: bf16 bs=64: loss" in line
    validated = make_config("bf16", batch_size=64)
    validated.evidence.speedup_low, validated.evidence.speedup_high = 1.9, 2.1
    assert "config bf16 bs=64 lr=0.1: 2.00x (1.90–2.10) the fp32 reference, validated" in (
        closing(validated)
    )
