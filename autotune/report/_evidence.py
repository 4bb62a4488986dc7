"""The charts of the measurements behind the speedups: the fp32 reference over time (drift and
noise), and the winner's speedup as the search measured it against what validation measured.
"""

from __future__ import annotations

import statistics
from datetime import datetime

from autotune.report._data import ReportData, measured_interval
from autotune.report._format import (
    noise_text,
    optimism_text,
    ratio_text,
    sentences,
    throughput_text,
)
from autotune.report._plots import REF_COLOR, Figure, ref_label
from autotune.report._svg import Plot, esc, mode_color, nice_range
from autotune.schema.config import Evidence, TunedConfig
from autotune.schema.spec import ValidationSettings
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord
from autotune.study.trials import label as params_label

__all__ = ["drifted", "reference_figure", "speed_line", "validation_figure"]

_DRIFT = "#c0392b"
_SEARCH = "#8c8c8c"
# What validation's bar was when a stored spec does not say (older studies).
_MIN_SPEEDUP = float(ValidationSettings.model_fields["min_speedup"].default)
# A row of the validation chart: name, speedup, its interval's low and high, colour.
_Row = tuple[str, float, float | None, float | None, str]


# Two measurements without intervals drifted where one is this many times the other (the
# search measures the reference again when two are further apart).
_APART = 1.5


def drifted(measurements: list[ReferenceMeasurement]) -> list[bool]:
    """For each measurement, whether it moved out of the previous one's interval (and the
    previous one out of its), or their figures lie ``_APART`` times apart (a fall from 12.5k
    to 2.2k samples/s, within two wide intervals or between runs too short for one, read as no
    drift at all); a measurement without an interval, by its figure against the other's.

    Example:
        >>> m = [ReferenceMeasurement(at=t, throughput=v, low=lo, high=hi, blocks=b)
        ...      for t, v, lo, hi, b in ((0, 100, 95, 105, 8), (60, 102, 97, 107, 8),
        ...                              (120, 80, 75, 85, 8), (180, 30, 5, 90, 3))]
        >>> drifted(m)
        [False, False, True, True]
    """
    out = [False]
    for prev, m in zip(measurements, measurements[1:], strict=False):
        (plo, phi), (lo, hi) = measured_interval(prev), measured_interval(m)
        low, high = sorted((prev.throughput, m.throughput))
        moved = high > _APART * low
        if plo is not None and phi is not None and lo is not None and hi is not None:
            moved = moved or hi < plo or lo > phi
        elif plo is not None and phi is not None:
            moved = moved or not plo <= m.throughput <= phi
        elif lo is not None and hi is not None:
            moved = moved or not lo <= prev.throughput <= hi
        out.append(moved)
    return out


def reference_figure(data: ReportData) -> Figure:
    """The fp32 reference's throughput at each measurement over the search, with intervals:
    a machine that drifts shows as a moving reference."""
    ref = data.reference
    ms = sorted(data.reference_measurements(), key=lambda m: m.at)
    if ref is None or not ms:
        return Figure(None, note="This study holds no measurement of the fp32 reference.")
    if data.legacy_reference is not None:
        m = ms[-1]
        return Figure(
            None,
            note=(
                f"The fp32 reference ({ref_label(ref)}) was measured once, at "
                f"{m.throughput:,.1f} samples/s, by an older autotune: no interval, no drift "
                "to show."
            ),
        )
    minutes = _in_minutes(ms)
    xs = [(m.at - ms[0].at) / (60.0 if minutes else 1.0) for m in ms]
    plot = _reference_axes(ms, xs, minutes)
    median = statistics.median(m.throughput for m in ms)
    if len(ms) > 1:
        plot.hline(median, "#999", label=f"median {median:,.1f}", dash="2 3")
        plot.line([(x, m.throughput) for x, m in zip(xs, ms, strict=True)], REF_COLOR, width=1.2)
    moved = drifted(ms)
    for x, m, drift in zip(xs, ms, moved, strict=True):
        _draw_measurement(plot, x, m, drift)
    legend = [("measurement", REF_COLOR, "dot")]
    if any(moved):
        legend.append(("drifted from the previous one", _DRIFT, "dot"))
    caption = _reference_caption(data, ref, ms, moved)
    return Figure(plot.render(), caption=caption, legend=legend)


def _in_minutes(ms: list[ReferenceMeasurement]) -> bool:
    """Whether the time axis counts minutes (the measurements span two or more), else seconds."""
    return ms[-1].at - ms[0].at >= 120


def _reference_axes(ms: list[ReferenceMeasurement], xs: list[float], minutes: bool) -> Plot:
    """Time since the first measurement across; samples/s up, over every interval."""
    lows = [measured_interval(m)[0] or m.throughput for m in ms]
    highs = [measured_interval(m)[1] or m.throughput for m in ms]
    y_lo, y_hi, y_ticks = nice_range(min(lows) * 0.97, max(highs) * 1.03)
    x_lo, x_hi, x_ticks = nice_range(0, max(xs[-1], 1.0))
    plot = Plot(
        (x_lo - (x_hi - x_lo) * 0.03, x_hi),
        (y_lo, y_hi),
        height=240,
        label="fp32 reference throughput over the search",
    )
    plot.axes(
        x_ticks,
        y_ticks,
        x_label=f"{'minutes' if minutes else 'seconds'} since its first measurement",
        y_label="samples/s",
    )
    return plot


def _draw_measurement(plot: Plot, x: float, m: ReferenceMeasurement, drift: bool) -> None:
    """One measurement with its interval, red when it moved out of the previous one's."""
    low, high = measured_interval(m)
    when = datetime.fromtimestamp(m.at).strftime("%H:%M:%S")
    tip = (
        f"{when}: {throughput_text(m.throughput, low, high, unit=' samples/s')}, "
        f"{m.blocks} timed blocks, "
        + (f"spread {m.spread:.1%}" if m.spread else "too few for a spread")
    ) + (": moved outside the previous interval (drift)" if drift else "")
    color = _DRIFT if drift else REF_COLOR
    if low is not None and high is not None:
        plot.errorbar(x, low, high, color, title=tip)
    plot.marker(x, m.throughput, color, title=tip)


def _reference_caption(
    data: ReportData, ref: ReferenceRecord, ms: list[ReferenceMeasurement], moved: list[bool]
) -> str:
    """How often the reference was measured, over how long, how far it ranged and drifted."""
    minutes = _in_minutes(ms)
    span = ms[-1].at - ms[0].at
    scale = 60.0 if minutes else 1.0
    median = statistics.median(m.throughput for m in ms)
    rng = (max(m.throughput for m in ms) - min(m.throughput for m in ms)) / median
    caption = (
        f"The fp32 reference ({ref_label(ref)}, {data.reference_where}) measured "
        f"{len(ms)} time{'s' if len(ms) != 1 else ''}"
        + (f" over {span / scale:,.1f} {'minutes' if minutes else 's'}" if len(ms) > 1 else "")
        + ", each with its 95% interval. Each trial's speedup divides by the measurement "
        "closest before it."
    )
    if len(ms) > 1:
        caption += (
            f" Range {min(m.throughput for m in ms):,.1f}–{max(m.throughput for m in ms):,.1f} "
            f"samples/s ({rng:.1%} of the median); {sum(moved)} of {len(ms) - 1} "
            f"re-measurements moved outside the previous interval or {_APART:g} times from it "
            "(drift)."
        )
    caption += f" Timing noise: {noise_text(data.noise, data.noise_interval)}."
    return caption


def validation_figure(data: ReportData) -> Figure:
    """The winner's speedup with its interval as the search measured it and as validation's
    paired blocks measured it; their difference is the search's optimism."""
    cfg = data.config
    if cfg is None:
        return Figure(None, note="No best.json for this study: nothing was validated yet.")
    ev = cfg.evidence
    if not ev.validated:
        return Figure(
            None,
            note=sentences(
                "No candidate's lower bound cleared the bar: the config is the fp32 reference "
                "(1.00×)",
                ev.validation_note,
            ),
        )
    rows = _speedup_rows(data, cfg)
    bar = _min_speedup(data)
    values = [v for _, s, lo, hi, _ in rows for v in (s, lo, hi) if v is not None] + [1.0, bar]
    x_lo, x_hi, x_ticks = nice_range(min(values) * 0.95, max(values) * 1.05)
    row_h = 40
    height = 30 + row_h * len(rows) + 46
    plot = Plot((x_lo, x_hi), (0, 1), height=height, left=220, label="search against validation")
    plot.axes(
        x_ticks,
        [],
        x_label="speedup over the fp32 reference (×)",
        y_label="",
        x_fmt=lambda v: f"{v:g}×",
    )
    plot.vline(1.0, REF_COLOR, label="fp32", title="the fp32 reference: 1.00×")
    plot.vline(bar, "#b45309", label=f"min {bar:g}×", row=1, title="validation's min_speedup")
    for i, (name, value, low, high, color) in enumerate(rows):
        y = plot.plot_top + 28 + i * row_h
        text = f"{name}: {ratio_text(value, low, high, x='×')}"
        if low is not None and high is not None:
            plot.hinterval(low, high, y, color, title=text)
        plot.parts.append(
            f'<circle cx="{plot.sx(value)}" cy="{y}" r="5" fill="{color}" class="mark">'
            f"<title>{esc(text)}</title></circle>"
        )
        plot.text(plot.plot_left - 8, y + 4, name, anchor="end", size=12)
    win = data.winner
    caption = (
        f"The winner ({params_label(win.params) if win is not None else cfg.precision}) as the "
        "search measured it (against the reference measured close in time) and as validation "
        "measured it, interleaving its blocks with the reference's. The best of many noisy "
        "figures is biased upward; validation's figure is the one the config claims."
    )
    if ev.search_optimism is not None:
        caption += f" Search optimism: {optimism_text(ev.search_optimism)}."
    return Figure(plot.render(), caption=caption)


def _speedup_rows(data: ReportData, cfg: TunedConfig) -> list[_Row]:
    """The winner's speedup as the search measured it (when known) and as validation did."""
    ev = cfg.evidence
    win = data.winner
    rec = data.rec(win) if win is not None else None
    search = ev.search_speedup if ev.search_speedup is not None else (rec.speedup if rec else None)
    s_low = rec.speedup_low if rec is not None else None
    s_high = rec.speedup_high if rec is not None else None
    rows: list[_Row] = []
    if search is not None:
        name = f"search · trial {win.number}" if win is not None else "search"
        rows.append((name, search, s_low, s_high, _SEARCH))
    blocks = f", {ev.paired_blocks} paired blocks" if ev.paired_blocks else ""
    rows.append(
        (
            f"validation{blocks}",
            ev.speedup,
            ev.speedup_low,
            ev.speedup_high,
            mode_color(cfg.precision),
        )
    )
    return rows


def _min_speedup(data: ReportData) -> float:
    """Validation's bar: the stored spec's min_speedup (the default for older studies)."""
    stored = data.spec.get("validation")
    return float(
        stored.get("min_speedup", _MIN_SPEEDUP) if isinstance(stored, dict) else _MIN_SPEEDUP
    )


def speed_line(ev: Evidence) -> str:
    """The winner card's speed, as HTML: samples/s and the speedup with its interval, what it
    divides by, and the plain AMP recipe's own figure."""
    tp = throughput_text(ev.throughput, ev.throughput_low, ev.throughput_high)
    if ev.speedup_low is not None and ev.speedup_high is not None:
        line = (
            f"{esc(tp)} samples/s · <b>{ev.speedup:.2f}×</b> "
            f"({ev.speedup_low:.2f}–{ev.speedup_high:.2f})"
        )
    else:
        line = f"{esc(tp)} samples/s · <b>{ev.speedup:.2f}×</b>"
    line += " the fp32 reference"
    if ev.paired_blocks:
        # What the ratio divides by: the reference's arm of the same pairs, not its latest
        # measurement elsewhere on the page (1.75× beside a reference of 1,972.1 read as 11.7×).
        beside = (
            f" (its arm {esc(throughput_text(ev.baseline_throughput))} samples/s)"
            if ev.baseline_throughput
            else ""
        )
        line += f" measured beside it{beside}, over {ev.paired_blocks} paired blocks"
    if ev.speedup_vs_amp and ev.speedup:
        # The AMP recipe's own figure, from its search trial: a ratio of the two would divide
        # figures of runs that were not measured together.
        line += (
            f" · the plain AMP recipe: {ev.speedup / ev.speedup_vs_amp:.2f}× the fp32 "
            "reference in the search (another run)"
        )
    return line
