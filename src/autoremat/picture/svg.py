"""SVG's pieces for the pictures (pure: strings in, strings out).

Every curve is told apart by its dash and weight as well as its colour (:data:`STYLES`), so a
grey-scale print still shows which is which; sizes are written in binary units
(:func:`size_ticks`); what a shape stands for is in its ``<title>`` (the browser shows it on
hover) and its ``data-`` attributes (for tests and tools).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

__all__ = [
    "FONT",
    "STYLES",
    "Frame",
    "Style",
    "attrs",
    "legend",
    "polyline",
    "size_label",
    "size_ticks",
    "text",
    "y_axis",
]

FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"


@dataclass(frozen=True)
class Style:
    """How a curve or line is drawn: colour, width and dash (SVG ``stroke-dasharray``, ``""``
    solid)."""

    colour: str
    width: float
    dash: str = ""

    def stroke(self) -> str:
        dash = f' stroke-dasharray="{self.dash}"' if self.dash else ""
        return f'stroke="{self.colour}" stroke-width="{self.width}"{dash}'


# Colours of distinct lightness, and distinct dashes: told apart in grey too.
STYLES = {
    "without": Style("#a05195", 2.5, "9 5"),
    "plan": Style("#08519c", 3.0),
    "measured": Style("#ff7c00", 2.5, "2 4"),
    "budget": Style("#d62728", 2.0, "14 4 3 4"),
    "device": Style("#d62728", 2.0, "14 4 3 4"),
}


@dataclass(frozen=True)
class Frame:
    """A plot area (``left``, ``top``, ``width``, ``height`` in pixels) for x from 0 to
    ``x_max`` and bytes from 0 to ``y_max``."""

    left: float
    top: float
    width: float
    height: float
    x_max: float
    y_max: float

    def x(self, value: float) -> float:
        return self.left + self.width * value / (self.x_max or 1)

    def y(self, nbytes: float) -> float:
        return self.top + self.height * (1 - nbytes / (self.y_max or 1))

    @property
    def bottom(self) -> float:
        return self.top + self.height


def attrs(**values: object) -> str:
    """``key="value"`` pairs, escaped; ``data_x`` written ``data-x``; ``None`` left out."""
    return " ".join(
        f'{k.rstrip("_").replace("_", "-")}="{escape(str(v))}"'
        for k, v in values.items()
        if v is not None
    )


def text(x: float, y: float, words: str, size: int = 12, **more: object) -> str:
    """A ``<text>`` at ``(x, y)``, escaped."""
    where = attrs(x=f"{x:.1f}", y=f"{y:.1f}", font_size=size, **more)
    return f"<text {where}>{escape(words)}</text>"


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def size_ticks(y_max: float, count: int = 5) -> list[tuple[int, str]]:
    """About ``count`` round sizes from 0 to ``y_max`` (1, 2 or 5 times a power of ten of the
    largest binary unit below ``y_max``), each with its label (``"0"``, ``"20 MiB"``)."""
    unit, scale = next(((u, s) for u, s in _UNITS if y_max >= s), ("B", 1))
    span = y_max / scale / max(count, 1)
    power = 10 ** math.floor(math.log10(span)) if span > 0 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= span)
    ticks, k = [], 0
    while k * step * scale <= y_max * (1 + 1e-9):
        value = k * step
        shown = f"{value:g}" if value == int(value) else f"{value:.2g}"
        ticks.append((round(value * scale), "0" if k == 0 else f"{shown} {unit}"))
        k += 1
    return ticks


def size_label(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more, three figures."""
    unit, scale = next(((u, s) for u, s in _UNITS if abs(nbytes) >= s), ("B", 1))
    return f"{nbytes / scale:.3g} {unit}" if unit != "B" else f"{nbytes} B"


def y_axis(frame: Frame) -> list[str]:
    """The grid lines and labels of the size axis."""
    parts = []
    for nbytes, label in size_ticks(frame.y_max):
        y = frame.y(nbytes)
        parts.append(
            f'<line x1="{frame.left:.1f}" y1="{y:.1f}" x2="{frame.left + frame.width:.1f}" '
            f'y2="{y:.1f}" stroke="#e3e3e3" stroke-width="1"/>'
        )
        parts.append(text(frame.left - 8, y + 4, label, 12, text_anchor="end", fill="#333"))
    parts.append(
        f'<line x1="{frame.left:.1f}" y1="{frame.top:.1f}" x2="{frame.left:.1f}" '
        f'y2="{frame.bottom:.1f}" stroke="#666" stroke-width="1"/>'
    )
    return parts


def polyline(
    frame: Frame, points: Sequence[tuple[float, int]], style: Style, **more: object
) -> str:
    """A curve through ``points`` (x on the frame's axis, bytes), a step after each point."""
    coords: list[str] = []
    for k, (x, nbytes) in enumerate(points):
        px, py = frame.x(x), frame.y(nbytes)
        if k:
            coords.append(f"{px:.1f},{frame.y(points[k - 1][1]):.1f}")
        coords.append(f"{px:.1f},{py:.1f}")
    return (
        f'<polyline fill="none" {style.stroke()} stroke-linejoin="round" '
        f'{attrs(**more)} points="{" ".join(coords)}"/>'
    )


def legend(items: Sequence[tuple[str, str]], x: float, y: float, width: float) -> list[str]:
    """A legend: each item a sample (an SVG fragment drawn in a 28 x 14 box at the origin)
    and its words, laid out left to right, wrapping at ``width``."""
    parts, cx, cy = [], x, y
    for sample, words in items:
        room = 40 + 7 * len(words)
        if cx + room > x + width:
            cx, cy = x, cy + 22
        parts.append(f'<g transform="translate({cx:.1f},{cy - 10:.1f})">{sample}</g>')
        parts.append(text(cx + 34, cy + 1, words, 12, fill="#222"))
        cx += room + 16
    return parts
