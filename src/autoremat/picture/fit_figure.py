"""What :func:`autoremat.fit` tried, as a figure (pure: plain data in, SVG out).

One stacked bar per batch size tried: the whole training step's memory by part (parameters
and buffers, optimizer state, inputs, gradients, activations, what the runtime and allocator
add, the reserve) against the device's line; the chosen batch outlined and named. The parts
are told apart by lightness and hatching as well as colour (a grey-scale print keeps them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from autoremat.picture.svg import FONT, STYLES, Frame, attrs, legend, size_label, text, y_axis

__all__ = ["PARTS", "Bar", "fit_svg"]

# part -> its fill (a colour, or a hatching defined in the figure), darkest first
PARTS = {
    "parameters and buffers": "#253494",
    "optimizer state": "#2c7fb8",
    "inputs": "url(#inputs)",
    "gradients": "#41b6c4",
    "activations": "#a1dab4",
    "optimizer step": "url(#step)",
    "runtime and allocator": "url(#runtime)",
    "reserve": "#ffffcc",
}
WIDTH, HEIGHT = 1200, 520


@dataclass(frozen=True)
class Bar:
    """One batch size tried: its ``parts`` (names of :data:`PARTS`, bytes), whether it was
    ``chosen``, and a ``note`` on its plan."""

    batch: int
    parts: tuple[tuple[str, int], ...]
    chosen: bool = False
    note: str = ""

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


def fit_svg(bars: Sequence[Bar], device: int, device_name: str = "device") -> str:
    """The bars against the ``device`` line (bytes) as an ``<svg>`` element."""
    top = max([b.total for b in bars] + [device, 1])
    frame = Frame(90.0, 40.0, 820.0, 380.0, x_max=max(len(bars), 1), y_max=top * 1.1)
    parts = [_hatchings(), *y_axis(frame)]
    slot = frame.width / max(len(bars), 1)
    for k, bar in enumerate(bars):
        parts += _bar(frame, bar, frame.left + slot * (k + 0.5), min(64.0, slot * 0.6))
    y = frame.y(device)
    parts.append(
        f'<line x1="{frame.left:.1f}" y1="{y:.1f}" x2="{frame.left + frame.width:.1f}" '
        f'y2="{y:.1f}" {STYLES["device"].stroke()} {attrs(data_device=device)}>'
        f"<title>{escape(device_name)}: {size_label(device)}</title></line>"
    )
    parts.append(text(frame.left + frame.width - 4, y - 6, f"{device_name} {size_label(device)}",
                      12, text_anchor="end", fill=STYLES["device"].colour,
                      font_weight="bold"))  # fmt: skip
    parts.append(text(frame.left + frame.width / 2, frame.bottom + 58, "batch size tried", 12,
                      text_anchor="middle", fill="#555"))  # fmt: skip
    items = [(f'<rect width="28" height="14" fill="{fill}" stroke="#333" stroke-width="0.5"/>',
              name) for name, fill in PARTS.items()]  # fmt: skip
    items.append((f'<line x1="0" y1="7" x2="28" y2="7" {STYLES["device"].stroke()}/>', "device"))
    parts += legend(items, frame.left + frame.width + 30, frame.top - 12, 1)  # (one a row)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" {attrs(width=WIDTH, height=HEIGHT)} '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" style="{FONT}" role="img" '
        f'{attrs(data_y_max=frame.y_max)}>{"".join(parts)}</svg>'
    )


def _hatchings() -> str:
    def hatch(name: str, colour: str, ground: str) -> str:
        return (
            f'<pattern id="{name}" width="6" height="6" patternUnits="userSpaceOnUse" '
            f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{ground}"/>'
            f'<line x1="0" y1="0" x2="0" y2="6" stroke="{colour}" stroke-width="2"/></pattern>'
        )

    inputs, runtime = hatch("inputs", "#225ea8", "#c7e9b4"), hatch("runtime", "#555", "#eee")
    return f"<defs>{inputs}{runtime}{hatch('step', '#2c7fb8', '#fff')}</defs>"


def _bar(frame: Frame, bar: Bar, centre: float, width: float) -> list[str]:
    """One stacked bar, its parts named on hover, its batch under it."""
    parts, below = [], 0
    x = centre - width / 2
    for name, nbytes in bar.parts:
        if nbytes <= 0:
            continue
        y0, y1 = frame.y(below + nbytes), frame.y(below)
        parts.append(
            f'<rect {attrs(x=f"{x:.1f}", y=f"{y0:.1f}", width=f"{width:.1f}")} '
            f'height="{max(y1 - y0, 0.5):.1f}" fill="{PARTS[name]}" stroke="#333" '
            f'stroke-width="0.5" {attrs(data_part=name, data_bytes=nbytes, data_batch=bar.batch)}>'
            f"<title>batch {bar.batch}: {escape(name)} {size_label(nbytes)}</title></rect>"
        )
        below += nbytes
    label = f"{bar.batch}" + (" (chosen)" if bar.chosen else "")
    parts.append(text(centre, frame.bottom + 18, label, 12, text_anchor="middle", fill="#111",
                      font_weight="bold" if bar.chosen else None))  # fmt: skip
    if bar.note:
        parts.append(text(centre, frame.bottom + 34, bar.note, 10, text_anchor="middle",
                          fill="#555"))  # fmt: skip
    if bar.chosen:
        y = frame.y(bar.total)
        parts.append(
            f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="{width + 6:.1f}" '
            f'height="{frame.bottom - y + 3:.1f}" fill="none" stroke="#000" stroke-width="2.5" '
            f'{attrs(data_chosen=bar.batch)}/>'
        )
    return parts
