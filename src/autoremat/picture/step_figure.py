"""The step's memory as a figure (pure: plain data in, SVG out).

Over the step's moments (x: the planned step's ops in order; forward, loss, backward marked
below the axis with each top-level module's span), the live bytes of each :class:`Curve`
(without recompute, with the plan, measured), the budget line, each curve's peak marked with
its bytes and the module it falls in, and the recomputes shaded and named (selective ones
hatched). Thousands of moments are drawn as at most two points a pixel column
(:func:`~autoremat.picture.series.decimated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from autoremat.picture.series import decimated
from autoremat.picture.svg import (
    FONT,
    STYLES,
    Frame,
    attrs,
    legend,
    polyline,
    size_label,
    text,
    y_axis,
)

__all__ = ["FRAME", "Curve", "Span", "StepFigure", "frame_of", "step_svg"]

# The plot area of a step's figure: left, top, width, height (pixels); the whole is 1200 wide.
FRAME = (90.0, 50.0, 1080.0, 380.0)
WIDTH, HEIGHT = 1200, 560


@dataclass(frozen=True)
class Curve:
    """One step's live bytes: ``key`` (its style in :data:`~autoremat.picture.svg.STYLES`),
    legend ``name``, ``short`` name (beside its peak), each moment's x and most bytes live,
    and where its peak falls."""

    key: str
    name: str
    short: str
    xs: tuple[float, ...]
    highs: tuple[int, ...]
    peak_path: str = ""
    peak_phase: str = ""

    @property
    def peak(self) -> int:
        return max(self.highs, default=0)

    @property
    def peak_x(self) -> float:
        return self.xs[self.highs.index(self.peak)] if self.highs else 0.0


@dataclass(frozen=True)
class Span:
    """A stretch of the axis (``start`` to ``end``) and what it is: a ``label`` (a module's
    path, a phase, a plan entry) and, for a recompute, its ``way``."""

    start: float
    end: float
    label: str
    way: str = ""


@dataclass(frozen=True)
class StepFigure:
    """What :func:`step_svg` draws: the ``curves`` over an axis of ``x_max`` moments, the
    ``phases`` and top-level ``modules`` below it, the ``recomputes`` shaded, the
    ``budget`` line (``None``: none)."""

    curves: tuple[Curve, ...]
    x_max: float
    phases: tuple[Span, ...] = ()
    modules: tuple[Span, ...] = ()
    recomputes: tuple[Span, ...] = ()
    budget: int | None = None


def frame_of(figure: StepFigure) -> Frame:
    """The plot area, its size axis up to a tenth above the highest peak or the budget."""
    top = max([c.peak for c in figure.curves] + [figure.budget or 0, 1])
    return Frame(*FRAME, x_max=figure.x_max, y_max=top * 1.1)


def step_svg(figure: StepFigure) -> str:
    """The figure as an ``<svg>`` element (module docstring)."""
    frame = frame_of(figure)
    parts = [_patterns(), *_recomputes(frame, figure.recomputes), *y_axis(frame)]
    parts += _phases(frame, figure.phases) + _modules(frame, figure.modules)
    if figure.budget is not None:
        parts += _budget(frame, figure.budget)
    for curve in figure.curves:
        points = decimated(curve.xs, curve.highs, int(frame.width))
        parts.append(polyline(frame, points, STYLES[curve.key], data_curve=curve.key))
    for k, curve in enumerate(figure.curves):
        parts += _peak(frame, curve, k)
    parts += legend(_legend_items(figure), frame.left, frame.bottom + 100, frame.width)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" {attrs(width=WIDTH, height=HEIGHT)} '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" style="{FONT}" role="img" '
        f'{attrs(data_y_max=frame.y_max, data_x_max=frame.x_max)}>{"".join(parts)}</svg>'
    )


def _patterns() -> str:
    """The hatching of selective recomputes."""
    return (
        '<defs><pattern id="selective" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fbe6a8"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#b8860b" stroke-width="2"/></pattern></defs>'
    )


def _recomputes(frame: Frame, spans: Sequence[Span]) -> list[str]:
    """Each recompute's stretch shaded over the plot, named on hover and, when wide
    enough, along its side from the foot (the peaks' labels are at the top)."""
    parts = []
    for s in spans:
        x0, x1 = frame.x(s.start), max(frame.x(s.end), frame.x(s.start) + 1.5)
        fill = "url(#selective)" if s.way != "full" else "#f7d774"
        words = f"recompute of {s.label or '(root)'} ({s.way})"
        parts.append(
            f'<rect {attrs(x=f"{x0:.1f}", y=frame.top, width=f"{x1 - x0:.1f}")} '
            f'height="{frame.height}" fill="{fill}" fill-opacity="0.6" '
            f'{attrs(data_entry=s.label, data_way=s.way)}><title>{escape(words)}</title></rect>'
        )
        if x1 - x0 >= 11:
            name = (s.label or "(root)") + (" (sel.)" if s.way != "full" else "")
            parts.append(
                text(x0 + 10, frame.bottom - 6, name, 10, fill="#5a4500",  # (reading up from
                     transform=f"rotate(-90 {x0 + 10:.1f} {frame.bottom - 6:.1f})")  # the foot)
            )
    return parts


def _phases(frame: Frame, phases: Sequence[Span]) -> list[str]:
    """Each phase's name under the axis, a line where it begins."""
    parts = []
    for s in phases:
        x0, x1 = frame.x(s.start), frame.x(s.end)
        parts.append(
            f'<line x1="{x0:.1f}" y1="{frame.top:.1f}" x2="{x0:.1f}" y2="{frame.bottom + 50:.1f}" '
            f'stroke="#999" stroke-width="1" stroke-dasharray="3 3"/>'
        )
        parts.append(text((x0 + x1) / 2, frame.bottom + 48, s.label, 13, text_anchor="middle",
                          fill="#222", font_weight="bold", data_phase=s.label))  # fmt: skip
    parts.append(text(frame.left + frame.width, frame.bottom + 66,
                      "the step's moments (its ops, in order) →", 11, text_anchor="end",
                      fill="#555"))  # fmt: skip
    return parts


def _modules(frame: Frame, modules: Sequence[Span]) -> list[str]:
    """The top-level modules' spans in a band under the axis, each named on hover."""
    parts = []
    for k, s in enumerate(modules):
        x0, x1 = frame.x(s.start), frame.x(s.end)
        fill = ("#d0d0d0", "#a8a8a8")[k % 2]
        parts.append(
            f'<rect {attrs(x=f"{x0:.1f}", y=frame.bottom + 6, width=f"{max(x1 - x0, 0.5):.1f}")} '
            f'height="18" fill="{fill}" {attrs(data_module=s.label)}>'
            f"<title>{escape(s.label or '(root)')}</title></rect>"
        )
        if x1 - x0 > 7 * len(s.label) + 6:
            parts.append(text((x0 + x1) / 2, frame.bottom + 19, s.label, 10,
                              text_anchor="middle", fill="#111"))  # fmt: skip
    return parts


def _budget(frame: Frame, budget: int) -> list[str]:
    y = frame.y(budget)
    return [
        f'<line x1="{frame.left:.1f}" y1="{y:.1f}" x2="{frame.left + frame.width:.1f}" '
        f'y2="{y:.1f}" {STYLES["budget"].stroke()} {attrs(data_budget=budget)}>'
        f"<title>budget {escape(size_label(budget))} ({budget} bytes)</title></line>",
        text(frame.left + frame.width - 4, y - 6, f"budget {size_label(budget)}", 12,
             text_anchor="end", fill=STYLES["budget"].colour, font_weight="bold"),
    ]


def _peak(frame: Frame, curve: Curve, k: int) -> list[str]:
    """The curve's peak: a marker, and its bytes and module beside it."""
    x, y = frame.x(curve.peak_x), frame.y(curve.peak)
    where = f"{curve.peak_path or '(root)'}, {curve.peak_phase}" if curve.peak_phase else ""
    words = f"{curve.short}: peak {size_label(curve.peak)}" + (f" in {where}" if where else "")
    right = x < frame.left + frame.width * 0.6
    style = STYLES[curve.key]
    return [
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{style.colour}" stroke="#fff" '
        f'stroke-width="1.5" {attrs(data_peak=curve.peak, data_curve=curve.key)}>'
        f"<title>{escape(curve.name)}: {escape(words)} ({curve.peak} bytes)</title></circle>",
        text(x + (9 if right else -9), y - 8 - 15 * k, words, 12, fill="#111",
             text_anchor="start" if right else "end", font_weight="bold",
             data_peak_label=curve.key),
    ]


def _legend_items(figure: StepFigure) -> list[tuple[str, str]]:
    items = [
        (f'<line x1="0" y1="7" x2="28" y2="7" {STYLES[c.key].stroke()}/>', c.name)
        for c in figure.curves
    ]
    if figure.budget is not None:
        sample = f'<line x1="0" y1="7" x2="28" y2="7" {STYLES["budget"].stroke()}/>'
        items.append((sample, "budget"))
    ways = {s.way for s in figure.recomputes}
    if "full" in ways:
        items.append(('<rect width="28" height="14" fill="#f7d774"/>', "recomputed"))
    if ways - {"full"}:
        items.append(('<rect width="28" height="14" fill="url(#selective)"/>',
                      "recomputed selectively (keeps its matmuls' outputs)"))  # fmt: skip
    items.append(('<rect width="28" height="14" fill="#bdbdbd"/>', "module (hover: its path)"))
    return items
