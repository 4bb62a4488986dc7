"""A search's progress where a notebook shows it: a tqdm bar when tqdm is installed, plain lines
otherwise.

:class:`NotebookProgress` is the ``on_event`` callback :func:`autotune.tune` gives the search.
The bar fills with the budget's seconds; its label says the phase, the trials so far and the
best setting with its speedup over the fp32 reference. A line is printed for each phase and
each new best, so the notebook keeps a record once the bar is gone; the closing line is the
config the search wrote (or that it fell back, and why). ``tqdm.auto`` draws the
widget in Jupyter and text elsewhere; no other dependency is needed for it.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, TextIO

from autotune.report._format import config_notes, ratio_text
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Outcome
from autotune.search import (
    FALLING_BACK,
    Budget,
    Event,
    PhaseStarted,
    TrialFinished,
    TrialStarted,
)
from autotune.study.trials import label as params_label

__all__ = ["NotebookProgress"]

# Outcomes of a result event that leave a trial complete; "crashed" is failed; the rest pruned.
_COMPLETE = (Outcome.COMPLETED, Outcome.INFEASIBLE, Outcome.REUSED)


class NotebookProgress:
    """The ``on_event`` callback of a search run from a notebook or a script.

    Args:
        budget: the search's clock: the bar's total and position.
        title: printed first, e.g. ``"tuning LitClassifier on cpu for 5m"``.
        bar: draw a tqdm bar (None: when ``tqdm`` is installed); False prints lines only.
        out: where lines go; stdout by default (a notebook shows it under the cell).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with NotebookProgress(Budget(60.0), title="tuning", bar=False, out=out) as progress:
        ...     progress(PhaseStarted("search"))
        >>> print(out.getvalue().strip())
        tuning
        search at 0s of 1m00s
        done: 0 trials
    """

    def __init__(
        self,
        budget: Budget,
        *,
        title: str = "",
        bar: bool | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.budget, self.title, self.out = budget, title, out or sys.stdout
        self.counts: Counter[str] = Counter()
        self.phase = "starting"
        self.best = ""
        self.current = ""
        self._bar: Any = None
        self._want_bar = bar
        # The config the search wrote, in words: the closing line's, in place of its best trial;
        # and the lines before it: the timing noise and others' load, as every surface says them.
        self.outcome = ""
        self.notes: list[str] = []

    def __enter__(self) -> NotebookProgress:
        if self.title:
            self._print(self.title)
        if self._want_bar is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=round(self.budget.total),
                    unit="s",
                    desc="starting",
                    bar_format="{desc} |{bar}| {n:.0f}/{total:.0f}s",
                    file=self.out,
                    leave=True,
                )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        how = "done" if exc_type is None else "stopped"
        self._refresh()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        tail = f"; {self.outcome}" if self.outcome else (f"; best {self.best}" if self.best else "")
        for note in self.notes:
            self._print(note)
        self._print(f"{how}: {self._trials()}{tail}")

    def config_written(self, config: TunedConfig) -> None:
        """What the search ended with, for the closing line: the config and its validated
        speedup, or that it fell back to the fp32 reference, and why (the search's best trial
        is not the config when validation refused it)."""
        ev = config.evidence
        settings = f"{config.precision} bs={config.batch_size} lr={config.learning_rate:.3g}"
        if ev.validated:
            shown = ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high)
            self.outcome = f"config {settings}: {shown} the fp32 reference, validated"
        else:
            note = ev.validation_note or ""
            # (A fallback's note ends saying so: once is enough.)
            said = (
                note if note.endswith(FALLING_BACK) else f"fell back to the fp32 reference: {note}"
            )
            self.outcome = f"config {settings}: {said.rstrip(': ')}"
        self.notes = config_notes(config, why=False)  # the closing line says why

    # ---- events ---------------------------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Take one search event."""
        if isinstance(event, PhaseStarted):
            phase = event.phase + (f" ({event.mode})" if event.mode else "")
            if phase != self.phase:
                self.phase = phase
                self._print(
                    f"{phase} at {_seconds(self.budget.elapsed())} of {_seconds(self.budget.total)}"
                )
        elif isinstance(event, TrialStarted):
            c = event.candidate
            self.current = f"{c.precision} bs={c.batch_size} lr={c.learning_rate:.3g}"
        elif isinstance(event, TrialFinished):
            self._on_result(event)
        self._refresh()

    def _on_result(self, event: TrialFinished) -> None:
        outcome = event.outcome
        if outcome in _COMPLETE:
            self.counts["complete"] += 1
        elif outcome == Outcome.CRASHED:
            self.counts["failed"] += 1
        else:
            self.counts["pruned"] += 1
        self.current = ""
        standing = event.standing
        if standing is not None and standing.best_params:
            text = params_label(standing.best_params)
            if standing.best_speedup:
                text += f", {standing.best_speedup:.2f}x the fp32 reference"
            if text != self.best:
                self.best = text
                self._print(f"new best: {text}")

    # ---- drawing --------------------------------------------------------------------------

    def _trials(self) -> str:
        n = sum(self.counts.values())
        parts = [
            f"{self.counts[k]} {k}" for k in ("complete", "pruned", "failed") if self.counts[k]
        ]
        return f"{n} trials" + (f" ({', '.join(parts)})" if parts else "")

    def _refresh(self) -> None:
        if self._bar is None:
            return
        desc = f"{self.phase} · {self._trials()}"
        if self.current:
            desc += f" · now {self.current}"
        self._bar.set_description_str(desc, refresh=False)
        self._bar.n = min(self.budget.total, self.budget.elapsed())
        self._bar.refresh()

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)


def _seconds(value: float) -> str:
    """``75.4`` → ``"1m15s"``; ``9.6`` → ``"10s"``."""
    total = max(0, round(value))
    if total < 60:
        return f"{total}s"
    m, s = divmod(total, 60)
    return f"{m}m{s:02d}s"
