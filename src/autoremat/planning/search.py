"""The search: the solver's walk proposes plans, running them decides.

The walk (:func:`~autoremat.planning.solver.solve`) is a fast model of the step, close but not
exact: it knows what each node frees and holds, not everything the step does. So no figure of
it reaches the user. Each plan it proposes is judged by a *judge*, a function that runs the
plan's step (:mod:`autoremat.planning.rehearsal`, or a whole rank's step) and says how many
bytes it is over what must fit (0 or less: it fits). The walk's own limit is then moved by what
the run said, and the walk asked again: :func:`cheapest` finds the cheapest plan that fits,
:func:`lowest` the lowest peak among the walk's lowest plan and :func:`hand_plans`.

Pure but for the judge: items in, items out (what a judge runs is the caller's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoremat.core.collector import frozen
from autoremat.planning.solver import Infeasible, Item, min_peak, solve, walk_peak

__all__ = [
    "SLACK",
    "TRIES",
    "Chosen",
    "Judge",
    "Walk",
    "cheapest",
    "cost",
    "floor",
    "hand_plans",
    "lowest",
]

# A plan, as the solver's items it recomputes (never one inside another), in the step's order.
Chosen = tuple[Item, ...]
# The bytes a plan's step is over what must fit (0 or less: it fits), found by running it.
Judge = Callable[[Chosen], int]

TRIES = 4  # plans run at most by one cheapest() search
SLACK = 0.005  # a plan this close below its limit (a fraction of it) is not raised further


@dataclass
class Walk:
    """The solver over one planning tree: its ``root`` and the step's points after the
    forward (``after``) and in it (``forward``), as :func:`solve` takes them."""

    root: Item
    after: Sequence[tuple[int, int]]
    forward: Sequence[tuple[int, int]] = ()
    _memo: dict[int, tuple[int, int]] = field(  # (what the solver finds once for every budget)
        default_factory=dict, init=False, repr=False, compare=False
    )

    def plan(self, limit: int, priced: bool = True) -> Chosen | None:
        """The walk's cheapest plan whose peak it prices at most ``limit`` (``priced=False``:
        any such plan, not the cheapest); ``None``: none."""
        try:
            with frozen():  # (the solver makes many states: autoremat.core.collector)
                return tuple(solve(self.root, self.after, limit, self.forward, self._memo, priced))
        except Infeasible:
            return None

    def fits(self, limit: int) -> bool:
        """Whether the walk has a plan it prices at most ``limit`` (any, not the cheapest)."""
        return self.plan(limit, priced=False) is not None

    def price(self, chosen: Chosen) -> int:
        """The peak the walk prices for ``chosen`` (at most the limit it was proposed at)."""
        return walk_peak(chosen, self.after, self.forward)

    @functools.cached_property
    def lowest(self) -> int:
        """The lowest limit the walk meets (:func:`min_peak`), found once."""
        with frozen():
            return min_peak(self.root, self.after, self.forward)


def cost(chosen: Chosen) -> float:
    """What recomputing ``chosen`` costs (:attr:`Item.cost`, summed)."""
    return sum(i.cost for i in chosen)


def cheapest(walk: Walk, limit: int, judge: Judge) -> Chosen | None:
    """The cheapest plan found that ``judge`` says fits, starting from the walk's plan at
    ``limit``; ``None`` when none did within :data:`TRIES` runs. How the walk's limit moves
    between runs: docs/cost-model.md, "The search"."""
    best: Chosen | None = None
    fits: int | None = None  # the highest walk limit whose plan fitted
    over: int | None = None  # the lowest whose plan did not
    tolerance = max(4096, int(limit * SLACK))
    at, seen = limit, set()
    for _ in range(TRIES):
        chosen = walk.plan(at)
        if chosen is None or tuple(map(id, chosen)) in seen:
            break
        seen.add(tuple(map(id, chosen)))
        excess = judge(chosen)
        if excess <= 0:
            best = chosen if best is None or cost(chosen) < cost(best) else best
            fits = at
        else:
            over = at
        if -tolerance <= excess <= 0 or (fits is not None and over is not None
                                          and over - fits <= tolerance):  # fmt: skip
            break
        # over: below the walk's own price of the plan by the excess (else the walk could
        # propose the same plan again: it prices a rank's gathers, say, at nothing)
        at = (min(at, walk.price(chosen)) if excess > 0 else at) - excess
        if fits is not None and over is not None and not fits < at < over:
            at = (fits + over) // 2  # (it left the bracket of limits: the bracket's middle)
    return best


def lowest(
    walk: Walk, peak: Judge, seeds: Sequence[Chosen] = (), bounded: bool = False
) -> tuple[Chosen, int]:
    """The plan with the lowest run peak (``peak``: a judge that gives the peak itself) among
    the walk's lowest plan and ``seeds`` (plans written by hand), the cheaper of equal ones;
    and that peak. The empty plan counts: ``peak(())`` is the step without recompute.

    ``bounded`` (``peak`` runs the step the walk's points were profiled on): a plan that cannot
    win by its :func:`floor` is not run (docs/cost-model.md, "The search"); the walk's plan,
    the likeliest lowest, runs first, then the others by their floors."""
    candidates = [c for c in (walk.plan(walk.lowest), (), *seeds) if c is not None]
    floored = [(floor(walk, c) if bounded else 0, c) for c in candidates]  # (each found once)
    if bounded:
        floored = floored[:1] + sorted(floored[1:], key=lambda fc: fc[0])
    seen: set[tuple[int, ...]] = set()
    best: tuple[int, float, Chosen] | None = None
    for low, c in floored:
        key = tuple(map(id, c))
        if key in seen or (bounded and best and (low, cost(c)) >= best[:2]):
            continue  # (it cannot peak lower, nor as low for less)
        seen.add(key)
        run = (peak(c), cost(c), c)
        best = run if best is None or run[:2] < best[:2] else best
    assert best is not None, "the empty plan is always a candidate"
    return best[2], best[0]


def floor(walk: Walk, chosen: Chosen) -> int:
    """A lower bound of the peak of the step with ``chosen`` recomputed: at each point of the
    step without recompute, its bytes less all that the items begun by then saved (the most
    one can free: :attr:`Item.freed` + :attr:`Item.held`), the most of these."""
    points = (*walk.after, *walk.forward)
    return max(
        (b - sum(max(0, i.freed + i.held) for i in chosen if i.start <= p) for p, b in points),
        default=0,
    )


def hand_plans(root: Item, groups: Sequence[Sequence[str]]) -> list[Chosen]:
    """The plans people write by hand for a model whose blocks are each of ``groups`` (module
    paths, :func:`autoremat.record.tree.find_blocks`: blocks of one class, the layers of one
    container): every call of every block recomputed whole; every block's children instead;
    and, for each outermost module that ran several times (a shared layer, a cell stepped in a
    loop), all its calls. Each with the nodes that can be chosen (candidates), empty and
    repeated plans left out."""
    plans: list[tuple[Item, ...]] = []
    for blocks in groups:
        called = tuple(f"{b}@" for b in blocks)  # (``path@k``: a call of a block that ran again)
        calls = [i for i in root.walk() if i.path in blocks or i.path.startswith(called)]
        plans.append(tuple(i for i in calls if i.candidate))
        plans.append(tuple(c for i in calls for c in i.children if c.candidate))
    shared: dict[str, list[Item]] = {}
    _called_again(root, shared)
    plans += [tuple(i for i in found if i.candidate) for found in shared.values()]
    ordered = (tuple(sorted(plan, key=lambda i: i.end)) for plan in plans)
    return list({tuple(map(id, plan)): plan for plan in ordered if plan}.values())


def _called_again(item: Item, found: dict[str, list[Item]]) -> None:
    """Collect in ``found`` the calls of each outermost module that ran several times (its
    nodes named ``path@k``), by path."""
    for child in item.children:
        module, _, call = child.path.rpartition("@")
        if call.isdigit() and module:
            found.setdefault(module, []).append(child)
        else:
            _called_again(child, found)
