"""What each knob (torch.compile, channels_last, fp32 islands) brought against the same point
with it off, and what compiling cost and after how many steps it pays off."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autotune.measure.knobs import break_even_steps
from autotune.measure.result import knob_text
from autotune.report._svg import esc
from autotune.schema.config import TunedConfig
from autotune.study.trials import display_outcome, feasible_trials, label, record

__all__ = ["KnobGain", "config_knobs", "knob_gains", "knob_lines", "knobs_html", "trial_knobs"]

# Each knob: its name, whether a trial's params have it on, and the params that turn it.
_KNOBS = (
    ("compile", lambda p: bool(p.get("compile")), ("compile", "compile_mode")),
    ("channels_last", lambda p: p.get("channels_last") is True, ("channels_last",)),
    ("fp32 islands", lambda p: p.get("fp32_islands", "none") != "none", ("fp32_islands",)),
)


@dataclass(frozen=True)
class KnobGain:
    """One knob's measured effect, at one point of the space.

    ``without`` is the trial at the same point with the knob off (None: never measured);
    ``gain`` the speedup with over the speedup without, minus one (None when either is missing,
    as when the point diverged without the knob: ``without_outcome`` says so).
    """

    knob: str
    with_trial: FrozenTrial
    without: FrozenTrial | None
    with_speedup: float
    without_speedup: float | None
    without_outcome: str | None
    gain: float | None
    compile_seconds: float | None = None
    break_even_steps: int | None = None


def _rest(params: dict, turned: tuple[str, ...]) -> dict:
    return {k: v for k, v in params.items() if k not in turned}


def knob_gains(trials: Iterable[FrozenTrial]) -> list[KnobGain]:
    """The best feasible trial with each knob on against the same point with it off, for every
    knob some trial turned on.

    Example:
        >>> knob_gains([])
        []
    """
    trials = [
        t
        for t in trials
        if t.params and record(t).duplicate_of is None and not record(t).tuned_config
    ]
    feasible = feasible_trials(trials)
    ok = {t.number for t in feasible}
    out = []
    for knob, on, turned in _KNOBS:
        with_knob = [t for t in feasible if on(t.params)]
        if not with_knob:
            continue
        best = max(with_knob, key=lambda t: record(t).speedup or 0.0)
        point = _rest(best.params, turned)
        same = [
            t
            for t in trials
            if not on(t.params) and _rest(t.params, turned) == point and t.state.is_finished()
        ]
        done = [t for t in same if t.number in ok]
        without = max(done, key=lambda t: record(t).speedup or 0.0) if done else None
        if without is None and same:
            without = max(same, key=lambda t: t.number)
        rec = record(best)
        s_on = rec.speedup or 0.0
        measured = without is not None and without.number in ok
        s_off = record(without).speedup if without is not None and measured else None
        gain = s_on / s_off - 1 if s_off else None
        seconds = rec.compile_seconds if knob == "compile" else None
        steps = None
        if seconds is not None and s_off and rec.reference_throughput:
            bs = int(best.params.get("batch_size", 0))
            steps = break_even_steps(seconds, bs, rec.reference_throughput, s_off, s_on)
        outcome = None
        if without is not None and not measured:
            outcome = display_outcome(without) or without.state.name.lower()
        out.append(KnobGain(knob, best, without, s_on, s_off, outcome, gain, seconds, steps))
    return out


def _line(g: KnobGain) -> str:
    text = f"{g.knob}: {label(g.with_trial.params)} {g.with_speedup:.2f}x"
    if g.without is None:
        text += "; not measured without it"
    elif g.without_speedup is not None:
        text += f" vs {g.without_speedup:.2f}x without ({g.gain:+.0%})"
    else:
        reason = record(g.without).reason
        text += f"; without it: {g.without_outcome}" + (f" ({reason})" if reason else "")
    if g.compile_seconds is not None:
        text += f"; compiling took {g.compile_seconds:.1f}s (untimed, charged to the budget)"
        if g.without_speedup is not None:
            text += (
                f", paid off after {g.break_even_steps:,} steps"
                if g.break_even_steps is not None
                else ", never paid off"
            )
    return text


def knob_lines(trials: Iterable[FrozenTrial]) -> list[str]:
    """:func:`knob_gains` as lines of text, one per knob."""
    return [_line(g) for g in knob_gains(trials)]


def trial_knobs(trial: FrozenTrial) -> str:
    """The knobs a trial turned, for the trials table: ``compile (12.3s) · channels_last``."""
    p, rec = trial.params, record(trial)
    parts = []
    if p.get("compile"):
        mode = p.get("compile_mode", "default")
        text = "compile" if mode == "default" else f"compile={mode}"
        if rec.compile_seconds is not None:
            text += f" ({rec.compile_seconds:.1f}s)"
        parts.append(text)
    if "channels_last" in p:
        parts.append("channels_last" if p["channels_last"] else "nchw")
    if rec.fp32_modules and p.get("fp32_islands", "none") != "none":
        parts.append(f"fp32: {', '.join(rec.fp32_modules)}")
    return " · ".join(parts) or "—"


def config_knobs(cfg: TunedConfig, params: Mapping[str, Any] | None) -> str:
    """A config's knobs as the trials' labels show them (`` compile channels_last``): the
    memory format only where the search chose it (a parameter of the trial behind the config,
    ``params``); otherwise it is the workload's own, which the fp32 reference ran too.

    Example:
        >>> from autotune.schema.config import GradScalerSettings
        >>> cfg = TunedConfig.model_construct(precision="bf16", batch_size=64, learning_rate=0.1,
        ...     grad_scaler=GradScalerSettings(enabled=False), channels_last=True, compile=False,
        ...     compile_mode="default", fp32_modules=[])
        >>> config_knobs(cfg, {"precision": "bf16"}), config_knobs(cfg, {"channels_last": True})
        ('', ' channels_last')
    """
    cand = cfg.candidate()
    if not params or "channels_last" not in params:
        cand = cand.model_copy(update={"channels_last": None})
    return knob_text(cand)


def knobs_html(trials: list[FrozenTrial]) -> str:
    """The report's section on what each knob brought; empty when no trial turned one."""
    gains = knob_gains(trials)
    if not gains:
        return ""
    rows = []
    for g in gains:
        without = "not measured"
        if g.without_speedup is not None:
            without = f"{g.without_speedup:.2f}x (#{g.without.number})"  # type: ignore[union-attr]
        elif g.without is not None:
            without = f"{g.without_outcome} (#{g.without.number})"
        cost = "—"
        if g.compile_seconds is not None:
            cost = f"compiling {g.compile_seconds:.1f}s"
            if g.break_even_steps is not None:
                cost += f", pays off after {g.break_even_steps:,} steps"
            elif g.without_speedup is not None:
                cost += ", never pays off"
        gain = "—" if g.gain is None else f"{g.gain:+.0%}"
        rows.append(
            f"<tr><th>{esc(g.knob)}</th><td>{esc(label(g.with_trial.params))} "
            f"(#{g.with_trial.number})</td><td class='num'>{g.with_speedup:.2f}x</td>"
            f"<td class='num'>{esc(without)}</td><td class='num'>{esc(gain)}</td>"
            f"<td>{esc(cost)}</td></tr>"
        )
    return (
        '<section id="knobs"><h2>What each knob brought</h2><p class="note">The best feasible '
        "trial with the knob on, against the same mode, batch and lr with it off; speedups over "
        "the fp32 reference measured close in time. Compiling happens in the untimed warm-up: its "
        "time is charged to the budget, never to the throughput.</p>"
        "<table class='knobs'><thead><tr><th>knob</th><th>with it</th><th class='num'>speedup</th>"
        "<th class='num'>without it</th><th class='num'>gain</th><th>cost</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )
