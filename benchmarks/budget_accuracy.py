"""Budgets: each plan's estimate (its step, run) against the measured peak, and the lowest
budget against the plans written by hand, in fp32 and under autocast.

    python benchmarks/budget_accuracy.py --models example:gpt2,example:cnn --label examples
    python benchmarks/budget_accuracy.py --precisions fp32,bf16,fp16 --singles
    python benchmarks/budget_accuracy.py --memory allocator --models mlp,cnn --label allocator

For each model (of :data:`zoo.ZOO`, of :data:`zoo.REPEATED`, or ``example:NAME``, a built-in
example) and precision: one profile, then budget plans priced by FLOPs (the same plan on any
machine) at 75% and 50% of the peak without recompute and at the lowest budget. Each plan is
applied to a copy and one step measured: by :class:`autoremat.LiveMemory` (what a
``plan(budget=...)`` budget bounds) and by the CPU allocator. With ``--memory allocator`` each
plan's step is run counted by the CPU allocator (as ``plan(device_memory=...)`` does on a CPU), so
the budget bounds the allocator's peak. Per model and precision also: whether the lowest budget's
plan holds, whether 4 KiB below it raises ``BudgetTooLow``, whether every block and every
block's children checkpointed by hand measure at or above it (``--singles``: every module
alone too, each run), and whether the measured peaks fall as the budgets do. Memory only.
Writes ``budget_accuracy[_LABEL].md`` and ``.csv`` to ``--out``.
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
from autoremat.examples import EXAMPLES
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.rehearsal import PlanFields, rehearsal_for
from autoremat.record.tree import find_blocks
from report import dicts_to_csv
from zoo import REPEATED, ZOO

PRECISIONS = {"fp32": None, "bf16": ("cpu", torch.bfloat16), "fp16": ("cpu", torch.float16)}
MODELS = [*ZOO, "looped-8", "two-tower"]


def build(name: str) -> Any:
    """A model of the benchmark zoo, of ``zoo.REPEATED``, or ``example:NAME``."""
    if name.startswith("example:"):
        return EXAMPLES[name.removeprefix("example:")]()
    return ZOO[name]() if name in ZOO else REPEATED[name][0]()


def rows_for(name: str, precision: str, memory: str, singles: bool) -> list[dict[str, Any]]:
    """The budget plans of ``name`` in ``precision`` (module docstring)."""
    model, args, kwargs = build(name)
    autocast = PRECISIONS[precision]
    started = time.perf_counter()
    prof = autoremat.profile(model, args, kwargs, autocast=autocast)
    run = rehearsal_for(prof, memory=memory)
    how = {"objective": "flops", "rehearsal": run}
    lowest = profile_lowest(prof, **how)  # type: ignore[arg-type]
    try:
        plan_from_profile(model, prof, lowest - 4096, **how)  # type: ignore[arg-type]
        raises = False
    except autoremat.BudgetTooLow:
        raises = True
    hand = _hand_lowest(model, prof, run, singles)
    rows, seen = [], []
    for label, budget in (("75%", int(0.75 * prof.peak)), ("50%", prof.peak // 2),
                          ("lowest", lowest)):  # fmt: skip
        if budget < lowest:
            continue  # below the lowest budget: the lowest row stands for it
        plan = plan_from_profile(model, prof, budget, **how)  # type: ignore[arg-type]
        wrapped = plan.apply(copy.deepcopy(model))
        tracker = autoremat.measure(wrapped, args, kwargs, autocast=autocast, memory="tensors")
        allocator = autoremat.measure(wrapped, args, kwargs, autocast=autocast,
                                      memory="allocator").peak  # fmt: skip
        bounded = allocator if memory == "allocator" else tracker.peak
        seen.append(bounded)
        rows.append({
            "model": name, "precision": precision, "memory": memory, "budget": label,
            "budget_bytes": budget, "entries": len(plan.modules), "way": run.way,
            "estimate": plan.estimated_peak, "tracker": tracker.peak, "allocator": allocator,
            "estimate_error": (plan.estimated_peak or 0) / bounded - 1,
            "held": bounded <= budget, "lowest_fraction": lowest / prof.peak,
            "below_raises": raises, "hand_lowest": hand, "hand_ok": hand >= lowest,
            "seconds": time.perf_counter() - started,
        })  # fmt: skip
    for r in rows:
        r["monotone"] = seen == sorted(seen, reverse=True)
    return rows


def _hand_lowest(model: Any, prof: Any, run: Any, singles: bool) -> int:
    """The least peak of the plans written by hand: every block (of one class; of one
    container), every block's children (and, with ``singles``, every module alone), each run
    (a run equals the measured step: ``tests/test_search.py``); the peak without recompute if
    there are none."""
    plans = []
    for by in ("class", "container") if prof.module_tree else ():
        blocks = find_blocks(prof.module_tree, by=by)
        kids = [f"{b}.{c}" for b in blocks for c, _ in model.get_submodule(b).named_children()]
        plans += [blocks, kids] if blocks not in plans else []
    if singles:
        plans += [[n.path] for n in prof.module_tree.walk() if n.path and not n.is_leaf]
    peaks = [prof.peak]
    for entries in (p for p in plans if p):
        try:
            peaks.append(run.peak(PlanFields(tuple(entries))))
        except ValueError:  # (a module that cannot be wrapped: no hand plan)
            continue
    return min(peaks)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Budgets: each plan's estimate (its step, run) against the measured peak",
        "",
        header,
        "",
        "Plans priced by FLOPs. `memory`: `tensors` (the tracker's: a `plan(budget=)` budget "
        "bounds it) or `allocator` (each plan's step run counted by the CPU allocator, as "
        "`plan(device_memory=...)` does on a CPU). `way`: how the steps ran (`real`, `fake`). "
        "`error`: "
        "estimate over the measured peak the budget bounds, less 1. `held`: that peak within the "
        "budget. `lowest`: the lowest budget as a fraction of the peak without recompute; "
        "`-4KiB`: a budget 4 KiB below it raises `BudgetTooLow`; `hand`: the least measured "
        "peak of every block, every block's children (and every module alone, with "
        "`--singles`) over the lowest, less 1 (never below 0: none measures lower); "
        "`monotone`: lower budgets measured no higher. `s`: profile and planning seconds.",
        "",
        "| model | precision | memory | budget | entries | way | estimate | measured | error "
        "| held | lowest | -4KiB | hand | monotone | s |",
        "|---|---|---|---|---:|---|---:|---:|---:|---|---:|---|---:|---|---:|",
    ]
    for r in rows:
        low = r["lowest_fraction"]
        measured = r["allocator"] if r["memory"] == "allocator" else r["tracker"]
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['memory']} | {r['budget']} | "
            f"{r['entries']} | {r['way']} | {r['estimate'] / 2**20:.2f} MiB | "
            f"{measured / 2**20:.2f} MiB | {r['estimate_error']:+.2%} | "
            f"{'yes' if r['held'] else 'NO'} | {low:.3f} | "
            f"{'yes' if r['below_raises'] else 'NO'} | "
            f"{'ok' if r['hand_ok'] else 'BELOW'} | {'yes' if r['monotone'] else 'NO'} | "
            f"{r['seconds']:.1f} |"
        )
    held = sum(r["held"] for r in rows)
    errors = [r["estimate_error"] for r in rows]
    lowest = [r for r in rows if r["budget"] == "lowest"]
    lines += [
        "",
        f"{held} of {len(rows)} plans held; estimate error {min(errors):+.2%} to "
        f"{max(errors):+.2%}; lowest budget: 4 KiB below raised in "
        f"{sum(r['below_raises'] for r in lowest)} of {len(lowest)}, no hand plan below it in "
        f"{sum(r['hand_ok'] for r in lowest)} of {len(lowest)}; monotone in "
        f"{sum(r['monotone'] for r in lowest)} of {len(lowest)}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--label", default="")
    parser.add_argument("--memory", default="tensors", help="tensors or allocator")
    parser.add_argument("--singles", action="store_true", help="every module alone by hand too")
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
            rows += rows_for(name, precision, ns.memory, ns.singles)
            header = (  # (written after each model: a long run's table is never lost)
                f"torch {torch.__version__}, CPU, 1 thread, {time.perf_counter() - start:.0f} s"
                + (f"; run: {ns.label}" if ns.label else "")
            )
            (Path(ns.out) / f"{stem}.md").write_text(markdown(rows, header))
            dicts_to_csv(rows, Path(ns.out) / f"{stem}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
