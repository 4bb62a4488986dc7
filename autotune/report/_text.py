"""The report in a few lines of plain text, for a terminal (``autotune report NAME --text``)."""

from __future__ import annotations

from optuna.trial import TrialState

from autotune.measure.parity import samples_seen
from autotune.report._data import ReportData, counts_text, measured_interval
from autotune.report._format import (
    busy_text,
    ceiling_text,
    noise_text,
    optimism_text,
    ratio_text,
    throughput_text,
)
from autotune.report._knob_gains import config_knobs, knob_lines
from autotune.report._plots import ref_label
from autotune.report.progress import scale_text
from autotune.schema.workload_spec import workload_label
from autotune.study.trials import display_outcome, feasible_trials
from autotune.study.trials import label as params_label

__all__ = ["render_text"]

# The best few trials are enough to see the shape of the result; the HTML report lists all.
_TOP = 5


def _reference_line(data: ReportData) -> str:
    ref, m = data.reference, data.reference_latest
    if ref is None:
        return "fp32 reference: not run"
    if m is None:
        return f"fp32 reference: {ref_label(ref)}: not measured"
    low, high = measured_interval(m)
    line = (
        f"fp32 reference: {ref_label(ref)}: "
        f"{throughput_text(m.throughput, low, high, unit=' samples/s')}"
    )
    n = len(ref.measurements)
    if n > 1:
        values = [x.throughput for x in ref.measurements]
        line += f" (latest of {n} measurements; range {min(values):,.1f}–{max(values):,.1f})"
    return line


def render_text(data: ReportData) -> str:
    """A short plain-text summary: winner (with its interval, the search's figure and the
    optimism), the fp32 reference and the noise, counts, the best trials, rejections.

    Example:
        >>> print(render_text(collect(load_study("tiny"))))  # doctest: +SKIP
        study 'tiny': autotune.workloads:tiny_convnet on cpu (x86_64)
        winner: bf16 bs=32 lr=0.2: 3,811.6 samples/s, 1.35x (1.31–1.40) the fp32 reference ...
        ...
    """
    cfg = data.config
    device = cfg.environment.device if cfg else str(data.spec.get("device", "?"))
    workload = workload_label(str(data.spec.get("workload", "?")))
    lines = [f"study {data.name!r}: {workload} on {device}"]
    lines += _winner_lines(data)
    lines.append(_reference_line(data))
    lines.append(f"timing noise: {noise_text(data.noise, data.noise_interval)}")
    busy = busy_text(cfg)
    if busy:
        lines.append(f"others' load: {busy}")
    lines.append(_amp_recipe_line(data))
    c = data.counts()
    lines.append(f"trials: {counts_text(c)}")
    lines += _best_trial_lines(data)
    found = cfg.evidence.fp16_diagnosis if cfg is not None else None
    if found:
        islands = f"; fp32 islands {found['islands']}" if found.get("islands") else ""
        lines.append(f"fp16 diagnosis: {found.get('reason', '')}{islands}")
    knobs = knob_lines(data.trials)
    if knobs:
        lines.append("what each knob brought (best with it, vs the same point without):")
        lines += [f"  {line}" for line in knobs]
    if cfg is not None and cfg.evidence.rejected:
        lines.append("main rejections:")
        lines += [f"  {r}" for r in cfg.evidence.rejected[:_TOP]]
    if data.ceilings:
        lines.append("batch ceilings:")
        lines += [
            f"  {ceiling_text(m, b, data.ceiling_limits.get(m))}" for m, b in data.ceilings.items()
        ]
    lines += [f"note: {n}" for n in data.notes]
    return "\n".join(lines)


def _winner_lines(data: ReportData) -> list[str]:
    """The validated config with its evidence; else the best trial so far, or why none."""
    cfg = data.config
    if cfg is None:
        if data.winner is None:
            return [f"no winner yet: {data.winner_note or 'no best.json'}"]
        rec = data.rec(data.winner)
        return [
            f"best so far: trial {data.winner.number} {params_label(data.winner.params)}: "
            f"{throughput_text(rec.throughput, unit=' samples/s')}, "
            f"{ratio_text(*data.speedup(data.winner))} ({data.winner_note})"
        ]
    ev = cfg.evidence
    settings = f"{cfg.precision} bs={cfg.batch_size} lr={cfg.learning_rate:.3g}"
    if cfg.grad_scaler.enabled:
        settings += f" init_scale={scale_text(cfg.grad_scaler.init_scale)}"
    settings += config_knobs(cfg, data.winner.params if data.winner else None)
    status = "validated" if ev.validated else "NOT validated: fp32 fallback"
    blocks = f" over {ev.paired_blocks} paired blocks" if ev.paired_blocks else ""
    lines = [
        f"winner: {settings}: {throughput_text(ev.throughput, unit=' samples/s')}, "
        f"{ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high)} the fp32 reference"
        f"{blocks} ({status})"
    ]
    if ev.validation_note:
        # The summary's and the page's words: how it was validated (its parity bar, widened
        # where a seed alone moves the loss past the tolerance), or why it fell back.
        lines.append(f"  {'validation' if ev.validated else 'why'}: {ev.validation_note}")
    if ev.search_speedup is not None:
        lines.append(
            f"  the search measured {ev.search_speedup:.2f}x: search optimism "
            f"{optimism_text(ev.search_optimism)}"
        )
    if ev.parity_gap is not None:
        seen = samples_seen(ev.parity_samples, ev.run_samples, ev.parity_projected)
        lines.append(
            f"  loss parity {ev.parity_gap:+.1%}{seen} (tolerance {ev.parity_tolerance:.0%})"
        )
    return lines


def _amp_recipe_line(data: ReportData) -> str:
    """The plain AMP recipe (fp16, GradScaler's defaults): what it measured, or why not."""
    t = data.amp_recipe
    if t is None or not t.params:
        return "plain AMP recipe: not run"
    rec = data.rec(t)
    if t.state == TrialState.COMPLETE:
        tail = (
            f"{throughput_text(rec.throughput, unit=' samples/s')}, {ratio_text(*data.speedup(t))}"
        )
    else:
        outcome = display_outcome(t) or t.state.name.lower()
        tail = f"{outcome}: {rec.reason}".rstrip(": ")
    return f"plain AMP recipe: {params_label(t.params)}: {tail}"


def _best_trial_lines(data: ReportData) -> list[str]:
    """The best few feasible trials, one line each."""
    ranked = sorted(
        feasible_trials(data.trials),
        key=lambda t: float(t.value or 0),
        reverse=data.maximize,
    )[:_TOP]
    if not ranked:
        return []
    lines = ["best feasible trials:"]
    for t in ranked:
        rec = data.rec(t)
        lines.append(
            f"  #{t.number:<3} {params_label(t.params):<40} "
            f"{throughput_text(rec.throughput, unit=' samples/s'):>20}  "
            f"{ratio_text(*data.speedup(t))}"
        )
    return lines
