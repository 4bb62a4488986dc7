"""The report's charts, each built from ReportData into a :class:`Figure`.

A chart with nothing to draw returns a Figure with no SVG and a note saying why, so the report
always has the same sections and a reader learns what is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from optuna.trial import FrozenTrial, TrialState

from autotune.parity import smoothed_loss_at
from autotune.progress import params_label, scale_text
from autotune.report._data import ReportData, feasible
from autotune.report._svg import PALETTE, Plot, mode_color, nice_range

__all__ = [
    "Figure",
    "history_figure",
    "importance_figure",
    "loss_figure",
    "scale_figure",
    "throughput_figure",
]

_REF_COLOR = "#4d4d4d"
_BAD = "#c0392b"


@dataclass
class Figure:
    """A chart (or the note that stands in for it), its legend and its caption."""

    svg: str | None
    caption: str = ""
    legend: list[tuple[str, str, str]] = field(default_factory=list)  # (label, colour, kind)
    note: str = ""


def _measured(data: ReportData) -> list[FrozenTrial]:
    """Trials that ran their own probe (a duplicate reuses a twin's, so it would double-count)."""
    return [t for t in data.trials if t.params and t.user_attrs.get("duplicate_of") is None]


def _tip(t: FrozenTrial, tail: str) -> str:
    return f"trial {t.number}: {params_label(t.params)} — {tail}"


def _pow2_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Powers of two in [lo, hi], thinned to at most ``most``."""
    ks = list(range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1))
    stride = max(1, math.ceil(len(ks) / most))
    return [2.0**k for k in ks[::stride]]


def throughput_figure(data: ReportData) -> Figure:
    """Samples/s against batch size, one colour per mode, with each mode's ceiling marked."""
    trials = _measured(data)
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("throughput")]
    lost = [t for t in trials if t.state in (TrialState.PRUNED, TrialState.FAIL)]
    if not done and not lost:
        return Figure(None, note="No trial has run yet: nothing to plot.")
    sizes = [int(t.params["batch_size"]) for t in done + lost]
    sizes += [b for b in data.ceilings.values() if b > 0]
    lo, hi = min(sizes) / 1.5, max(sizes) * 1.5
    top = max((float(t.user_attrs["throughput"]) for t in done), default=1.0)
    _, y_hi, y_ticks = nice_range(0, top * 1.08)
    plot = Plot((lo, hi), (0, y_hi), x_log2=True, label="throughput by batch size per mode")
    ticks = sorted(set(sizes))
    if len(ticks) > 9:
        ticks = _pow2_ticks(lo, hi)
    plot.axes(ticks, y_ticks, x_label="batch size (log scale)", y_label="samples/s")
    modes = list(dict.fromkeys(str(t.params["precision"]) for t in done + lost))
    modes += [m for m in data.ceilings if m not in modes]
    for row, mode in enumerate(sorted(data.ceilings, key=lambda m: data.ceilings[m])):
        b = data.ceilings[mode]
        if b > 0:
            plot.vline(
                b,
                mode_color(mode),
                label=f"{mode} ceiling {b}",
                row=row,
                title=f"{mode}: largest batch that fits with the memory margin: {b}",
            )
    for mode in modes:
        color = mode_color(mode)
        mine = [t for t in done if t.params["precision"] == mode]
        best: dict[int, float] = {}
        for t in mine:
            b, tp = int(t.params["batch_size"]), float(t.user_attrs["throughput"])
            best[b] = max(best.get(b, 0.0), tp)
        plot.line(sorted(best.items()), color, width=1.5, opacity=0.55, dots=False)
        for t in mine:
            tp = float(t.user_attrs["throughput"])
            ok = feasible(t)
            plot.marker(
                t.params["batch_size"],
                tp,
                color,
                kind="dot" if ok else "ring",
                title=_tip(t, f"{tp:,.1f} samples/s" + ("" if ok else ", infeasible (parity)")),
            )
        for t in lost:
            if t.params["precision"] == mode:
                why = t.user_attrs.get("reason") or t.user_attrs.get("outcome") or t.state.name
                plot.marker(t.params["batch_size"], 0, color, kind="cross", title=_tip(t, why))
    legend = [(m, mode_color(m), "dot") for m in modes]
    legend += [("infeasible (loss parity)", "#777", "ring"), ("pruned or failed", "#777", "cross")]
    legend.append(("OOM ceiling", "#777", "dash"))
    return Figure(
        plot.render(),
        caption=(
            "Each point is one probe's throughput over its timed steps; the faint line joins each "
            "mode's best per batch size. Pruned and failed trials sit on the axis (hover for the "
            "reason). Dashed lines: the largest batch each mode fits with the memory margin."
        ),
        legend=legend,
    )


def _curve(t: FrozenTrial) -> list[tuple[float, float | None]]:
    bs = int(t.params["batch_size"])
    losses = t.user_attrs.get("losses") or []
    return [((i + 1) * bs, None if v is None else float(v)) for i, v in enumerate(losses)]


def loss_figure(data: ReportData) -> Figure:
    """The winner's loss against the fp32 reference's on a samples-seen axis: the parity check."""
    ref, win = data.reference, data.winner
    if ref is None or not ref.user_attrs.get("losses"):
        return Figure(None, note="The fp32 reference has no loss curve yet: nothing to compare.")
    curves = [("fp32 reference · " + params_label(ref.params), ref, _REF_COLOR)]
    same = win is None or win.number == ref.number
    if not same:
        color = mode_color(win.params["precision"])
        if win.params["precision"] == "fp32":
            color = PALETTE[1]
        curves.append((f"winner · trial {win.number} · {params_label(win.params)}", win, color))
    points = [p for _, t, _ in curves for p in _curve(t) if p[1] is not None]
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
    if not same:
        bs_w, bs_r = int(win.params["batch_size"]), int(ref.params["batch_size"])
        lw, lr = win.user_attrs.get("losses") or [], ref.user_attrs.get("losses") or []
        shared = min(len(lw) * bs_w, len(lr) * bs_r)
        if shared > 0:
            plot.band(shared / 2, shared, "#4c72b0", label="parity window")
            for t, bs, color in ((win, bs_w, curves[1][2]), (ref, bs_r, _REF_COLOR)):
                finite = [float("nan") if v is None else float(v) for v in t.user_attrs["losses"]]
                mean = smoothed_loss_at(finite, bs, shared)
                if mean is not None:
                    plot.line([(shared / 2, mean), (shared, mean)], color, width=3, dash="2 3")
        gap = win.user_attrs.get("parity_gap")
        if gap is not None:
            caption += (
                f" Over the shaded window the winner's mean loss is {float(gap):+.1%} against the "
                f"reference's (tolerance {data.parity_tolerance:.0%}; dotted: the window means)."
            )
        ev = data.config.evidence if data.config else None
        if ev is not None and ev.parity_gap is not None:
            caption += f" The validation reruns, with a fresh seed, measured {ev.parity_gap:+.1%}."
    else:
        caption += f" {data.winner_note or 'The winner is the fp32 reference itself.'}"
    for name, t, color in curves:
        plot.line(_curve(t), color, width=2.2, title=name)
    return Figure(plot.render(), caption=caption, legend=[(n, c, "line") for n, _, c in curves])


def scale_figure(data: ReportData) -> Figure:
    """GradScaler scale at each check point of every fp16 probe (log2 axis)."""
    runs = [
        t
        for t in _measured(data)
        if t.params.get("precision") == "fp16" and t.user_attrs.get("scales")
    ]
    if not runs:
        wanted = "fp16" in (data.spec.get("space") or {}).get("precisions", ["fp16"])
        why = "no fp16 trial recorded a scale" if wanted else "fp16 is not in this study's space"
        return Figure(None, note=f"No GradScaler to show: {why}.")
    values = [float(v) for t in runs for _, v in t.user_attrs["scales"] if v and v > 0]
    steps = [int(s) for t in runs for s, _ in t.user_attrs["scales"]]
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
    for i, t in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        pts = [(float(s), float(v)) for s, v in t.user_attrs["scales"] if v and v > 0]
        outcome = t.user_attrs.get("outcome", t.state.name.lower())
        init = scale_text(float(t.params.get("init_scale", 2**16)))
        name = f"trial {t.number} · init_scale {init} · {outcome}"
        plot.line(pts, color, width=2, dash=None if t.state == TrialState.COMPLETE else "6 3")
        for s, v in pts:
            plot.marker(s, v, color, r=3.5, title=f"{name}: step {s:g}, scale {scale_text(v)}")
        if i < 10:
            legend.append((name, color, "line"))
    if len(runs) > 10:
        legend.append((f"… and {len(runs) - 10} more", "#777", "line"))
    return Figure(
        plot.render(),
        caption=(
            "The scale at each check point. A drop is a skipped step (an overflow). With the "
            "default growth_interval of 2000 a short probe never sees the scale grow, only back "
            "off from init_scale. Dashed: the trial did not complete."
        ),
        legend=legend,
    )


def _objective_measured(trial: FrozenTrial, maximize: bool) -> float | None:
    """A trial's objective as measured: its value, or its throughput where the value told to
    Optuna is the infeasible trial's worst value."""
    if trial.value is not None and math.isfinite(trial.value):
        return float(trial.value)
    throughput = trial.user_attrs.get("throughput") if maximize else None
    return float(throughput) if isinstance(throughput, (int, float)) else None


def history_figure(data: ReportData) -> Figure:
    """The objective per trial in order, with the best feasible value so far as a step line."""
    # An infeasible trial is told the worst value (trials.objective_value): plot what it measured.
    measured = {t.number: _objective_measured(t, data.maximize) for t in data.trials}
    done = [
        t for t in data.trials if t.state == TrialState.COMPLETE and measured[t.number] is not None
    ]
    lost = [t for t in data.trials if t.state in (TrialState.PRUNED, TrialState.FAIL)]
    if not done and not lost:
        return Figure(None, note="No trial has finished yet.")
    last = max(t.number for t in done + lost)
    values = [measured[t.number] for t in done]
    y_lo, y_hi, y_ticks = nice_range(0, max(values, default=1.0) * 1.08)
    plot = Plot((-0.5, last + 0.5), (y_lo, y_hi), label="optimization history")
    _, _, x_ticks = nice_range(0, max(last, 1), count=10, integer=True)
    x_ticks = [x for x in x_ticks if x <= last]
    y_label = "samples/s" if data.maximize else "objective (lower is better)"
    plot.axes(x_ticks, y_ticks, x_label="trial number", y_label=y_label)
    best: float | None = None
    steps: list[tuple[float, float | None]] = []
    for t in sorted(done, key=lambda t: t.number):
        if feasible(t):
            v = measured[t.number]
            if best is None or (v > best if data.maximize else v < best):
                best = v
        if best is not None:
            steps.append((t.number, best))
    if steps:
        steps.append((last + 0.5, steps[-1][1]))
        plot.line(steps, "#2a9d8f", width=2, step=True, title="best feasible so far")
    for t in done:
        ok = feasible(t)
        color = mode_color(t.params.get("precision"))
        tail = f"{measured[t.number]:,.1f}" + ("" if ok else ", infeasible (parity)")
        if t.user_attrs.get("duplicate_of") is not None:
            tail += f", reused trial {t.user_attrs['duplicate_of']}"
        plot.marker(
            t.number, measured[t.number], color, kind="dot" if ok else "ring", title=_tip(t, tail)
        )
    for t in lost:
        why = t.user_attrs.get("reason") or t.user_attrs.get("outcome") or t.state.name
        plot.marker(
            t.number, y_lo, mode_color(t.params.get("precision")), kind="cross", title=_tip(t, why)
        )
    modes = list(dict.fromkeys(str(t.params.get("precision")) for t in done + lost))
    legend = [(m, mode_color(m), "dot") for m in modes]
    legend += [
        ("best feasible so far", "#2a9d8f", "line"),
        ("infeasible", "#777", "ring"),
        ("pruned or failed", "#777", "cross"),
    ]
    return Figure(
        plot.render(),
        caption="The objective of every completed trial in the order the sampler ran them.",
        legend=legend,
    )


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
