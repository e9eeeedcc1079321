"""The autoremat command: look at a model's module tree, plan which modules to recompute,
and try a plan out on an example.

Subcommands: tree, plan, demo, bench, fit and examples; "autoremat --help" describes them (its
text is DESCRIPTION and EPILOG below). Every error is one line, "autoremat: error: ...",
with exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoremat.batch_inputs import batch_size_of, scale_batch
from autoremat.device_fit import OBJECTIVES as FIT_OBJECTIVES
from autoremat.device_fit import fit
from autoremat.examples import EXAMPLES
from autoremat.measurement import Measurement, measure
from autoremat.optimizer_memory import OPTIMIZERS
from autoremat.planner import plan
from autoremat.plans import Plan
from autoremat.sizes import format_size, parse_budget
from autoremat.step import train_step
from autoremat.strategies.budget import BudgetTooLow
from autoremat.strategies.levels import DEFAULT_SEGMENTS
from autoremat.targets import CliError, TargetError, load_target
from autoremat.tree import build_tree

__all__ = [
    "BUDGET_FORMS",
    "CliError",
    "TargetError",
    "demo",
    "load_target",
    "main",
    "parse_budget_arg",
]

# How a --budget may be written, in the command line's words.
BUDGET_FORMS = (
    "a fraction of the peak without recompute (0.5), a percentage (50%), a size "
    "(800MB, 2GiB; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or whole bytes (25000000)"
)
# Timed rounds of the demo (one training step of each model per round) unless --rounds is given.
DEFAULT_ROUNDS = 7

DESCRIPTION = """\
Choose which submodules of a PyTorch model to recompute in the backward pass (activation
checkpointing), to lower the peak memory of a training step."""

EPILOG = f"""\
subcommands:
  tree TARGET       print the modules that ran, with their paths and input/output shapes
  plan TARGET       print the modules chosen for recompute: --segments K (the levels
                    strategy, default K={DEFAULT_SEGMENTS}) or --budget B (the cheapest recompute
                    whose predicted peak fits B); --measure applies the plan to a copy
                    and measures its peak
  demo [TARGET]     plan with both strategies, apply them, measure peak, FLOPs and step
                    time, and check that a training step is unchanged (TARGET: gpt2)
  bench TARGET      compare recompute strategies side by side (a markdown table)
  fit TARGET        the largest batch whose training step (parameters, gradients,
                    optimizer state, activations) fits --device-memory M (24GiB, 90%),
                    and the cheapest plan for it, checked once on the device
  examples          list the built-in example models

TARGET is one of:
  NAME              a built-in example ({", ".join(EXAMPLES)};
                    "autoremat examples" describes them)
  FILE.py:FACTORY   a Python file and a function in it that takes no arguments and returns
                    (model, args, kwargs): an nn.Module, a tuple of positional inputs and a
                    dict of keyword inputs for one forward pass

A TARGET file is executed: it is imported as Python code, with your permissions. Only run
files you trust.

B, a budget for the peak memory of a training step, is a fraction of the peak without
recompute (0.5), a percentage (50%), a size (800MB, 2GiB; units B, KB, MB, GB, TB, KiB,
MiB, GiB, TiB) or whole bytes (25000000).

Errors print one line, "autoremat: error: ...", and exit with status 2."""

TARGET_HELP = "a built-in example name, or FILE.py:FACTORY (the file is executed)"


def parse_budget_arg(text: str) -> int | float | str:
    """What ``--budget TEXT`` asks for, as :func:`autoremat.plan` takes it: a bare number in
    (0, 1] is a fraction (float), a bare whole number above 1 is bytes (int), anything else
    (``"50%"``, ``"2GiB"``, ``"800MB"``) stays a string once its form is checked.

    Raises:
        CliError: none of the forms in :data:`BUDGET_FORMS`.
    """
    stripped = text.strip()
    try:
        number: float | None = float(stripped)
    except ValueError:
        number = None
    if number is not None:
        if 0.0 < number <= 1.0:
            return number
        if 1.0 < number < math.inf and number.is_integer():
            return int(number)
        raise CliError(
            f"budget {text}: a bare number is a fraction in (0, 1] or whole bytes; "
            f"use {BUDGET_FORMS}"
        )
    try:
        parse_budget(stripped, 2**40)
    except ValueError:
        why = "; a percentage is above 0% and at most 100%" if stripped.endswith("%") else ""
        raise CliError(f"budget {text} is not understood{why}; use {BUDGET_FORMS}") from None
    return stripped


def _at_least(size: int) -> str:
    """A --budget value of at least ``size`` bytes, in the unit :func:`format_size` picks,
    rounded up: ``"23.14MiB"``."""
    unit = format_size(size).split()[1]
    if unit == "B":
        return str(size)
    scale = 2 ** (10 * (1 + ("KiB", "MiB", "GiB", "TiB").index(unit)))
    return f"{math.ceil(size * 100 / scale) / 100:.2f}{unit}"


def _below_lowest(exc: BudgetTooLow, text: str, value: int | float | str, model: str) -> str:
    """The start of a message for a budget below the lowest peak any plan reaches."""
    asked = text
    if isinstance(value, float) or str(value).endswith("%"):
        asked += f" ({format_size(parse_budget(value, exc.baseline))})"
    return (
        f"budget {asked} is below the lowest peak {model} reaches, {format_size(exc.lowest)} "
        f"({exc.lowest / exc.baseline:.0%} of {format_size(exc.baseline)} without recompute)"
    )


def _check_segments(segments: int | None) -> None:
    if segments is not None and segments < 0:
        raise CliError(
            f"--segments must be 0 or more, got {segments}; try --segments {DEFAULT_SEGMENTS}"
        )


def _budget_plan(model: nn.Module, args: Any, kwargs: Any, text: str, objective: str) -> Plan:
    """``plan(budget=...)`` for ``--budget text``; a budget below the lowest reachable peak is
    an error that suggests one that works."""
    value = parse_budget_arg(text)
    try:
        return plan(model, args, kwargs, budget=value, objective=objective)
    except BudgetTooLow as exc:
        start = _below_lowest(exc, text, value, type(model).__name__)
        raise CliError(f"{start}; try --budget {_at_least(exc.lowest)}") from None


def _measured(chosen: Plan, model: nn.Module, args: Any, kwargs: Any) -> str:
    """The measured step peak of ``chosen`` applied to a copy of ``model``, against its
    prediction."""
    wrapped = chosen.apply(copy.deepcopy(model))
    peak = measure(wrapped, args, kwargs).peak
    line = f"measured peak {format_size(peak)}"
    if chosen.estimated_peak is not None:
        error = (chosen.estimated_peak - peak) / peak
        line += f" (predicted {format_size(chosen.estimated_peak)}, error {error:+.1%})"
    if chosen.budget is not None:
        line += f"; {'within' if peak <= chosen.budget else 'OVER'} the budget"
    return line


def _plan_command(ns: argparse.Namespace) -> int:
    """``autoremat plan``: print the plan (and, with --measure, its measured peak)."""
    _check_segments(ns.segments)
    if ns.budget is None and ns.objective != "time":
        raise CliError("--objective applies to budget plans: add --budget")
    model, args, kwargs = load_target(ns.target)
    if ns.budget is None:
        chosen = plan(model, args, kwargs, segments=ns.segments)
        print(chosen)
    else:
        chosen = _budget_plan(model, args, kwargs, ns.budget, ns.objective)
        print(chosen.summary())
    if ns.measure:
        print(_measured(chosen, model, args, kwargs))
    return 0


# The demo ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    """One model of the demo: its label, plan (None for the unwrapped model) and what one
    training step of it cost."""

    label: str
    plan: Plan | None
    model: nn.Module
    measured: Measurement


def _demo_budget(model: nn.Module, args: Any, kwargs: Any, text: str) -> tuple[Plan, str]:
    """The demo's budget plan and its label. A budget below the lowest reachable peak is
    replaced by that peak, with one line that says so."""
    value = parse_budget_arg(text)
    try:
        return plan(model, args, kwargs, budget=value), f"budget {text}"
    except BudgetTooLow as exc:
        start = _below_lowest(exc, text, value, type(model).__name__)
        print(f"{start}; using {format_size(exc.lowest)} instead")
        # The planner's warning that this budget is near the lowest peak says it again.
        planner_log = logging.getLogger("autoremat")
        level = planner_log.level
        planner_log.setLevel(logging.ERROR)
        try:
            lowest = plan(model, args, kwargs, budget=exc.lowest)
        finally:
            planner_log.setLevel(level)
        return lowest, f"budget {format_size(exc.lowest)}"


def _one_step(model: nn.Module, args: Any, kwargs: Any) -> torch.Tensor:
    """The loss of one training step from a fixed seed (the global RNG is left as found)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return train_step(model, args, kwargs)


def _same_step(model: nn.Module, chosen: Plan, args: Any, kwargs: Any) -> bool:
    """Whether one training step of ``chosen`` applied to a copy of ``model`` gives exactly
    the loss, gradients and buffers of one step of an unwrapped copy."""
    reference, wrapped = copy.deepcopy(model), chosen.apply(copy.deepcopy(model))
    if not torch.equal(_one_step(reference, args, kwargs), _one_step(wrapped, args, kwargs)):
        return False
    pairs = zip(reference.named_parameters(), wrapped.named_parameters(), strict=True)
    for (_, p), (_, q) in pairs:
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and q.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    buffers = zip(reference.buffers(), wrapped.buffers(), strict=True)
    return all(torch.equal(x, y) for x, y in buffers)


def _time_interleaved(
    models: list[nn.Module], args: Any, kwargs: Any, rounds: int
) -> list[list[float]]:
    """Seconds of one training step of each model (copies of them) in each of ``rounds``
    rounds, after one warm-up round. Each round steps every model once, starting from a
    different one each round, so that a machine that slows down or speeds up affects them
    alike."""
    copies = [copy.deepcopy(m) for m in models]
    times: list[list[float]] = [[] for _ in copies]
    with torch.random.fork_rng(devices=[]):
        for r in range(rounds + 1):
            for k in range(len(copies)):
                i = (r + k) % len(copies)
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                start = time.perf_counter()
                train_step(copies[i], args, kwargs)
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                if r:
                    times[i].append(time.perf_counter() - start)
    return times


def _spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def _print_table(rows: list[_Row], times: list[list[float]] | None) -> None:
    """The demo's table (a size column per figure, time only when timed), then each plan
    against the unwrapped model."""
    head = f"{'':18}{'peak':>12}{'predicted':>12}{'saved':>12}{'GFLOP':>8}"
    print(head + (f"{'ms/step':>9}{'spread':>8}" if times else ""))
    for i, row in enumerate(rows):
        m, predicted = row.measured, row.plan.estimated_peak if row.plan else None
        line = (
            f"{row.label:18}{format_size(m.peak):>12}"
            f"{format_size(predicted) if predicted else '-':>12}"
            f"{format_size(m.saved):>12}{m.flops / 1e9:>8.2f}"
        )
        if times:
            line += f"{statistics.median(times[i]) * 1e3:>9.1f}{_spread(times[i]):>8.0%}"
        print(line)
    base = rows[0].measured
    for i, row in enumerate(rows[1:], start=1):
        line = (
            f"{row.label}: peak x{row.measured.peak / base.peak:.2f}, "
            f"FLOPs x{row.measured.flops / base.flops:.2f}"
        )
        if times:
            ratios = [t / b for t, b in zip(times[i], times[0], strict=True)]
            half_range = (max(ratios) - min(ratios)) / 2
            line += f", time x{statistics.median(ratios):.2f} ±{half_range:.2f}"
        print(line)
    if times:
        print(
            f"time: median of {len(times[0])} rounds, each one step of every model in turn; "
            "spread = (max - min) / median;\n± = half the range of the per-round ratios. "
            "CPU step times are noisy (other processes, clock\nchanges): a ratio within its "
            "± of 1 is no measured difference. Peaks and FLOPs are exact."
        )
    else:
        print("time: not measured (--rounds 0)")


def demo(target: str, segments: int, budget: str, rounds: int = DEFAULT_ROUNDS) -> int:
    """Plan and apply on an example with both strategies; show the tree, the choices, what
    each saved (measured), step times with their spread, and that one training step is
    identical to the unwrapped model's. Returns 0, or 1 when a step differs."""
    _check_segments(segments)
    if rounds < 0:
        raise CliError(f"--rounds must be 0 or more, got {rounds}; try --rounds {DEFAULT_ROUNDS}")
    model, args, kwargs = load_target(target)
    levels = plan(model, args, kwargs, segments=segments)
    print(levels)
    print()
    budgeted, budget_label = _demo_budget(model, args, kwargs, budget)
    print(budgeted.summary())
    print()
    rows = [_Row("no recompute", None, model, measure(model, args, kwargs))]
    for label, chosen in [(f"levels, {segments}", levels), (budget_label, budgeted)]:
        wrapped = chosen.apply(copy.deepcopy(model))
        rows.append(_Row(label, chosen, wrapped, measure(wrapped, args, kwargs)))
    identical = all(_same_step(model, chosen, args, kwargs) for chosen in (levels, budgeted))
    times = _time_interleaved([r.model for r in rows], args, kwargs, rounds) if rounds else None
    _print_table(rows, times)
    print()
    print(
        "one training step of each wrapped model vs the unwrapped one (same seed, dropout on): "
        f"loss, gradients and buffers {'identical' if identical else 'DIFFERENT'}"
    )
    return 0 if identical else 1


# The parser and main ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoremat",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_tree = sub.add_parser("tree", help="print the module tree with paths and I/O shapes")
    p_tree.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    _add_plan(sub.add_parser("plan", help="print the modules chosen for recompute"))
    _add_demo(
        sub.add_parser(
            "demo", help="plan, apply, check gradients and show the savings and step times"
        )
    )
    p_bench = sub.add_parser("bench", help="compare recompute strategies side by side")
    p_bench.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p_bench.add_argument("--repeats", type=int, default=3, help="timed steps per strategy")
    p_bench.add_argument(
        "--compile", action="store_true", help="also torch.compile at memory budgets (slow)"
    )
    _add_fit(sub.add_parser("fit", help="the largest batch that fits a device, and its plan"))
    sub.add_parser("examples", help="list the built-in example models")
    return parser


def _add_fit(p_fit: argparse.ArgumentParser) -> None:
    p_fit.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p_fit.add_argument(
        "--device-memory",
        metavar="M",
        default="100%",
        help="memory the whole training step may use: a size (24GiB), whole bytes, or a "
        "percentage of the device's memory (default 100%%)",
    )
    p_fit.add_argument(
        "--device", default=None, help="move the model there first (e.g. cuda; default: as built)"
    )
    p_fit.add_argument("--optimizer", choices=(*OPTIMIZERS, "none"), default="adamw")
    p_fit.add_argument(
        "--objective",
        choices=FIT_OBJECTIVES,
        default="batch",
        help="the largest batch (default), or the most predicted samples per second",
    )
    p_fit.add_argument("--max-batch", type=int, default=2**16, metavar="N")
    p_fit.add_argument(
        "--autocast",
        choices=("bf16", "fp16"),
        default=None,
        help="train under torch.autocast with this dtype (sized on meta with its casts)",
    )
    p_fit.add_argument(
        "--batch-dim",
        type=int,
        default=0,
        metavar="D",
        help="the inputs' batch dimension (default 0; 1 for sequence-first inputs)",
    )
    p_fit.add_argument(
        "--no-verify", action="store_true", help="do not run the batch found on the device"
    )


def _fit_command(ns: argparse.Namespace) -> int:
    """``autoremat fit``: the batch of TARGET's inputs scaled along their first dimension."""
    try:
        device_memory = parse_budget_arg(ns.device_memory)
    except CliError:
        raise CliError(
            f"--device-memory {ns.device_memory} is not understood: give a size (24GiB, 800MB), "
            f"whole bytes, or a percentage of the device's memory (90%)"
        ) from None
    model, args, kwargs = load_target(ns.target)
    if ns.device is not None:
        model.to(ns.device)
    found = fit(
        model,
        lambda b: scale_batch(args, kwargs, b, ns.batch_dim),
        device_memory=device_memory,
        optimizer=None if ns.optimizer == "none" else ns.optimizer,
        objective=ns.objective,
        max_batch=ns.max_batch,
        verify=not ns.no_verify,
        autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(ns.autocast or ""),
    )
    example = batch_size_of(args, kwargs, ns.batch_dim)
    print(f"{ns.target} (example batch {example} along dimension {ns.batch_dim}, ", end="")
    print(f"optimizer {ns.optimizer})")
    print(found)
    print(found.plan.summary())
    return 1 if found.fits is False else 0


def _add_plan(p_plan: argparse.ArgumentParser) -> None:
    p_plan.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    how = p_plan.add_mutually_exclusive_group()
    how.add_argument(
        "--segments", type=int, metavar="K", help="levels strategy with K split points (default 3)"
    )
    how.add_argument(
        "--budget",
        metavar="B",
        help=f"budget strategy: the step's peak memory within B, {BUDGET_FORMS}".replace("%", "%%"),
    )
    p_plan.add_argument(
        "--objective",
        choices=("time", "flops"),
        default="time",
        help="what a budget plan minimises: the recompute's profiled time (default) or its FLOPs",
    )
    p_plan.add_argument(
        "--measure", action="store_true", help="apply the plan to a copy and measure its peak"
    )


def _add_demo(p_demo: argparse.ArgumentParser) -> None:
    p_demo.add_argument(
        "target",
        metavar="TARGET",
        nargs="?",
        default="gpt2",
        help="a built-in example name (default gpt2), or FILE.py:FACTORY (the file is executed)",
    )
    p_demo.add_argument(
        "--segments",
        type=int,
        default=DEFAULT_SEGMENTS,
        metavar="K",
        help="split points of the levels plan (default 3)",
    )
    p_demo.add_argument(
        "--budget",
        default="50%",
        metavar="B",
        help="budget of the budget plan (default 50%%); below the lowest reachable peak, "
        "that peak is used instead",
    )
    p_demo.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="N",
        help=f"timed rounds, one step of each model per round (default {DEFAULT_ROUNDS}; "
        "0: no timing)",
    )


def _run(ns: argparse.Namespace) -> int:
    if ns.command == "examples":
        for name, factory in EXAMPLES.items():
            print(f"{name:10} {' '.join((factory.__doc__ or '').split())}")
        return 0
    if ns.command == "demo":
        return demo(ns.target, ns.segments, ns.budget, ns.rounds)
    if ns.command == "plan":
        return _plan_command(ns)
    if ns.command == "fit":
        return _fit_command(ns)
    model, args, kwargs = load_target(ns.target)
    if ns.command == "tree":
        print(build_tree(model, args, kwargs))
        return 0
    from autoremat.comparison import bench_target, to_markdown

    rows = bench_target(model, args, kwargs, compile=ns.compile, repeats=ns.repeats, name=ns.target)
    print(to_markdown(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autoremat`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit
    status: 0, 2 after an error (printed as one line), 1 when the demo finds a step that
    differs."""
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return _run(ns)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"autoremat: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
