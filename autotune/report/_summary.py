"""The summary ``autotune search`` prints when it ends, for a person at a terminal: one table in
80 columns, and lines for what does not fit it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optuna.trial import FrozenTrial, TrialState
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.execution.contention import NOTABLE, cores, others_text
from autotune.report._data import counts_text
from autotune.report._format import (
    kept_lr_text,
    noise_text,
    optimism_text,
    ratio_text,
    throughput_text,
)
from autotune.report._knob_gains import config_knobs, knob_lines
from autotune.report.progress import scale_text
from autotune.schema.enums import Role
from autotune.schema.workload_spec import workload_label
from autotune.study.reference import ReferenceRecord
from autotune.study.trials import display_outcome, record, role_trials, trial_counts

__all__ = ["print_summary"]

Row = tuple[str, str, str, str, str]


def settings_text(
    precision: str,
    batch_size: object,
    learning_rate: float | None,
    params: Mapping[str, Any],
    knobs: str = "",
) -> str:
    """A row's settings: ``fp16 bs=128 lr=0.1 init_scale=65536``, then its knobs.

    Example:
        >>> settings_text("fp16", 128, 0.1, {"init_scale": 65536.0})
        'fp16 bs=128 lr=0.1 init_scale=65536'
        >>> settings_text("fp32", 128, None, {"lr_multiplier": 2.0})
        'fp32 bs=128 lr×2'
    """
    if learning_rate is None:
        lr = f"lr×{float(params.get('lr_multiplier', 1.0)):.3g}"
    else:
        lr = f"lr={learning_rate:.3g}"
    text = f"{precision} bs={batch_size} {lr}"
    if precision == "fp16" and params.get("init_scale") is not None:
        text += f" init_scale={scale_text(float(params['init_scale']))}"
    return text + knobs


def _half_width(value: float | None, low: float | None, high: float | None) -> float | None:
    """An interval's half-width relative to its value (0.018: ±1.8%); None where unknown (a
    probe cut short after one timed step stores its figure as both ends: no interval, where
    ``±0.0%`` read as a perfectly steady one)."""
    if not value or low is None or high is None or high <= low:
        return None
    return (high - low) / 2 / value


def _samples(value: float | None, low: float | None, high: float | None) -> str:
    """Samples/s with its interval as a relative half-width, narrow enough for the table:
    ``23,729.9 ±1.8%`` (the speedups beside it carry their whole interval).

    Example:
        >>> _samples(950.0, 940.0, 960.0), _samples(950.0, None, None), _samples(None, 1, 2)
        ('950.0 ±1.1%', '950.0', '—')
        >>> _samples(101.3, 101.3, 101.3)
        '101.3'
    """
    half = _half_width(value, low, high)
    return throughput_text(value) + ("" if half is None else f" ±{half:.1%}")


def _winner_params(result: Any) -> Mapping[str, Any] | None:
    """The parameters of the trial behind the config: validation's winner, else the trial the
    config was stored as (it holds them too)."""
    selection = getattr(result, "selection", None)
    if selection is not None and selection.winner is not None:
        return selection.winner.trial.params
    crowned = [t for t in result.store.trials() if record(t).tuned_config]
    return crowned[-1].params if crowned and crowned[-1].params else None


def _winner_rows(result: Any) -> list[Row]:
    cfg = result.config
    ev = cfg.evidence
    params = _winner_params(result)
    scale = {"init_scale": cfg.grad_scaler.init_scale} if cfg.grad_scaler.enabled else {}
    settings = settings_text(
        cfg.precision, cfg.batch_size, cfg.learning_rate, scale, config_knobs(cfg, params)
    )
    if ev.validated:
        status = "validated" + (
            f" over {ev.paired_blocks} paired blocks" if ev.paired_blocks else ""
        )
    else:
        status = "NOT validated: fp32 fallback"
    rows = [
        (
            "winner",
            settings,
            _samples(ev.throughput, ev.throughput_low, ev.throughput_high),
            ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high),
            status,
        )
    ]
    if ev.search_speedup is not None:
        optimism = f"search optimism {optimism_text(ev.search_optimism)}"
        rows.append(("  in search", "the same", "", f"{ev.search_speedup:.2f}x", optimism))
    return rows


def _reference_row(reference: ReferenceRecord | None) -> Row:
    """The fp32 reference's row: its latest measurement with its interval."""
    if reference is None:
        return ("fp32 reference", "—", "—", "—", "not measured")
    settings = settings_text(reference.precision, reference.batch_size, reference.learning_rate, {})
    m = reference.latest()
    if m is None:
        return ("fp32 reference", settings, "—", "—", "not measured")
    n = len(reference.measurements)
    outcome = f"measured {n} time{'s' if n != 1 else ''}" + (", latest shown" if n > 1 else "")
    low, high = (m.low, m.high) if m.blocks > 0 else (None, None)
    return ("fp32 reference", settings, _samples(m.throughput, low, high), "1.00x", outcome)


def _amp_row(amp: FrozenTrial | None) -> Row:
    """The plain AMP recipe's row; its reason, when it did not complete, goes below the table."""
    if amp is None:
        return ("plain AMP recipe", "—", "—", "—", "not run")
    rec = record(amp)
    p = amp.params or amp.system_attrs.get("fixed_params") or {}
    settings = settings_text(
        str(p.get("precision", "fp16")), p.get("batch_size", "—"), rec.learning_rate, p
    )
    outcome = display_outcome(amp) or amp.state.name.lower()
    if amp.state != TrialState.COMPLETE:
        return ("plain AMP recipe", settings, "—", "—", outcome)
    speedup = ratio_text(rec.speedup, rec.speedup_low, rec.speedup_high)
    tp = _samples(rec.throughput, rec.throughput_low, rec.throughput_high)
    return ("plain AMP recipe", settings, tp, speedup, outcome)


def _noise(result: Any) -> str:
    """This device's timing noise, as the config and the report show it
    (:meth:`ReferenceRecord.timing_noise`), else the reference's interval where no run timed
    enough blocks for a spread."""
    ev = result.config.evidence
    if ev.noise:
        return noise_text(ev.noise)
    reference = result.reference
    noise = reference.timing_noise() if reference is not None else None
    latest = reference.latest() if reference is not None else None
    if noise or latest is None or latest.blocks <= 0:
        return noise_text(noise)
    return noise_text(0.0, _half_width(latest.throughput, latest.low, latest.high))


# The table's columns: header, the narrowest it may get (the longest word it must keep whole:
# ``init_scale=1048576``, ``(3.93–4.01)``), and the order in which space beyond those goes,
# the outcome first, so that it keeps to a line or two.
_COLUMNS: tuple[tuple[str, int, int], ...] = (("", 14, 4), ("settings", 20, 1))
_COLUMNS += (("samples/s", 9, 3), ("vs fp32", 11, 2), ("outcome", 16, 0))
# Between two columns: the (blank) divider and a space of padding.
_GAP = 2


def _widths(rows: list[Row], total: int) -> list[int]:
    """Each column's width: as wide as its longest cell where the table fits ``total``
    columns; otherwise its narrowest, then what is left by the columns' priority."""
    natural = [
        max([len(head)] + [len(line) for row in rows for line in row[i].splitlines()])
        for i, (head, _, _) in enumerate(_COLUMNS)
    ]
    room = total - _GAP * (len(_COLUMNS) - 1)
    if sum(natural) <= room:
        return natural
    widths = [min(n, least) for n, (_, least, _) in zip(natural, _COLUMNS, strict=True)]
    for i in sorted(range(len(_COLUMNS)), key=lambda i: _COLUMNS[i][2]):
        widths[i] += max(0, min(natural[i] - widths[i], room - sum(widths)))
    return widths


def summary_table(result: Any, width: int = 80) -> Table:
    """The winner, the fp32 reference and the plain AMP recipe, within ``width`` columns.

    Cells wrap between words, never inside one (``init_scale=65536`` stays whole); an outcome
    is a few words (a baseline's reason follows the table).
    """
    amp = role_trials(result.store.trials()).get(Role.AMP_RECIPE)
    rows = [*_winner_rows(result), _reference_row(result.reference), _amp_row(amp)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1))
    for (head, _, _), w in zip(_COLUMNS, _widths(rows, width), strict=True):
        table.add_column(head, width=w, style="bold" if not head else None)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def _items(console: Console, lines: list[str]) -> None:
    """Lines of a list, indented, each wrapped under itself rather than under the margin."""
    grid = Table.grid(padding=(0, 0, 0, 2), pad_edge=True)
    grid.add_column()
    for line in lines:
        grid.add_row(escape(line))
    console.print(grid, highlight=False)


def print_summary(result: Any, console: Console) -> None:
    """Print the end-of-search summary of a :class:`~autotune.search.SearchResult`.

    Args:
        result: what :func:`autotune.search.run_search` returned (its config must be set).
        console: where to print (the CLI's stdout console).
    """
    cfg = result.config
    ev = cfg.evidence
    console.print(
        f"[bold]study {escape(repr(cfg.study))}[/]: {escape(workload_label(cfg.workload))} on "
        f"{escape(cfg.environment.device)}",
        highlight=False,
    )
    console.print(summary_table(result, console.width))
    amp = role_trials(result.store.trials()).get(Role.AMP_RECIPE)
    if amp is not None and amp.state != TrialState.COMPLETE and record(amp).reason:
        outcome = display_outcome(amp) or amp.state.name.lower()
        line = f"plain AMP recipe: {outcome}: {record(amp).reason}"
        console.print(escape(line), highlight=False)
    console.print(f"timing noise: {_noise(result)}", highlight=False)
    moved = moved_text(result.reference)
    if moved:
        console.print(moved, highlight=False)
    # The config's figure where it has one: best.json, the report and this summary say the same.
    taken = (
        ev.others_cores if ev.others_cores is not None else getattr(result, "others_cores", None)
    )
    if taken is not None and taken >= NOTABLE:
        console.print(others_text(taken, cores()), highlight=False)
    if ev.cut:
        console.print("[bold]cut from the space:[/]")
        _items(console, [f"{key}: {why}" for key, why in ev.cut.items()])
    diagnosis = ev.fp16_diagnosis or {}
    if diagnosis.get("islands"):
        console.print(
            f"fp16 diagnosis: {diagnosis.get('reason', '')}; fp32 islands {diagnosis['islands']}",
            highlight=False,
            markup=False,
        )
    knobs = knob_lines(result.store.trials())
    if knobs:
        console.print("[bold]what each knob brought[/] (best with it, vs the same point without):")
        _items(console, knobs)
    if cfg.compile and ev.compile_seconds is not None:
        pays = (
            f"pays off after {ev.compile_break_even_steps:,} training steps"
            if ev.compile_break_even_steps is not None
            else "its payoff is unknown (no uncompiled twin measured faster or slower)"
        )
        console.print(
            f"compile: {ev.compile_seconds:.1f}s in the untimed warm-up (charged to the "
            f"budget); {pays}",
            highlight=False,
        )
    if result.rejected:
        console.print("[bold]main rejections:[/]")
        _items(console, [str(r) for r in result.rejected[:6]])
    console.print(
        f"trials: {counts_text(trial_counts(result.store.trials()))}; "
        f"lr scaling: {ev.lr_scaling}{kept_lr_text(cfg)}; {result.elapsed:.1f}s elapsed",
        highlight=False,
    )
    if ev.validation_note:
        console.print(f"validation: {escape(ev.validation_note)}", highlight=False)
    console.print(f"config written to [bold]{escape(str(result.path))}[/]", highlight=False)


# The fp32 reference's measurements this far apart (highest over lowest) are worth a line.
MOVED = 1.1


def moved_text(reference: ReferenceRecord | None) -> str:
    """A line where the fp32 reference's measurements moved by more than a tenth over the
    search: the table's samples/s were measured at different times, and each ratio divides by
    the reference measured nearest in time (on an H200 the AMP recipe's 19,756 samples/s stood
    at 0.94x beside the reference's latest 14,922); empty otherwise.

    Example:
        >>> from autotune.study.reference import ReferenceMeasurement as M
        >>> ms = [M(at=1.0, throughput=t, low=t, high=t) for t in (21760.0, 14922.4)]
        >>> moved_text(ReferenceRecord(batch_size=128, learning_rate=0.1, measurements=ms))
        'the fp32 reference measured 14,922–21,760 samples/s over the search (2 runs): each ratio divides by the one measured nearest in time, so compare rows by their ratios'
    """
    rates = [m.throughput for m in (reference.measurements if reference else []) if m.throughput]
    if len(rates) < 2 or max(rates) < MOVED * min(rates):
        return ""
    return (
        f"the fp32 reference measured {min(rates):,.0f}–{max(rates):,.0f} samples/s over the "
        f"search ({len(rates)} runs): each ratio divides by the one measured nearest in time, "
        "so compare rows by their ratios"
    )
