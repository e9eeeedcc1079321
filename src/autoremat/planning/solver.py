"""The solver's walk: the cheapest set of planning items whose peak, as it prices it, fits.

Pure: it reads :class:`Item` trees and points, and knows nothing of models, profiles or wraps
(:mod:`autoremat.planning.planning_tree` makes the items from a profile). It is the search's
fast model of the step, not its figure: every plan it proposes is run before anyone sees a
number (:mod:`autoremat.planning.search`). docs/cost-model.md, "The walk", gives the model:
the step's points ``(p, bytes)`` without recompute (:mod:`autoremat.costs.timeline`), and how
recomputing a set of items, never one inside another, lowers them (:attr:`Item.freed`,
:attr:`Item.freed_in_forward`), holds more inside a chosen node's span (:meth:`Item.held_at`,
:attr:`Item.held`) and adds the point ``(start, recompute_peak)``; :attr:`Item.cost` prices it.

The walk is a dynamic programme over the tree in execution order whose state is the set of
Pareto-optimal ``(bytes freed so far, cost so far)`` pairs (with :attr:`Item.cached`, freed in
the forward too), every one feasible so far, thinned past ``MAX_STATES`` (:func:`_merge`):
docs/cost-model-history.md, "The solver", says what it tries at each node, why it is exact,
what thinning costs and how much work it is.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_STATES = 1024
NONE = -(2**62)  # the bytes at a point where no moment was seen (below any budget)
# What Item.cost charges: docs/cost-model.md, "Pricing: time or FLOPs".
FLOPS_PER_SECOND = 1e11
TIE_PER_BYTE = 1e-3

__all__ = ["Infeasible", "Item", "min_peak", "solve", "walk_peak"]


@dataclass(frozen=True)
class Item:
    """One node of the planning tree (children ordered by ``end``)."""

    path: str
    start: int
    end: int
    freed: int
    flops: int
    candidate: bool = True
    children: tuple[Item, ...] = ()
    recompute_peak: int = 0
    # runs of two or more children that can be recomputed as one: (i, j, the run [i:j) as an
    # item named path[i:j], spanning those children)
    runs: tuple[tuple[int, int, Item], ...] = ()
    written: int = 0  # bytes the recompute's ops write
    # held, held_from (and cached below): as autoremat.costs.profile.NodeCost's; ``held`` is
    # also added to the points of its backward, start <= p <= end (its recompute has brought
    # back all its forward dropped, and handed over what a selective recompute cached)
    held: int = 0
    held_from: tuple[tuple[int, int], ...] = ()
    # the other ways to recompute this node whole (same path and span, no children)
    other_ways: tuple[Item, ...] = ()
    way: str = "full"  # how this item recomputes: "full", or a selective way ("selective")
    # the recompute's time, measured (ops and per-op overheads); None: priced from flops and
    # written bytes
    seconds: float | None = None
    cached: int = 0  # (see held above, and freed_in_forward)

    @property
    def freed_in_forward(self) -> int:
        """What recomputing it frees at the points of the forward after its end."""
        return self.freed - self.cached

    def held_at(self, point: int) -> int:
        """The bytes more than the step without recompute live at ``point``, inside the span,
        while this item's checkpointed forward runs (fewer when negative)."""
        return self.held + sum(b for p, b in self.held_from if p <= point)

    def worst_inside(self, forward: Sequence[int], backward: Sequence[int]) -> tuple[int, int]:
        """The most bytes live at the points inside the span when this item is checkpointed,
        in its forward and after it, given the most live at each point ``p`` in the step
        without recompute, in its forward (``forward[p]``) and after (``backward[p]``);
        :data:`NONE` for a phase without a point in the span."""
        during, after, extra, begin = NONE, NONE, self.held, self.start + 1
        stop = min(self.end + 1, len(forward), len(backward))
        if self.start < stop:
            most = max(backward[self.start : stop])
            after = most + self.held if most > NONE else NONE
        for p, b in (*self.held_from, (stop, 0)):
            if p > begin and begin < stop:
                most = max(forward[begin : min(p, stop)])
                during = max(during, most + extra if most > NONE else NONE)
                begin = p
            extra += b
        return during, after

    @property
    def cost(self) -> float:
        # (bytes break ties: of two equally costly ways, the one that writes less, frees less)
        work = self.flops if self.seconds is None else self.seconds * FLOPS_PER_SECOND
        return work + TIE_PER_BYTE * (self.written + max(0, self.freed))

    def wholes(self) -> list[Item]:
        """The ways to recompute this node whole that free bytes: itself and its other ways."""
        return [i for i in (self, *self.other_ways) if i.freed > 0] if self.candidate else []

    @property
    def run_items(self) -> tuple[tuple[int, int, Item], ...]:
        """``(i, j, item)`` for each run ``[i:j)`` that frees something, none if this node
        is not a candidate."""
        return tuple(r for r in self.runs if r[2].freed > 0) if self.candidate else ()

    def walk(self) -> list[Item]:
        return [self, *(item for child in self.children for item in child.walk())]


class Infeasible(ValueError):
    """No set of modules brings the predicted peak under the budget."""


# A state of the dynamic programme: (-bytes freed so far, cost so far, tie-break, chosen,
# -bytes freed so far at the points of the forward), where chosen is a linked list (item,
# rest). Tuples sort natively: most freed, then cheapest (the tie-break is unique).
_State = tuple[int, float, int, Any, int]


def _merge(parts: list[list[_State]], grid: int, phased: bool = False) -> list[_State]:
    """The states of ``parts`` (each sorted, most freed first) that no other state beats on
    bytes freed and cost (``phased``: and on bytes freed in the forward); past
    ``MAX_STATES``, per ``grid`` bytes freed the one that freed most (``phased``: and the one
    that freed most in the forward), so that no feasible answer is lost."""
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return parts[0] if parts else []
    # (sorting the concatenated runs: timsort merges them, comparing tuples in C)
    states = sorted(itertools.chain.from_iterable(parts))
    kept = _pareto(states) if phased else _cheaper(states)
    if len(kept) <= MAX_STATES:
        return kept
    thinned: dict[int, list[_State]] = {}
    for s in kept:
        bucket = thinned.setdefault(-s[0] // grid, [s])
        if phased and s[4] < bucket[-1][4]:
            bucket[1:] = [s]
    return [s for bucket in thinned.values() for s in bucket]


def _cheaper(states: list[_State]) -> list[_State]:
    """The states (most freed first) cheaper than every state that freed more."""
    least = itertools.accumulate((s[1] for s in states), min, initial=math.inf)
    return [s for s, best in zip(states, least, strict=False) if s[1] < best]


def _pareto(states: list[_State]) -> list[_State]:
    """The states (most freed first) that no state freeing as much beats on both cost and
    bytes freed in the forward."""
    kept: list[_State] = []
    # a staircase of the kept states: bytes freed in the forward, most first (negated), and
    # the least cost among those freeing at least as much, falling along it
    forward: list[int] = []
    costs: list[float] = []
    for s in states:
        k = bisect.bisect_right(forward, s[4])
        if k and costs[k - 1] <= s[1]:
            continue
        kept.append(s)
        j = k
        while j < len(costs) and costs[j] >= s[1]:
            j += 1
        forward[k:j], costs[k:j] = [s[4]], [s[1]]
    return kept


def solve(
    root: Item,
    points: Sequence[tuple[int, int]],
    budget: int,
    forward: Sequence[tuple[int, int]] = (),
    memo: dict[int, tuple[int, int]] | None = None,
    priced: bool = True,
) -> list[Item]:
    """The cheapest set of nodes under ``root`` whose peak, as the walk prices it (module
    docstring; ``points`` after the forward, ``forward`` in it), is at most ``budget``.
    ``memo``: a dict kept between solves of one ``root``, ``points`` and ``forward`` at other
    budgets (what does not depend on the budget is found once). Not ``priced``: any set that
    fits (every cost taken as 0, the walk keeps only the states that freed most: whether one
    fits, fast).

    Raises:
        Infeasible: no set fits; :func:`min_peak` gives the lowest reachable peak.
    """
    solver = _Solver(root, points, budget, forward, {} if memo is None else memo, priced)
    states = solver.check([(0, 0.0, next(solver.counter), None, 0)], -1, root.start)
    states = solver.check(solver.run(root, states), root.end, solver.top)
    if not states:
        raise Infeasible(f"no recompute plan has a predicted peak <= {budget} bytes")
    chosen: list[Item] = []
    link = min(states, key=lambda s: s[1])[3]  # (the cheapest state's chosen list)
    while link is not None:
        chosen.append(link[0])
        link = link[1]
    return sorted(chosen, key=lambda i: i.end)


class _Solver:
    """The dynamic programme of :func:`solve` (module docstring) for one budget."""

    def __init__(self, root: Item, points: Sequence[tuple[int, int]], budget: int,
                 forward: Sequence[tuple[int, int]], memo: dict[int, tuple[int, int]],
                 priced: bool = True) -> None:  # fmt: skip
        self.budget, self.memo, self.priced = budget, memo, priced  # (not priced: costs 0)
        self.top = max((p for p, _ in (*points, *forward)), default=0)
        # the most bytes live at each point: in the forward, after it, and either (NONE: no
        # moment there)
        self.during = [NONE] * (self.top + 1)
        self.after = [NONE] * (self.top + 1)
        for p, b in forward:
            self.during[p] = max(self.during[p], b)
        for p, b in points:
            self.after[p] = max(self.after[p], b)
        self.need = [max(d, a) for d, a in zip(self.during, self.after, strict=True)]
        items = root.walk()
        wholes = [w for i in items for w in (i, *i.other_ways)]
        # Bytes freed beyond the largest excess over the budget are worth no more.
        self.cap = max(0, max(self.need) - budget, *(w.recompute_peak - budget for w in wholes))
        self.grid = max(1, -(-self.cap // MAX_STATES))
        # some item frees less in the forward than after it: states carry both
        runs = [r for i in items for _, _, r in i.runs]
        self.phased = any(w.cached for w in (*wholes, *runs))
        self.counter = itertools.count()
        self.useful: dict[int, bool] = {}
        self._mark(root)

    def _mark(self, item: Item) -> bool:
        """Whether anything under ``item`` can be chosen."""
        here = bool(item.wholes()) or bool(item.run_items)
        self.useful[id(item)] = any([self._mark(c) for c in item.children]) or here
        return self.useful[id(item)]

    def feasible(self, states: list[_State], worst: int) -> list[_State]:
        """The states in which ``worst`` live bytes fit: a prefix, as states are sorted by
        bytes freed, most first."""
        return states[: bisect.bisect_right(states, (self.budget - worst, math.inf))]

    def forward_fits(self, states: list[_State], worst: int) -> list[_State]:
        """The states in which ``worst`` live bytes at a point of the forward fit."""
        if not self.phased:  # (bytes freed are the same in both phases)
            return self.feasible(states, worst)
        return [s for s in states if s[4] <= self.budget - worst]

    def check(self, states: list[_State], lo: int, hi: int) -> list[_State]:
        """Keep the states under budget at every point ``p`` with ``lo < p <= hi``."""
        span = slice(max(lo + 1, 0), hi + 1)  # (no point there: nothing to check, NONE)
        if not self.phased:
            return self.feasible(states, max(self.need[span], default=NONE))
        after = self.feasible(states, max(self.after[span], default=NONE))
        return self.forward_fits(after, max(self.during[span], default=NONE))

    def take(self, item: Item, states: list[_State]) -> list[_State]:
        """The states in which recomputing ``item`` whole fits, with it recomputed."""
        worst = self.memo.get(id(item))  # (items live as long as their root)
        if worst is None:
            worst = self.memo[id(item)] = item.worst_inside(self.during, self.after)
        during, after = worst
        fits = self.feasible(states, max(after, item.recompute_peak))
        fits = self.forward_fits(fits, during)
        cap = self.cap
        if not self.phased:  # those that reach the cap become equal: keep the cheapest (last)
            capped = bisect.bisect_right(fits, (item.freed - cap, math.inf))
            fits = fits[max(0, capped - 1) :]
        freed, forward, link = item.freed, item.freed_in_forward, item
        cost = item.cost if self.priced else 0.0
        return [  # (min(x, cap) written out: this line runs for every state of every item)
            (-(a if (a := freed - s[0]) < cap else cap), s[1] + cost, k, (link, s[3]),
             -(b if (b := forward - s[4]) < cap else cap))
            for s, k in zip(fits, self.counter, strict=False)
        ]  # fmt: skip

    def run(self, item: Item, states: list[_State]) -> list[_State]:
        """The states after ``item``'s span: it recomputed whole (any way), a run of its
        children, or its children's own choices."""
        if not self.useful[id(item)]:
            return self.check(states, item.start, item.end)
        kids = item.children
        runs: dict[int, list[tuple[int, Item]]] = {}
        for i, j, whole in item.run_items:
            runs.setdefault(i, []).append((j, whole))
        # arriving[k]: states that have passed children 0..k-1 (k = len(kids): all of them)
        arriving: list[list[list[_State]]] = [[states], *([] for _ in kids)]
        cursor = item.start
        for k, child in enumerate(kids):
            here = self.check(_merge(arriving[k], self.grid, self.phased), cursor, child.start)
            if self.useful[id(child)]:
                arriving[k + 1].append(self.run(child, here))
            else:  # nothing to choose: check the points of its span not checked yet
                arriving[k + 1].append(self.check(here, max(cursor, child.start), child.end))
            for j, whole in runs.get(k, []):
                arriving[j].append(self.take(whole, here))
            cursor = max(cursor, child.end)
        inside = self.check(_merge(arriving[len(kids)], self.grid, self.phased), cursor, item.end)
        taken = [self.take(whole, states) for whole in item.wholes()]
        return _merge([inside, *taken], self.grid, self.phased)


def walk_peak(chosen: Sequence[Item], points: Sequence[tuple[int, int]],
              forward: Sequence[tuple[int, int]] = ()) -> int:  # fmt: skip
    """The peak the walk prices for recomputing ``chosen`` (never one inside another): what
    :func:`solve` keeps at most its budget (module docstring); the profiled peak for none."""
    after = [(p, b + sum(s.held for s in chosen if s.start <= p <= s.end)) for p, b in points]
    after += [(s.start, s.recompute_peak) for s in chosen]
    during = [
        (p, b + sum(s.held_at(p) for s in chosen if s.start < p <= s.end)) for p, b in forward
    ]
    return max(
        [
            *(b - sum(s.freed for s in chosen if s.end < p) for p, b in after),
            *(b - sum(s.freed_in_forward for s in chosen if s.end < p) for p, b in during),
        ],
        default=0,
    )


def min_peak(
    root: Item, points: Sequence[tuple[int, int]], forward: Sequence[tuple[int, int]] = ()
) -> int:
    """The lowest budget :func:`solve` meets, to the byte: no plan of the walk fits a byte
    less, which the search's lowest peak relies on. A bisection of solves that are not
    ``priced`` (only whether some plan fits matters here); once the gap is within a
    sixteenth, a byte below each plan it finds is tried (the lowest is a plan's price: most
    often none fits there and the search is over, where halving the gap would take some 20
    more solves; tried earlier, it mostly finds another plan, at a high budget's cost)."""
    baseline = max((b for _, b in (*points, *forward)), default=0)
    lo, hi = 0, baseline  # hi is always feasible: the empty plan
    below = False  # whether to try a byte below the last plan's price next
    memo: dict[int, tuple[int, int]] = {}
    while hi - lo > 1:
        mid = hi - 1 if below else (lo + hi) // 2
        try:
            found = solve(root, points, mid, forward, memo, priced=False)
        except Infeasible:
            lo, below = mid, False
            continue
        # (the plan found may price below the limit asked: a limit there is met too)
        hi = max(lo + 1, min(mid, walk_peak(found, points, forward)))
        below = not below and (hi - lo) * 16 <= hi
    return hi
