"""The budget strategy: the cheapest recompute whose predicted step peak fits a budget.

From a profile of one training step (:mod:`autoremat.costs`), the planning tree
(:mod:`autoremat.planning_tree`) and the solver (:mod:`autoremat.solver`): ``budget=`` bytes,
a fraction of the no-recompute peak, a percentage or a size string
(:func:`autoremat.sizes.parse_budget`); cost is the recompute's profiled time
(``objective="time"``) or its FLOPs (``"flops"``).
"""

from __future__ import annotations

import logging
from typing import Any

from autoremat.costs import Profile
from autoremat.planning_tree import planning_tree, recompute_seconds
from autoremat.plans import Choice
from autoremat.selective import WAYS
from autoremat.sizes import format_size, parse_budget
from autoremat.solver import Infeasible, Item, min_peak, predict_peak, solve
from autoremat.strategies import Options, Strategy

__all__ = ["HEADROOM", "NEAR_LOWEST", "OBJECTIVES", "STRATEGY", "BudgetTooLow", "lowest"]

logger = logging.getLogger("autoremat")

# Bytes a budget plan keeps free below the budget for what the cost model does not see: the
# recompute's copies of small buffers and statistics, measured at up to a few hundred bytes.
HEADROOM = 1024
# A budget this close (a fraction of it) above the lowest reachable peak gets a warning.
NEAR_LOWEST = 0.02
# What a budget plan minimises (plan's ``objective``).
OBJECTIVES = ("time", "flops")


class BudgetTooLow(ValueError):
    """The budget is below the lowest step peak any plan reaches. ``lowest`` is that peak in
    bytes (a budget that works), ``baseline`` the peak without recompute."""

    def __init__(self, message: str, lowest: int, baseline: int) -> None:
        super().__init__(message)
        self.lowest, self.baseline = lowest, baseline


def _check(options: Options) -> None:
    parse_budget(options.budget, 1)  # malformed budgets fail before the model runs
    if options.objective not in OBJECTIVES:
        raise ValueError(
            f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, "
            f"got {options.objective!r}"
        )


def lowest(prof: Profile, options: Options, root: Item | None = None) -> int:
    """The lowest budget, in bytes, that a plan for ``prof`` meets (headroom included)."""
    if root is None:
        root = planning_tree(prof, options.selective, None, options.objective)
    return min_peak(root, prof.backward_points, prof.forward_points) + HEADROOM


def _choose(prof: Profile, options: Options) -> dict[str, Any]:
    limit = parse_budget(options.budget, prof.peak)
    skipped: dict[str, str] = {}
    root = planning_tree(prof, options.selective, skipped, options.objective)
    _log_skipped(skipped, options.model_name)
    chosen = [] if limit >= prof.peak else _solve(prof, root, limit, options)
    seconds = {i.path: recompute_seconds(prof, i) for i in chosen}
    return {
        "modules": tuple(i.path for i in chosen),
        "budget": limit,
        "estimated_peak": predict_peak(prof.backward_points, chosen, prof.forward_points),
        "baseline_peak": prof.peak,
        "recompute_flops": sum(i.flops for i in chosen),
        "objective": options.objective,
        "recompute_seconds": sum(seconds.values()),
        "choices": tuple(Choice(i.path, i.freed, i.flops, i.way, seconds[i.path]) for i in chosen),
        "selective": {i.path: WAYS[i.way] for i in chosen if i.way in WAYS},
    }


def _solve(prof: Profile, root: Item, limit: int, options: Options) -> list[Item]:
    forward, after = prof.forward_points, prof.backward_points
    try:
        chosen = solve(root, after, limit - HEADROOM, forward)
    except Infeasible:
        least = lowest(prof, options, root)
        raise BudgetTooLow(
            f"budget {format_size(limit)} ({options.budget!r}) is below the lowest peak that "
            f"recomputing modules of {options.model_name} reaches, {format_size(least)} "
            f"({least / prof.peak:.0%} of the {format_size(prof.peak)} peak without "
            f"recompute; about {least} bytes). Try budget={least}, a smaller batch, or "
            f"mixed precision.",
            least,
            prof.peak,
        ) from None
    if chosen:
        try:
            solve(root, after, int(limit * (1 - NEAR_LOWEST)) - HEADROOM, forward)
        except Infeasible:
            logger.warning(
                "budget %s is within %.0f%% of the lowest peak recomputing modules of %s "
                "reaches: the plan recomputes about all it can (%d entries, %.3f GFLOP more); a "
                "slightly larger budget may cost much less",
                format_size(limit),
                NEAR_LOWEST * 100,
                options.model_name,
                len(chosen),
                sum(i.flops for i in chosen) / 1e9,
            )
    return chosen


def _log_skipped(skipped: dict[str, str], model_name: str) -> None:
    if not skipped:
        return
    logger.warning(
        "%d module(s) of %s cannot be recomputed on their own and were left out of the "
        "plan (their parents can still be chosen): %s",
        len(skipped),
        model_name,
        "; ".join(f"{p!r}: {why}" for p, why in list(skipped.items())[:5])
        + (" ..." if len(skipped) > 5 else ""),
    )


STRATEGY = Strategy(name="budget", keyword="budget", needs="profile", check=_check, choose=_choose)
