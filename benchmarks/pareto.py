"""The budget planner's Pareto curve against the structural rules and torch.compile.

    python benchmarks/pareto.py [--models a,b] [--steps 8] [--out benchmarks/results]

For each zoo model, sweeps the budget from the no-recompute peak down to the lowest budget the
planner meets, applies each plan to a copy and measures it (step peak, FLOPs, and the bytes
autograd saved, the basis on which torch.compile is compared). The structural strategies'
and torch.compile's points come from ``results.csv`` of ``benchmarks/run.py``. Writes
``pareto.csv`` and ``pareto.png`` (two panels per model: peak vs FLOPs, saved bytes vs FLOPs).
"""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import math
import sys
from pathlib import Path

import torch

import autoremat
from autoremat.comparison import saved_by_autograd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import from_csv
from zoo import ZOO


def sweep(name: str, steps: int) -> list[dict[str, float | str]]:
    model, args, kwargs = ZOO[name]()
    base = autoremat.measure(model, args, kwargs)
    base_saved = saved_by_autograd(model, args, kwargs)
    low = autoremat.lowest_budget(model, args, kwargs)
    budgets = sorted({low, *(int(low + (base.peak - low) * k / steps) for k in range(steps + 1))})
    points = []
    for budget in budgets:
        plan = autoremat.plan(model, args, kwargs, budget=budget)
        wrapped = plan.apply(copy.deepcopy(model))
        m = autoremat.measure(wrapped, args, kwargs)
        saved = saved_by_autograd(wrapped, args, kwargs)
        points.append(
            {
                "model": name,
                "budget": budget / base.peak,
                "peak": m.peak / base.peak,
                "predicted": plan.estimated_peak / base.peak,
                "flops": m.flops / base.flops,
                "saved": saved / base_saved,
                "within": float(m.peak <= budget),
            }
        )
        print(
            f"{name}: budget {budget / base.peak:.2f} -> peak {m.peak / base.peak:.2f}",
            file=sys.stderr,
        )
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    out = Path(ns.out)
    models = ns.models.split(",")
    curve = [p for name in models for p in sweep(name, ns.steps)]
    with open(out / "pareto.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    others = from_csv(out / "results.csv") if (out / "results.csv").exists() else []

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(2 * rows, cols, figsize=(4.2 * cols, 3.3 * 2 * rows), squeeze=False)
    for i, name in enumerate(models):
        for section, (key, label) in enumerate([("peak", "step peak"), ("saved", "saved bytes")]):
            ax = axes[section * rows + i // cols][i % cols]
            mine = sorted((p for p in curve if p["model"] == name), key=lambda p: p["flops"])
            ax.plot(
                [p["flops"] for p in mine],
                [p[key] for p in mine],
                "-X",
                color="crimson",
                label="autoremat budget sweep",
                zorder=3,
            )
            for r in others:
                if r.model != name or r.strategy.startswith("budget") or r.flops_ratio is None:
                    continue
                y = r.autograd_saved_ratio if (key == "saved" or r.compiled) else r.peak_ratio
                if y is None or (key == "peak" and r.compiled):
                    continue
                marker = "^" if r.compiled else "o"
                ax.scatter([r.flops_ratio], [y], marker=marker, s=40, color="0.35", zorder=2)
                ax.annotate(
                    r.strategy,
                    (r.flops_ratio, y),
                    xytext=(4, 2),
                    textcoords="offset points",
                    fontsize=6,
                    color="0.3",
                )
            ax.set_title(f"{name}: {label} vs FLOPs", fontsize=9)
            ax.set_xlabel("FLOPs / no recompute", fontsize=8)
            ax.set_ylabel(f"{label} / no recompute", fontsize=8)
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
    for j in range(len(models), rows * cols):
        for section in range(2):
            axes[section * rows + j // cols][j % cols].axis("off")
    fig.suptitle(
        "red: autoremat's budget planner swept from no recompute to its lowest budget; "
        "grey circles: structural rules; grey triangles: torch.compile activation_memory_budget",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out / "pareto.png", dpi=100)
    worst = max(p["predicted"] / p["peak"] - 1 for p in curve)
    print(
        f"{len(curve)} plans; all within budget: {all(p['within'] for p in curve)}; "
        f"largest over-prediction {worst:+.1%}"
    )


if __name__ == "__main__":
    main()
