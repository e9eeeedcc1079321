"""Rows of :func:`autoremat.comparison.compare` to CSV files and back, and to a plot (PNG).

Not part of the installed package: the plot needs matplotlib (a dev dependency). The benchmark
scripts import this file from this directory (``sys.path``).

    to_csv(rows, "results.csv")
    plot(from_csv("results.csv"), "results.png", title="...")
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autoremat.comparison import Row

__all__ = ["CSV_FIELDS", "dicts_to_csv", "from_csv", "plot", "to_csv"]

# one CSV column per Row field, less the plan (an object, not a figure)
CSV_FIELDS = tuple(f.name for f in dataclasses.fields(Row) if f.name != "plan")


# --------------------------------------------------------------------------- CSV


def to_csv(rows: Sequence[Row], path: str | Path) -> None:
    """Write the rows to a CSV file, one column per :data:`CSV_FIELDS` (every :class:`Row`
    field but ``plan``); ``None`` is empty."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            values = {name: getattr(row, name) for name in CSV_FIELDS}
            writer.writerow({k: "" if v is None else v for k, v in values.items()})


def dicts_to_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write rows of figures (dicts with the same keys, in order) to a CSV file, one column per
    key; the folder is made if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def from_csv(path: str | Path) -> list[Row]:
    """The rows :func:`to_csv` wrote (to redraw a plot without rerunning); ``plan`` is None."""
    fields = {f.name: f for f in dataclasses.fields(Row)}
    rows = []
    with open(path, newline="") as f:
        for record in csv.DictReader(f):
            values: dict[str, Any] = {}
            for name, text in record.items():
                kind = str(fields[name].type)
                if name in ("model", "strategy", "note"):
                    values[name] = text
                elif name in ("grads_match", "compiled", "identical"):
                    values[name] = text == "True"
                elif text == "":
                    values[name] = None
                elif "int" in kind:
                    values[name] = int(text)
                else:
                    values[name] = float(text)
            rows.append(Row(**values))
    return rows


# --------------------------------------------------------------------------- plot

_FAMILIES = ("none", "every block", "sqrt", "levels", "budget", "compile", "other")
_MARKERS = {
    "none": "*",
    "every block": "s",
    "sqrt": "D",
    "levels": "o",
    "budget": "X",
    "compile": "^",
    "other": "P",
}
# (x field, x label, y: "peak" (compiled rows: autograd-saved) or "saved") per section
_SECTIONS = (
    ("time_ratio", "step time / no recompute", "peak"),
    ("flops_ratio", "FLOPs / no recompute", "peak"),
    ("flops_ratio", "FLOPs / no recompute", "saved"),
)
_PANEL_W, _PANEL_H = 4.2, 3.4  # inches


def _family(strategy: str) -> str:
    for prefix in _FAMILIES[:-1]:
        if strategy.startswith(prefix):
            return prefix
    return "other"


def _short(strategy: str) -> str:
    """The label beside a point: ``every``, ``sqrt``, ``L4``, ``C0.5``, ``B50%``."""
    if strategy == "every block":
        return "every"
    if strategy == "sqrt segments":
        return "sqrt"
    if strategy.startswith("levels s="):
        return "L" + strategy.removeprefix("levels s=")
    if strategy.startswith("compile b="):
        return "C" + strategy.removeprefix("compile b=")
    if strategy.startswith("budget "):
        return "B" + strategy.removeprefix("budget ")
    return strategy


def _legend_key(strategy: str) -> tuple[int, float, str]:
    """Families in a fixed order; levels by segment count, compile by decreasing budget."""
    family = _family(strategy)
    number = 0.0
    with contextlib.suppress(ValueError):
        number = float(strategy.rsplit("=", 1)[-1])
    return _FAMILIES.index(family), -number if family == "compile" else number, strategy


def _colors(names: Sequence[str]) -> dict[str, Any]:
    """A colour per strategy: black baseline, one hue per family, shades within a family."""
    import matplotlib.pyplot as plt

    fixed = {"none": "black", "every block": "tab:orange", "sqrt": "tab:brown", "other": "0.5"}
    ramps = {"levels": plt.get_cmap("viridis"), "compile": plt.get_cmap("autumn")}
    colors: dict[str, Any] = {}
    for family, ramp in ramps.items():
        members = [n for n in names if _family(n) == family]
        for i, n in enumerate(members):
            colors[n] = ramp(0.85 * i / max(1, len(members) - 1))
    for n in names:
        colors.setdefault(n, fixed.get(_family(n), "0.5"))
    return colors


def _points(ax: Any, rows: Sequence[Row], model: str, section: int, colors: dict) -> None:
    """One point per row of ``model`` with both figures of ``section`` known."""
    xfield, _, yfield = _SECTIONS[section]
    for r in rows:
        if r.model != model:
            continue
        x = getattr(r, xfield)
        saved_basis = r.compiled or yfield == "saved"
        y = r.autograd_saved_ratio if saved_basis else r.peak_ratio
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            continue
        family = _family(r.strategy)
        ax.scatter(
            [x],
            [y],
            marker=_MARKERS[family],
            s=110 if family == "none" else 60,
            facecolors="none" if r.compiled else [colors[r.strategy]],
            edgecolors=[colors[r.strategy]],
            linewidths=1.8,
            zorder=3,
        )
        ax.annotate(
            _short(r.strategy),
            (x, y),
            xytext=(5, 3),
            textcoords="offset points",
            fontsize=7,
            color="0.2",
        )


def _panel(ax: Any, model: str, section: int, first_column: bool) -> None:
    """Title, axes, reference lines and grid of one panel."""
    _, xlabel, yfield = _SECTIONS[section]
    what = "peak" if yfield == "peak" else "saved bytes"
    ax.set_title(f"{model}: {what} vs {xlabel.split(' /')[0]}", fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    if first_column:
        ax.set_ylabel(
            "peak / no recompute\n(open triangles: autograd-saved)"
            if yfield == "peak"
            else "autograd-saved / no recompute",
            fontsize=8,
        )
    ax.tick_params(labelsize=7)
    ax.margins(x=0.15)
    ax.set_ylim(bottom=-0.05, top=max(1.1, ax.get_ylim()[1]))
    ax.grid(True, alpha=0.3)


def _legend(fig: Any, names: Sequence[str], colors: dict[str, Any]) -> None:
    """One legend entry per strategy, above the panels."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D(
            [],
            [],
            ls="",
            marker=_MARKERS[_family(n)],
            markersize=8,
            markeredgewidth=1.6,
            markerfacecolor="none" if _family(n) == "compile" else colors[n],
            markeredgecolor=colors[n],
            label=n,
        )
        for n in names
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=min(len(handles), 7),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1.0),
    )


def plot(rows: Sequence[Row], path: str | Path, *, title: str | None = None) -> None:
    """A PNG with one panel per model in three sections: peak ratio (y) against step time
    ratio (x), then against FLOP ratio; then autograd-saved ratio (y, the same basis for every
    strategy, compiled ones included) against FLOP ratio: the Pareto view of saved bytes vs
    FLOPs. Each point is a strategy, the baseline at (1, 1). Compiled strategies (open
    triangles) have no peak: in the first two sections their y is the autograd-saved ratio.
    ``title`` goes below the panels."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    names = sorted(dict.fromkeys(r.strategy for r in rows), key=_legend_key)
    colors = _colors(names)
    cols = min(4, max(1, len(models)))
    grid_rows = math.ceil(len(models) / cols)
    legend_rows = math.ceil(len(names) / 7)
    top_in, bottom_in = 0.25 + 0.25 * legend_rows, 0.55 if title else 0.1
    height = _PANEL_H * len(_SECTIONS) * grid_rows + top_in + bottom_in
    fig, axes = plt.subplots(
        len(_SECTIONS) * grid_rows, cols, figsize=(_PANEL_W * cols, height), squeeze=False
    )
    for section in range(len(_SECTIONS)):
        for i in range(grid_rows * cols):
            ax = axes[section * grid_rows + i // cols][i % cols]
            if i >= len(models):
                ax.axis("off")
                continue
            ax.axhline(1.0, color="0.75", lw=0.8, zorder=0)
            ax.axvline(1.0, color="0.75", lw=0.8, zorder=0)
            _points(ax, rows, models[i], section, colors)
            _panel(ax, models[i], section, i % cols == 0)
    _legend(fig, names, colors)
    if title:
        fig.text(0.5, 0.05 / height, textwrap.fill(title, 45 * cols), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, bottom_in / height, 1, 1 - top_in / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
