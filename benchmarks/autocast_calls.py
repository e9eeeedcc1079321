"""Shared modules under autocast: the weight casts a recompute makes again, predicted or not.

    python benchmarks/autocast_calls.py               # ~4 min on 2 shared CPU cores
    python benchmarks/autocast_calls.py --models looped-8

Autocast casts a shared module's weights once per forward (its cast cache) and a recompute of
a later call casts them again (``docs/cost-model.md``, "Autocast"). For each model of
:data:`zoo.REPEATED`, under CPU bf16 autocast:

* ``call sets``: the shared module's calls recomputed whole, in sets (each call alone, all,
  all but the first, all but the last, the odd ones, the even ones): the step run with them
  (:mod:`autoremat.planning.rehearsal`, what a plan states) against the measured one, and the
  walk's price of them (:func:`autoremat.planning.solver.walk_peak`: an upper bound);
* ``budget`` plans priced by FLOPs (the same plan on any machine) at 75% and 50% of the peak
  without recompute and at the lowest budget: measured peak within the budget, and the error.

Memory only (no timing): the figures are the same on a busy machine. Writes
``autocast_calls.md`` and ``autocast_calls.csv`` to ``--out``.
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
import run
from autoremat.planning.planning_tree import planning_tree
from autoremat.planning.rehearsal import PlanFields, rehearsal_for
from autoremat.planning.solver import walk_peak
from autoremat.wrap.wrapping import apply
from report import dicts_to_csv
from zoo import REPEATED

BF16 = ("cpu", torch.bfloat16)


def call_sets(calls: list[str]) -> dict[str, list[str]]:
    sets = {f"{c} alone": [c] for c in calls}
    sets |= {
        "all": calls,
        "all but the first": calls[1:],
        "all but the last": calls[:-1],
        "odd": calls[1::2],
        "even": calls[::2],
    }
    return sets


def sweep(name: str, model: Any, args: Any, kwargs: Any, shared: str) -> dict[str, Any]:
    """The call sets' run and measured peaks: the worst error each way, and the walk's most
    over (never under: the search relies on it)."""
    prof = autoremat.profile(model, args, kwargs, autocast=BF16)
    rng = int(torch.get_rng_state().numel())
    items = {i.path: i for i in planning_tree(prof, selective=False, rng_state=rng).walk()}
    errors, walk = [], []
    calls = {shared: len(prof.calls_of(shared))}
    for chosen in call_sets(prof.calls_of(shared)).values():
        run_peak = rehearsal_for(prof).peak(PlanFields(tuple(chosen), {}, calls))
        wrapped = apply(copy.deepcopy(model), chosen, calls=calls)
        measured = autoremat.measure(wrapped, args, kwargs, autocast=BF16).peak
        errors.append(run_peak / measured - 1)
        priced = walk_peak([items[c] for c in chosen], prof.backward_points, prof.forward_points)
        walk.append(priced / measured - 1)
    return {
        "model": name,
        "kind": "call sets",
        "plans": len(errors),
        "under": sum(e < 0 for e in errors),
        "worst_under": min(errors),
        "worst_over": max(errors),
        "walk_over": max(walk),
        "walk_under": sum(w < 0 for w in walk),
        "held": None,
    }


def budgets(name: str, model: Any, args: Any, kwargs: Any) -> list[dict[str, Any]]:
    """Budget plans priced by FLOPs: held, and the estimate's error."""
    lowest = autoremat.lowest_budget(model, args, kwargs, autocast=BF16, objective="flops")
    rows = []
    for label, target in (("75%", 0.75), ("50%", 0.5), ("lowest", lowest)):
        try:
            plan = autoremat.plan(
                model, args, kwargs, budget=target, autocast=BF16, objective="flops"
            )
        except autoremat.BudgetTooLow:
            continue  # below the lowest budget: the lowest row stands for it
        wrapped = plan.apply(copy.deepcopy(model))
        measured = autoremat.measure(wrapped, args, kwargs, autocast=BF16).peak
        error = plan.estimated_peak / measured - 1  # type: ignore[operator]
        rows.append(
            {
                "model": name,
                "kind": f"budget {label}",
                "plans": 1,
                "under": int(error < 0),
                "worst_under": min(error, 0.0),
                "worst_over": max(error, 0.0),
                "held": measured <= plan.budget,  # type: ignore[operator]
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Shared modules under autocast: each plan's step, run, against the measured peak",
        "",
        header,
        "",
        "CPU bf16 autocast. `under`: plans whose measured peak was above the estimate (the "
        "run); `worst`: estimate over measured, less 1. `walk`: the walk's price over "
        "measured, less 1, at most (and the plans it under-priced: the search needs none). "
        "`held`: the measured peak within the budget.",
        "",
        "| model | plans | n | under | worst under | worst over | walk | walk under | held |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        held = "" if r["held"] is None else ("yes" if r["held"] else "NO")
        walk = "" if r.get("walk_over") is None else f"{r['walk_over']:+.2%}"
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['plans']} | {r['under']} | "
            f"{r['worst_under']:+.3%} | {r['worst_over']:+.3%} | {walk} | "
            f"{r.get('walk_under', '')} | {held} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="looped-8,two-tower,lstm-cell-64,albert-6")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    for name in ns.models.split(","):
        factory, shared = REPEATED[name]
        model, args, kwargs = factory()
        print(name, file=sys.stderr, flush=True)
        rows += [sweep(name, model, args, kwargs, shared), *budgets(name, model, args, kwargs)]
    out = Path(ns.out)
    dicts_to_csv(rows, out / "autocast_calls.csv")
    text = markdown(rows, run.machine_line(time.perf_counter() - start))
    (out / "autocast_calls.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
