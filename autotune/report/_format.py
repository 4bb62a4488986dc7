"""Figures with their intervals, written the same way in the report, the text and the CLI."""

from __future__ import annotations

import math

from autotune.execution.contention import NOTABLE
from autotune.schema.config import TunedConfig
from autotune.search import lr_for

__all__ = [
    "busy_text",
    "ceiling_text",
    "config_notes",
    "kept_lr_text",
    "noise_text",
    "optimism_text",
    "ratio_text",
    "sentences",
    "throughput_text",
]


def _number(value: object) -> float | None:
    """A finite number, or None (absent, not a number, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def ratio_text(
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    x: str = "x",
    missing: str = "",
) -> str:
    """A speedup with its interval: ``1.93x (1.85–2.01)``.

    Args:
        value: the speedup; None gives ``—``.
        low, high: its interval; when either is absent only the value is written, followed by
            ``missing`` (``" (—)"`` in a table, where the column promises an interval).
        x: the sign after the number (``×`` in HTML).
        missing: what stands for an interval that was not measured.

    Example:
        >>> ratio_text(1.934, 1.851, 2.012), ratio_text(1.5), ratio_text(None)
        ('1.93x (1.85–2.01)', '1.50x', '—')
        >>> ratio_text(1.5, x="×", missing=" (—)")
        '1.50× (—)'
    """
    v, lo, hi = _number(value), _number(low), _number(high)
    if v is None:
        return "—"
    if lo is None or hi is None:
        return f"{v:.2f}{x}{missing}"
    return f"{v:.2f}{x} ({lo:.2f}–{hi:.2f})"


def throughput_text(
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    unit: str = "",
    missing: str = "",
) -> str:
    """Samples/s with its interval: ``1,812.5 (1,790.2–1,840.0)``; ``—`` without a value. An
    interval whose ends are equal (a probe cut short after one timed step stores its figure as
    both) is none: no ``(101.3–101.3)`` that reads as a perfectly steady figure.

    Example:
        >>> throughput_text(1812.49, 1790.2, 1840.0, unit=" samples/s")
        '1,812.5 samples/s (1,790.2–1,840.0)'
        >>> throughput_text(0), throughput_text(812.5), throughput_text(101.3, 101.3, 101.3)
        ('—', '812.5', '101.3')
    """
    v, lo, hi = _number(value), _number(low), _number(high)
    if not v:
        return "—"
    if lo is None or hi is None or hi <= lo:
        return f"{v:,.1f}{unit}{missing}"
    return f"{v:,.1f}{unit} ({lo:,.1f}–{hi:,.1f})"


def optimism_text(optimism: float | None) -> str:
    """The search's figure against validation's: ``+8.8%`` (the search measured 8.8% more).

    Example:
        >>> optimism_text(0.0876), optimism_text(-0.02), optimism_text(None)
        ('+8.8%', '-2.0%', '—')
    """
    v = _number(optimism)
    return "—" if v is None else f"{v:+.1%}"


def noise_text(spread: float | None, interval: float | None = None) -> str:
    """A device's timing noise: the spread of the fp32 reference's timed blocks (their
    interquartile range over their median), in words a reader can place.

    A spread of 0 says nothing measured it (fewer than 4 blocks give none): ``interval``, the
    relative half-width of the reference's 95% interval, stands in, named as what it is, so
    the figure never claims a quiet device beside an interval that is not.

    Example:
        >>> print(noise_text(0.021))
        2.1% (spread of the fp32 reference's timed blocks: interquartile range over median)
        >>> print(noise_text(0.0, 0.04))
        ±4.0% (the fp32 reference's 95% interval; its timed blocks were too few for a spread)
        >>> noise_text(None), noise_text(0.0)
        ('—', '—')
    """
    v, w = _number(spread), _number(interval)
    if v:
        return (
            f"{v:.1%} (spread of the fp32 reference's timed blocks: interquartile range over "
            "median)"
        )
    if w:
        return (
            f"±{w:.1%} (the fp32 reference's 95% interval; its timed blocks were too few for a "
            "spread)"
        )
    return "—"


def _capital(text: str) -> str:
    """A sentence's first word capitalised when it is a plain word (``slower`` → ``Slower``);
    a name stays as written (``fp16``, ``init_scale``, ``torch.compile``)."""
    word = text.split(" ", 1)[0].rstrip(":,;")
    return text[0].upper() + text[1:] if word.isalpha() and word.islower() else text


def sentences(*parts: str) -> str:
    """Sentences joined into one text: each starts with a capital and ends with a full stop
    (empty parts are skipped), so no sentence starts lower-case after a full stop.

    Example:
        >>> sentences("same parameters as trial 3: measurement reused", "slower: upper bound")
        'Same parameters as trial 3: measurement reused. Slower: upper bound.'
        >>> sentences("No interval.", "fp16 diverged at step 3")
        'No interval. fp16 diverged at step 3.'
    """
    out = []
    for part in parts:
        part = part.strip()
        if part:
            out.append(_capital(part) + ("" if part.endswith((".", "!", "?")) else "."))
    return " ".join(out)


# What limited a mode's batch ceiling (autotune.measure.ceilings.Ceiling.limited_by), in words.
_LIMITS = {
    "memory": "memory runs out above it",
    "margin": "a larger batch leaves less than the memory margin free",
    "time": "a larger batch's try would not fit its time limit",
    "cap": "the space's cap, its largest batch size",
    "crash": "a larger batch crashed the worker",
    "busy": "other processes held the memory margin, so it is not stored (measured again on resume)",
}


def ceiling_text(mode: str, batch_size: int, limited_by: str | None) -> str:
    """A batch ceiling with what limited it; a bare ceiling where that is not known (a study
    written before it was stored).

    Example:
        >>> ceiling_text("fp16", 512, "memory")
        'fp16 ceiling 512: memory runs out above it'
        >>> ceiling_text("bf16", 2048, None)
        'bf16 ceiling 2048'
    """
    why = _LIMITS.get(limited_by or "")
    return f"{mode} ceiling {batch_size}" + (f": {why}" if why else "")


def kept_lr_text(cfg: TunedConfig) -> str:
    """`` (the winner's lr 0.1 is kept below the rule's 0.2, ...)`` where the config's lr is
    below what its rule gives at its batch (the search kept it after the rule's blew up);
    empty otherwise.

    Example:
        >>> from autotune.schema.config import Evidence
        >>> ev = Evidence.model_construct(
        ...     lr_scaling="linear", base_learning_rate=0.1, base_batch_size=128
        ... )
        >>> cfg = TunedConfig.model_construct(batch_size=256, learning_rate=0.1, evidence=ev)
        >>> kept_lr_text(cfg)
        " (the winner's lr 0.1 is kept below the rule's 0.2, which blew up at this batch)"
    """
    ev = cfg.evidence
    if ev.base_learning_rate is None or ev.base_batch_size is None:
        return ""
    rule = lr_for(ev.lr_scaling, ev.base_learning_rate, ev.base_batch_size, cfg.batch_size, 1.0)
    if cfg.learning_rate >= rule * (1 - 1e-6):
        return ""
    return (
        f" (the winner's lr {cfg.learning_rate:.3g} is kept below the rule's {rule:.3g}, "
        "which blew up at this batch)"
    )


def busy_text(cfg: TunedConfig | None) -> str | None:
    """Other processes' load while the config's search measured, as every surface shows it (on
    any machine); None where it was not measured or stayed under half a core.

    Example:
        >>> busy_text(None) is None
        True
    """
    cores = cfg.evidence.others_cores if cfg is not None else None
    if cores is None or cores < NOTABLE:
        return None
    return (
        f"other processes kept {cores:.1f} cores busy while the search measured: its figures "
        "ran beside them"
    )


def config_notes(cfg: TunedConfig, *, why: bool = True) -> list[str]:
    """What every surface shows beside a config's figure, read from the config alone and
    labelled as the text report labels them: why it fell back (a fallback; ``why=False`` where
    the surface says it already), this device's timing noise, and other processes' load where
    notable (:func:`busy_text`).

    Example:
        >>> from autotune.schema.config import Evidence
        >>> ev = Evidence.model_construct(
        ...     validated=False, validation_note="no candidate cleared 1.05x", noise=0.042,
        ...     others_cores=1.6,
        ... )
        >>> for note in config_notes(TunedConfig.model_construct(evidence=ev)):
        ...     print(note)
        why: no candidate cleared 1.05x
        timing noise: 4.2% (spread of the fp32 reference's timed blocks: interquartile range over median)
        others' load: other processes kept 1.6 cores busy while the search measured: its figures ran beside them
    """
    ev = cfg.evidence
    notes = []
    if why and not ev.validated and ev.validation_note:
        notes.append(f"why: {ev.validation_note}")
    if ev.noise:
        notes.append(f"timing noise: {noise_text(ev.noise)}")
    busy = busy_text(cfg)
    if busy:
        notes.append(f"others' load: {busy}")
    return notes
