"""Modules that run many times: per-call plans against per-call checkpointing by hand (issue 14).

    python benchmarks/calls.py                      # ~5 min on 2 shared CPU cores
    python benchmarks/calls.py --models looped-8 --repeats 3

For each model of :data:`zoo.REPEATED` (Hugging Face ALBERT at 6 and 12 layers, one block
looped 8 times, an ``nn.LSTMCell`` stepped over 64 time steps, two towers sharing an encoder),
side by side in one :func:`autoremat.comparison.compare`:

* ``every call (hand)``: the shared module wrapped, so that each of its calls is checkpointed
  (what one writes by hand: ``checkpoint(layer, x)`` inside the loop);
* ``all calls but the last (hand)``: the same less the last call, whose activations backward
  uses first (entries ``path@0 .. path@n-2``);
* ``budget 50%``: :func:`autoremat.plan` at half the peak without recompute;
* ``budget min``: the plan at the lowest budget the planner states
  (:func:`autoremat.lowest_budget`).

Figures: measured peak over no recompute (``peak x``), whether a plan's measured peak is within
its budget, the plan's predicted peak against the measured one, FLOPs over no recompute
(recompute included), step time over no recompute (median of ``--repeats`` interleaved steps),
and whether one step's loss and gradients equal the unwrapped model's (dropout on). The target:
``budget min`` within 10% of the better hand row, and 50% budgets held. Writes ``calls.md`` and
``calls.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
from autoremat import profile, wrap
from autoremat.comparison import Applied, Contender, Row, budget_plan, compare, no_recompute
from report import dicts_to_csv
from zoo import REPEATED

TARGET = 1.10  # budget min's peak over the better hand row's, at most


def by_hand(name: str, entries: list[str]) -> Contender:
    def apply(model: Any, args: Any, kwargs: Any) -> Applied:
        return Applied(wrap.apply(model, entries), note=f"{len(entries)} entries")

    return Contender(name, apply)


def rows_for(name: str, repeats: int) -> list[dict[str, Any]]:
    factory, shared = REPEATED[name]
    model, args, kwargs = factory()
    calls = profile(model, args, kwargs).calls_of(shared)
    strategies = [
        no_recompute(),
        by_hand("every call (hand)", [shared]),
        by_hand("all calls but the last (hand)", calls[:-1]),
        budget_plan(0.5),
        budget_plan("min"),
    ]
    print(f"{name}: {len(calls)} calls of {shared}", file=sys.stderr, flush=True)
    measured = compare(model, args, kwargs, strategies, repeats=repeats, name=name)
    hand = min(r.peak for r in measured[1:3] if r.peak is not None)
    return [_row(name, len(calls), r, hand) for r in measured[1:]]


def _row(name: str, calls: int, r: Row, hand: int) -> dict[str, Any]:
    p = r.plan
    budgeted = p is not None and p.budget is not None and r.peak is not None
    return {
        "model": name,
        "calls": calls,
        "strategy": r.strategy,
        "peak_x": r.peak_ratio,
        "peak_over_hand": None if r.peak is None else r.peak / hand,
        "within": r.peak <= p.budget if budgeted else None,  # type: ignore[union-attr,operator]
        "estimate_error": (p.estimated_peak - r.peak) / r.peak if budgeted else None,  # type: ignore[union-attr,operator]
        "flops_x": r.flops_ratio,
        "time_x": r.time_ratio,
        "entries": None if p is None else len(p.modules),
        "call_entries": None if p is None else sum("@" in e for e in p.modules),
        "grads": "ok" if r.grads_match else "DIFFER",
    }


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Modules that run many times: per-call plans against per-call checkpointing by hand",
        "",
        header,
        "",
        "Ratios are to no recompute of the same model (`peak x`, `FLOPs x`, `time x`); `vs hand`:"
        " the measured peak over the better of the two hand rows. Target: `budget min` within "
        f"{TARGET:.2f}x of hand, and `budget 50%` within its budget. `entries`: the plan's "
        "entries (of which per call, `path@k`). `est. error`: predicted over measured peak, "
        "less 1.",
        "",
        "| model | calls | strategy | peak x | vs hand | target | within | est. error | FLOPs x |"
        " time x | entries | grads |",
        "|---|---:|---|---:|---:|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        target = ""
        if r["strategy"] == "budget min" and r["peak_over_hand"] is not None:
            target = "met" if r["peak_over_hand"] <= TARGET else "missed"
        within = "" if r["within"] is None else ("yes" if r["within"] else "NO")
        entries = "" if r["entries"] is None else f"{r['entries']} ({r['call_entries']})"
        lines.append(
            f"| {r['model']} | {r['calls']} | {r['strategy']} | {_fmt(r['peak_x'], '.3f')} | "
            f"{_fmt(r['peak_over_hand'], '.3f')} | {target} | {within} | "
            f"{_fmt(r['estimate_error'], '+.2%')} | {_fmt(r['flops_x'], '.3f')} | "
            f"{_fmt(r['time_x'], '.2f')} | {entries} | {r['grads']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(REPEATED))
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = [row for name in ns.models.split(",") for row in rows_for(name, ns.repeats)]
    out = Path(ns.out)
    dicts_to_csv(rows, out / "calls.csv")
    text = markdown(rows, run.machine_line(time.perf_counter() - start, ns.repeats))
    (out / "calls.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
