"""autoremat under torch.compile, side by side with compile's own memory budget (issue 16).

    python benchmarks/compile.py                         # gpt2, llama, vit, cnn (~30 min)
    python benchmarks/compile.py --models gpt2 --repeats 3

Rows per model, all in one run and measured alike (peak and saved from the CPU allocator's own
events, :class:`autoremat.record.memory.CpuAllocatorMemory`, for eager and compiled rows):

* ``none``: eager, no recompute (the baseline of every ratio);
* ``budget 75%``, ``budget 50%``, ``budget min``: eager autoremat plans;
* ``budget ... + compile``: the same plans applied, then ``torch.compile`` (inductor,
  ``activation_memory_budget`` left at 1.0: the partitioner keeps what the plan keeps);
* ``budget ... (compile-checked) + compile``: ``autoremat.plan(..., compile=...)`` (the plan's
  compiled step measured, and planned again while over the budget), then compiled;
* ``compile b=1 ... b=0``: inductor with ``activation_memory_budget`` 1, 0.75, 0.5, 0.25, 0;
* ``every block + compile``: Hugging Face's own gradient checkpointing (or every block
  wrapped, for a model without it), then compiled.

Writes ``compile.md`` and ``compile.csv`` to ``--out``. The markdown adds, for each compiled
autoremat plan, its predicted peak (eager cost model) against the peak measured under compile.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autoremat.comparison import Row, budget_plan, compare, compiled, every_block, to_markdown
from report import to_csv
from run import machine_line, progress_printer
from zoo import ZOO

MiB = 2**20
MODELS = ("gpt2", "llama", "vit", "cnn")
PLAN_BUDGETS: tuple[float | str, ...] = (0.75, 0.5, "min")
COMPILE_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)

LEGEND = """\
Ratios are to the eager `none` row of the same model. `peak`: the most CPU memory allocated
at once during one training step above what was allocated before it (parameters and inputs
excluded), and `saved`: what is still allocated when the loss is computed, both replayed from
the allocator's own events (`torch.profiler`, `profile_memory=True`) for every row, eager or
compiled, after a warm-up step. FLOPs: forward, backward and recompute (compiled rows: counted
on the graphs inductor compiled). `ms/step`: median of interleaved timed steps, ± half their
range; the machine is shared and noisy. `grads`: loss and every gradient of one step from the
same seed equal to eager `none` within rtol 1e-5, atol 1e-6 (inductor compiled with
`fallback_random`, so that dropout draws eager's masks). `compile s`: the warm-up step,
cold compile included."""


def strategies() -> list:
    # objective="flops": the plan depends on no timing, so the eager and the compiled row of a
    # budget apply the same plan.
    chosen = [budget_plan(b, objective="flops") for b in PLAN_BUDGETS]
    chosen += [compiled(first=budget_plan(b, objective="flops")) for b in PLAN_BUDGETS]
    # the same budgets, checked under compile (plan(compile=...): replanned while over)
    chosen += [
        compiled(first=budget_plan(b, objective="flops", compile_backend="inductor"))
        for b in PLAN_BUDGETS[1:]
    ]
    chosen += [compiled(b) for b in COMPILE_BUDGETS]
    chosen.append(compiled(first=every_block()))
    return chosen


def plan_vs_compiled(rows: list[Row]) -> str:
    """A table: each autoremat plan's budget and predicted peak against the peak measured
    eagerly and under compile, and the gradients' worst relative error against eager ``none``
    next to compiled ``none``'s (``compile b=1``: inductor's own rounding)."""
    lines = [
        "| model | plan | budget MiB | predicted MiB | eager MiB | compiled MiB "
        "| compiled / predicted | grads error | compile b=1 grads error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_name = {(r.model, r.strategy): r for r in rows}
    for row in rows:
        if not row.compiled or row.plan is None or row.peak is None:
            continue
        plan = row.plan
        eager = by_name.get(
            (row.model, row.strategy.removesuffix(" + compile").removesuffix(" (compile-checked)"))
        )
        reference = by_name.get((row.model, "compile b=1"))
        if plan.estimated_peak is None or plan.budget is None or eager is None or not eager.peak:
            continue
        lines.append(
            f"| {row.model} | {row.strategy.removesuffix(' + compile')} | "
            f"{plan.budget / MiB:.1f} | "
            f"{plan.estimated_peak / MiB:.1f} | {eager.peak / MiB:.1f} | {row.peak / MiB:.1f} | "
            f"{row.peak / plan.estimated_peak:.2f} | {_error(row)} | {_error(reference)} |"
        )
    return "\n".join(lines)


def _error(row: Row | None) -> str:
    return "n/a" if row is None or row.grads_error is None else f"{row.grads_error:.1g}"


def write(rows: list[Row], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.md").write_text(
        f"# autoremat under torch.compile\n\n{header}\n\n{LEGEND}\n\n{to_markdown(rows)}\n\n"
        f"## Plans under compile: budget, predicted peak (eager cost model), measured peaks\n\n"
        f"{plan_vs_compiled(rows)}\n"
    )
    to_csv(rows, out / "compile.csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per strategy")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    # every strategy compiles another copy of the same model: the same code objects again, 9
    # times per model, past dynamo's default limit of 8 (it would then run them eagerly)
    torch._dynamo.config.recompile_limit = 64
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    out = Path(ns.out)
    start = time.perf_counter()
    progress = progress_printer(start)
    rows: list[Row] = []
    for name in ns.models.split(","):
        model, args, kwargs = ZOO[name]()
        rows += compare(
            model,
            args,
            kwargs,
            strategies(),
            repeats=ns.repeats,
            name=name,
            progress=progress,
            memory="allocator",
        )
        write(rows, out, machine_line(repeats=ns.repeats))
    header = machine_line(time.perf_counter() - start, ns.repeats)
    write(rows, out, header)
    progress(f"done; wrote {out}/compile.md, compile.csv")
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
