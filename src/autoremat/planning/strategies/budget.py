"""The budget strategy: the cheapest recompute whose predicted step peak fits a budget.

From a profile of one training step (:mod:`autoremat.costs`), the planning tree
(:mod:`autoremat.planning.planning_tree`) and the solver (:mod:`autoremat.planning.solver`):
``budget=`` bytes, a fraction of the no-recompute peak, a percentage or a size string
(:func:`autoremat.core.sizes.parse_budget`); cost is the recompute's profiled time
(``objective="time"``) or its FLOPs (``"flops"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autoremat.core.entries import parse_call
from autoremat.core.selective import WAYS
from autoremat.core.sizes import Budget, format_size, percent_hint
from autoremat.costs.profile import Profile
from autoremat.planning.choice import OBJECTIVES, Choice
from autoremat.planning.planning_tree import planning_tree, recompute_seconds
from autoremat.planning.prediction import predict_peak
from autoremat.planning.solver import Infeasible, Item, min_peak, solve
from autoremat.planning.strategy import Request, Strategy, left_out_warning

__all__ = [
    "HEADROOM",
    "NEAR_LOWEST",
    "STRATEGY",
    "BudgetTooLow",
    "choices_for",
    "lowest",
]

# Bytes a budget plan keeps free below the budget for what the cost model does not see: the
# recompute's copies of small buffers and statistics, measured at up to a few hundred bytes.
HEADROOM = 1024
# A budget this close (a fraction of it) above the lowest reachable peak gets a warning.
NEAR_LOWEST = 0.02


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
    """The lowest budget, in bytes, that a plan for ``prof`` meets (headroom included; never
    above the peak without recompute, which the empty plan meets)."""
    if root is None:
        root = planning_tree(prof, request.selective, None, request.objective)
    return min(min_peak(root, prof.backward_points, prof.forward_points) + HEADROOM, prof.peak)


def _choose(prof: Profile, request: Request) -> dict[str, Any]:
    assert isinstance(request.budget, Budget), "checked first (Strategy.check)"
    limit = request.budget.resolve(prof.peak)
    skipped: dict[str, str] = {}
    root = planning_tree(prof, request.selective, skipped, request.objective)
    warnings = {"left_out": left_out_warning(skipped, request.model_name)}
    chosen: list[Item] = []
    if limit < prof.peak:
        chosen, warnings["near_lowest"] = _solve(prof, root, limit, request, skipped)
    choices = choices_for(prof, chosen)
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
        "warnings": {kind: text for kind, text in warnings.items() if text},
        "device": prof.device,
        "calls": {
            path: len(prof.calls_of(path))
            for c in choices
            if (call := parse_call(c.path)) is not None
            for path in [call[0]]
        },
    }


def choices_for(prof: Profile, chosen: list[Item]) -> tuple[Choice, ...]:
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
) -> tuple[list[Item], str | None]:
    """The items chosen for ``limit`` bytes, and the warning when the budget is near the
    lowest peak any plan reaches (``None`` otherwise)."""
    forward, after = prof.forward_points, prof.backward_points
    try:
        chosen = solve(root, after, limit - HEADROOM, forward)
    except Infeasible:
        least = lowest(prof, request, root)
        given = request.budget.given if isinstance(request.budget, Budget) else request.budget
        hint = percent_hint(given)
        raise BudgetTooLow(
            f"budget {format_size(limit)} ({given!r}) is below the lowest peak that "
            f"recomputing modules of {request.model_name} reaches, {format_size(least)} "
            f"({least / prof.peak:.0%} of the {format_size(prof.peak)} peak without "
            f"recompute; about {least} bytes). Try budget={least}, a smaller batch"
            f"{'' if request.autocast else ', or mixed precision'}.{_left_out_hint(skipped)}"
            f"{f' ({hint}.)' if hint else ''}",
            least,
            prof.peak,
        ) from None
    if chosen:
        try:
            solve(root, after, int(limit * (1 - NEAR_LOWEST)) - HEADROOM, forward)
        except Infeasible:
            return chosen, (
                f"budget {format_size(limit)} is within {NEAR_LOWEST:.0%} of the lowest peak "
                f"recomputing modules of {request.model_name} reaches: the plan recomputes "
                f"about all it can ({len(chosen)} entries, "
                f"{sum(i.flops for i in chosen) / 1e9:.3f} GFLOP more); a slightly larger "
                f"budget may cost much less"
            )
    return chosen, None


def _left_out_hint(skipped: dict[str, str]) -> str:
    """What the BudgetTooLow message adds when modules that would have freed memory were left
    out of the plan: they may be why the budget cannot be met."""
    if not skipped:
        return ""
    names = ", ".join(repr(p or "(root)") for p in list(skipped)[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return (
        f" {len(skipped)} module(s) that would have freed memory cannot be recomputed and were "
        f"left out ({names}{more}; their reasons are in the plan's left_out and logged)."
    )


STRATEGY = Strategy(name="budget", keyword="budget", needs="profile", check=_check, choose=_choose)

