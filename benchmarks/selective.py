"""Selective recompute (issue 6): eager plans with and without it against torch.compile.

    python benchmarks/selective.py                         # ~23 min on 2 shared CPU cores
    python benchmarks/selective.py --models gpt-torch --steps 4 --no-compile   # smoke test

For the zoo's GPT-2-like (Hugging Face ``gpt2`` and the plain-PyTorch TinyGPT ``gpt-torch``),
Llama-like (``llama``) and ViT-like (``vit``) models, in one run, side by side:

* no recompute (the baseline of every ratio);
* ``budget 50% (module)``: :func:`autoremat.plan` at a 50% budget, module-level recompute only
  (``selective=False``); ``budget 50% (flops)``: selective recompute allowed, minimising
  FLOPs (``objective="flops"``); ``budget 50%``: the default, selective allowed, minimising
  the profiled recompute time (``objective="time"``), with its predicted time ratio
  (``1 + plan.recompute_seconds / measured no-recompute step``) beside the measured one;
* a budget sweep, minimising FLOPs, module-level and selective: ``--steps`` budgets (default
  6; 8 take about 3 minutes more) evenly spaced from the lowest budget that variant's planner
  meets up to just below the no-recompute peak;
* ``torch.compile`` (inductor) at ``activation_memory_budget`` 1.0, 0.5, 0.2 and 0.0
  (:func:`autoremat.comparison.inductor.compiled`; cold compiles take 20-60 s each here).

Everything of one model runs through :func:`autoremat.comparison.compare` twice, in the same
process: once for the headline (none, the two 50% plans and the compile points, ``--repeats`` timed
steps each) and once for the sweep (none and the sweep plans, ``--sweep-repeats`` timed
steps); each call interleaves its timed steps and gives time ratios to its own ``none``. A sweep
plan identical to an earlier one (same modules, same selective set) is measured once; its row
repeats the figures with ``same plan as``.

Figures per point: step peak (``autoremat.measure``, eager only), saved bytes (the bytes kept
from the forward for backward: autograd's saved tensors, seen by ``saved_tensors_hooks``, plus
the cache of selective checkpointing, which those hooks do not see; parameters and inputs left
out; for compiled models the hooks see what the compiled graph saves, so both are on one
basis), FLOPs (``FlopCounterMode``; pointwise ops count zero, hence the step time too), step
time, the planner's predicted peak and its error, whether the measured peak is within the
budget, and whether the loss and every gradient of one step equal those of the unwrapped eager
model (``DIFFER`` otherwise: torch.compile with a budget below 1 recomputes dropout with fresh
random numbers, pytorch#190758).

``autoremat.plan`` profiles the model on every call; here each model is profiled once and all
its plans reuse that profile (the same model on the same inputs gives the same profile), which
saves about 20 profiled steps per model.

Writes ``selective.md``, ``selective.csv`` and ``selective.png`` to ``--out`` (after each
model, so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
from autoremat import wrap
from autoremat.comparison import (
    Applied,
    Contender,
    Row,
    budget_plan,
    compare,
    compiled,
    no_recompute,
)
from autoremat.planning import plan as planner
from autoremat.planning.fingerprint import fingerprint
from zoo import ZOO

MODELS = ("gpt2", "gpt-torch", "llama", "vit")
# the eager plans at the headline budget: (selective, objective, row name)
HEADLINE_PLANS = (
    (False, "flops", "budget 50% (module)"),
    (True, "flops", "budget 50% (flops)"),
    (True, "time", "budget 50%"),
)
COMPILE_BUDGETS = (1.0, 0.5, 0.2, 0.0)
HEADLINE = 0.5
TARGET_FLOPS = 1.05  # the target: recompute FLOPs at most 5% above no recompute
# two FLOP or saved ratios closer than this are taken as equal when saying who wins
TOLERANCE = 0.005

_MiB = 2**20


# --------------------------------------------------------------------------- planning


@contextlib.contextmanager
def profile_once() -> Iterator[None]:
    """Let every ``autoremat.plan`` call inside reuse the first profile of a model with the same
    module structure (the caller keeps to one model and one set of inputs inside)."""
    original = planner.profile  # what plan() and lowest_budget() profile with
    cache: dict[str, Any] = {}

    def cached(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        key = fingerprint(model)
        if key not in cache:
            cache[key] = original(model, *args, **kwargs)
        return cache[key]

    planner.profile = cached
    try:
        yield
    finally:
        planner.profile = original


@dataclass
class Point:
    """What this script knows about a strategy beyond its :class:`Row`."""

    variant: str  # none, module, selective (minimising FLOPs), time (the default), compile
    budget: float | None = None  # fraction of the no-recompute peak; compile: its budget
    budget_bytes: int | None = None
    predicted: int | None = None
    entries: int | None = None
    selective_entries: int | None = None
    key: tuple[frozenset[str], frozenset[str]] | None = None  # (modules, selective ones)
    recompute_seconds: float | None = None  # as the plan's profile predicts


def planned(
    fraction: float,
    selective: bool,
    name: str,
    peak: int,
    points: dict[str, Point],
    objective: str = "flops",
) -> Contender:
    """:func:`autoremat.comparison.budget_plan` at ``fraction`` of ``peak`` (the profile's), named
    ``name``; records the plan's figures in ``points[name]``."""
    inner = budget_plan(fraction, selective=selective, objective=objective)
    # the budget in bytes, as autoremat.plan takes a fraction of its profile's peak
    variant = "module" if not selective else "time" if objective == "time" else "selective"
    point = Point(variant, fraction, max(1, int(fraction * peak)))
    points[name] = point

    def apply(model: nn.Module, args: Any, kwargs: Any) -> Applied | None:
        applied = inner.apply(model, args, kwargs)
        if applied is None:
            return None
        assert isinstance(applied, Applied) and applied.plan is not None
        modules = frozenset(wrap.wrapped_paths(applied.model))
        chosen = frozenset(wrap.selective_paths(applied.model))
        point.predicted = applied.predicted_peak
        point.entries, point.selective_entries = len(modules), len(chosen)
        point.key = (modules, frozenset(wrap.selective_paths(applied.model).items()))
        point.recompute_seconds = applied.plan.recompute_seconds
        return applied

    return Contender(name, apply, dedupe=True)


def sweep_fractions(low: int, peak: int, steps: int) -> list[float]:
    """``steps`` budgets (fractions of ``peak``) from ``low`` bytes up to just below ``peak``."""
    out = []
    for k in range(steps):
        target = low + (peak - low) * k / steps
        out.append(math.ceil(target + 1) / peak)  # int(f * peak) stays at or above target
    return out


# --------------------------------------------------------------------------- one model


@dataclass
class Result:
    """One line of the report."""

    model: str
    part: str  # headline or sweep
    strategy: str
    variant: str
    budget: float | None
    peak_mib: float | None
    peak_ratio: float | None
    saved_mib: float | None
    saved_ratio: float | None
    step_saved_ratio: float | None
    gflops: float | None
    flops_ratio: float | None
    ms: float | None
    time_ratio: float | None
    time_spread: float | None
    predicted_ratio: float | None
    predicted_time_ratio: float | None
    estimate_error: float | None
    within_budget: bool | None
    entries: int | None
    selective_entries: int | None
    grads: str
    same_plan_as: str
    note: str


def results_of(model: str, part: str, rows: list[Row], points: dict[str, Point]) -> list[Result]:
    """One :class:`Result` per strategy in ``points`` (duplicates copy their kept row)."""
    by_name = {r.strategy: r for r in rows}
    base = by_name["none"]
    by_key = {}
    for name, p in points.items():
        if name in by_name and p.key is not None:
            by_key.setdefault(p.key, name)
    out = []
    for name, p in points.items():
        same = ""
        row = by_name.get(name)
        if row is None and p.key is not None and p.key in by_key:
            same = by_key[p.key]
            row = by_name[same]
        if row is None:
            continue
        failed = row.flops is None
        predicted_ratio = error = None
        if p.predicted is not None and row.peak:
            predicted_ratio = p.predicted / base.peak
            error = (p.predicted - row.peak) / row.peak
        predicted_time = None
        if p.recompute_seconds is not None and base.seconds:
            predicted_time = 1 + p.recompute_seconds / base.seconds
        within = None
        if p.budget_bytes is not None and row.peak is not None:
            within = row.peak <= p.budget_bytes
        out.append(
            Result(
                model=model,
                part=part,
                strategy=name,
                variant=p.variant,
                budget=p.budget,
                peak_mib=None if row.peak is None else row.peak / _MiB,
                peak_ratio=row.peak_ratio,
                saved_mib=None if row.autograd_saved is None else row.autograd_saved / _MiB,
                saved_ratio=row.autograd_saved_ratio,
                step_saved_ratio=None if row.compiled else row.saved_ratio,
                gflops=None if row.flops is None else row.flops / 1e9,
                flops_ratio=row.flops_ratio,
                ms=None if row.seconds is None else row.seconds * 1e3,
                time_ratio=row.time_ratio,
                time_spread=row.time_spread,
                predicted_ratio=predicted_ratio,
                predicted_time_ratio=predicted_time,
                estimate_error=error,
                within_budget=within,
                entries=p.entries,
                selective_entries=p.selective_entries,
                grads="n/a" if failed else "ok" if row.grads_match else "DIFFER",
                same_plan_as=same,
                note=row.note,
            )
        )
    return out


def run_model(
    name: str,
    steps: int,
    repeats: int,
    sweep_repeats: int,
    compile_budgets: tuple[float, ...],
    progress: Callable[[str], None],
) -> list[Result]:
    model, args, kwargs = ZOO[name]()
    with profile_once():
        # Budget fractions are of the profile's peak (what plan() takes them of), which need not
        # be the measured no-recompute peak to the byte.
        peak = planner.profile(model, args, kwargs).peak
        progress(f"{name}: profile peak {peak / _MiB:.2f} MiB")
        headline: dict[str, Point] = {"none": Point("none")}
        strategies = [no_recompute()]
        for selective, objective, label in HEADLINE_PLANS:
            strategies.append(planned(HEADLINE, selective, label, peak, headline, objective))
        for b in compile_budgets:
            strategies.append(compiled(b))
            headline[strategies[-1].name] = Point("compile", b)
        rows = compare(
            model, args, kwargs, strategies, repeats=repeats, name=name, progress=progress
        )
        results = results_of(name, "headline", rows, headline)

        sweep: dict[str, Point] = {"none": Point("none")}
        strategies = [no_recompute()]
        for selective in (False, True):
            low = planner.lowest_budget(model, args, kwargs, selective=selective)
            progress(
                f"{name}: lowest budget {'selective' if selective else 'module'} "
                f"{low / peak:.1%} of {peak / _MiB:.1f} MiB"
            )
            for f in sweep_fractions(low, peak, steps):
                label = f"sweep {f:.1%}" + ("" if selective else " (module)")
                strategies.append(planned(f, selective, label, peak, sweep))
        rows = compare(
            model, args, kwargs, strategies, repeats=sweep_repeats, name=name, progress=progress
        )
        results += [r for r in results_of(name, "sweep", rows, sweep) if r.variant != "none"]
    return results


# --------------------------------------------------------------------------- reporting


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _spread(r: Result) -> str:
    if r.time_ratio is None:
        return "n/a"
    spread = "" if r.time_spread is None else f" ±{50 * r.time_spread:.0f}%"
    return f"{r.time_ratio:.2f}{spread}"


def _entries(r: Result) -> str:
    if r.entries is None:
        return ""
    return f"{r.entries} ({r.selective_entries} sel.)"


COLUMNS = (
    "model | strategy | peak MiB | peak x | held MiB | held x | FLOPs x | time x | "
    "predicted time x | predicted x | est. error | within | entries | grads | note"
)


def table(results: list[Result]) -> str:
    lines = ["| " + COLUMNS + " |", "|" + "|".join(["---"] * COLUMNS.count("|") + ["---"]) + "|"]
    for r in results:
        note = f"same plan as {r.same_plan_as}" if r.same_plan_as else ""
        if r.grads == "DIFFER":
            worst = re.search(r"\d+/\d+ grads differ[^;]*", r.note)
            note = (note + "; " if note else "") + (worst.group(0) if worst else "")
        if r.grads == "n/a":
            note = r.note
        cells = [
            r.model,
            r.strategy,
            _f(r.peak_mib, ".1f"),
            _f(r.peak_ratio),
            _f(r.saved_mib, ".1f"),
            _f(r.saved_ratio),
            _f(r.flops_ratio, ".3f"),
            _spread(r),
            _f(r.predicted_time_ratio),
            _f(r.predicted_ratio),
            _f(r.estimate_error, "+.1%"),
            "n/a" if r.within_budget is None else "yes" if r.within_budget else "NO",
            _entries(r),
            r.grads,
            note.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _eager(results: list[Result], model: str, variant: str) -> list[Result]:
    return [
        r
        for r in results
        if r.model == model
        and r.variant in (variant, "none")
        and r.flops_ratio is not None
        and r.saved_ratio is not None
    ]


def _least_saved(points: list[Result], flops: float) -> Result | None:
    """The point that saves least among those with at most ``flops`` (ties: fewer FLOPs)."""
    fit = [p for p in points if p.flops_ratio <= flops + TOLERANCE]
    return min(fit, key=lambda p: (p.saved_ratio, p.flops_ratio), default=None)


def _cheapest(points: list[Result], saved: float) -> Result | None:
    """The point with the fewest FLOPs among those that save at most ``saved``."""
    fit = [p for p in points if p.saved_ratio <= saved + TOLERANCE]
    return min(fit, key=lambda p: (p.flops_ratio, p.saved_ratio), default=None)


def _pt(r: Result) -> str:
    t = "" if r.time_ratio is None else f", time {r.time_ratio:.2f}x"
    return f"{r.strategy} (saved {r.saved_ratio:.2f}x, FLOPs {r.flops_ratio:.3f}x{t})"


def where_each_wins(results: list[Result]) -> str:
    """Sentences computed from the points: for each compile point, the eager points of each
    variant at no more FLOPs and at no more saved bytes."""
    paragraphs = []
    for model in dict.fromkeys(r.model for r in results):
        lines = [f"**{model}.**"]
        mine = [r for r in results if r.model == model]
        by = {r.strategy: r for r in mine if r.part == "headline"}
        mod, sel = (
            by.get(f"budget {HEADLINE:.0%} (module)"),
            by.get(f"budget {HEADLINE:.0%} (flops)"),
        )
        timed_plan = by.get(f"budget {HEADLINE:.0%}")
        if mod and sel and mod.flops_ratio and sel.flops_ratio:
            verdict = "meets" if sel.flops_ratio <= TARGET_FLOPS else "misses"
            lines.append(
                f"At the 50% budget, selective recompute costs {sel.flops_ratio:.3f}x FLOPs "
                f"(time {_f(sel.time_ratio)}x) against {mod.flops_ratio:.3f}x "
                f"(time {_f(mod.time_ratio)}x) for module-level recompute: it {verdict} the "
                f"{TARGET_FLOPS:.2f}x target (peak {_f(sel.peak_ratio)}x vs {_f(mod.peak_ratio)}x)."
            )
            if timed_plan and timed_plan.flops_ratio:
                lines.append(
                    f"Minimising profiled time instead (the default), the plan costs "
                    f"{timed_plan.flops_ratio:.3f}x FLOPs and {_f(timed_plan.time_ratio)}x time "
                    f"(predicted {_f(timed_plan.predicted_time_ratio)}x; the FLOPs-minimal plan "
                    f"was predicted at {_f(sel.predicted_time_ratio)}x)."
                )
            timed = [
                r for r in (mod, sel, timed_plan, by.get("compile b=0.5")) if r and r.time_ratio
            ]
            if len(timed) > 1:
                fastest = min(timed, key=lambda r: r.time_ratio)
                lines.append(
                    "Step time at that point: "
                    + ", ".join(
                        f"{r.strategy} {r.time_ratio:.2f}x (±{50 * (r.time_spread or 0):.0f}%)"
                        for r in timed
                    )
                    + f"; fastest: {fastest.strategy}"
                    + (" (its gradients DIFFER from eager)." if fastest.grads == "DIFFER" else ".")
                )
        curves = {v: _eager(mine, model, v) for v in ("module", "selective")}
        for c in [r for r in mine if r.variant == "compile" and r.flops_ratio is not None]:
            if c.saved_ratio is None:
                continue
            parts = []
            for variant, pts in curves.items():
                same_flops = _least_saved(pts, c.flops_ratio)
                same_saved = _cheapest(pts, c.saved_ratio)
                if same_flops is not None and same_flops.saved_ratio < c.saved_ratio - TOLERANCE:
                    parts.append(
                        f"eager {variant} wins: {_pt(same_flops)} saves less at no more FLOPs"
                    )
                elif same_saved is not None and same_saved.flops_ratio < c.flops_ratio - TOLERANCE:
                    parts.append(
                        f"eager {variant} wins: {_pt(same_saved)} saves as little for fewer FLOPs"
                    )
                else:
                    best = (
                        f"needs {same_saved.flops_ratio:.3f}x FLOPs to save as little"
                        if same_saved is not None
                        else "never saves as little (its lowest: "
                        f"{min(p.saved_ratio for p in pts):.2f}x)"
                    )
                    near = (
                        f"saves {same_flops.saved_ratio:.2f}x at no more FLOPs"
                        if same_flops is not None
                        else "has no point at so few FLOPs"
                    )
                    parts.append(f"compile wins over eager {variant}, which {near} and {best}")
            grads = " (its gradients DIFFER from eager)" if c.grads == "DIFFER" else ""
            lines.append(f"{_pt(c)}{grads}: " + "; ".join(parts) + ".")
        paragraphs.append(" ".join(lines[:1]) + "\n\n" + "\n".join(f"- {x}" for x in lines[1:]))
    return "\n\n".join(paragraphs)


def headline_table(results: list[Result]) -> str:
    wanted = ("none", *(name for _, _, name in HEADLINE_PLANS), "compile b=0.5")
    rows = [r for r in results if r.part == "headline" and r.strategy in wanted]
    rows.sort(key=lambda r: (r.model, wanted.index(r.strategy)))
    order = list(dict.fromkeys(r.model for r in results))
    rows.sort(key=lambda r: order.index(r.model))
    lines = [
        "| model | strategy | peak x | saved x | FLOPs x | time x | predicted time x | grads |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.strategy} | {_f(r.peak_ratio)} | {_f(r.saved_ratio)} | "
            f"{_f(r.flops_ratio, '.3f')} | {_spread(r)} | {_f(r.predicted_time_ratio)} | "
            f"{r.grads} |"
        )
    return "\n".join(lines)


LEGEND = """\
Ratios are to `none` (no recompute) of the same model. `peak`: most tensor memory alive during
the step (`autoremat.measure`, eager only: a dispatch-mode tracker cannot see inside compiled
code). `saved`: bytes kept from the forward for backward, parameters and inputs excluded:
storages packed by `saved_tensors_hooks` (these fire for eager and compiled code alike) plus the
outputs kept in selective checkpointing's cache, which those hooks do not see
(`autoremat.comparison.saved_by_autograd`); this is the basis on which eager plans and
torch.compile are compared. FLOPs: `FlopCounterMode` (matmuls, convolutions, attention;
pointwise ops count zero), forward, backward and recompute; compiled rows count the graphs
inductor compiled.
`time x`: median of interleaved timed steps over the median of `none`'s in the same comparison
(± half the range over the median); 2 shared cores, 1 torch thread, so read it with its spread.
`predicted time x`: 1 + the plan's `recompute_seconds` (its profile's timing of the recomputed
ops plus the measured per-op overheads of checkpoint and selective checkpointing) over the
measured step time of `none`.
`predicted x`: the planner's predicted peak over the measured no-recompute peak; `est. error`:
(predicted - measured) / measured peak. `within`: measured peak <= the budget in bytes (the
fraction of the no-recompute peak that the planner's profile found, which can differ a little
from the measured one). `entries`: modules (or runs) the plan recomputes, and how many of them
selectively. `grads`: the loss and every gradient of one step from the same seed equal those
of the unwrapped eager model within rtol 1e-5, atol 1e-6. Sweep rows: budgets evenly spaced
from the lowest the planner meets to just below the no-recompute peak; `same plan as` rows
repeat the measured figures of that plan."""


def write(results: list[Result], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(Result)]
    with open(out / "selective.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in results:
            values = dataclasses.asdict(r)
            writer.writerow({k: "" if v is None else v for k, v in values.items()})
    text = (
        "# Selective recompute vs module-level recompute vs torch.compile\n\n"
        f"{header}\n\n"
        f"## At a {HEADLINE:.0%} budget (compile: activation_memory_budget 0.5)\n\n"
        f"{headline_table(results)}\n\n"
        "## Where each wins (saved bytes vs FLOPs, from the points below)\n\n"
        "For each torch.compile point: the eager point of each variant that saves least at no "
        f"more FLOPs, and the one with the fewest FLOPs that saves no more (ratios within "
        f"{TOLERANCE} count as equal).\n\n"
        f"{where_each_wins(results)}\n\n"
        "## Every point\n\n"
        f"{LEGEND}\n\n{table(results)}\n"
    )
    (out / "selective.md").write_text(text)
    plot(results, out / "selective.png", header)


def plot(results: list[Result], path: Path, header: str) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    cols = len(models)
    sections = [("flops_ratio", "FLOPs / no recompute"), ("time_ratio", "step time / no recompute")]
    fig, axes = plt.subplots(
        len(sections), cols, figsize=(4.4 * cols, 3.8 * len(sections) + 0.8), squeeze=False
    )
    style = {
        "module": ("tab:blue", "o", "eager, module-level (budget sweep)"),
        "selective": ("crimson", "X", "eager, selective allowed (budget sweep, min FLOPs)"),
        "time": ("tab:green", "s", "eager, default plan (min profiled time), 50%"),
    }
    for col, model in enumerate(models):
        mine = [r for r in results if r.model == model and r.saved_ratio is not None]
        for row, (xfield, xlabel) in enumerate(sections):
            ax = axes[row][col]
            ax.axhline(1.0, color="0.8", lw=0.8, zorder=0)
            ax.axvline(1.0, color="0.8", lw=0.8, zorder=0)
            for variant, (color, marker, label) in style.items():
                pts = [
                    r
                    for r in mine
                    if r.variant == variant
                    and getattr(r, xfield) is not None
                    and not (xfield == "time_ratio" and r.same_plan_as)
                ]
                pts.sort(key=lambda r: -(r.budget or 0))
                if xfield == "flops_ratio" and variant != "time":  # curves start at none
                    pts = [r for r in mine if r.strategy == "none"][:1] + pts
                ax.plot(
                    [getattr(r, xfield) for r in pts],
                    [r.saved_ratio for r in pts],
                    linestyle="-" if xfield == "flops_ratio" else "none",
                    marker=marker,
                    color=color,
                    ms=5,
                    lw=1.2,
                    alpha=0.85,
                    label=label,
                    zorder=3,
                )
                for r in pts:
                    if r.part == "headline":
                        ax.scatter(
                            [getattr(r, xfield)],
                            [r.saved_ratio],
                            s=150,
                            facecolors="none",
                            edgecolors=color,
                            lw=1.5,
                            zorder=4,
                        )
            for r in mine:
                x = getattr(r, xfield)
                if x is None:
                    continue
                if r.variant == "none" and r.part == "headline":
                    ax.scatter([x], [r.saved_ratio], marker="*", s=140, color="black", zorder=5)
                elif r.variant == "compile":
                    ax.scatter(
                        [x],
                        [r.saved_ratio],
                        marker="^",
                        s=70,
                        facecolors="none" if r.grads == "DIFFER" else "darkorange",
                        edgecolors="darkorange",
                        lw=1.6,
                        zorder=5,
                    )
                    ax.annotate(
                        f"C{r.budget:g}",
                        (x, r.saved_ratio),
                        xytext=(5, 2),
                        textcoords="offset points",
                        fontsize=7,
                        color="darkorange",
                    )
            ax.set_title(f"{model}: saved bytes vs {xlabel.split(' /')[0]}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("saved for backward / no recompute", fontsize=8)
            ax.set_ylim(bottom=-0.03, top=max(1.08, ax.get_ylim()[1]))
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    from matplotlib.lines import Line2D

    handles += [
        Line2D([], [], ls="", marker="*", ms=10, color="black"),
        Line2D([], [], ls="", marker="^", ms=8, mfc="darkorange", mec="darkorange"),
        Line2D([], [], ls="", marker="^", ms=8, mfc="none", mec="darkorange"),
        Line2D([], [], ls="", marker="o", ms=11, mfc="none", mec="0.3"),
    ]
    labels += [
        "no recompute",
        "torch.compile, activation_memory_budget (grads ok)",
        "torch.compile (grads DIFFER from eager)",
        "ringed: the 50% budget plan",
    ]
    fig.legend(
        handles, labels, loc="upper center", ncol=3 if cols > 2 else 1, fontsize=8, frameon=False
    )
    fig.text(0.5, 0.005, textwrap.fill(header, 60 * cols), ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine_line(seconds: float | None, ns: argparse.Namespace) -> str:
    return run.machine_line(
        seconds,
        detail=f"{ns.repeats} timed steps per headline strategy, {ns.sweep_repeats} per sweep "
        f"plan, {ns.steps} sweep budgets per variant",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument("--steps", type=int, default=6, help="sweep budgets per variant")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps, headline")
    parser.add_argument("--sweep-repeats", type=int, default=3, help="timed steps, sweep")
    parser.add_argument(
        "--compile-budgets",
        default=",".join(f"{b:g}" for b in COMPILE_BUDGETS),
        help="activation_memory_budget values for torch.compile",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    names = [n.strip() for n in ns.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; choose from {', '.join(ZOO)}")
    budgets = () if ns.no_compile else tuple(float(b) for b in ns.compile_budgets.split(","))
    out = Path(ns.out)
    start = time.perf_counter()
    progress = run.progress_printer(start)

    results: list[Result] = []
    for name in names:
        results += run_model(name, ns.steps, ns.repeats, ns.sweep_repeats, budgets, progress)
        write(results, out, machine_line(None, ns))
    header = machine_line(time.perf_counter() - start, ns)
    write(results, out, header)
    progress(f"done; wrote {out}/selective.md, selective.csv, selective.png")
    print(header)
    print(headline_table(results))
    print()
    print(where_each_wins(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
