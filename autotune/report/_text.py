"""The report in a few lines of plain text, for a terminal (``autotune report NAME --text``)."""

from __future__ import annotations

from optuna.trial import TrialState

from autotune.progress import params_label, scale_text
from autotune.report._data import ReportData, feasible

__all__ = ["render_text"]

# The best few trials are enough to see the shape of the result; the HTML report lists all.
_TOP = 5


def _tp(value: object) -> str:
    return f"{float(value):,.1f} samples/s" if isinstance(value, (int, float)) and value else "—"


def render_text(data: ReportData) -> str:
    """A short plain-text summary: winner, baselines, counts, the best trials, rejections.

    Example:
        >>> print(render_text(collect(load_study("tiny"))))  # doctest: +SKIP
        study 'tiny': autotune.workloads:tiny_convnet on cpu (x86_64)
        winner: bf16 bs=32 lr=0.2: 3,811.6 samples/s, 1.35x the fp32 reference (validated)
        ...
    """
    cfg = data.config
    device = cfg.environment.device if cfg else str(data.spec.get("device", "?"))
    lines = [f"study {data.name!r}: {data.spec.get('workload', '?')} on {device}"]
    if cfg is not None:
        ev = cfg.evidence
        settings = f"{cfg.precision} bs={cfg.batch_size} lr={cfg.learning_rate:.3g}"
        if cfg.grad_scaler.enabled:
            settings += f" init_scale={scale_text(cfg.grad_scaler.init_scale)}"
        status = "validated" if ev.validated else "NOT validated: fp32 fallback"
        lines.append(
            f"winner: {settings}: {_tp(ev.throughput)}, {ev.speedup:.2f}x the fp32 reference "
            f"({status})"
        )
        if ev.parity_gap is not None:
            lines.append(
                f"  loss parity {ev.parity_gap:+.1%} (tolerance {ev.parity_tolerance:.0%})"
            )
    elif data.winner is not None:
        lines.append(
            f"best so far: trial {data.winner.number} {params_label(data.winner.params)}: "
            f"{_tp(data.winner.user_attrs.get('throughput'))} ({data.winner_note})"
        )
    else:
        lines.append(f"no winner yet: {data.winner_note or 'no best.json'}")
    for label, t in (("fp32 reference", data.reference), ("plain AMP recipe", data.amp_recipe)):
        if t is None or not t.params:
            lines.append(f"{label}: not run")
            continue
        outcome = str(t.user_attrs.get("outcome") or t.state.name.lower())
        if t.state == TrialState.COMPLETE:
            ratio = data.vs_reference(t)
            tail = _tp(t.user_attrs.get("throughput")) + (f" ({ratio:.2f}x)" if ratio else "")
        else:
            tail = f"{outcome}: {t.user_attrs.get('reason', '')}".rstrip(": ")
        lines.append(f"{label}: {params_label(t.params)}: {tail}")
    c = data.counts()
    lines.append(
        f"trials: {c['complete']} complete ({c['infeasible']} infeasible), {c['pruned']} pruned, "
        f"{c['failed']} failed" + (f", {c['other']} not finished" if c["other"] else "")
    )
    ranked = sorted(
        (t for t in data.trials if feasible(t) and t.user_attrs.get("duplicate_of") is None),
        key=lambda t: float(t.value or 0),
        reverse=data.maximize,
    )[:_TOP]
    if ranked:
        lines.append("best feasible trials:")
        for t in ranked:
            ratio = data.vs_reference(t)
            lines.append(
                f"  #{t.number:<3} {params_label(t.params):<40} "
                f"{_tp(t.user_attrs.get('throughput')):>20}" + (f"  {ratio:.2f}x" if ratio else "")
            )
    if cfg is not None and cfg.evidence.rejected:
        lines.append("main rejections:")
        lines += [f"  {r}" for r in cfg.evidence.rejected[:_TOP]]
    if data.ceilings:
        lines.append("batch ceilings: " + ", ".join(f"{m} ≤ {b}" for m, b in data.ceilings.items()))
    lines += [f"note: {n}" for n in data.notes]
    return "\n".join(lines)
