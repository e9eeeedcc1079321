"""The rows of a comparison as a Markdown table (``autoremat bench`` prints it). CSV files and
plots are made by the benchmark scripts (``benchmarks/report.py`` in the repository)."""

from __future__ import annotations

from collections.abc import Sequence

from autoremat.comparison.applied import MiB
from autoremat.comparison.row import Row

__all__ = ["MARKDOWN_COLUMNS", "to_markdown"]

MARKDOWN_COLUMNS = (
    "model",
    "strategy",
    "peak MiB",
    "peak x",
    "held MiB",
    "held x",
    "autograd-saved MiB",
    "autograd-saved x",
    "GFLOP",
    "FLOPs x",
    "ms/step",
    "time x",
    "grads",
    "note",
)


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / MiB:.1f}"


def _ms(seconds: float | None, spread: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.0f}" + ("" if spread is None else f" ±{50 * spread:.0f}%")


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _cells(r: Row) -> list[str]:
    """One table line's cells, in :data:`MARKDOWN_COLUMNS` order."""
    return [
        r.model,
        r.strategy,
        _mib(r.peak),
        _x(r.peak_ratio),
        _mib(r.saved),
        _x(r.saved_ratio),
        _mib(r.autograd_saved),
        _x(r.autograd_saved_ratio),
        "n/a" if r.flops is None else f"{r.flops / 1e9:.2f}",
        _x(r.flops_ratio),
        _ms(r.seconds, r.time_spread),
        _x(r.time_ratio),
        "n/a" if r.flops is None else "ok" if r.grads_match else "DIFFER",
        r.note.replace("|", "\\|"),
    ]


def to_markdown(rows: Sequence[Row]) -> str:
    """A Markdown table of :data:`MARKDOWN_COLUMNS`: one line per row, in order; sizes in MiB,
    ratios to the model's ``none`` row, ``n/a`` for a figure that is ``None``, ``ms/step`` with
    ± half the timed steps' range relative to the median, ``grads`` ``ok`` or ``DIFFER``
    (``n/a`` when the contender failed), ``|`` in notes escaped."""
    lines = [
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 or i >= 12 else "---:" for i in range(14)) + "|",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
