"""Hand-rolled SVG charts: the report works offline, with no plotting library and no CDN."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

__all__ = ["MODE_COLORS", "PALETTE", "Plot", "esc", "fmt_num", "mode_color", "nice_range"]

# One colour per precision mode, the same in every chart and the legend.
MODE_COLORS = {"fp32": "#4c72b0", "tf32": "#8172b3", "fp16": "#dd8452", "bf16": "#55a868"}
# Distinct colours for series that are not modes (several fp16 trials in one chart).
PALETTE = ("#dd8452", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
_INK = "#333"
_GRID = "#e3e3e3"
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


def esc(value: object) -> str:
    """Text escaped for HTML and SVG (attribute-safe)."""
    return html.escape(str(value), quote=True)


def mode_color(mode: object) -> str:
    return MODE_COLORS.get(str(mode), "#937860")


def fmt_num(value: float) -> str:
    """Short tick labels: ``12000`` → ``12k``; ``1500`` → ``1,500``; ``0.25`` → ``0.25``.

    Example:
        >>> fmt_num(12000), fmt_num(1500), fmt_num(0.25)
        ('12k', '1,500', '0.25')
    """
    if abs(value) >= 1e4:
        return f"{value / 1e3:,.4g}k"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3g}"


def nice_range(
    lo: float, hi: float, count: int = 5, *, integer: bool = False
) -> tuple[float, float, list[float]]:
    """Round an interval out to 1-2-2.5-5 steps (whole-number steps for ``integer`` axes such as
    steps and trial numbers); returns ``(lo, hi, ticks)``.

    Example:
        >>> nice_range(3, 97)
        (0.0, 100.0, [0.0, 20.0, 40.0, 60.0, 80.0, 100.0])
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10):
        step = max(m * mag, 1.0) if integer else m * mag
        if (hi - lo) / step <= count:
            break
    start = math.floor(lo / step + 1e-9) * step
    end = math.ceil(hi / step - 1e-9) * step
    ticks = [float(round(start + i * step, 12)) for i in range(round((end - start) / step) + 1)]
    return float(start), float(end), ticks


class Plot:
    """One chart: data ranges, axes, marks; :meth:`render` returns the ``<svg>`` element.

    Args:
        x_range, y_range: data limits of the plot area.
        width, height: the SVG's size in pixels (it scales down with the page).
        x_log2, y_log2: log2 axes (batch sizes, GradScaler scales).
        label: the chart's accessible name (``aria-label`` and ``<title>``).
        left: room for y tick labels, in pixels.

    Example:
        >>> p = Plot((0, 10), (0, 1), label="demo")
        >>> p.line([(0, 0), (10, 1)], "#333")
        >>> p.render().startswith("<svg")
        True
    """

    def __init__(  # noqa: PLR0913 - drawing options, keyword-only with defaults, as matplotlib's
        self,
        x_range: tuple[float, float],
        y_range: tuple[float, float],
        *,
        width: int = 760,
        height: int = 320,
        x_log2: bool = False,
        y_log2: bool = False,
        label: str = "",
        left: int = 70,
    ) -> None:
        self.width, self.height = width, height
        self.left, self.right, self.top, self.bottom = left, 24, 14, 46
        self.x_log2, self.y_log2 = x_log2, y_log2
        self.x0, self.x1 = self._t(x_range[0], x_log2), self._t(x_range[1], x_log2)
        self.y0, self.y1 = self._t(y_range[0], y_log2), self._t(y_range[1], y_log2)
        if self.x1 == self.x0:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        if self.y1 == self.y0:
            self.y0, self.y1 = self.y0 - 1, self.y1 + 1
        self.label = label
        self.back: list[str] = []
        self.parts: list[str] = []

    @staticmethod
    def _t(v: float, log2: bool) -> float:
        return math.log2(v) if log2 else v

    # ---- coordinates -----------------------------------------------------------------------

    @property
    def plot_left(self) -> float:
        return float(self.left)

    @property
    def plot_right(self) -> float:
        return float(self.width - self.right)

    @property
    def plot_top(self) -> float:
        return float(self.top)

    @property
    def plot_bottom(self) -> float:
        return float(self.height - self.bottom)

    def sx(self, v: float) -> float:
        t = (self._t(v, self.x_log2) - self.x0) / (self.x1 - self.x0)
        return round(self.plot_left + t * (self.plot_right - self.plot_left), 2)

    def sy(self, v: float) -> float:
        t = (self._t(v, self.y_log2) - self.y0) / (self.y1 - self.y0)
        return round(self.plot_bottom - t * (self.plot_bottom - self.plot_top), 2)

    # ---- marks -----------------------------------------------------------------------------

    def axes(
        self,
        x_ticks: Sequence[float],
        y_ticks: Sequence[float],
        *,
        x_label: str,
        y_label: str,
        x_fmt: Callable[[float], str] = fmt_num,
        y_fmt: Callable[[float], str] = fmt_num,
    ) -> None:
        """Grid lines at the ticks, tick labels, the axis lines and the axis titles."""
        out = self.back
        lft, r, t, b = self.plot_left, self.plot_right, self.plot_top, self.plot_bottom
        for v in y_ticks:
            y = self.sy(v)
            out.append(f'<line x1="{lft}" y1="{y}" x2="{r}" y2="{y}" stroke="{_GRID}"/>')
            out.append(
                f'<text x="{lft - 6}" y="{y + 4}" text-anchor="end" font-size="11" '
                f'fill="{_INK}">{esc(y_fmt(v))}</text>'
            )
        for v in x_ticks:
            x = self.sx(v)
            out.append(f'<line x1="{x}" y1="{t}" x2="{x}" y2="{b}" stroke="{_GRID}"/>')
            out.append(
                f'<text x="{x}" y="{b + 16}" text-anchor="middle" font-size="11" '
                f'fill="{_INK}">{esc(x_fmt(v))}</text>'
            )
        out.append(f'<line x1="{lft}" y1="{b}" x2="{r}" y2="{b}" stroke="{_INK}"/>')
        out.append(f'<line x1="{lft}" y1="{t}" x2="{lft}" y2="{b}" stroke="{_INK}"/>')
        out.append(
            f'<text x="{(lft + r) / 2}" y="{self.height - 8}" text-anchor="middle" '
            f'font-size="12" fill="{_INK}">{esc(x_label)}</text>'
        )
        cy = (t + b) / 2
        out.append(
            f'<text x="14" y="{cy}" text-anchor="middle" font-size="12" fill="{_INK}" '
            f'transform="rotate(-90 14 {cy})">{esc(y_label)}</text>'
        )

    def line(  # noqa: PLR0913 - drawing options, keyword-only with defaults, as matplotlib's
        self,
        points: Sequence[tuple[float, float | None]],
        color: str,
        *,
        width: float = 2,
        dash: str | None = None,
        opacity: float = 1.0,
        title: str | None = None,
        step: bool = False,
        dots: bool = True,
    ) -> None:
        """A polyline; a point with y None breaks it (a non-finite loss leaves a gap). A lone
        point between gaps is drawn as a dot unless ``dots`` is off (a guide line, not data)."""
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in points:
            if y is None:
                runs.append([])
            else:
                runs[-1].append((self.sx(x), self.sy(y)))
        style = f'fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round"'
        if dash:
            style += f' stroke-dasharray="{dash}"'
        if opacity < 1:
            style += f' stroke-opacity="{opacity}"'
        tip = f"<title>{esc(title)}</title>" if title else ""
        for run in runs:
            if len(run) == 1 and dots:
                # A lone point (a probe stopped after one step) is still data: show it as a dot.
                x, y = run[0]
                self.parts.append(
                    f'<circle cx="{x}" cy="{y}" r="{width + 1}" fill="{color}">{tip}</circle>'
                )
                continue
            if len(run) < 2:
                continue
            if step:
                stepped = [run[0]]
                for x, y in run[1:]:
                    stepped += [(x, stepped[-1][1]), (x, y)]
                run = stepped
            pts = " ".join(f"{x},{y}" for x, y in run)
            self.parts.append(f'<polyline points="{pts}" {style}>{tip}</polyline>')

    def marker(
        self,
        x: float,
        y: float,
        color: str,
        *,
        kind: str = "dot",
        title: str | None = None,
        r: float = 4.5,
    ) -> None:
        """``dot`` (filled), ``ring`` (hollow), ``square`` (filled) or ``cross`` (×) at a data
        point."""
        cx, cy = self.sx(x), self.sy(y)
        tip = f"<title>{esc(title)}</title>" if title else ""
        if kind == "square":
            self.parts.append(
                f'<rect x="{cx - r}" y="{cy - r}" width="{2 * r}" height="{2 * r}" '
                f'fill="{color}" stroke="#fff" stroke-width="1" class="mark">{tip}</rect>'
            )
        elif kind == "cross":
            d = r * 0.9
            self.parts.append(
                f'<path d="M{cx - d},{cy - d}L{cx + d},{cy + d}M{cx - d},{cy + d}L{cx + d},{cy - d}" '
                f'stroke="{color}" stroke-width="2" class="mark">{tip}</path>'
            )
        elif kind == "ring":
            self.parts.append(
                f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="#fff" stroke="{color}" '
                f'stroke-width="2" class="mark">{tip}</circle>'
            )
        else:
            self.parts.append(
                f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="{color}" stroke="#fff" '
                f'stroke-width="1" class="mark">{tip}</circle>'
            )

    def errorbar(
        self, x: float, low: float, high: float, color: str, *, title: str | None = None
    ) -> None:
        """A vertical interval from ``low`` to ``high`` at ``x``, with short caps (drawn under
        the markers, so the point stays on top)."""
        cx, y0, y1 = self.sx(x), self.sy(low), self.sy(high)
        tip = f"<title>{esc(title)}</title>" if title else ""
        cap = 4
        self.back.append(
            f'<path d="M{cx},{y0}L{cx},{y1}M{cx - cap},{y0}L{cx + cap},{y0}'
            f'M{cx - cap},{y1}L{cx + cap},{y1}" stroke="{color}" stroke-width="1.4" '
            f'class="errorbar">{tip}</path>'
        )

    def hinterval(
        self, low: float, high: float, y: float, color: str, *, title: str | None = None
    ) -> None:
        """A horizontal interval from data ``low`` to ``high`` on pixel row ``y``, with caps."""
        x0, x1 = self.sx(low), self.sx(high)
        tip = f"<title>{esc(title)}</title>" if title else ""
        cap = 6
        self.parts.append(
            f'<path d="M{x0},{y}L{x1},{y}M{x0},{y - cap}L{x0},{y + cap}M{x1},{y - cap}L{x1},{y + cap}" '
            f'stroke="{color}" stroke-width="2" class="errorbar">{tip}</path>'
        )

    def vline(
        self, x: float, color: str, *, label: str = "", row: int = 0, title: str | None = None
    ) -> None:
        """A dashed vertical marker across the plot, labelled near the top (rows stack)."""
        sx = self.sx(x)
        tip = f"<title>{esc(title or label)}</title>" if (title or label) else ""
        self.parts.append(
            f'<line x1="{sx}" y1="{self.plot_top}" x2="{sx}" y2="{self.plot_bottom}" '
            f'stroke="{color}" stroke-width="1.5" stroke-dasharray="5 4">{tip}</line>'
        )
        if label:
            # About 6.5 px a character at 11 px: a label that would run off the right ends there.
            near_right = sx > self.plot_right - max(90.0, 6.5 * len(label))
            anchor, dx = ("end", -4) if near_right else ("start", 4)
            self.parts.append(
                f'<text x="{sx + dx}" y="{self.plot_top + 12 + 14 * row}" text-anchor="{anchor}" '
                f'font-size="11" fill="{color}" font-weight="600">{esc(label)}</text>'
            )

    def hline(self, y: float, color: str, *, label: str = "", dash: str = "5 4") -> None:
        sy = self.sy(y)
        self.parts.append(
            f'<line x1="{self.plot_left}" y1="{sy}" x2="{self.plot_right}" y2="{sy}" '
            f'stroke="{color}" stroke-width="1.5" stroke-dasharray="{dash}"/>'
        )
        if label:
            self.parts.append(
                f'<text x="{self.plot_right - 4}" y="{sy - 5}" text-anchor="end" font-size="11" '
                f'fill="{color}">{esc(label)}</text>'
            )

    def band(self, x_lo: float, x_hi: float, color: str, *, label: str = "") -> None:
        """A shaded vertical band (drawn under the data), e.g. the parity window."""
        a, b = self.sx(x_lo), self.sx(x_hi)
        self.back.append(
            f'<rect x="{min(a, b)}" y="{self.plot_top}" width="{abs(b - a)}" '
            f'height="{self.plot_bottom - self.plot_top}" fill="{color}" fill-opacity="0.12"/>'
        )
        if label:
            self.back.append(
                f'<text x="{(a + b) / 2}" y="{self.plot_top + 12}" text-anchor="middle" '
                f'font-size="11" fill="{_INK}">{esc(label)}</text>'
            )

    def bar(self, x0: float, x1: float, y: float, height: float, color: str, title: str) -> None:
        """A horizontal bar from data x0 to x1, centred on pixel row ``y``."""
        a, b = self.sx(x0), self.sx(x1)
        self.parts.append(
            f'<rect x="{a}" y="{y - height / 2}" width="{max(0.0, b - a)}" height="{height}" '
            f'fill="{color}" class="mark"><title>{esc(title)}</title></rect>'
        )

    def text(self, x: float, y: float, text: str, *, anchor: str = "start", size: int = 11) -> None:
        """Text at pixel coordinates (for labels that are not tied to data values)."""
        self.parts.append(
            f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{_INK}">{esc(text)}</text>'
        )

    def render(self) -> str:
        body = "".join(self.back + self.parts)
        return (
            f'<svg class="plot" viewBox="0 0 {self.width} {self.height}" width="{self.width}" '
            f'height="{self.height}" role="img" aria-label="{esc(self.label)}" style="{_FONT}">'
            f"<title>{esc(self.label)}</title>{body}</svg>"
        )
