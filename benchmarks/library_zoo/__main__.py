"""Run the library zoo and write its table: ``python -m library_zoo`` from ``benchmarks/``
(``make zoo``). Writes ``benchmarks/results/zoo.md`` and ``zoo.csv``.

Each architecture runs in fp32 and under CPU bf16 autocast, each with its own checkpointing off
and (where its library has a switch) on (:func:`library_zoo.check.check`), and once through
``plan``, ``measure`` and ``fit`` on the user's model (:func:`library_zoo.check.check_calls`).

Exit status 1 when a row fails what the zoo promises: a crash; a plan that did not train
exactly, was not recomputed, or measured over its budget (fp32 and bf16); a user's model left
changed or its forward no longer as a fresh model's.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
import warnings
from pathlib import Path

from library_zoo import ZOO, ZooModel, own_checkpointing_on
from library_zoo.check import CallsCheck, PlanCheck, ZooRow, check, check_calls

RESULTS = Path(__file__).resolve().parents[1] / "results"
MiB = 2**20


def _configurations(entry: ZooModel) -> list[tuple[str, bool]]:
    model, _, _ = entry.build()
    switch = own_checkpointing_on(model)
    return [(p, own) for own in ((False, True) if switch else (False,)) for p in ("fp32", "bf16")]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _plan_cell(c: PlanCheck | None, peak: int | None) -> list[str]:
    if c is None:
        return ["", "", "", ""]
    if c.error:
        return [f"{c.budget / peak:.2f}" if peak else "", "", "", f"failed: {c.error}"]
    ok = "yes" if c.exact and c.recomputed else ("not recomputed" if c.exact else "NO")
    held = "yes" if c.held else "NO"
    return [f"{c.budget / peak:.2f}" if peak else "", _pct(c.estimate_error), held, ok]


def _cells(r: ZooRow) -> list[str]:
    peak = r.peak
    eb = f"{r.every_block / peak:.2f}" if r.every_block and peak else ""
    return [
        r.model, r.library, r.precision, "on" if r.own else "off",
        f"{peak / MiB:.2f}" if peak else "",
        *_plan_cell(r.mid, peak), *_plan_cell(r.low, peak), eb,
        f"{r.plan_seconds:.1f}" if r.plan_seconds is not None else "",
        "; ".join(r.left_as_found) or ("yes" if not r.error else ""),
        r.error,
    ]


HEADER = [
    "model", "library", "precision", "own ckpt", "peak MiB",
    "mid budget", "mid est. error", "mid held", "mid exact",
    "lowest", "lowest est. error", "lowest held", "lowest exact",
    "every block", "plan s", "left as found", "error",
]


def _plans(rows: list[ZooRow], precision: str) -> list[PlanCheck]:
    return [c for r in rows if r.precision == precision for c in (r.mid, r.low) if c is not None]


def summary(rows: list[ZooRow], calls: list[CallsCheck]) -> list[str]:
    """The table in a few lines: per precision, how many plans trained exactly, were
    recomputed and held, and the estimates' range; crashes; models left changed."""
    lines = []
    for precision in ("fp32", "bf16"):
        plans = _plans(rows, precision)
        errors = [c.estimate_error for c in plans if c.estimate_error is not None]
        low, high = (min(errors), max(errors)) if errors else (0.0, 0.0)
        lines.append(
            f"- {precision}: {len(plans)} plans; exact {sum(c.exact for c in plans)}, "
            f"recomputed {sum(c.recomputed for c in plans)}, held "
            f"{sum(c.held for c in plans)}; estimate error {low:+.1%} to {high:+.1%}"
        )
    crashed = [r for r in rows if r.error] + [c for c in calls if c.error]
    changed = sorted({r.model for r in rows if r.left_as_found} | {
        c.model for c in calls if c.left_as_found or c.probe_same is False})
    fitted = sum(c.fit.startswith("batch ") for c in calls)
    lines.append(f"- crashes: {len(crashed)}; models left changed: {len(changed)} "
                 f"{', '.join(changed)}".rstrip())
    lines.append(f"- fit found a batch for {fitted} of {len(calls)} models (the others: why, "
                 f"in the last table)")
    return lines


def _markdown(rows: list[ZooRow], calls: list[CallsCheck], seconds: float) -> str:
    lines = [
        "# The library zoo",
        "",
        f"{len({r.model for r in rows})} architectures, {len(rows)} configurations, "
        f"{seconds / 60:.1f} min on this machine (`make zoo`; `docs/zoo.md` explains it).",
        "Budgets as fractions of the no-recompute peak; est. error = (estimated - measured) /"
        " measured; every block = the measured peak with every block checkpointed by hand, as a"
        " fraction. Every plan, fp32 and bf16, must train exactly, recompute, hold its budget and"
        " be estimated within -0.5% to +2% (mid) or +5% (lowest) of its measured peak.",
        "",
        *summary(rows, calls),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    lines += ["", "## plan, measure and fit on the user's model (fp32)", "",
              "| model | left as found | forward as a fresh model's | fit at 2x the step |",
              "|---|---|---|---|"]
    for c in calls:
        same = {True: "yes", False: "NO", None: ""}[c.probe_same]
        lines.append(f"| {c.model} | {'; '.join(c.left_as_found) or 'yes'} | {same} | "
                     f"{c.fit or c.error} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m library_zoo", description=__doc__)
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for zoo.md/zoo.csv")
    opts = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the plans' own warnings would drown the table
    warnings.simplefilter("ignore")  # and so would the libraries' deprecation notices
    started = time.perf_counter()
    rows, calls, bad = [], [], []
    for name in opts.models.split(","):
        entry = ZOO[name]
        for precision, own in _configurations(entry):
            rows.append(check(entry, precision, own))
            bad += rows[-1].failures()
            print(" | ".join(_cells(rows[-1])), file=sys.stderr, flush=True)
        calls.append(check_calls(entry))
        bad += calls[-1].failures()
    seconds = time.perf_counter() - started
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "zoo.md").write_text(_markdown(rows, calls, seconds))
    with open(opts.out / "zoo.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(_cells(r) for r in rows)
    for b in bad:
        print(f"FAIL {b}", file=sys.stderr)
    print(f"{len(rows)} configurations, {len(bad)} failures, {seconds:.0f} s", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
