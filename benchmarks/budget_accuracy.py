"""Budgets as the device counts them: predicted against measured, by the tensor tracker and by
the CPU allocator, in fp32 and under bf16 autocast.

    python benchmarks/budget_accuracy.py                   # ~10 min on 2 shared CPU cores
    python benchmarks/budget_accuracy.py --models mlp,cnn --label before

For each model of :data:`zoo.ZOO` and the shared-module models of :data:`zoo.REPEATED`, in
fp32 and under CPU bf16 autocast: one profile, then budget plans priced by FLOPs (the same plan
on any machine) at 75% and 50% of the peak without recompute and at the lowest budget. Each
plan is applied to a copy and one step measured twice: by :class:`autoremat.LiveMemory` (what a
``plan(budget=...)`` budget bounds) and by the CPU allocator (``measure(...,
memory="allocator")``: what the machine sees, kernels' scratch and checkpoints' RNG states
included). Memory only (no timing). Writes ``budget_accuracy[_LABEL].md`` and ``.csv`` to
``--out``; ``--label`` names a run (run it on another checkout with ``PYTHONPATH=its/src`` for
a "before" table).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autoremat
from autoremat.planning.plan import plan_from_profile, profile_lowest
from report import dicts_to_csv
from zoo import REPEATED, ZOO

PRECISIONS = {"fp32": None, "bf16": ("cpu", torch.bfloat16)}
MODELS = [*ZOO, "looped-8", "two-tower"]


def build(name: str) -> Any:
    return ZOO[name]() if name in ZOO else REPEATED[name][0]()


def rows_for(name: str, precision: str) -> list[dict[str, Any]]:
    """The three budget plans of ``name`` in ``precision``: predicted and measured."""
    model, args, kwargs = build(name)
    autocast = PRECISIONS[precision]
    prof = autoremat.profile(model, args, kwargs, autocast=autocast)
    lowest = profile_lowest(prof, objective="flops")
    rows = []
    for label, budget in (("75%", 0.75), ("50%", 0.5), ("lowest", lowest)):
        if isinstance(budget, float) and budget * prof.peak < lowest:
            continue  # below the lowest budget: the lowest row stands for it
        plan = plan_from_profile(model, prof, budget, objective="flops")
        wrapped = plan.apply(copy.deepcopy(model))
        tracker = autoremat.measure(wrapped, args, kwargs, autocast=autocast).peak
        allocator = autoremat.measure(
            wrapped, args, kwargs, autocast=autocast, memory="allocator"
        ).peak
        estimate, limit = plan.estimated_peak or 0, plan.budget or 0
        rows.append(
            {
                "model": name,
                "precision": precision,
                "budget": label,
                "budget_bytes": limit,
                "entries": len(plan.modules),
                "estimate": estimate,
                "tracker": tracker,
                "allocator": allocator,
                "estimate_error": estimate / tracker - 1,
                "held": tracker <= limit,
                "allocator_over_budget": allocator / limit - 1,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Budgets: predicted against measured (tensor tracker and CPU allocator)",
        "",
        header,
        "",
        "Plans priced by FLOPs. `error`: estimate over the tracker's measured peak, less 1 "
        "(negative: under-predicted). `held`: the tracker's peak within the budget (what a "
        "budget bounds). `allocator`: the CPU allocator's peak over the budget, less 1 (what "
        "the machine saw beyond the tensors: kernels' scratch, checkpoints' RNG states).",
        "",
        "| model | precision | budget | entries | estimate | tracker | error | held | allocator |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['budget']} | {r['entries']} | "
            f"{r['estimate'] / 2**20:.2f} MiB | {r['tracker'] / 2**20:.2f} MiB | "
            f"{r['estimate_error']:+.2%} | {'yes' if r['held'] else 'NO'} | "
            f"{r['allocator_over_budget']:+.2%} |"
        )
    held = sum(r["held"] for r in rows)
    errors = [r["estimate_error"] for r in rows]
    lines += [
        "",
        f"{held} of {len(rows)} plans held; estimate error {min(errors):+.2%} to "
        f"{max(errors):+.2%}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    stem = "budget_accuracy" + (f"_{ns.label}" if ns.label else "")
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    for name in ns.models.split(","):
        for precision in ns.precisions.split(","):
            print(name, precision, file=sys.stderr, flush=True)
            rows += rows_for(name, precision)
            header = (  # (written after each model: a long run's table is never lost)
                f"torch {torch.__version__}, CPU, 1 thread, {time.perf_counter() - start:.0f} s"
                + (f"; run: {ns.label}" if ns.label else "")
            )
            (Path(ns.out) / f"{stem}.md").write_text(markdown(rows, header))
            dicts_to_csv(rows, Path(ns.out) / f"{stem}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
