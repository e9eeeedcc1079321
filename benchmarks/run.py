"""Run the benchmark zoo against every recompute strategy, side by side.

    python benchmarks/run.py                      # everything (compile on gpt2 and mlp only)
    python benchmarks/run.py --models gpt2,mlp --repeats 3 --no-compile

Strategies: none; every block; sqrt(n) segments (chains only); autoremat levels at segments
1, 2, 4, 8, 16, 32 (identical plans kept once); torch.compile at activation_memory_budget 1.0,
0.5 and 0.0 (gpt2 and mlp by default, ``--compile-all`` for every model). Writes
``results.md``, ``results.csv`` and ``results.png`` to ``--out`` (after each model, so an
interrupted run keeps what it measured), progress to stderr and the table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autoremat.comparison import (
    Contender,
    Row,
    budget_plan,
    compare,
    compiled,
    every_block,
    levels_plan,
    no_recompute,
    sqrt_segments,
    to_markdown,
)
from report import plot, to_csv
from zoo import COMPILE_DEFAULT, ZOO

LEVELS = (1, 2, 4, 8, 16, 32)
BUDGETS = (1.0, 0.5, 0.0)

LEGEND = """\
Ratios are to the `none` row of the same model. `peak`: most tensor memory alive during the
step (activations, gradients, temporaries; parameters and inputs excluded), from
`autoremat.measure`. `saved`: memory created by the forward and still alive before backward.
`autograd-saved`: distinct storages packed by `saved_tensors_hooks`, plus the outputs kept in
selective checkpointing's cache, which those hooks do not see (parameters and inputs
excluded). For `compile` rows `peak` and `saved` come from the CPU allocator's own events (a
dispatch-mode tracker cannot see inside compiled code; on CPU the two agree within 1% on eager
steps). FLOPs count matmuls/convolutions/attention, forward,
backward and recompute (compiled rows: counted on the graphs inductor compiled). `ms/step`:
median of interleaved timed steps (one step of each strategy per round), ± half their range
relative to the median; the machine is shared and noisy, so read `time x` with that in mind.
`grads`: loss and every parameter gradient of one step from the same seed equal to `none`
within rtol 1e-5, atol 1e-6 (the note gives the worst relative error otherwise)."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def progress_printer(start: float) -> Callable[[str], None]:
    """``progress(line)``: the line on stderr, after the seconds since ``start``."""

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {line}", file=sys.stderr, flush=True)

    return progress


def machine_line(
    seconds: float | None = None, repeats: int | None = None, detail: str | None = None
) -> str:
    parts = [
        f"CPU: {cpu_model()}",
        f"{os.cpu_count()} cores",
        f"torch threads: {torch.get_num_threads()}",
        f"torch {torch.__version__}",
    ]
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        parts.append(f"transformers {transformers.__version__}")
    parts.append(f"date {datetime.datetime.now().isoformat(timespec='minutes')}")
    if detail is not None:
        parts.append(detail)
    elif repeats is not None:
        parts.append(f"{repeats} timed steps per strategy")
    if hasattr(os, "getloadavg"):
        parts.append(f"load average {os.getloadavg()[0]:.1f}")
    if seconds is not None:
        parts.append(f"run took {seconds / 60:.1f} min")
    return "Machine: " + ", ".join(parts)


def strategies_for(
    name: str, compile_models: set[str], budgets: tuple[float, ...]
) -> list[Contender]:
    chosen: list[Contender] = [no_recompute(), every_block(), sqrt_segments()]
    chosen += [levels_plan(k) for k in LEVELS]
    chosen += [budget_plan(f) for f in (0.75, 0.5, 0.25)] + [budget_plan("min")]
    if name in compile_models:
        chosen += [compiled(b) for b in budgets]
    return chosen


def write(rows: list[Row], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = to_markdown(rows)
    (out / "results.md").write_text(
        f"# autoremat benchmark: recompute strategies side by side\n\n{header}\n\n"
        f"{LEGEND}\n\n{table}\n"
    )
    to_csv(rows, out / "results.csv")
    plot(rows, out / "results.png", title=header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(ZOO)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--compile-all",
        action="store_true",
        help=f"torch.compile every model (default: {', '.join(COMPILE_DEFAULT)}); slow",
    )
    parser.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in BUDGETS),
        help="activation_memory_budget values for torch.compile",
    )
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine, OpenMP threads that lose "
        "their core stall every op; 0 leaves torch's default)",
    )
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)

    names = list(ZOO) if not ns.models else [n.strip() for n in ns.models.split(",") if n]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; choose from {', '.join(ZOO)}")
    budgets = tuple(float(b) for b in ns.budgets.split(",") if b.strip())
    if ns.no_compile:
        compile_models: set[str] = set()
    elif ns.compile_all:
        compile_models = set(names)
    else:
        compile_models = set(COMPILE_DEFAULT)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    out = Path(ns.out)

    start = time.perf_counter()
    progress = progress_printer(start)

    rows: list[Row] = []
    for name in names:
        model, args, kwargs = ZOO[name]()
        strategies = strategies_for(name, compile_models, budgets)
        rows += compare(
            model, args, kwargs, strategies, repeats=ns.repeats, name=name, progress=progress
        )
        write(rows, out, machine_line(repeats=ns.repeats))
        del model, args, kwargs
    header = machine_line(time.perf_counter() - start, ns.repeats)
    write(rows, out, header)
    progress(f"done; wrote {out}/results.md, results.csv, results.png")
    print(header)
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
