"""The budget strategy: the cheapest recompute whose step peak, run, fits a budget.

From a profile of one training step (:mod:`autoremat.costs`), the planning tree
(:mod:`autoremat.planning.planning_tree`), the solver's walk (:mod:`autoremat.planning.solver`)
and the search that runs the walk's plans (:mod:`autoremat.planning.search`,
:mod:`autoremat.planning.rehearsal`). Budgets (:func:`autoremat.core.sizes.parse_budget`),
objectives and ``estimated_peak``: docs/guide.md, "Budgets and objectives".
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from autoremat.core.entries import parse_call
from autoremat.core.selective import WAYS
from autoremat.core.sizes import Budget, format_size, percent_hint
from autoremat.core.words import first_few
from autoremat.costs.profile import Profile
from autoremat.planning.choice import OBJECTIVES, Choice
from autoremat.planning.planning_tree import planning_tree, recompute_seconds
from autoremat.planning.rehearsal import CannotRun, PlanFields, Rehearsal, rehearsal_for
from autoremat.planning.search import SLACK, Chosen, Judge, Walk, cheapest, hand_plans, lowest
from autoremat.planning.solver import Item
from autoremat.planning.strategy import Request, Strategy, left_out_warning
from autoremat.record.tree import find_blocks

__all__ = ["STRATEGY", "BudgetTooLow", "Planner", "choices_for", "fields_for"]

# A budget this close (a fraction of it) above the lowest reachable peak gets a warning.
NEAR_LOWEST = 0.02

# a rehearsal -> the lowest plans found with its runs, by (profile, selective, hand plans
# tried): planners of one profile (a budget, its lowest, fit's candidates) search it once
_lowest_found: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[Any, ...]]]
_lowest_found = weakref.WeakKeyDictionary()


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


class Planner:
    """The budget strategy's search over one profile: the walk over its planning tree, and
    the plans it proposes run by ``rehearsal`` (by default the profile's own step,
    :func:`~autoremat.planning.rehearsal.rehearsal_for`)."""

    def __init__(self, prof: Profile, request: Request, rehearsal: Rehearsal | None = None):
        self.prof, self.request = prof, request
        self.skipped: dict[str, str] = {}
        self.rehearsal = rehearsal or rehearsal_for(prof)
        self.priced = ""  # why a plan was priced by the walk, once one was
        # which hand plans (:func:`hand_plans`, by index) the lowest runs (None: all), and
        # which was the lowest plan (None: the walk's own, or none)
        self.hands: set[int] | None = None
        self.won: int | None = None
        self.root = self.tree(request.objective, self.skipped)
        self.walk = Walk(self.root, prof.backward_points, prof.forward_points)

    def tree(self, objective: str, skipped: dict[str, str] | None = None) -> Item:
        """The planning tree priced by ``objective``, RNG states counted as the step is."""
        rng = self.rehearsal.rng_state
        return planning_tree(self.prof, self.request.selective, skipped, objective, rng)

    def peak(self, chosen: Chosen) -> int:
        """The step's peak with ``chosen`` recomputed, run (the profile's own without, when
        the rehearsal runs the step the profile ran: eagerly)."""
        if not chosen and self.rehearsal.eager:
            return self.prof.peak
        try:
            return self.rehearsal.peak(fields_for(self.prof, list(chosen)))
        except CannotRun as exc:  # (priced by the walk, its guess, and said so)
            self.priced = f"the walk's price ({self.rehearsal.how}: {exc})"
            return self.walk.price(chosen)

    def cheapest(self, limit: int, judge: Judge | None = None) -> tuple[Chosen, int] | None:
        """The cheapest plan found whose step peaks at most ``limit`` (or, with ``judge``, that
        it says fits: a whole step's memory on a device, a rank's), the walk searched from
        ``limit``; else the lowest plan if it fits; and its peak. ``None``: none fits."""
        known = self._known_lowest() if judge is None else None
        judge = judge or (lambda c: self.peak(c) - limit)
        if limit >= self.prof.peak and judge(()) <= 0:
            return (), self.peak(())
        if known is not None and limit < known[1] + max(4096, int(limit * SLACK)):
            # (a lowest already found: below it nothing fits, just above it that plan does)
            return known if known[1] <= limit else None
        found = cheapest(self.walk, limit, judge)
        if found is None:
            found = self.lowest()[0]
            if judge(found) > 0:
                return None
        return found, self.peak(found)

    def lowest(self) -> tuple[Chosen, int]:
        """The plan with the lowest run peak the planner can make, and that peak
        (:func:`autoremat.planning.search.lowest`: the walk's lowest plan and hand plans).
        Priced by FLOPs whatever the objective: the lowest plan does not depend on timing."""
        known = _lowest_found.setdefault(self.rehearsal, {})
        key = self._lowest_key()
        if key not in known or known[key][0]() is not self.prof:
            known[key] = (weakref.ref(self.prof), *self._search_lowest())
        _, chosen, least, self.won = known[key]
        return chosen, least

    def _known_lowest(self) -> tuple[Chosen, int] | None:
        """:meth:`lowest` if it was found already (by this planner or one of the same
        profile and rehearsal), else ``None``."""
        known = _lowest_found.get(self.rehearsal, {}).get(self._lowest_key())
        return self.lowest() if known is not None and known[0]() is self.prof else None

    def _lowest_key(self) -> tuple[Any, ...]:
        hands = None if self.hands is None else frozenset(self.hands)
        return id(self.prof), self.request.selective, hands

    def _search_lowest(self) -> tuple[Chosen, int, int | None]:
        """:meth:`lowest`, searched: the plan, its peak, and which hand plan it is."""
        prof = self.prof
        root = self.tree("flops")
        walk = Walk(root, prof.backward_points, prof.forward_points)
        tree = prof.module_tree
        groups = [find_blocks(tree), find_blocks(tree, by="container")] if tree else []
        hand = hand_plans(root, groups)
        tried = [h for k, h in enumerate(hand) if self.hands is None or k in self.hands]
        bounded = self.rehearsal.eager  # (its runs are of the profiled step)
        chosen, least = lowest(walk, self.peak, tried, bounded=bounded)
        return chosen, least, next((k for k, h in enumerate(hand) if h == chosen), None)

    def too_low(self, limit: int) -> BudgetTooLow:
        """The error for a ``limit`` below :meth:`lowest`."""
        least, prof, request = self.lowest()[1], self.prof, self.request
        given = request.budget.given if isinstance(request.budget, Budget) else request.budget
        hint = percent_hint(given)
        asked, reached = format_size(limit), format_size(least)
        if asked == reached:  # (a budget just below: the bytes tell them apart)
            asked, reached = f"{limit:,} bytes", f"{least:,} bytes"
        asked += "" if given == limit else f" ({given!r})"  # (as given, unless it is bytes)
        floored = 100 * least // prof.peak  # (99.8% is not 100%: recompute does lower it)
        share = f"{floored}% of the {format_size(prof.peak)} peak without recompute"
        if least >= prof.peak:  # (at the step's peak, recompute holds nothing less)
            share = "the peak without recompute: recompute frees nothing at this step's peak"
        exact = "" if reached.endswith(" bytes") else f"; about {least} bytes"
        compiled = " compiled" if self.rehearsal.way == "compiled" else ""  # (the share: eager)
        return BudgetTooLow(
            f"budget {asked} is below the lowest{compiled} peak that recomputing modules of "
            f"{request.model_name} reaches, {reached} ({share}{exact}). Try budget={least}, "
            f"a smaller batch{'' if request.autocast else ', or mixed precision'}."
            f"{_left_out_hint(self.skipped)}{f' ({hint}.)' if hint else ''}",
            least,
            prof.peak,
        )

    def fields(
        self, limit: int, judge: Judge | None = None, too_low: Callable[[], Exception] | None = None
    ) -> dict[str, Any]:
        """The plan's fields for the plan :meth:`cheapest` finds for ``limit`` and ``judge``.

        Raises:
            BudgetTooLow: none fits (or ``too_low()``, when given).
        """
        found = self.cheapest(limit, judge)
        if found is None:
            raise too_low() if too_low else self.too_low(limit)
        (chosen, peak), prof, request = found, self.prof, self.request
        budget = limit if judge is None else peak - judge(chosen)  # (the peak its step leaves)
        choices = choices_for(prof, list(chosen))
        warnings = {
            "left_out": left_out_warning(self.skipped, request.model_name),
            "near_lowest": self._near_lowest(chosen, budget, len(choices)),
        }
        entries = _fields_of(prof, choices)
        return {
            "modules": entries.modules,
            "selective": dict(entries.selective or {}),
            "calls": dict(entries.calls or {}),
            "budget": budget,
            "estimated_peak": peak,
            "estimated_by": self.priced or self.rehearsal.how,
            "baseline_peak": prof.peak,
            "recompute_flops": sum(i.flops for i in chosen),
            "objective": request.objective,
            "recompute_seconds": sum(c.seconds or 0.0 for c in choices),
            "choices": choices,
            "left_out": self.skipped,
            "warnings": {kind: text for kind, text in warnings.items() if text},
            "device": prof.device,
        }

    def _near_lowest(self, chosen: Chosen, limit: int, entries: int) -> str | None:
        """The warning for a budget within :data:`NEAR_LOWEST` of the lowest peak the walk
        reaches, for a plan of ``entries`` entries (``None`` otherwise)."""
        if not chosen or self.walk.fits(int(limit * (1 - NEAR_LOWEST))):
            return None
        return (
            f"budget {format_size(limit)} is within {NEAR_LOWEST:.0%} of the lowest peak "
            f"recomputing modules of {self.request.model_name} reaches: the plan recomputes "
            f"about all it can ({entries} entries, {sum(i.flops for i in chosen) / 1e9:.3f} "
            f"GFLOP more); a slightly larger budget may cost much less"
        )


def _choose(prof: Profile, request: Request) -> dict[str, Any]:
    assert isinstance(request.budget, Budget), "checked first (Strategy.check)"
    planner = Planner(prof, request, request.rehearsal)
    return planner.fields(request.budget.resolve(prof.peak))


def fields_for(prof: Profile, chosen: list[Item]) -> PlanFields:
    """What a rehearsal applies for the items ``chosen`` (:func:`choices_for`'s entries)."""
    return _fields_of(prof, choices_for(prof, chosen))


def _fields_of(prof: Profile, choices: tuple[Choice, ...]) -> PlanFields:
    """What a rehearsal applies for the plan entries ``choices``."""
    called = [call[0] for c in choices if (call := parse_call(c.path)) is not None]
    return PlanFields(
        modules=tuple(c.path for c in choices),
        selective={c.path: WAYS[c.way] for c in choices if c.way in WAYS},
        calls={path: len(prof.calls_of(path)) for path in called},
    )


def choices_for(prof: Profile, chosen: list[Item]) -> tuple[Choice, ...]:
    """The plan's entries for the items the solver chose, as :class:`Choice` rows in the
    order of the step: a call ``path@k`` of a module that ran several times stays a call
    entry, unless every call of the module was chosen the same way: then one entry ``path``
    (every call recomputed, however many a later step makes) sums them."""
    found = [Choice(i.path, i.freed, i.flops, i.way, recompute_seconds(prof, i)) for i in chosen]
    by_module: dict[str, list[Choice]] = {}
    for c in found:
        if (call := parse_call(c.path)) is not None:
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


def _left_out_hint(skipped: dict[str, str]) -> str:
    """What the BudgetTooLow message adds when modules that would have freed memory were left
    out of the plan: they may be why the budget cannot be met."""
    if not skipped:
        return ""
    names = first_few([repr(p or "(root)") for p in list(skipped)[:3]], 3, len(skipped))
    return (
        f" {len(skipped)} module(s) that would have freed memory cannot be recomputed and were "
        f"left out ({names}; their reasons are in the plan's left_out and logged)."
    )


STRATEGY = Strategy(name="budget", keyword="budget", needs="profile", check=_check, choose=_choose)
