"""The report of a study: a self-contained HTML page with plots (:func:`write_report`), and short
text summaries for a terminal."""

from __future__ import annotations

from pathlib import Path

from autotune.infra.files import make_dirs, write_text
from autotune.report._data import DEFAULT_STORAGE, ReportData, collect, load_study
from autotune.report._format import (
    busy_text,
    config_notes,
    noise_text,
    optimism_text,
    ratio_text,
    throughput_text,
)
from autotune.report._html import render_html
from autotune.report._knob_gains import KnobGain, knob_gains, knob_lines
from autotune.report._summary import print_summary
from autotune.report._text import render_text
from autotune.study.store import StudyStore

__all__ = [
    "DEFAULT_STORAGE",
    "KnobGain",
    "ReportData",
    "busy_text",
    "collect",
    "config_notes",
    "knob_gains",
    "knob_lines",
    "load_study",
    "noise_text",
    "optimism_text",
    "print_summary",
    "ratio_text",
    "render_html",
    "render_text",
    "throughput_text",
    "write_report",
]


def write_report(
    study: str | StudyStore,
    *,
    storage: str = DEFAULT_STORAGE,
    out_dir: str | Path | None = None,
) -> Path:
    """Write ``report.html`` for a study; returns its path.

    Args:
        study: a study name (opened from ``storage``) or an open study's store.
        storage: the Optuna storage URL; the spec's default SQLite file when omitted.
        out_dir: the folder for ``report.html`` (and where ``best.json`` is looked for first);
            ``studies/<name>/`` by default.

    Returns:
        The path of the written report.

    Raises:
        StorageError: the storage cannot be opened or holds no study of that name (the message
            lists the studies it holds).

    Example:
        >>> from autotune.report import write_report
        >>> write_report("tiny")  # doctest: +SKIP
        PosixPath('studies/tiny/report.html')
    """
    if isinstance(study, str):
        study = load_study(study, storage)
    out = Path(out_dir) if out_dir is not None else Path("studies") / study.name
    data = collect(study, out_dir=out, storage=storage)
    # The owner's only, unless AUTOTUNE_UMASK says otherwise (autotune.infra.files).
    make_dirs(out)
    path = out / "report.html"
    # Write beside, then rename: a reader never opens a half-written page.
    tmp = path.with_suffix(".html.tmp")
    write_text(tmp, render_html(data))
    tmp.replace(path)
    return path
