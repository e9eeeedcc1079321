"""Budgets as the device counts them: predicted against measured, by the tensor tracker and by
the CPU allocator, in fp32 and under bf16 autocast.

    python benchmarks/budget_accuracy.py                   # ~10 min on 2 shared CPU cores
    python benchmarks/budget_accuracy.py --models mlp,cnn --label before
    python benchmarks/budget_accuracy.py --memory both --precisions fp32,bf16,fp16 --label scratch
    python benchmarks/budget_accuracy.py --models example:gpt2,example:lstm-cell --label examples

For each model of :data:`zoo.ZOO` and the shared-module models of :data:`zoo.REPEATED`, in
fp32 and under CPU bf16 autocast: one profile, then budget plans priced by FLOPs (the same plan
on any machine) at 75% and 50% of the peak without recompute and at the lowest budget. Each
plan is applied to a copy and one step measured twice: by :class:`autoremat.LiveMemory` (what a
``plan(budget=...)`` budget bounds) and by the CPU allocator (``measure(...,
memory="allocator")``: what the machine sees, kernels' scratch and checkpoints' RNG states
included). With ``--memory allocator`` (or ``both``) the profile is the CPU allocator's
(``profile(memory="allocator")``) and the plans are made as ``plan_for_device`` makes them, so
their budget bounds the allocator's peak. ``--precisions`` may add ``fp16`` (CPU float16
autocast). Memory only (no timing). Writes ``budget_accuracy[_LABEL].md`` and ``.csv`` to
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
from autoremat.examples import EXAMPLES
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.training.device_model import CPU_RNG_STATE
from autoremat.training.plan_for_device import plan_fitting
from autoremat.training.step_memory import checkpoint_state
from report import dicts_to_csv
from zoo import REPEATED, ZOO

PRECISIONS = {"fp32": None, "bf16": ("cpu", torch.bfloat16), "fp16": ("cpu", torch.float16)}
MODELS = [*ZOO, "looped-8", "two-tower"]


def build(name: str) -> Any:
    """A model of the benchmark zoo, of ``zoo.REPEATED``, or ``example:NAME``, a built-in
    example (``autoremat.examples.EXAMPLES``, as ``autoremat examples`` lists them)."""
    if name.startswith("example:"):
        return EXAMPLES[name.removeprefix("example:")]()
    return ZOO[name]() if name in ZOO else REPEATED[name][0]()


def rows_for(name: str, precision: str, memory: str = "tensors") -> list[dict[str, Any]]:
    """The three budget plans of ``name`` in ``precision``: predicted and measured. With
    ``memory="allocator"`` the profile is the CPU allocator's (kernels' scratch) and each plan
    is made as ``plan_for_device`` makes it: what its checkpoints keep counted too."""
    model, args, kwargs = build(name)
    autocast = PRECISIONS[precision]
    prof = autoremat.profile(model, args, kwargs, autocast=autocast, memory=memory)
    lowest = profile_lowest(prof, objective="flops")
    rows = []
    for label, budget in (("75%", 0.75), ("50%", 0.5), ("lowest", lowest)):
        if isinstance(budget, float) and budget * prof.peak < lowest:
            continue  # below the lowest budget: the lowest row stands for it
        plan, limit, kept = _plan(model, prof, budget, memory)
        wrapped = plan.apply(copy.deepcopy(model))
        tracker = autoremat.measure(wrapped, args, kwargs, autocast=autocast).peak
        allocator = autoremat.measure(
            wrapped, args, kwargs, autocast=autocast, memory="allocator"
        ).peak
        estimate = (plan.estimated_peak or 0) + kept
        bounded = allocator if memory == "allocator" else tracker
        rows.append(
            {
                "model": name,
                "precision": precision,
                "profile": memory,
                "budget": label,
                "budget_bytes": limit,
                "entries": len(plan.modules),
                "estimate": estimate,
                "tracker": tracker,
                "allocator": allocator,
                "estimate_error": estimate / bounded - 1,
                "held": bounded <= limit,
                "allocator_over_budget": allocator / limit - 1,
            }
        )
    return rows


def _plan(model: Any, prof: Any, budget: float | int, memory: str) -> tuple[Any, int, int]:
    """The plan at ``budget`` (a fraction of the peak, or bytes), its budget in bytes and what
    its checkpoints keep beyond the profile's figure (by the allocator: RNG states and buffer
    copies, which the plan is made to leave room for; the lowest budget is raised by them)."""
    if memory == "tensors":
        plan = plan_from_profile(model, prof, budget, objective="flops")
        return plan, plan.budget or 0, 0
    limit = int(budget * prof.peak) if isinstance(budget, float) else int(budget)
    if not isinstance(budget, float):  # the lowest: room for what its checkpoints keep
        lowest = plan_from_profile(model, prof, budget, objective="flops")
        limit += checkpoint_state(lowest, prof, CPU_RNG_STATE)
    plan = plan_fitting(model, prof, limit, CPU_RNG_STATE, objective="flops")
    return plan, limit, checkpoint_state(plan, prof, CPU_RNG_STATE)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Budgets: predicted against measured (tensor tracker and CPU allocator)",
        "",
        header,
        "",
        "Plans priced by FLOPs. `profile`: `tensors` (the tracker's: a `plan(budget=)` "
        "budget bounds the tracker's peak) or `allocator` (`profile(memory=\"allocator\")`, "
        "kernels' scratch counted, plans made as `plan_for_device` makes them: checkpoints' RNG "
        "states and buffer copies counted; the budget bounds the allocator's peak). `error`: "
        "estimate over the measured peak the budget bounds, less 1 (negative: under-predicted). "
        "`held`: that peak within the budget. `allocator`: the CPU allocator's peak over the "
        "budget, less 1 (what the machine saw).",
        "",
        "| model | precision | profile | budget | entries | estimate | tracker | allocator peak "
        "| error | held | allocator |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r.get('profile', 'tensors')} | "
            f"{r['budget']} | {r['entries']} | {r['estimate'] / 2**20:.2f} MiB | "
            f"{r['tracker'] / 2**20:.2f} MiB | {r['allocator'] / 2**20:.2f} MiB | "
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
    parser.add_argument("--memory", default="tensors", help="tensors, allocator or both")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    stem = "budget_accuracy" + (f"_{ns.label}" if ns.label else "")
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    for name in ns.models.split(","):
        for precision in ns.precisions.split(","):
            for memory in ("tensors", "allocator") if ns.memory == "both" else (ns.memory,):
                print(name, precision, memory, file=sys.stderr, flush=True)
                rows += rows_for(name, precision, memory)
            header = (  # (written after each model: a long run's table is never lost)
                f"torch {torch.__version__}, CPU, 1 thread, {time.perf_counter() - start:.0f} s"
                + (f"; run: {ns.label}" if ns.label else "")
            )
            (Path(ns.out) / f"{stem}.md").write_text(markdown(rows, header))
            dicts_to_csv(rows, Path(ns.out) / f"{stem}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
