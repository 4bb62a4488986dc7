"""The report as one self-contained HTML page: inline CSS and SVG, no script, no URL."""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.measure.parity import samples_seen
from autotune.report._data import ReportData, counts_text, measured_interval
from autotune.report._evidence import reference_figure, speed_line, validation_figure
from autotune.report._format import (
    busy_text,
    ceiling_text,
    kept_lr_text,
    noise_text,
    optimism_text,
    ratio_text,
    sentences,
    throughput_text,
)
from autotune.report._knob_gains import config_knobs, knobs_html, trial_knobs
from autotune.report._plots import (
    Figure,
    history_figure,
    importance_figure,
    loss_figure,
    ref_label,
    scale_figure,
    throughput_figure,
)
from autotune.report._svg import esc
from autotune.report.progress import scale_text
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Outcome, Role
from autotune.schema.workload_spec import workload_label
from autotune.study.trials import display_outcome
from autotune.study.trials import label as params_label

__all__ = ["render_html"]

_CSS = """
:root { color-scheme: light; --ink:#222; --muted:#666; --line:#ddd; --ok:#1e7f4f; --warn:#b45309;
  --bad:#b91c1c; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;
  color:var(--ink); background:#f6f7f9; }
main { max-width:1280px; margin:0 auto; padding:24px 28px 48px; background:#fff; }
h1 { font-size:26px; margin:0 0 4px; }
h2 { font-size:19px; margin:36px 0 10px; padding-bottom:4px; border-bottom:1px solid var(--line); }
.meta, .note, figcaption, footer { color:var(--muted); }
.note { font-style:italic; }
.winner-card { border:1px solid var(--line); border-left:5px solid var(--ok); border-radius:6px;
  padding:12px 16px; margin:12px 0 16px; }
.winner-card.fallback { border-left-color:var(--warn); }
.winner-card .big { font-size:22px; font-weight:600; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:13px; color:#fff;
  background:var(--ok); vertical-align:middle; margin-left:8px; }
.badge.warn { background:var(--warn); }
table { border-collapse:collapse; width:100%; font-size:14px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { background:#f1f3f5; font-weight:600; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
.scroll { overflow-x:auto; }
table.trials { font-size:12.5px; }
table.trials th { position:sticky; top:0; }
table.trials th.num, table.trials td.wrap { white-space:normal; }
table.trials td.settings { min-width:10em; }
table.trials td.reason { min-width:16em; overflow-wrap:anywhere; }
table.trials .tok { white-space:nowrap; }
table.trials .state { display:block; font-size:11px; color:var(--muted); }
table.trials tr.pruned td, table.trials tr.fail td { color:#7a4b4b; }
table.trials tr.infeasible td { color:#7a6a3b; }
table.trials tr.waiting td, table.trials tr.running td { color:#999; }
table.trials tr.winner td { background:#eaf7ef; font-weight:600; }
dl.facts { display:grid; grid-template-columns:max-content 1fr; gap:4px 16px; margin:12px 0; }
dl.facts dt { font-weight:600; } dl.facts dd { margin:0; }
figure { margin:8px 0 0; }
svg.plot { width:100%; height:auto; max-width:900px; display:block; }
ul.legend { list-style:none; padding:0; margin:6px 0; display:flex; flex-wrap:wrap; gap:4px 18px;
  font-size:13px; }
ul.legend svg { vertical-align:middle; margin-right:5px; }
footer { margin-top:40px; font-size:12px; }
"""


def _tp(value: Any) -> str:
    return f"{float(value):,.1f}" if isinstance(value, (int, float)) and value else "—"


def _ratio(value: float | None, low: float | None = None, high: float | None = None) -> str:
    """A table cell: ``1.93× (1.85–2.01)``; ``(—)`` where no interval was measured."""
    return ratio_text(value, low, high, x="×", missing=" (—)")


def _mib(value: Any) -> str:
    """Bytes in the unit that keeps a few digits: a CPU probe peaks at KiB, a GPU at GiB."""
    if not isinstance(value, (int, float)):
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return "—"  # pragma: no cover - the loop always returns


def _swatch(color: str, kind: str) -> str:
    shapes = {
        "dot": f'<circle cx="7" cy="7" r="5" fill="{color}"/>',
        "ring": f'<circle cx="7" cy="7" r="4.5" fill="#fff" stroke="{color}" stroke-width="2"/>',
        "cross": f'<path d="M3,3L11,11M3,11L11,3" stroke="{color}" stroke-width="2"/>',
        "square": f'<rect x="2" y="2" width="10" height="10" fill="{color}"/>',
        "dash": f'<line x1="0" y1="7" x2="14" y2="7" stroke="{color}" stroke-width="2" '
        'stroke-dasharray="4 3"/>',
    }
    shape = shapes.get(
        kind, f'<line x1="0" y1="7" x2="14" y2="7" stroke="{color}" stroke-width="3"/>'
    )
    return f'<svg class="swatch" width="14" height="14" aria-hidden="true">{shape}</svg>'


def _figure(section: str, heading: str, fig: Figure, intro: str = "") -> str:
    parts = [f'<section id="{section}"><h2>{esc(heading)}</h2>']
    if intro:
        parts.append(f"<p>{esc(intro)}</p>")
    if fig.svg is None:
        parts.append(f'<p class="note">{esc(fig.note)}</p>')
    else:
        parts.append(f"<figure>{fig.svg}")
        if fig.legend:
            items = "".join(
                f"<li>{_swatch(color, kind)}{esc(label)}</li>" for label, color, kind in fig.legend
            )
            parts.append(f'<ul class="legend">{items}</ul>')
        parts.append(f"<figcaption>{esc(fig.caption)}</figcaption></figure>")
        if fig.note:
            parts.append(f'<p class="note">{esc(fig.note)}</p>')
    parts.append("</section>")
    return "".join(parts)


def _role(data: ReportData, t: FrozenTrial) -> str:
    role = data.rec(t).role
    if data.rec(t).tuned_config:
        return "best.json's config"
    if role == Role.REFERENCE:
        return "reference"
    if role == Role.AMP_RECIPE:
        return "AMP recipe"
    if role and role.endswith("_at_base"):
        return f"{role[: -len('_at_base')]} at base"
    return ""


def _outcome(t: FrozenTrial) -> str:
    return display_outcome(t) or t.state.name.lower()


def _winner_card(data: ReportData, cfg: TunedConfig) -> str:
    ev = cfg.evidence
    settings = f"{cfg.precision} · batch {cfg.batch_size} · lr {cfg.learning_rate:.3g}"
    if cfg.grad_scaler.enabled:
        settings += f" · GradScaler init_scale {scale_text(cfg.grad_scaler.init_scale)}"
    if knobs := config_knobs(cfg, data.winner.params if data.winner else None).strip():
        settings += f" · {knobs}"
    badge = (
        '<span class="badge">validated</span>'
        if ev.validated
        else '<span class="badge warn">not validated: fp32 fallback</span>'
    )
    line = speed_line(ev)
    facts = _winner_facts(data, cfg)
    return (
        f'<div class="winner-card{"" if ev.validated else " fallback"}">'
        f'<div class="big">{esc(settings)}{badge}</div><div>{line}</div>'
        f"<div>{esc(' · '.join(facts))}</div>"
        f'<div class="note">{esc(sentences(ev.validation_note))}</div></div>'
    )


def _winner_facts(data: ReportData, cfg: TunedConfig) -> list[str]:
    """The winner's evidence beyond its speed: the search's figure, parity, memory, noise."""
    ev = cfg.evidence
    facts = []
    if ev.search_speedup is not None:
        facts.append(
            f"the search measured {ev.search_speedup:.2f}× (search optimism "
            f"{optimism_text(ev.search_optimism)})"
        )
    if ev.parity_gap is not None:
        facts.append(
            f"loss parity {ev.parity_gap:+.1%} vs the fp32 reference"
            f"{samples_seen(ev.parity_samples, ev.run_samples, ev.parity_projected)} "
            f"(tolerance {ev.parity_tolerance:.0%})"
        )
    if ev.peak_memory_bytes is not None:
        mem = f"peak memory {_mib(ev.peak_memory_bytes)}"
        if ev.baseline_peak_memory_bytes is not None:
            mem += f" (the fp32 reference: {_mib(ev.baseline_peak_memory_bytes)})"
        facts.append(mem)
    if cfg.grad_scaler.enabled:
        facts.append(f"{ev.skipped_steps} skipped steps in validation")
    if data.noise is not None:
        facts.append(f"timing noise of this device {data.noise:.1%}")
    elif data.noise_interval:
        facts.append(
            f"timing noise of this device ±{data.noise_interval:.1%} (the reference's interval)"
        )
    return facts


Row = tuple[str, str, str, str, Any, str]


def _trial_row(data: ReportData, name: str, t: FrozenTrial | None) -> Row:
    """A baseline table row for a trial: settings, samples/s and speedup with intervals."""
    if t is None:
        return (name, "—", "—", "—", None, "not run")
    rec = data.rec(t)
    outcome = _outcome(t)
    if rec.reason and outcome != Outcome.COMPLETED:
        outcome += f": {rec.reason}"
    settings = params_label(t.params) if t.params else "not run yet"
    tp = "—"
    if t.state == TrialState.COMPLETE:
        tp = throughput_text(
            rec.throughput, rec.throughput_low, rec.throughput_high, missing=" (—)"
        )
    return (name, settings, tp, _ratio(*data.speedup(t)), rec.peak_memory_bytes, outcome)


def _reference_row(data: ReportData) -> Row:
    ref, m = data.reference, data.reference_latest
    if ref is None:
        return ("fp32 reference", "—", "—", "—", None, "not measured yet")
    if m is None:
        return ("fp32 reference", ref_label(ref), "—", "—", ref.peak_memory_bytes, "not measured")
    low, high = measured_interval(m)
    n = len(ref.measurements)
    outcome = f"the divisor of every speedup; measured {n} time{'s' if n != 1 else ''}"
    if n > 1:
        outcome += ", latest shown"
    return (
        "fp32 reference",
        ref_label(ref),
        throughput_text(m.throughput, low, high, missing=" (—)"),
        "1.00×",
        ref.peak_memory_bytes,
        outcome,
    )


def _summary(data: ReportData) -> str:
    cfg = data.config
    parts = ['<section id="summary"><h2>Summary</h2>']
    if cfg is not None:
        parts.append(_winner_card(data, cfg))
    else:
        parts.append(
            '<p class="note">No best.json for this study was found (the search may still be '
            "running, was interrupted, or wrote it elsewhere: pass --out). The table below "
            "shows the search's figures only.</p>"
        )
    rows: list[Row] = []
    if cfg is not None and cfg.evidence.validated:
        ev = cfg.evidence
        label = params_label(data.winner.params) if data.winner else cfg.precision
        blocks = f" over {ev.paired_blocks} paired blocks" if ev.paired_blocks else ""
        rows.append(
            (
                "winner (validation, paired)",
                label,
                throughput_text(
                    ev.throughput, ev.throughput_low, ev.throughput_high, missing=" (—)"
                ),
                _ratio(ev.speedup, ev.speedup_low, ev.speedup_high),
                ev.peak_memory_bytes,
                "validated" + blocks,
            )
        )
        if data.winner is not None:
            row = _trial_row(data, "winner (in the search)", data.winner)
            optimism = f"search optimism {optimism_text(ev.search_optimism)}"
            rows.append((*row[:5], optimism))
    elif cfg is None and data.winner is not None:
        row = _trial_row(data, "best feasible trial", data.winner)
        rows.append((*row[:5], data.winner_note))
    rows.append(_reference_row(data))
    rows.append(_trial_row(data, "plain AMP recipe", data.amp_recipe))
    body = "".join(
        f"<tr><th>{esc(a)}</th><td>{esc(b)}</td><td class='num'>{esc(c)}</td>"
        f"<td class='num'>{esc(d)}</td><td class='num'>{_mib(e)}</td><td>{esc(f)}</td></tr>"
        for a, b, c, d, e, f in rows
    )
    parts.append(
        '<table class="baselines"><thead><tr><th></th><th>settings</th>'
        "<th class='num'>samples/s (95% interval)</th><th class='num'>vs fp32 (95% interval)</th>"
        f"<th class='num'>peak memory</th><th>outcome</th></tr></thead><tbody>{body}</tbody></table>"
    )
    if data.reference_throughput is None:
        parts.append(
            '<p class="note">The fp32 reference has not been measured: no speed-ups yet.</p>'
        )
    parts.append(_facts(data))
    parts.append("</section>")
    return "".join(parts)


_OBJECTIVES = {
    "speedup": "speedup over the fp32 reference measured close in time",
    "throughput": "samples/s",
    "time_to_loss": "time to the fp32 reference's loss",
}


def _facts(data: ReportData) -> str:
    spec, cfg = data.spec, data.config
    c = data.counts()
    items: list[tuple[str, str]] = [
        ("workload", str(spec.get("workload", "?"))),
        ("budget", f"{spec.get('budget', '?')} · objective: {_OBJECTIVES[data.objective]}"),
        ("trials", counts_text(c)),
    ]
    if cfg is not None:
        env = cfg.environment
        items.insert(
            1,
            (
                "environment",
                f"{env.device} · torch {env.torch} · CUDA {env.cuda or '—'} · autotune {env.autotune}",
            ),
        )
        rule = f"{cfg.evidence.lr_scaling} scaling with the batch size{kept_lr_text(cfg)}"
        items.append(("learning rate", rule))
    items.append(("timing noise", noise_text(data.noise, data.noise_interval)))
    busy = busy_text(cfg)
    if busy:
        items.append(("others' load", busy))
    if data.ceilings:
        text = "; ".join(
            ceiling_text(m, b, data.ceiling_limits.get(m)) for m, b in data.ceilings.items()
        )
        items.append((f"batch ceilings ({data.ceiling_device})", text))
    if cfg is not None and cfg.evidence.cut:
        items.append(
            ("cut from the space", "; ".join(f"{k}: {v}" for k, v in cfg.evidence.cut.items()))
        )
    if cfg is not None and cfg.evidence.rejected:
        items.append(("main rejections", "; ".join(cfg.evidence.rejected[:8])))
    if cfg is not None and (found := cfg.evidence.fp16_diagnosis):
        islands = f"; fp32 islands {found['islands']}" if found.get("islands") else ""
        items.append(("fp16 diagnosis", f"{found.get('reason', '')}{islands}"))
    if data.config_path is not None:
        items.append(("config", str(data.config_path)))
    for note in data.notes:
        items.append(("note", note))
    body = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items)
    return f'<dl class="facts">{body}</dl>'


def _settings_cell(data: ReportData, t: FrozenTrial) -> str:
    """What a trial ran, in one cell that wraps between settings: ``fp16 bs=64 lr=0.4 (×1)
    init_scale=256 compile``. A trial that never ran shows what it was queued with."""
    rec = data.rec(t)
    p = t.params or t.system_attrs.get("fixed_params") or {}
    if not p:
        return "—"
    lr = "—" if rec.learning_rate is None else f"{rec.learning_rate:.3g}"
    if "lr_multiplier" in p:
        lr += f" (×{float(p['lr_multiplier']):.3g})"
    toks = [str(p.get("precision", "—")), f"bs={p.get('batch_size', '—')}", f"lr={lr}"]
    if p.get("init_scale") is not None:
        toks.append(f"init_scale={scale_text(float(p['init_scale']))}")
    if (knobs := trial_knobs(t)) != "—":
        toks += knobs.split(" · ")
    return _toks(*toks)


def _toks(*texts: str) -> str:
    """Texts that a cell wraps between, never inside one (``(1.47–1.54)`` stays whole)."""
    return " ".join(f'<span class="tok">{esc(text)}</span>' for text in texts)


def _trials_table(data: ReportData) -> str:
    head = (
        "<tr><th class='num'>#</th><th>role</th><th>outcome</th><th>settings</th>"
        "<th class='num'>samples/s</th><th class='num'>vs fp32 (95% interval)</th>"
        "<th class='num'>peak memory</th><th class='num'>parity gap</th>"
        "<th class='num'>probe s</th><th>reason</th></tr>"
    )
    rows = []
    winner = data.winner.number if data.winner is not None else None
    for t in sorted(data.trials + data.validated, key=lambda t: t.number):
        rec = data.rec(t)
        outcome, state = _outcome(t), t.state.name.lower()
        classes = [state]
        if outcome == Outcome.INFEASIBLE:
            classes.append("infeasible")
        if t.number == winner:
            classes.append("winner")
        role = _role(data, t) + (" ★ winner" if t.number == winner else "")
        reason = rec.reason
        if rec.duplicate_of is not None:
            reason = sentences(
                f"same parameters as trial {rec.duplicate_of}: measurement reused", reason
            )
        gap, secs = rec.parity_gap, rec.probe_seconds
        done = t.state == TrialState.COMPLETE
        tp_tip = ""
        if done and rec.throughput_low is not None and rec.throughput_high is not None:
            tp_tip = "95% interval " + throughput_text(
                rec.throughput, rec.throughput_low, rec.throughput_high
            )
            if rec.blocks:
                tp_tip += f" over {rec.blocks} timed blocks"
        ratio_tip = ""
        if done and rec.reference_throughput:
            ratio_tip = f"against the fp32 reference at {rec.reference_throughput:,.1f} samples/s"
        # The Optuna state beside the outcome where it says more ("slower", pruned).
        extra = "" if outcome.startswith(state) else f'<span class="state">{esc(state)}</span>'
        cells = [
            f"<td class='num'>{t.number}</td>",
            f"<td>{esc(role.strip())}</td>",
            f"<td>{esc(outcome)}{extra}</td>",
            f"<td class='settings'>{_settings_cell(data, t)}</td>",
            f"<td class='num' title='{esc(tp_tip)}'>{_tp(rec.throughput if done else None)}</td>",
            f"<td class='num wrap' title='{esc(ratio_tip)}'>{_toks(*_ratio(*data.speedup(t)).split(' '))}</td>",
            f"<td class='num'>{_mib(rec.peak_memory_bytes)}</td>",
            f"<td class='num'>{'—' if gap is None else f'{gap:+.1%}'}</td>",
            f"<td class='num'>{'—' if secs is None else f'{secs:.1f}'}</td>",
            f"<td class='reason'>{esc(reason.strip())}</td>",
        ]
        rows.append(
            f'<tr class="{" ".join(classes)}" data-trial="{t.number}">{"".join(cells)}</tr>'
        )
    note = "" if rows else '<p class="note">This study has no trials yet.</p>'
    return (
        f'<section id="trials"><h2>Every trial ({len(rows)})</h2>{note}'
        f'<div class="scroll"><table class="trials"><thead>{head}</thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
        "</section>"
    )


def render_html(data: ReportData) -> str:
    """The whole report page for one study, as a string.

    Args:
        data: what :func:`autotune.report.collect` gathered.

    Returns:
        A complete HTML document with inline CSS and SVG: it opens offline, from a file.
    """
    from autotune.version import __version__

    spec = data.spec
    device = data.config.environment.device if data.config else str(spec.get("device", "?"))
    title = f"autotune report · {data.name}"
    sections = [
        _summary(data),
        knobs_html(data.trials),
        _figure(
            "throughput",
            "Throughput by batch size",
            throughput_figure(data),
            "What each precision mode delivers at each batch size, and how large a batch each "
            "runs (what limited it: memory, time or the space's cap).",
        ),
        _figure(
            "parity",
            "Loss parity: winner against the fp32 reference",
            loss_figure(data),
            "A fast setting only counts if it learns as well as fp32, sample for sample.",
        ),
        _figure(
            "validation",
            "Search against validation",
            validation_figure(data),
            "The search's figure for the winner is the best of many noisy ones; validation "
            "measures it again, paired block by block with the fp32 reference.",
        ),
        _figure(
            "reference",
            "The fp32 reference over time",
            reference_figure(data),
            "Every speedup divides by the fp32 reference measured close in time: a busy or "
            "drifting machine shows here as a moving reference.",
        ),
        _figure("scaler", "GradScaler scale (fp16 trials)", scale_figure(data)),
        _figure("history", "Optimization history", history_figure(data)),
        _figure("importance", "Parameter importances", importance_figure(data)),
        _trials_table(data),
    ]
    generated = data.generated_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body><main>"
        f"<header><h1>{esc(title)}</h1>"
        f'<p class="meta">{esc(workload_label(str(spec.get("workload", "?"))))} on {esc(device)} · '
        f"storage {esc(data.storage or '?')}</p></header>"
        + "".join(sections)
        + f"<footer>Written by autotune {esc(__version__)} on {esc(generated)}.</footer>"
        "</main></body></html>\n"
    )
