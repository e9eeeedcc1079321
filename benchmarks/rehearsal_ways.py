"""A plan's step run on fake tensors and for real, side by side, on the library zoo.

For each zoo model, fp32 and CPU bf16 autocast: profile one step, let ``lowest_budget``'s
search propose its plans, and run the first two of them both ways (a fresh
:class:`~autoremat.planning.rehearsal.Rehearsal` each, ``"fake"`` and ``"real"``): the peaks,
whether they are the same to the byte, the seconds of each way, the way the step fell back to
(a step fake tensors cannot run is run for real), and what ``way_for`` chose from the profile's
forward op times. Writes ``results/rehearsal_ways.csv`` and ``.md`` (docs/cost-model.md,
"Running a plan's step").

    cd benchmarks && ../.venv-zoo/bin/python rehearsal_ways.py [--models tv_resnet18 hf_llama]
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import autoremat
import library_zoo  # (first: transformers imports torchvision, which needs the zoo's shim)
from autoremat.planning import rehearsal
from autoremat.planning.plan import profile_lowest

RESULTS = Path(__file__).parent / "results"
PLANS = 2  # plans of the lowest-budget search run both ways, per configuration


def proposed(prof: Any) -> list[rehearsal.PlanFields]:
    """The plans ``lowest_budget``'s search runs on ``prof`` (the empty one left out)."""
    seen: list[rehearsal.PlanFields] = []
    run = rehearsal.Rehearsal._run

    def kept(self: Any, plan: Any, watch: Any = None) -> Any:
        seen.append(plan)
        return run(self, plan, watch)

    rehearsal.Rehearsal._run = kept  # type: ignore[method-assign]
    try:
        profile_lowest(prof)
    finally:
        rehearsal.Rehearsal._run = run  # type: ignore[method-assign]
    return [p for p in seen if p is not None][:PLANS]


def both_ways(name: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """One configuration's row (module docstring)."""
    model, args, kwargs = library_zoo.ZOO[name].build()
    prof = autoremat.profile(model, args, kwargs, autocast=dtype)
    root = prof[prof.tree.path]
    row: dict[str, Any] = {
        "model": name,
        "precision": "bf16" if dtype else "fp32",
        "forward us/op": round(root.op_seconds / root.ops * 1e6),
        "way_for": rehearsal.way_for(prof),
    }
    plans = proposed(prof)
    for way in ("real", "fake"):
        runner = rehearsal.Rehearsal(prof.step, way)
        started = time.perf_counter()
        row[f"{way} peaks"] = [runner.peak(p) for p in plans]
        row[f"{way} s"] = round(time.perf_counter() - started, 3)
        row[f"{way} ran"] = runner.way
    row["same"] = row["real peaks"] == row["fake peaks"]
    row["fake/real"] = round(row["fake s"] / row["real s"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(library_zoo.ZOO))
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rows = []
    for name in options.models:
        for dtype in (None, torch.bfloat16):
            rows.append(both_ways(name, dtype))
            print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "rehearsal_ways.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    faked = [r for r in rows if r["fake ran"] == "fake"]
    ratios = [r["fake/real"] for r in faked]
    lines = [
        "# Plan steps on fake tensors and for real (`benchmarks/rehearsal_ways.py`)",
        "",
        f"{len(rows)} configurations, {sum(len(r['real peaks']) for r in rows)} plans; "
        f"the same peak to the byte both ways: {sum(r['same'] for r in rows)} of {len(rows)}; "
        f"fake tensors ran {len(faked)} (the others fell back to the real step); fake / real "
        f"seconds {min(ratios)}-{max(ratios)}x, median {statistics.median(ratios)}x; way_for "
        f"chose real on {sum(r['way_for'] == 'real' for r in rows)}.",
        "",
        "| model | precision | forward us/op | way_for | real s | fake s | fake ran | same |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
    ]
    lines += [
        f"| {r['model']} | {r['precision']} | {r['forward us/op']} | {r['way_for']} | "
        f"{r['real s']} | {r['fake s']} | {r['fake ran']} | {'yes' if r['same'] else 'NO'} |"
        for r in rows
    ]
    (RESULTS / "rehearsal_ways.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
