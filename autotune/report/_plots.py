"""The report's charts, each built from ReportData into a :class:`Figure` (or a note saying why
there is nothing to draw)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import smoothed_loss_at
from autotune.report._data import ReportData, measured_interval
from autotune.report._format import ceiling_text, ratio_text, sentences, throughput_text
from autotune.report._svg import PALETTE, Plot, mode_color, nice_range
from autotune.report.progress import scale_text
from autotune.schema.enums import Outcome
from autotune.study.reference import ReferenceRecord
from autotune.study.trials import DEFAULT_INIT_SCALE, TrialRecord, display_outcome, is_feasible
from autotune.study.trials import label as params_label

__all__ = [
    "REF_COLOR",
    "Figure",
    "history_figure",
    "importance_figure",
    "loss_figure",
    "ref_label",
    "scale_figure",
    "throughput_figure",
]

REF_COLOR = "#4d4d4d"
# A ceiling's cause, short enough for its label on the chart (the tooltip says it in full).
_LIMIT_WORDS = dict(memory="memory", margin="memory margin", time="time", cap="cap", crash="crash")
_BAD = "#c0392b"


@dataclass
class Figure:
    """A chart (or the note that stands in for it), its legend and its caption."""

    svg: str | None
    caption: str = ""
    legend: list[tuple[str, str, str]] = field(default_factory=list)  # (label, colour, kind)
    note: str = ""


def _measured(data: ReportData) -> list[FrozenTrial]:
    """Trials that ran their own probe (a duplicate reuses a twin's, so it would double-count;
    a trial whose start a full disk cut off may hold its precision and no batch size)."""
    return [
        t
        for t in data.trials
        if {"precision", "batch_size"} <= t.params.keys() and data.rec(t).duplicate_of is None
    ]


def _tip(t: FrozenTrial, tail: str) -> str:
    return f"trial {t.number}: {params_label(t.params)} — {tail}"


def _pow2_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Powers of two in [lo, hi], thinned to at most ``most``."""
    ks = list(range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1))
    stride = max(1, math.ceil(len(ks) / most))
    return [2.0**k for k in ks[::stride]]


def _why(data: ReportData, t: FrozenTrial) -> str:
    rec = data.rec(t)
    return rec.reason or rec.outcome or t.state.name.lower()


def throughput_figure(data: ReportData) -> Figure:
    """Samples/s against batch size, one colour per mode, each point with its interval, the
    fp32 reference marked, and each mode's ceiling."""
    trials = _measured(data)
    done = [t for t in trials if t.state == TrialState.COMPLETE and data.rec(t).throughput]
    lost = [t for t in trials if t.state in (TrialState.PRUNED, TrialState.FAIL)]
    if not done and not lost:
        return Figure(None, note="No trial has run yet: nothing to plot.")
    plot = _throughput_axes(data, done, lost)
    modes = list(dict.fromkeys(str(t.params["precision"]) for t in done + lost))
    modes += [m for m in data.ceilings if m not in modes]
    _draw_ceilings(plot, data)
    # The reference is drawn first: a trial at its batch size stays visible on top of it.
    bars = _draw_reference(plot, data)
    for mode in modes:
        mine = [t for t in done if t.params["precision"] == mode]
        bars += _draw_mode(
            plot, data, mode, mine, [t for t in lost if t.params["precision"] == mode]
        )
    legend = [(m, mode_color(m), "dot") for m in modes]
    if data.reference is not None and data.reference_latest is not None:
        legend.append(("fp32 reference (latest)", REF_COLOR, "square"))
    legend += [("infeasible (loss parity)", "#777", "ring"), ("pruned or failed", "#777", "cross")]
    legend.append(("batch ceiling", "#777", "dash"))
    caption = (
        "Each point is one probe's throughput: the median over its timed blocks"
        + (", with its 95% interval as a bar" if bars else "")
        + "; the faint line joins each mode's best per batch size. Pruned and failed trials sit "
        "on the axis (hover for the reason). Dashed lines: each mode's largest batch, and "
        + (
            "what limited it: memory, the memory margin, the time a try may take, or the "
            "space's cap."
            if data.ceiling_limits
            else "the largest batch each mode ran (this study did not record what limited it)."
        )
    )
    note = ""
    if not bars and done:
        note = "These probes recorded no interval (an older study): points without bars."
    return Figure(plot.render(), caption=caption, legend=legend, note=note)


def _throughput_axes(data: ReportData, done: list[FrozenTrial], lost: list[FrozenTrial]) -> Plot:
    """The throughput chart's axes: every batch size tried, ceiling or reference on a log2
    axis; samples/s up to the highest interval."""
    ref, ref_m = data.reference, data.reference_latest
    sizes = [int(t.params["batch_size"]) for t in done + lost]
    sizes += [b for b in data.ceilings.values() if b > 0]
    if ref is not None and ref_m is not None:
        sizes.append(ref.batch_size)
    lo, hi = min(sizes) / 1.5, max(sizes) * 1.5
    tops = [data.rec(t).throughput_high or data.rec(t).throughput or 0.0 for t in done]
    if ref_m is not None:
        tops.append(ref_m.high)
    _, y_hi, y_ticks = nice_range(0, max(tops, default=1.0) * 1.08)
    plot = Plot((lo, hi), (0, y_hi), x_log2=True, label="throughput by batch size per mode")
    ticks: list[float] = sorted(set(sizes))
    if len(ticks) > 9:
        ticks = _pow2_ticks(lo, hi)
    plot.axes(ticks, y_ticks, x_label="batch size (log scale)", y_label="samples/s")
    return plot


def _draw_ceilings(plot: Plot, data: ReportData) -> None:
    """Each mode's ceiling, a dashed line labelled with what limited it."""
    for row, mode in enumerate(sorted(data.ceilings, key=lambda m: data.ceilings[m])):
        b = data.ceilings[mode]
        if b > 0:
            why = data.ceiling_limits.get(mode)
            plot.vline(
                b,
                mode_color(mode),
                label=f"{mode} ceiling {b}"
                + (f" ({_LIMIT_WORDS[why]})" if why in _LIMIT_WORDS else ""),
                row=row,
                title=ceiling_text(mode, b, why),
            )


def _draw_reference(plot: Plot, data: ReportData) -> int:
    """The fp32 reference's latest measurement, with its interval; returns the bars drawn."""
    ref, ref_m = data.reference, data.reference_latest
    if ref is None or ref_m is None:
        return 0
    low, high = measured_interval(ref_m)
    text = throughput_text(ref_m.throughput, low, high, unit=" samples/s")
    title = f"fp32 reference {ref_label(ref)}: {text} (its latest measurement)"
    bars = 0
    if low is not None and high is not None:
        plot.errorbar(ref.batch_size, low, high, REF_COLOR, title=title)
        bars += 1
    plot.marker(ref.batch_size, ref_m.throughput, REF_COLOR, kind="square", title=title)
    return bars


def _draw_mode(
    plot: Plot, data: ReportData, mode: str, done: list[FrozenTrial], lost: list[FrozenTrial]
) -> int:
    """One mode's probes: a faint line through its best per batch size, each probe with its
    interval (a ring when infeasible), and its lost trials on the axis; returns the bars drawn."""
    color = mode_color(mode)
    best: dict[int, float] = {}
    for t in done:
        b, tp = int(t.params["batch_size"]), float(data.rec(t).throughput or 0.0)
        best[b] = max(best.get(b, 0.0), tp)
    plot.line(sorted(best.items()), color, width=1.5, opacity=0.55, dots=False)
    bars = 0
    for t in done:
        rec = data.rec(t)
        ok = is_feasible(t)
        text = throughput_text(
            rec.throughput, rec.throughput_low, rec.throughput_high, unit=" samples/s"
        )
        text += ", " + ratio_text(*data.speedup(t)) + " the fp32 reference"
        if rec.blocks:
            text += f", {rec.blocks} timed blocks"
        if rec.throughput_low is not None and rec.throughput_high is not None:
            plot.errorbar(
                t.params["batch_size"],
                rec.throughput_low,
                rec.throughput_high,
                color,
                title=_tip(t, "95% interval " + text),
            )
            bars += 1
        plot.marker(
            t.params["batch_size"],
            float(rec.throughput or 0.0),
            color,
            kind="dot" if ok else "ring",
            title=_tip(t, text + ("" if ok else ", infeasible (parity)")),
        )
    for t in lost:
        plot.marker(t.params["batch_size"], 0, color, kind="cross", title=_tip(t, _why(data, t)))
    return bars


def ref_label(ref: ReferenceRecord) -> str:
    """The reference's settings as trials are labelled: ``fp32 bs=32 lr×1``."""
    return params_label({"precision": ref.precision, "batch_size": ref.batch_size})


def _curve(batch_size: int, losses: list[float | None]) -> list[tuple[float, float | None]]:
    return [((i + 1) * batch_size, v) for i, v in enumerate(losses)]


def loss_figure(data: ReportData) -> Figure:
    """The winner's loss against the fp32 reference's on a samples-seen axis: the parity check."""
    ref = data.reference
    if ref is None or not ref.losses:
        return Figure(None, note="The fp32 reference has no loss curve yet: nothing to compare.")
    # Each run drawn: (name, losses, batch size, colour); the reference's first.
    runs = [("fp32 reference · " + ref_label(ref), ref.losses, ref.batch_size, REF_COLOR)]
    other = _other_winner(data, ref)
    if other is not None:
        win, win_rec = other
        mode = win.params["precision"]
        color = PALETTE[1] if mode == "fp32" else mode_color(mode)
        name = f"winner · trial {win.number} · {params_label(win.params)}"
        runs.append((name, win_rec.losses, int(win.params["batch_size"]), color))
    curves = [(name, _curve(bs, losses), color) for name, losses, bs, color in runs]
    points = [(x, y) for _, pts, _ in curves for x, y in pts if y is not None]
    if not points:
        return Figure(None, note="Every recorded loss is non-finite: nothing to draw.")
    x_hi = max(x for x, _ in points)
    y_lo, y_hi, y_ticks = nice_range(min(y for _, y in points), max(y for _, y in points))
    x_lo_n, x_hi_n, x_ticks = nice_range(0, x_hi)
    plot = Plot((0, x_hi_n), (y_lo, y_hi), label="loss against samples seen, winner and reference")
    plot.axes(x_ticks, y_ticks, x_label="samples seen", y_label="training loss")
    caption = (
        "Training loss at every step of the search probes (warm-up included) against samples "
        "seen, so runs with different batch sizes line up."
    )
    if other is None:
        caption = sentences(caption, data.winner_note or "The winner is the fp32 reference itself")
    else:
        win_rec = other[1]
        reference_run, winner_run = ((losses, bs, color) for _, losses, bs, color in runs)
        _draw_parity_window(plot, [winner_run, reference_run])
        if win_rec.parity_gap is not None:
            caption += (
                f" Over the shaded window the winner's mean loss is {win_rec.parity_gap:+.1%} "
                f"against the reference's (tolerance {data.parity_tolerance:.0%}; dotted: the "
                "window means)."
            )
        ev = data.config.evidence if data.config else None
        if ev is not None and ev.parity_gap is not None:
            caption += f" The validation reruns, with a fresh seed, measured {ev.parity_gap:+.1%}."
    for name, pts, color in curves:
        plot.line(pts, color, width=2.2, title=name)
    return Figure(plot.render(), caption=caption, legend=[(n, c, "line") for n, _, c in curves])


def _other_winner(data: ReportData, ref: ReferenceRecord) -> tuple[FrozenTrial, TrialRecord] | None:
    """The winner and its record, if it has a loss curve and is not the reference's settings."""
    win = data.winner
    if win is None or not (win_rec := data.rec(win)).losses:
        return None
    same = (
        win.params.get("precision") == ref.precision
        and win.params.get("batch_size") == ref.batch_size
        and win_rec.learning_rate is not None
        and math.isclose(win_rec.learning_rate, ref.learning_rate, rel_tol=1e-9)
    )
    return None if same else (win, win_rec)


def _draw_parity_window(plot: Plot, runs: list[tuple[list[float | None], int, str]]) -> None:
    """The window parity is judged over, each run's mean loss there dotted across it."""
    shared = min(len(losses) * bs for losses, bs, _ in runs)
    if shared <= 0:
        return
    plot.band(shared / 2, shared, "#4c72b0", label="parity window")
    for losses, bs, color in runs:
        finite = [float("nan") if v is None else float(v) for v in losses]
        mean = smoothed_loss_at(finite, bs, shared)
        if mean is not None:
            plot.line([(shared / 2, mean), (shared, mean)], color, width=3, dash="2 3")


def _scale_points(data: ReportData, t: FrozenTrial) -> tuple[list[tuple[float, float]], str]:
    """The scales a probe recorded at its check points, the one that found it diverging
    included. A diverged probe of an older study (which recorded no scale at that check) is run
    on to the step where its loss turned non-finite, at the scale its skipped steps left:
    GradScaler halves it at each, and a short probe never grows it. The second value says so,
    for the derived point's tooltip."""
    rec = data.rec(t)
    pts = [(float(s), v) for s, v in rec.scales if v and v > 0]
    if rec.outcome != Outcome.DIVERGED:
        return pts, ""
    at = float(next((i for i, v in enumerate(rec.losses) if v is None), len(rec.losses)))
    if pts and at <= pts[-1][0]:
        return pts, ""
    init = float(t.params.get("init_scale", DEFAULT_INIT_SCALE))
    skipped = rec.skipped_steps or 0
    note = (
        f"diverged at step {at:g}; the scale there is init_scale halved at each of its "
        f"{skipped} skipped steps"
    )
    return ([] if pts else [(0.0, init)]) + pts + [(at, init / 2**skipped)], note


def scale_figure(data: ReportData) -> Figure:
    """GradScaler scale at each check point of every fp16 probe (log2 axis); a diverged one is
    drawn too, its last point marked ×."""
    runs = [
        (t, *_scale_points(data, t)) for t in _measured(data) if t.params.get("precision") == "fp16"
    ]
    runs = [(t, pts, note) for t, pts, note in runs if pts or data.rec(t).scales]
    if not runs:
        wanted = "fp16" in (data.spec.get("space") or {}).get("precisions", ["fp16"])
        why = "no fp16 trial recorded a scale" if wanted else "fp16 is not in this study's space"
        return Figure(None, note=f"No GradScaler to show: {why}.")
    values = [v for _, pts, _ in runs for _, v in pts]
    steps = [s for _, pts, _ in runs for s, _ in pts]
    if not values:
        return Figure(None, note="No GradScaler to show: every recorded scale is zero.")
    lo = 2.0 ** math.floor(math.log2(min(values)) - 1)
    hi = 2.0 ** math.ceil(math.log2(max(values)) + 1)
    _, x_hi, x_ticks = nice_range(0, max(steps + [1]), integer=True)
    plot = Plot((0, x_hi), (lo, hi), y_log2=True, label="GradScaler scale over steps, fp16 trials")
    plot.axes(
        x_ticks,
        _pow2_ticks(lo, hi, most=7),
        x_label="step",
        y_label="scale (log2)",
        y_fmt=lambda v: f"{v:,.0f}" if v >= 1 else f"{v:g}",
    )
    if lo <= 1:
        plot.hline(1, _BAD, label="scale < 1: diverging")
    legend = []
    diverged = 0
    for i, (t, pts, note) in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        outcome = display_outcome(t) or t.state.name.lower()
        init = scale_text(float(t.params.get("init_scale", DEFAULT_INIT_SCALE)))
        name = f"trial {t.number} · init_scale {init} · {outcome}"
        plot.line(pts, color, width=2, dash=None if t.state == TrialState.COMPLETE else "6 3")
        for j, (s, v) in enumerate(pts):
            derived = note and j == len(pts) - 1
            tip = f"{name}: step {s:g}, scale {scale_text(v)}" + (f"; {note}" if derived else "")
            plot.marker(s, v, color, r=3.5, title=tip)
        if data.rec(t).outcome == Outcome.DIVERGED and pts:
            diverged += 1
            s, v = pts[-1]
            why = data.rec(t).reason or "diverged"
            plot.marker(s, v, _BAD, kind="cross", r=6, title=f"{name}: {why}")
        if i < 10:
            legend.append((name, color, "line"))
    if len(runs) > 10:
        legend.append((f"… and {len(runs) - 10} more", "#777", "line"))
    if diverged:
        legend.append(("diverged: where it stopped", _BAD, "cross"))
    return Figure(
        plot.render(),
        caption=(
            "The scale at each check point. A drop is a skipped step (an overflow). With the "
            "default growth_interval of 2000 a short probe never sees the scale grow, only back "
            "off from init_scale. Dashed: the trial did not complete; ×: it diverged there, at "
            "the step its loss turned non-finite (the scale there is what its skipped steps left)."
        ),
        legend=legend,
    )


_Y_LABELS = {
    "speedup": "speedup over the fp32 reference (×)",
    "throughput": "samples/s",
    "time_to_loss": "seconds to the reference's loss (lower is better)",
}


def _value_text(data: ReportData, value: float) -> str:
    if data.objective == "speedup":
        return f"{value:.2f}×"
    if data.objective == "time_to_loss":
        return f"{value:,.1f} s"
    return f"{value:,.1f} samples/s"


def _objective_measured(data: ReportData, trial: FrozenTrial) -> float | None:
    """A trial's objective as measured: the speedup it recorded (an infeasible trial is told
    the worst value, see trials.objective_value, and one above the validated config just under
    it, see crown.store_config), else its value, else the throughput it measured."""
    rec = data.rec(trial)
    if data.objective == "speedup" and rec.speedup is not None:
        return rec.speedup
    if trial.value is not None and math.isfinite(trial.value):
        return float(trial.value)
    return rec.speedup if data.objective == "speedup" else rec.throughput


def history_figure(data: ReportData) -> Figure:
    """The objective per trial in order (a speedup with its interval), with the best feasible
    value so far as a step line."""
    measured = {t.number: v for t in data.trials if (v := _objective_measured(data, t)) is not None}
    done = [t for t in data.trials if t.state == TrialState.COMPLETE and t.number in measured]
    # A trial that never ran (queued, then the search ended) has no parameters and no place.
    lost = [t for t in data.trials if t.state in (TrialState.PRUNED, TrialState.FAIL) and t.params]
    if not done and not lost:
        return Figure(None, note="No trial has finished yet.")
    last = max(t.number for t in done + lost)
    speedup = data.objective == "speedup"
    values = [measured[t.number] for t in done]
    if speedup:
        values += [data.rec(t).speedup_high or 0.0 for t in done]
    y_lo, y_hi, y_ticks = nice_range(0, max(values, default=1.0) * 1.08)
    plot = Plot((-0.5, last + 0.5), (y_lo, y_hi), label="optimization history")
    _, _, x_ticks = nice_range(0, max(last, 1), count=10, integer=True)
    x_ticks = [x for x in x_ticks if x <= last]
    plot.axes(x_ticks, y_ticks, x_label="trial number", y_label=_Y_LABELS[data.objective])
    if speedup and y_lo <= 1 <= y_hi:
        plot.hline(1, REF_COLOR, label="fp32 reference", dash="2 3")
    steps = _best_so_far(data, done, measured)
    if steps:
        steps.append((last + 0.5, steps[-1][1]))
        plot.line(steps, "#2a9d8f", width=2, step=True, title="best feasible so far")
    for t in done:
        _draw_objective(plot, data, t, measured[t.number])
    for t in lost:
        plot.marker(
            t.number,
            y_lo,
            mode_color(t.params.get("precision")),
            kind="cross",
            title=_tip(t, _why(data, t)),
        )
    modes = list(dict.fromkeys(str(t.params.get("precision")) for t in done + lost))
    legend = [(m, mode_color(m), "dot") for m in modes]
    legend += [
        ("best feasible so far", "#2a9d8f", "line"),
        ("infeasible", "#777", "ring"),
        ("pruned or failed", "#777", "cross"),
    ]
    caption = "The objective of every completed trial in the order the sampler ran them"
    if speedup:
        caption += (
            ": its speedup over the fp32 reference measured close to it in time, with the "
            "95% interval as a bar."
        )
    else:
        caption += "."
    return Figure(plot.render(), caption=caption, legend=legend)


def _best_so_far(
    data: ReportData, done: list[FrozenTrial], measured: dict[int, float]
) -> list[tuple[float, float | None]]:
    """The best feasible objective after each completed trial, in trial order."""
    best: float | None = None
    steps: list[tuple[float, float | None]] = []
    for t in sorted(done, key=lambda t: t.number):
        if is_feasible(t):
            v = measured[t.number]
            if best is None or (v > best if data.maximize else v < best):
                best = v
        if best is not None:
            steps.append((t.number, best))
    return steps


def _draw_objective(plot: Plot, data: ReportData, t: FrozenTrial, value: float) -> None:
    """One completed trial's objective: a dot (a ring when infeasible), and a speedup's
    interval as a bar."""
    ok, rec = is_feasible(t), data.rec(t)
    color = mode_color(t.params.get("precision"))
    speedup = data.objective == "speedup"
    if speedup:
        tail = ratio_text(value, rec.speedup_low, rec.speedup_high, x="×")
    else:
        tail = _value_text(data, value)
    tail += "" if ok else ", infeasible (parity)"
    if rec.duplicate_of is not None:
        tail += f", reused trial {rec.duplicate_of}"
    if speedup and rec.speedup_low is not None and rec.speedup_high is not None:
        plot.errorbar(t.number, rec.speedup_low, rec.speedup_high, color, title=_tip(t, tail))
    plot.marker(t.number, value, color, kind="dot" if ok else "ring", title=_tip(t, tail))


def importance_figure(data: ReportData) -> Figure:
    """How much each sampled parameter explains of the objective, as horizontal bars."""
    if not data.importances:
        return Figure(None, note=f"Parameter importances unavailable: {data.importance_note}.")
    items = sorted(data.importances.items(), key=lambda kv: kv[1], reverse=True)
    row = 30
    height = 30 + row * len(items) + 46
    plot = Plot((0, 1), (0, 1), height=height, left=120, label="parameter importances")
    _, _, ticks = nice_range(0, 1)
    plot.axes(
        ticks,
        [],
        x_label="share of the objective's variation",
        y_label="",
        x_fmt=lambda v: f"{v:.0%}",
    )
    for i, (name, value) in enumerate(items):
        y = plot.plot_top + 16 + i * row
        plot.bar(0, value, y, 18, "#4c72b0", f"{name}: {value:.1%}")
        plot.text(plot.plot_left - 8, y + 4, name, anchor="end", size=12)
        plot.text(plot.sx(value) + 6, y + 4, f"{value:.0%}")
    return Figure(plot.render(), caption=data.importance_note + ".")
