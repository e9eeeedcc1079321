"""The budget strategy: the cheapest recompute whose predicted step peak fits a budget.

From a profile of one training step (:mod:`autoremat.costs`), the planning tree
(:mod:`autoremat.planning_tree`) and the solver (:mod:`autoremat.solver`): ``budget=`` bytes,
a fraction of the no-recompute peak, a percentage or a size string
(:func:`autoremat.sizes.parse_budget`); cost is the recompute's profiled time
(``objective="time"``) or its FLOPs (``"flops"``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from autoremat.costs import Profile
from autoremat.entries import parse_call
from autoremat.planning_tree import planning_tree, recompute_seconds
from autoremat.plans import Choice
from autoremat.selective import WAYS
from autoremat.sizes import Budget, format_size
from autoremat.solver import Infeasible, Item, min_peak, predict_peak, solve
from autoremat.strategies import Request, Strategy, log_left_out

__all__ = [
    "HEADROOM",
    "NEAR_LOWEST",
    "OBJECTIVES",
    "STRATEGY",
    "BudgetTooLow",
    "entries",
    "lowest",
]

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


def _check(request: Request) -> Request:
    """The request with its budget parsed (malformed budgets fail before the model runs)."""
    budget = request.budget
    parsed = budget if isinstance(budget, Budget) else Budget.parse(budget)
    if request.objective not in OBJECTIVES:
        raise ValueError(
            f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, "
            f"got {request.objective!r}"
        )
    return dataclasses.replace(request, budget=parsed)


def lowest(prof: Profile, request: Request, root: Item | None = None) -> int:
    """The lowest budget, in bytes, that a plan for ``prof`` meets (headroom included)."""
    if root is None:
        root = planning_tree(prof, request.selective, None, request.objective)
    return min_peak(root, prof.backward_points, prof.forward_points) + HEADROOM


def _choose(prof: Profile, request: Request) -> dict[str, Any]:
    assert isinstance(request.budget, Budget), "checked first (Strategy.check)"
    limit = request.budget.resolve(prof.peak)
    skipped: dict[str, str] = {}
    root = planning_tree(prof, request.selective, skipped, request.objective)
    log_left_out(skipped, request.model_name)
    chosen = [] if limit >= prof.peak else _solve(prof, root, limit, request, skipped)
    choices = entries(prof, chosen)
    return {
        "modules": tuple(c.path for c in choices),
        "budget": limit,
        "estimated_peak": predict_peak(prof.backward_points, chosen, prof.forward_points),
        "baseline_peak": prof.peak,
        "recompute_flops": sum(i.flops for i in chosen),
        "objective": request.objective,
        "recompute_seconds": sum(c.seconds or 0.0 for c in choices),
        "choices": choices,
        "selective": {c.path: WAYS[c.way] for c in choices if c.way in WAYS},
        "left_out": skipped,
        "calls": {
            path: len(prof.calls_of(path))
            for c in choices
            if (call := parse_call(c.path)) is not None
            for path in [call[0]]
        },
    }


def entries(prof: Profile, chosen: list[Item]) -> tuple[Choice, ...]:
    """The plan's entries for the items the solver chose, as :class:`Choice` rows in the
    order of the step: a call ``path@k`` of a module that ran several times stays a call
    entry, unless every call of the module was chosen the same way: then one entry ``path``
    (every call recomputed, however many a later step makes) sums them."""
    found = [Choice(i.path, i.freed, i.flops, i.way, recompute_seconds(prof, i)) for i in chosen]
    by_module: dict[str, list[Choice]] = {}
    for c in found:
        call = parse_call(c.path)
        if call is not None:
            by_module.setdefault(call[0], []).append(c)
    whole = {
        path: calls
        for path, calls in by_module.items()
        if len(calls) == len(prof.calls_of(path)) and len({c.way for c in calls}) == 1
    }
    merged: list[Choice] = []
    for c in found:
        call = parse_call(c.path)
        if call is None or call[0] not in whole:
            merged.append(c)
        elif c is whole[call[0]][-1]:  # the module's entry sits where its last call ended
            calls = whole[call[0]]
            freed, flops = sum(x.freed for x in calls), sum(x.flops for x in calls)
            seconds = sum(x.seconds or 0.0 for x in calls)
            merged.append(Choice(call[0], freed, flops, c.way, seconds))
    return tuple(merged)


def _solve(
    prof: Profile, root: Item, limit: int, request: Request, skipped: dict[str, str]
) -> list[Item]:
    forward, after = prof.forward_points, prof.backward_points
    try:
        chosen = solve(root, after, limit - HEADROOM, forward)
    except Infeasible:
        least = lowest(prof, request, root)
        given = request.budget.given if isinstance(request.budget, Budget) else request.budget
        raise BudgetTooLow(
            f"budget {format_size(limit)} ({given!r}) is below the lowest peak that "
            f"recomputing modules of {request.model_name} reaches, {format_size(least)} "
            f"({least / prof.peak:.0%} of the {format_size(prof.peak)} peak without "
            f"recompute; about {least} bytes). Try budget={least}, a smaller batch"
            f"{'' if request.autocast else ', or mixed precision'}.{_left_out_hint(skipped)}",
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
                request.model_name,
                len(chosen),
                sum(i.flops for i in chosen) / 1e9,
            )
    return chosen


def _left_out_hint(skipped: dict[str, str]) -> str:
    """What the BudgetTooLow message adds when modules that would have freed memory were left
    out of the plan: they may be why the budget cannot be met."""
    if not skipped:
        return ""
    names = ", ".join(repr(p or "(root)") for p in list(skipped)[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return (
        f" {len(skipped)} module(s) that would have freed memory cannot be recomputed and were "
        f"left out ({names}{more}; the reasons are logged on the 'autoremat' logger)."
    )


STRATEGY = Strategy(name="budget", keyword="budget", needs="profile", check=_check, choose=_choose)
