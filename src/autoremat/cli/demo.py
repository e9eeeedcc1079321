"""``autoremat demo``: both strategies planned, applied and compared on one model.

The comparison is :func:`autoremat.comparison.compare`'s: each plan applied to a fresh copy,
one measured step each, interleaved timed rounds, and one step from the same seed compared
with the unwrapped model's bit for bit."""

from __future__ import annotations

from typing import Any

from torch import nn

from autoremat.cli.arguments import (
    below_lowest,
    check_segments,
    loss_from_output,
    parse_budget_arg,
)
from autoremat.cli.targets import CliError, load_target
from autoremat.comparison.contenders import applied_plan, no_recompute
from autoremat.comparison.harness import compare
from autoremat.comparison.row import Row
from autoremat.core.sizes import format_size
from autoremat.costs.profile import profile
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.step import LossFn
from autoremat.training.plan import plan

__all__ = ["DEFAULT_ROUNDS", "demo"]

# Timed rounds of the demo (one training step of each model per round) unless --rounds is given.
DEFAULT_ROUNDS = 7


def _budget_plan(
    model: nn.Module, args: Any, kwargs: Any, text: str, loss_fn: LossFn | None
) -> tuple[Plan, str]:
    """The demo's budget plan and its label. A budget below the lowest reachable peak is
    replaced by that peak, with one line that says so (both planned from one profile)."""
    value = parse_budget_arg(text)
    prof = profile(model, args, kwargs, loss_fn=loss_fn)
    try:
        return plan_from_profile(model, prof, value), f"budget {text}"
    except BudgetTooLow as exc:
        start = below_lowest(exc, text, value, type(model).__name__)
        print(f"{start}; using {format_size(exc.lowest)} instead")
        return plan_from_profile(model, prof, exc.lowest), f"budget {format_size(exc.lowest)}"


def _print_table(rows: list[Row], rounds: int) -> None:
    """The demo's table (time only when ``rounds`` were timed), then each plan against the
    unwrapped model."""
    timed = rounds > 0
    head = f"{'':18}{'peak':>12}{'predicted':>12}{'held':>12}{'GFLOP':>8}"
    print(head + (f"{'ms/step':>9}{'spread':>8}" if timed else ""))
    for row in rows:
        predicted = row.plan.estimated_peak if row.plan else None
        label = "no recompute" if row.plan is None else row.strategy
        line = (
            f"{label:18}{format_size(row.peak or 0):>12}"
            f"{format_size(predicted) if predicted else '-':>12}"
            f"{format_size(row.saved or 0):>12}{(row.flops or 0) / 1e9:>8.2f}"
        )
        if timed and row.seconds is not None:
            line += f"{row.seconds * 1e3:>9.2f}{row.time_spread or 0:>8.0%}"
        print(line)
    for row in rows[1:]:
        line = f"{row.strategy}: peak x{row.peak_ratio:.2f}, FLOPs x{row.flops_ratio:.2f}"
        print(line + (f", time x{row.time_ratio:.2f}" if timed else ""))
    print("held: bytes the forward leaves alive for backward (activations, outputs, the loss)")
    if timed:
        print(
            f"time: the median of {rounds} rounds, each one step of every model in turn (the "
            "order reversed\nevery other round); time x is the ratio of the ms/step column; "
            "spread = (max - min) / median.\nCPU step times are noisy (other processes, clock "
            "changes): a ratio within the spreads of 1\nis no measured difference. Peaks and "
            "FLOPs are exact."
        )
    else:
        print("time: not measured (--rounds 0)")


def demo(
    target: str,
    segments: int,
    budget: str,
    rounds: int = DEFAULT_ROUNDS,
    loss: str | None = None,
) -> int:
    """Plan and apply on an example with both strategies; show the tree, the choices, what
    each saved (measured), step times with their spread, and that one training step is
    identical to the unwrapped model's. Returns 0, or 1 when a step differs or fails."""
    check_segments(segments)
    if rounds < 0:
        raise CliError(f"--rounds must be 0 or more, got {rounds}; try --rounds {DEFAULT_ROUNDS}")
    model, args, kwargs = load_target(target)
    loss_fn = loss_from_output(loss)
    levels = plan(model, args, kwargs, segments=segments, loss_fn=loss_fn)
    print(levels)
    print()
    budgeted, budget_label = _budget_plan(model, args, kwargs, budget, loss_fn)
    print(budgeted.summary())
    print()
    contenders = [no_recompute(), applied_plan(f"levels, {segments}", levels)]
    contenders.append(applied_plan(budget_label, budgeted))
    rows = compare(model, args, kwargs, contenders, loss_fn=loss_fn, repeats=rounds, name=target)
    failed = [r for r in rows if r.peak is None]
    for row in failed:
        print(f"{row.strategy}: {row.note}")
    if failed:
        return 1
    _print_table(rows, rounds)
    print()
    identical = all(r.identical for r in rows[1:])
    print(
        "one training step of each wrapped model vs the unwrapped one (same seed, dropout on): "
        f"loss, gradients and buffers {'identical' if identical else 'DIFFERENT'}"
    )
    return 0 if identical else 1
