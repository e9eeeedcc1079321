"""The budget solver: the cheapest set of planning items whose predicted step peak fits.

Pure: it reads :class:`Item` trees and points, and knows nothing of models, profiles or wraps
(:mod:`autoremat.planning.planning_tree` makes the items from a profile). Cost model (see
``docs/cost-model.md`` for the reasoning and the measured error):

* Every tree node ``i`` is numbered by when its forward ended (``end``); ``start`` is how many
  nodes had ended before it began. Recomputing ``i`` frees ``freed[i]`` bytes: what its
  subtree saved for backward, less its inputs (the checkpoint keeps those), and costs
  ``cost[i]`` (:attr:`Item.cost`: its recompute's measured seconds when the item has them, else
  its forward FLOPs; bytes break ties).
* The profiled step without recompute gives *points* ``(p, bytes)``: at some moment ``bytes``
  were live while nodes ``0..p-1`` had finished their forward and not begun their backward.
  Recomputing a set ``S`` of nodes, never one inside another, lowers that moment to
  ``bytes - sum(freed[s] for s in S if end[s] < p)``: before a node's backward starts, its
  activations are gone; once it starts, the recompute brings them all back, exactly as they
  were in the step without recompute, gradients and all. At the points of the forward a node
  frees ``freed[s] - cached[s]`` (:attr:`Item.cached`: under autocast, the weight casts the
  cast cache keeps until the forward ends). The recompute itself adds the point
  ``(start[s], recompute_peak[s])``: the most live bytes while it runs, temporaries included
  (:class:`autoremat.NodeCost`), plus its :attr:`Item.recasts` whose holders are not
  all in ``S`` (under autocast, the weight casts it makes again while the first copies
  live: the one term that depends on what else is chosen). At the points inside its span
  (``start[s] < p <= end[s]``), a chosen node holds more than the step without recompute (or
  fewer), and how much depends on the phase: points come in two lists, those of the forward
  pass (``forward``) and those after it.
  While its own forward runs, it holds :meth:`Item.held_at` ``(p)``: the inputs the
  checkpoint keeps, from its start; less what its finished parts saved, which a
  checkpointed forward drops; more, for a selective recompute, each kept output nothing else
  saved, from the point it was made. During its backward it holds its inputs only
  (:attr:`Item.held_in_backward`): the recompute has brought the rest back, and taken the
  cached outputs out of the cache; at some points more, the inputs the step would let go
  part-way through that backward (:meth:`Item.held_back`). The predicted peak is the
  maximum over the points; with ``S`` empty it is the profiled peak itself.

The solver is exact under that model: a dynamic programme over the tree in execution order
whose state is the set of Pareto-optimal ``(bytes freed so far, cost so far)`` pairs (when an
item has :attr:`Item.cached`, triples: the bytes freed at the points of the forward too). At each
node it either recomputes the node whole, in any of its ways (allowed when every point inside
the node's span already fits with what was freed before it), or, for a plain
``nn.Sequential``, a run of two or more consecutive children as one, or descends into its
children. Points are checked as the walk passes them, so every kept state is feasible so far;
a state with more bytes freed and less cost dominates, since what is feasible later depends
only on the bytes freed. Bytes freed are counted up to the largest excess over the budget
(more is worth nothing). Past ``MAX_STATES`` states, the frontier keeps one state per
``1/MAX_STATES`` of that excess, the one that freed most: no feasible answer is lost, and the
cost may exceed the optimum by what separates states within one step (never on small trees,
where the frontier stays below it). With :attr:`Item.cached` it keeps two per step, the one
that freed most and the one that freed most in the forward: a feasible answer between them
could then be lost (the randomized test has found none). The work is
``O((nodes x ways + runs) x frontier)``; ``runs`` is at most ``MAX_RUN`` per child of a
Sequential. Recasts are not additive: when
the walk takes an item that has some, it checks them in each state against that state's own
choices (the holders ended before the item began, so they are decided); states are still
merged by bytes freed and cost alone, so with recasts the answer fits but may not be the
cheapest (a state merged away could have covered a later item's holders). The same holds for
:attr:`Item.shared_casts`, added per state to what the item frees after the forward, and
:attr:`Item.shared_inputs`, added per state in both phases. Two terms only
:func:`~autoremat.planning.prediction.predict_peak` counts, not the walk, which prices them as
not freed (so its answer fits and its estimate may be lower than the walk's bound; a plan that
fits only thanks to them can be missed): :attr:`Item.late_casts` (a first call's weight copy,
gone once the later calls that saved it and are not recomputed have run their backward, and
made again by the first call's recompute while the step's figure still counts it) and
:attr:`Item.alive_inputs` (inputs the step holds anyway for a while, which the checkpoint's
keeping costs nothing then).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_STATES = 1024
NONE = -(2**62)  # the bytes at a point where no moment was seen (below any budget)
# Costs are in FLOPs, or FLOP-equivalents: an item with measured ``seconds`` costs them at
# FLOPS_PER_SECOND; one without costs its FLOPs. Bytes (freed, and written by the recompute)
# break ties at TIE_PER_BYTE.
FLOPS_PER_SECOND = 1e11
TIE_PER_BYTE = 1e-3

__all__ = ["Infeasible", "Item", "Late", "RunCost", "min_peak", "solve"]

# A run [i:j) of a node's children recomputed as one (a plain Sequential): (i, j, freed, flops,
# recompute_peak, held, held_from, cached), the last six as :class:`Item` has them
RunCost = tuple[int, int, int, int, int, int, tuple[tuple[int, int], ...], int]


@dataclass
class Late:
    """What an item's :attr:`Item.late_casts` free for a plan (:meth:`Item.late_freed`):
    ``spans``, ``(bytes, after, before, held)``, gone at the points ``p`` after the forward
    with ``after < p < before`` outside the ``held`` spans; ``points``, point -> bytes the
    step's figure there falls by; ``first``, bytes its recompute's peak counts once less."""

    spans: list[tuple[int, int, int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    points: dict[int, int] = field(default_factory=dict)
    first: int = 0


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
    # runs of two or more children that can be recomputed as one (:data:`RunCost`)
    runs: tuple[RunCost, ...] = ()
    written: int = 0  # bytes the recompute's ops write
    # bytes it keeps alive during its own forward beyond the step without recompute (inputs
    # the checkpoint holds): added to the points inside its span; and how that changes
    # part-way, (point, bytes) from that point on (what its finished parts saved, dropped by
    # the checkpoint: negative; a selective recompute's cached outputs: positive)
    held: int = 0
    held_from: tuple[tuple[int, int], ...] = ()
    # the other ways to recompute this node whole (same path and span, no children)
    other_ways: tuple[Item, ...] = ()
    way: str = "full"  # how this item recomputes: "full", or a selective way ("selective")
    # the recompute's time, measured (ops and per-op overheads); None: priced from flops and
    # written bytes
    seconds: float | None = None
    # under autocast, the weight casts its recompute makes again: (bytes, holders), more at
    # its recompute's peak unless every holder (a node, by end) is chosen too (no holders:
    # always); and (point, bytes, indexes into recasts): the live bytes of the step without
    # recompute in each stretch of its backward, with the recasts still live then
    recasts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    recast_moments: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # the part of ``freed`` that stays live until the forward ends (under autocast, the weight
    # casts its forward made, which autocast's cast cache keeps until its region ends): at
    # the points of the forward the item frees ``freed - cached``, after it ``freed``
    cached: int = 0
    # such casts that items before it saved too (a shared module's weights): (bytes, ends of
    # those nodes), freed after the forward, from its end, when every one of them is chosen
    shared_casts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # inputs it holds (in ``held``, so less in ``freed``) that nodes ended before it began
    # took too: (bytes, (start, end) of those nodes); when one of them is chosen, its
    # checkpoint keeps them until after this item's backward, so they are freed back, from
    # its end, in both phases
    shared_inputs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    # such casts that nodes after it saved too (a shared module's first call casts the
    # weights, later calls save the same copy): (bytes, (start, end) of those nodes by end,
    # per node the (point, bytes) its span's points fall by once its grad_fns have used the
    # copy, whether this node made it); with it chosen, the copy is gone once the later
    # savers not chosen have used it (:meth:`late_freed`); in :func:`predict_peak` only
    late_casts: tuple[
        tuple[int, tuple[tuple[int, int], ...], tuple[tuple[tuple[int, int], ...], ...], bool],
        ...,
    ] = ()
    # inputs it holds (in ``held``) that the step without recompute holds anyway for a while:
    # (bytes, forward until, backward above, spans of earlier takers); unless one of those is
    # chosen, not held beyond that step at the points of the forward from its start and
    # before the one, nor after the forward at those above the other; in predict_peak only
    alive_inputs: tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...] = ()
    # (point, bytes) more it holds at those points of its backward, by keeping to its end
    # inputs the step without recompute frees part-way through it (:meth:`held_back`)
    kept_inputs: tuple[tuple[int, int], ...] = ()

    @property
    def freed_in_forward(self) -> int:
        """What recomputing it frees at the points of the forward after its end."""
        return self.freed - self.cached

    def run_item(
        self,
        i: int,
        j: int,
        freed: int,
        flops: int,
        recompute_peak: int,
        held: int = 0,
        held_from: tuple[tuple[int, int], ...] = (),
        cached: int = 0,
    ) -> Item:
        """The run ``[i:j)`` of this node's children as one item, named ``path[i:j]``; its
        bytes written and seconds are its children's."""
        kids = self.children[i:j]
        seconds = [k.seconds for k in kids]
        return Item(
            path=f"{self.path}[{i}:{j}]",
            start=kids[0].start,
            end=kids[-1].end,
            freed=freed,
            flops=flops,
            recompute_peak=recompute_peak,
            held=held,
            held_from=held_from,
            cached=cached,
            written=sum(k.written for k in kids),
            seconds=None if None in seconds else sum(seconds),  # type: ignore[arg-type]
        )

    def recast_with(self, chosen: Sequence[Item]) -> tuple[int, list[tuple[int, int]]]:
        """When ``chosen`` (never one inside another) are recomputed, the bytes of
        :attr:`recasts` its recompute adds (those without holders or with a holder no chosen
        item covers), and its backward's moments ``(point, bytes)`` with them."""
        covered = _covering(chosen)
        counted = [
            not holders or not all(covered(h) for h in holders) for _, holders in self.recasts
        ]
        moments = [
            (p, b + sum(self.recasts[g][0] for g in alive if counted[g]) + self._inside(p))
            for p, b, alive in self.recast_moments
        ]
        extra = sum(size for (size, _), count in zip(self.recasts, counted, strict=True) if count)
        return extra, moments

    def shared_freed(self, chosen: Sequence[Item]) -> int:
        """The bytes of :attr:`shared_casts` it frees after the forward when ``chosen`` are
        recomputed: those whose other savers ``chosen`` all cover."""
        if not self.shared_casts:
            return 0
        covered = _covering(chosen)
        return sum(b for b, ends in self.shared_casts if all(covered(e) for e in ends))

    def late_freed(self, chosen: Sequence[Item]) -> Late:
        """What :attr:`late_casts` free when ``chosen`` (this item among them) are recomputed.

        A copy dies once the first later saver not chosen (``u``; none: every one is) has run
        the grad_fns that used it; a chosen one uses its recompute's own copy. So it is gone
        at the points after the forward between this item's end and ``u``'s start (the last
        saver's when all are chosen: after its end :attr:`shared_casts` free it), but for those
        inside a chosen item that holds a later saver, whose recompute casts it again; inside
        each later saver's span up to ``u``, in the stretches after its grad_fns used it
        (``credits``). When this node made the copy, its recompute makes it again while the
        step's figure still holds the first: its recompute's peak counts it once less."""
        late = Late()
        if not self.late_casts:
            return late
        covered = _covering(chosen)
        for size, savers, credits, remade in self.late_casts:
            late.first += size if remade else 0
            gone = next((k for k, (_, e) in enumerate(savers) if not covered(e)), None)
            last = len(savers) - 1 if gone is None else gone
            hold = [
                (c.start, c.end)
                for c in chosen
                if any(c.start <= e <= c.end for _, e in savers[: last + 1])
            ]
            late.spans.append((size, self.end, savers[last][0], tuple(hold)))
            for found in credits[: last + 1]:
                for p, b in found:
                    late.points[p] = max(late.points.get(p, 0), b)
        return late

    def input_credit(self, chosen: Sequence[Item]) -> int:
        """The bytes of :attr:`shared_inputs` an earlier chosen item already holds, freed back
        after this item's end when ``chosen`` are recomputed. (An item's span names its node:
        a run's never equals a node's, as it begins with one child and ends with another.)"""
        if not self.shared_inputs:
            return 0
        spans = {(c.start, c.end) for c in chosen}
        return sum(b for b, holders in self.shared_inputs if any(h in spans for h in holders))

    def recast_peak(self, chosen: Sequence[Item]) -> int:
        """The most live bytes its recompute and backward reach with the recasts ``chosen``
        leave (:meth:`recast_with`), before what items chosen earlier freed."""
        extra, moments = self.recast_with(chosen)
        return max([self.recompute_peak + extra, *(b for _, b in moments)])

    def _inside(self, point: int) -> int:
        # (a recast moment is one stretch: its bytes count the inputs kept there already)
        return self.held_in_backward if point >= self.start else 0

    def held_back(self, point: int) -> int:
        """The bytes more than the step without recompute live at ``point`` of its backward
        (``start <= point <= end``): :attr:`held_in_backward`, and its :attr:`kept_inputs`
        there."""
        return self.held + sum(b for p, b in self.kept_inputs if p == point)

    def held_at(self, point: int) -> int:
        """The bytes more than the step without recompute live at ``point``, inside the span,
        while this item's checkpointed forward runs (fewer when negative)."""
        return self.held + sum(b for p, b in self.held_from if p <= point)

    @property
    def held_in_backward(self) -> int:
        """The bytes more than the step without recompute live at the points of its backward
        (``start <= p <= end`` after the forward): ``held``. Its recompute has brought back all
        its forward dropped, and handed over what a selective recompute cached
        (``torch.utils.checkpoint``'s cache gives each output up as the recompute reaches
        it). The point ``start`` counts too: the backward of the node's own ops before its
        first child (all of a node whose modules run no child) is there, and the
        checkpoint holds the inputs until that ends (an upper bound at the moments of
        ``start`` after it)."""
        return self.held

    def worst_inside(self, forward: Sequence[int], backward: Sequence[int]) -> tuple[int, int]:
        """The most bytes live at the points inside the span when this item is checkpointed,
        in its forward and after it, given the most live at each point ``p`` in the step
        without recompute, in its forward (``forward[p]``) and after (``backward[p]``);
        :data:`NONE` for a phase without a point in the span."""
        during, after, extra, begin = NONE, NONE, self.held, self.start + 1
        stop = min(self.end + 1, len(forward), len(backward))
        if self.start < stop:
            most = max(backward[self.start : stop])
            after = most + self.held_in_backward if most > NONE else NONE
            for p, b in self.kept_inputs:
                if p < stop and backward[p] > NONE:
                    after = max(after, backward[p] + self.held + b)
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
        if not self.candidate:
            return []
        return [i for i in (self, *self.other_ways) if i.freed > 0]

    def walk(self) -> list[Item]:
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out


def _covering(chosen: Sequence[Item]) -> Any:
    """Whether a node (by its ``end``) is inside one of ``chosen`` (never one inside another):
    the first chosen item ending at or after it begins at or before it."""
    spans = sorted((c.end, c.start) for c in chosen)
    ends = [e for e, _ in spans]

    def covered(h: int) -> bool:
        k = bisect.bisect_left(ends, h)
        return k < len(spans) and spans[k][1] <= h

    return covered


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
    kept: list[_State] = []
    best = math.inf
    for s in states:
        if s[1] < best:
            kept.append(s)
            best = s[1]
    return kept


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
) -> list[Item]:
    """The cheapest set of nodes under ``root`` whose predicted peak
    (:func:`~autoremat.planning.prediction.predict_peak`, with the same ``points`` and
    ``forward``) is at most ``budget`` (module docstring; with
    :attr:`~Item.recasts`, a set that fits, not always the cheapest).

    Raises:
        Infeasible: no set fits; :func:`min_peak` gives the lowest reachable peak.
    """
    solver = _Solver(root, points, budget, forward)
    states = solver.check([(0, 0.0, next(solver.counter), None, 0)], -1, root.start)
    states = solver.check(solver.run(root, states), root.end, solver.top)
    if not states:
        raise Infeasible(f"no recompute plan has a predicted peak <= {budget} bytes")
    best = min(states, key=lambda s: s[1])
    return sorted(_chosen(best), key=lambda i: i.end)


def _chosen(state: _State) -> list[Item]:
    """The items of ``state``'s chosen list, last chosen first."""
    chosen: list[Item] = []
    link = state[3]
    while link is not None:
        chosen.append(link[0])
        link = link[1]
    return chosen


class _Solver:
    """The dynamic programme of :func:`solve` (module docstring) for one budget."""

    def __init__(
        self,
        root: Item,
        points: Sequence[tuple[int, int]],
        budget: int,
        forward: Sequence[tuple[int, int]],
    ) -> None:
        self.budget = budget
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
        # Bytes freed beyond the largest excess over the budget are worth no more.
        self.cap = max(
            0,
            max(self.need) - budget,
            # (every recast counted: nothing chosen covers a holder)
            *(w.recast_peak(()) - budget for i in root.walk() for w in (i, *i.other_ways)),
            # (the inputs a checkpoint keeps at the points of its backward)
            *(
                self.after[p] + w.held + b - budget
                for i in root.walk()
                for w in (i, *i.other_ways)
                for p, b in w.kept_inputs
                if p <= self.top and self.after[p] > NONE
            ),
        )
        self.grid = max(1, -(-self.cap // MAX_STATES))
        # some item frees less in the forward than after it: states carry both
        self.phased = any(
            w.cached or w.shared_casts for i in root.walk() for w in (i, *i.other_ways)
        ) or any(r[7] for i in root.walk() for r in i.runs)
        self.counter = itertools.count()
        self.useful: dict[int, bool] = {}
        self._mark(root)

    def _mark(self, item: Item) -> bool:
        """Whether anything under ``item`` can be chosen."""
        here = bool(item.wholes()) or (item.candidate and any(r[2] > 0 for r in item.runs))
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
        if item.held_from or item.kept_inputs or self.phased:
            during, after = item.worst_inside(self.during, self.after)
        else:  # the same in both phases (the common case, kept fast)
            inside = max(self.need[item.start + 1 : item.end + 1], default=NONE)
            after = max(inside, self.after[item.start] if item.start <= self.top else NONE)
            after = during = after + item.held if after > NONE else 0
        fits = self.feasible(states, max(after, item.recompute_peak))
        fits = self.forward_fits(fits, during)
        if item.recasts:
            fits = [s for s in fits if self.recasts_fit(item, s)]
        cap = self.cap
        if not self.phased:  # those that reach the cap become equal: keep the cheapest (last)
            capped = bisect.bisect_right(fits, (item.freed - cap, math.inf))
            fits = fits[max(0, capped - 1) :]
        freed, forward, cost, link = item.freed, item.freed_in_forward, item.cost, item
        per_state = item.shared_casts or item.shared_inputs
        extra = [self.credits(item, s) if per_state else (0, 0) for s in fits]
        return [
            (
                -min(freed + more - s[0], cap),
                s[1] + cost,
                k,
                (link, s[3]),
                -min(forward + more_forward - s[4], cap),
            )
            for s, (more, more_forward), k in zip(fits, extra, self.counter, strict=False)
        ]

    @staticmethod
    def credits(item: Item, state: _State) -> tuple[int, int]:
        """What ``item`` frees beyond its own figures given ``state``'s choices (decided: they
        ended before it began), after the forward and in it: its shared casts and the inputs
        an earlier chosen item holds (:meth:`Item.shared_freed`, :meth:`Item.input_credit`)."""
        chosen = _chosen(state)
        credit = item.input_credit(chosen)
        return item.shared_freed(chosen) + credit, credit

    def recasts_fit(self, item: Item, state: _State) -> bool:
        """Whether ``item``'s recompute and backward fit with the recasts ``state``'s choices
        leave (its holders end before it begins: what covers them is chosen already)."""
        room = self.budget - state[0]  # the budget plus what was freed before the item
        return item.recast_peak(_chosen(state)) <= room

    def run(self, item: Item, states: list[_State]) -> list[_State]:
        """The states after ``item``'s span: it recomputed whole (any way), a run of its
        children, or its children's own choices."""
        if not self.useful[id(item)]:
            return self.check(states, item.start, item.end)
        kids = item.children
        runs: dict[int, list[tuple[int, Item]]] = {}
        for i, j, freed, flops, peak, held, held_from, cached in (
            item.runs if item.candidate else ()
        ):
            if freed > 0:
                run = item.run_item(i, j, freed, flops, peak, held, held_from, cached)
                runs.setdefault(i, []).append((j, run))
        # arriving[k]: states that have passed children 0..k-1 (k = len(kids): all of them)
        arriving: list[list[list[_State]]] = [[] for _ in range(len(kids) + 1)]
        arriving[0] = [states]
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


def min_peak(
    root: Item, points: Sequence[tuple[int, int]], forward: Sequence[tuple[int, int]] = ()
) -> int:
    """The lowest budget :func:`solve` meets (within 0.1% of the baseline above the lowest
    predicted peak any plan reaches)."""
    baseline = max((b for _, b in (*points, *forward)), default=0)
    lo, hi = 0, baseline  # hi is always feasible: the empty plan
    tolerance = max(1, baseline // 1000)
    while hi - lo > tolerance:
        mid = (lo + hi) // 2
        try:
            solve(root, points, mid, forward)
            hi = mid
        except Infeasible:
            lo = mid
    return hi
