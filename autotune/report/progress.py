"""Live progress of a search: the phase, the budget, the trials, the best so far.

:class:`SearchProgress` is the ``on_event`` callback of :func:`autotune.search.run_search`.

- On a terminal it draws a rich live view, redrawn four times a second so the budget bar moves
  between events; log lines scroll above it.
- Anywhere else (CI, a pipe, a service, ``--log-json``) it draws nothing: after every trial it
  logs one status line whose numbers are also bound as fields, so JSON logs carry them.

Either way it logs the milestones the search itself does not: phase changes, a new best, an
infeasible result with its parity gap, a trial that reused an earlier measurement.

Use it as a context manager: the live view is stopped in ``__exit__`` whatever ends the search
(Ctrl-C included), so the terminal gets its cursor back and no half-drawn frame stays behind.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from loguru import logger
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from autotune.schema.enums import Outcome
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
from autotune.study.trials import label as params_label

__all__ = ["SearchProgress", "candidate_label", "params_label", "scale_text"]

# Outcomes of a "result" event that leave a trial COMPLETE; "crashed" is FAIL; the rest PRUNED.
_COMPLETE = (Outcome.COMPLETED, Outcome.INFEASIBLE)
_FAILED = (Outcome.CRASHED,)


def _seconds(value: float) -> str:
    """``75.4`` → ``"1m15s"``; ``9.6`` → ``"10s"``."""
    total = max(0, round(value))
    if total < 60:
        return f"{total}s"
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def scale_text(value: float) -> str:
    """A GradScaler scale as people write it: ``1048576`` not ``1.04858e+06``; ``0.5`` stays.

    Example:
        >>> scale_text(2.0**20), scale_text(0.5)
        ('1048576', '0.5')
    """
    return f"{value:.0f}" if value >= 1 and float(value).is_integer() else f"{value:g}"


def candidate_label(candidate: dict[str, Any]) -> str:
    """``{"precision": "fp16", "batch_size": 64, "learning_rate": 0.1, ...}`` →
    ``"fp16 bs=64 lr=0.1 init_scale=1024"`` (init_scale only where a GradScaler runs).

    Example:
        >>> candidate_label({"precision": "bf16", "batch_size": 32, "learning_rate": 0.2})
        'bf16 bs=32 lr=0.2'
    """
    text = (
        f"{candidate.get('precision')} bs={candidate.get('batch_size')} "
        f"lr={float(candidate.get('learning_rate') or 0):.3g}"
    )
    if candidate.get("precision") == "fp16" and candidate.get("init_scale") is not None:
        text += f" init_scale={scale_text(float(candidate['init_scale']))}"
    if candidate.get("compile"):
        mode = candidate.get("compile_mode") or "default"
        text += " compile" if mode == "default" else f" compile={mode}"
    if candidate.get("fp32_modules"):
        text += f" fp32[{','.join(candidate['fp32_modules'])}]"
    return text


class _Deferred:
    """A log call kept until :meth:`SearchProgress.__call__` has released its lock."""

    def __init__(self, queue: list, fields: dict[str, Any]) -> None:
        self.queue, self.fields = queue, fields

    def info(self, message: str, *args: Any) -> None:
        self.queue.append(("INFO", self.fields, message, args))

    def debug(self, message: str, *args: Any) -> None:
        self.queue.append(("DEBUG", self.fields, message, args))


class SearchProgress:
    """The ``on_event`` callback of a search: a live view on a terminal, status lines elsewhere.

    Args:
        budget: the search's clock (its ``total``, ``elapsed()`` and ``left()`` feed the bar).
        console: where the live view goes; a stderr console by default.
        live: draw the live view; by default only when ``console`` is a real terminal.
        title: shown on the live view's frame, e.g. the study name and its workload.
        device: where it runs, after the title ("on cpu"); ``auto`` shows the device the worker
            picked once it says.
        parity_tolerance: named in the line about an infeasible trial.

    Example:
        >>> clock = Budget(45.0)  # doctest: +SKIP
        >>> with SearchProgress(clock, title="tiny") as progress:  # doctest: +SKIP
        ...     run_search(spec, budget=clock, on_event=progress)
    """

    def __init__(
        self,
        budget: Budget,
        *,
        console: Console | None = None,
        live: bool | None = None,
        title: str = "",
        device: str = "",
        parity_tolerance: float | None = None,
    ) -> None:
        self.budget = budget
        self.console = console or Console(stderr=True)
        if live is None:
            live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.live = live
        self.title = title
        self.device = device
        self.parity_tolerance = parity_tolerance
        self.phase = "starting"
        self.phase_mode: str | None = None
        self.modes: list[str] = []
        self.cut: dict[str, str] = {}
        self.ceilings: dict[str, int] = {}
        self.counts: Counter[str] = Counter()
        self.pruned_by: Counter[str] = Counter()
        self.current: tuple[int, str, float] | None = None
        self.last = ""
        self.best: dict[str, Any] = {}
        self._pending: int | None = None
        self._lock = threading.Lock()
        self._queue: list[tuple[str, dict[str, Any], str, tuple[Any, ...]]] = []
        self._live: Live | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start drawing the live view (nothing in plain mode)."""
        if self.live and self._live is None:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def stop(self) -> None:
        """Stop the live view and give the terminal back; safe to call more than once."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def __enter__(self) -> SearchProgress:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        # The last frame stays on screen: make it say how the search ended, not where it was.
        with self._lock:
            self.current = None
            self.phase_mode = None
            if exc_type is None:
                self.phase = "done"
            elif issubclass(exc_type, KeyboardInterrupt) or "Interrupted" in exc_type.__name__:
                self.phase = "interrupted"
            else:
                self.phase = "stopped"
        self.stop()

    # ---- events ----------------------------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Take one search event (see :mod:`autotune.search`'s event types)."""
        with self._lock:
            if isinstance(event, HardwareChecked):
                self._on_hardware(event)
            elif isinstance(event, PhaseStarted):
                self._on_phase(event)
            elif isinstance(event, CeilingFound):
                self.ceilings[event.mode] = event.ceiling.batch_size
            elif isinstance(event, TrialStarted):
                self._on_trial(event)
            elif isinstance(event, TrialFinished):
                self._on_result(event)
            queued, self._queue = self._queue, []
        # Log only after the lock is released: a log line prints through the console, whose
        # lock the live view's refresh thread holds while it waits for ours to draw a frame.
        for level, fields, message, args in queued:
            logger.bind(**fields).log(level, message, *args)

    def _logger(self, **fields: Any) -> _Deferred:
        return _Deferred(self._queue, fields)

    def _on_hardware(self, event: HardwareChecked) -> None:
        if self.device == "auto" and event.device:
            self.device = event.device
        self.modes = list(event.modes)
        self.cut = dict(event.cut)
        cut = f" (cut: {', '.join(self.cut)})" if self.cut else ""
        self._logger(event="modes", modes=self.modes).info(
            "modes to search: {}{}", ", ".join(self.modes), cut
        )

    def _on_phase(self, event: PhaseStarted) -> None:
        self._settle_pending()
        phase, mode = event.phase, event.mode
        if (phase, mode) == (self.phase, self.phase_mode):
            return
        self.phase, self.phase_mode = phase, mode
        self.current = None
        self._logger(event="phase", phase=phase, mode=mode).info(
            "phase {}{} at {} of {}",
            phase,
            f" ({mode})" if mode else "",
            _seconds(self.budget.elapsed()),
            _seconds(self.budget.total),
        )

    def _on_trial(self, event: TrialStarted) -> None:
        self._settle_pending()
        number = event.number
        label = candidate_label(event.candidate.model_dump())
        self.current = (number, label, time.monotonic())
        self._pending = number
        self._logger(event="trial", trial=number).debug("trial {} started: {}", number, label)

    def _settle_pending(self) -> None:
        """A trial with no result before the next event reused a finished twin's measurement."""
        if self._pending is None:
            return
        number, self._pending = self._pending, None
        self.counts["reused"] += 1
        self.last = f"trial {number}: same parameters as an earlier trial, measurement reused"
        self._logger(event="reused", trial=number).info(
            "trial {} has the parameters of an earlier trial: its measurement is reused", number
        )

    def _on_result(self, event: TrialFinished) -> None:
        number = event.number
        if self._pending == number:
            self._pending = None
        outcome = event.outcome
        head = f"trial {number}"
        if self.current is not None and self.current[0] == number:
            head += f" {self.current[1]}"
        self.current = None
        if outcome == Outcome.REUSED:
            self.counts["reused"] += 1
            self.last = f"{head}: {event.reason or 'measurement reused'}"
        elif outcome in _COMPLETE:
            self.counts["complete"] += 1
            self.last = f"{head}: {event.throughput or 0.0:,.1f} samples/s"
            if event.speedup is not None:
                self.last += f" ({event.speedup:.2f}x)"
            if outcome == Outcome.INFEASIBLE:
                self.counts["infeasible"] += 1
                self.last += " — infeasible (loss parity)"
                self._log_infeasible(number, event.gap)
        elif outcome in _FAILED:
            self.counts["failed"] += 1
            self.last = f"{head}: crashed: {event.reason}"
        else:
            self.counts["pruned"] += 1
            self.pruned_by[outcome] += 1
            self.last = f"{head}: {outcome}: {event.reason}"
        self._update_best(event.standing)
        if not self.live:
            self._log_status()

    def _log_infeasible(self, number: int, gap: Any) -> None:
        tol = (
            f" (tolerance {self.parity_tolerance:.0%})" if self.parity_tolerance is not None else ""
        )
        if gap is None:
            self._logger(event="infeasible", trial=number).info(
                "trial {} infeasible: its loss curve is not comparable to the fp32 reference's",
                number,
            )
            return
        self._logger(event="infeasible", trial=number, parity_gap=gap).info(
            "trial {} infeasible: loss {:+.1%} vs the fp32 reference at equal samples seen{}",
            number,
            float(gap),
            tol,
        )

    def _update_best(self, standing: Standing | None) -> None:
        if standing is None:
            return
        best = {
            "value": standing.best,
            "params": standing.best_params,
            "throughput": standing.best_throughput,
            "speedup": standing.best_speedup,
            "reference": standing.reference_throughput,
        }
        changed = best["params"] is not None and (
            best["params"] != self.best.get("params") or best["value"] != self.best.get("value")
        )
        self.best = best
        if changed:
            self._logger(
                event="best", best_throughput=best["throughput"], speedup=self.speedup()
            ).info("new best: {}", self.best_text())

    # ---- what is shown ---------------------------------------------------------------------

    def speedup(self) -> float | None:
        """The best feasible trial's speedup over the fp32 reference measured near it."""
        value = self.best.get("speedup")
        return float(value) if value else None

    def best_text(self) -> str:
        """``bf16 bs=64 lr×1 at 3,811.6 samples/s, 1.35x the fp32 reference`` or ``—``."""
        params = self.best.get("params")
        if not params:
            return "—"
        text = params_label(params)
        if self.best.get("throughput"):
            text += f" at {float(self.best['throughput']):,.1f} samples/s"
        ratio = self.speedup()
        if ratio is not None:
            text += f", {ratio:.2f}x the fp32 reference"
        return text

    def trials_text(self) -> str:
        """``4 complete (1 infeasible) · 2 pruned (oom 1, diverged 1) · 0 failed``."""
        c = self.counts
        text = f"{c['complete']} complete"
        if c["infeasible"]:
            text += f" ({c['infeasible']} infeasible)"
        text += f" · {c['pruned']} pruned"
        if self.pruned_by:
            text += " (" + ", ".join(f"{k} {n}" for k, n in self.pruned_by.most_common()) + ")"
        text += f" · {c['failed']} failed"
        if c["reused"]:
            text += f" · {c['reused']} reused"
        return text

    def phase_text(self) -> str:
        return self.phase + (f" ({self.phase_mode})" if self.phase_mode else "")

    def budget_text(self) -> str:
        elapsed, total = self.budget.elapsed(), self.budget.total
        left = total - elapsed
        tail = f"{_seconds(left)} left" if left >= 0 else f"{_seconds(-left)} over"
        return f"{_seconds(elapsed)} of {_seconds(total)} · {tail}"

    def _log_status(self) -> None:
        elapsed = self.budget.elapsed()
        self._logger(
            event="progress",
            elapsed_s=round(elapsed, 1),
            budget_s=self.budget.total,
            phase=self.phase,
            complete=self.counts["complete"],
            pruned=self.counts["pruned"],
            failed=self.counts["failed"],
            best_throughput=self.best.get("throughput"),
            speedup=self.speedup(),
        ).info(
            "progress: {} ({:.0%}), {}; trials {}; best {}",
            self.budget_text(),
            min(1.0, elapsed / self.budget.total) if self.budget.total else 1.0,
            self.phase_text(),
            self.trials_text(),
            self.best_text(),
        )

    def __rich__(self) -> RenderableType:
        """The live view, rebuilt on every refresh so the clock moves between events."""
        with self._lock:
            elapsed, total = self.budget.elapsed(), self.budget.total
            over = elapsed > total
            bar = ProgressBar(
                total=total,
                completed=min(elapsed, total),
                width=36,
                complete_style="red" if over else "green",
                finished_style="red",
            )
            clock = Table.grid(padding=(0, 1))
            clock.add_row(bar, Text(self.budget_text(), style="red" if over else ""))
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column(overflow="fold")
            grid.add_row("budget", clock)
            grid.add_row("phase", Text(self.phase_text(), style="cyan"))
            grid.add_row("modes", Text(self._modes_text()))
            grid.add_row("trials", Text(self.trials_text()))
            if self.current is not None:
                number, label, started = self.current
                grid.add_row(
                    "now",
                    Text(f"trial {number}: {label} · {_seconds(time.monotonic() - started)}"),
                )
            if self.last:
                grid.add_row("last", Text(self.last, overflow="ellipsis", no_wrap=True))
            grid.add_row("best", Text(self.best_text(), style="green" if self.best else ""))
            where = f" on {self.device}" if self.device else ""
            title = "autotune search" + (f" · {self.title}{where}" if self.title else where)
            return Panel(Group(grid), title=title, title_align="left", expand=False)

    def _modes_text(self) -> str:
        if not self.modes:
            return "—"
        parts = [f"{m} ≤{self.ceilings[m]}" if self.ceilings.get(m) else m for m in self.modes]
        text = " · ".join(parts)
        # Only whole modes; batch-size cuts live in the ceilings shown beside each mode.
        whole = [k for k in self.cut if " " not in k]
        if whole:
            text += "   cut: " + ", ".join(whole)
        return text
