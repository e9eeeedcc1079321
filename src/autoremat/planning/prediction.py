"""The predicted step peak of a plan: the cost model's answer for a set of planning items.

:func:`predict_peak` prices a set of :class:`~autoremat.planning.solver.Item` recomputed
together (``autoremat.planning.solver``'s module docstring states the model), with every term
the solver's walk counts and those only the estimate counts (a first call's weight copy gone
early, inputs the step holds anyway: :attr:`Item.late_casts`, :attr:`Item.alive_inputs`).
Pure, like the solver: items and points in, bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoremat.planning.solver import Item, Late

__all__ = ["predict_peak"]


def predict_peak(
    points: Sequence[tuple[int, int]],
    chosen: Sequence[Item],
    forward: Sequence[tuple[int, int]] = (),
) -> int:
    """The predicted step peak when the ``chosen`` nodes are recomputed (module docstring).

    ``forward`` are the points of the forward pass, where a chosen node part-way through its
    own forward holds :meth:`Item.held_at` bytes more; ``points`` the others (at those inside
    its span it holds :meth:`Item.held_back` more). Points given only in ``points``
    are priced as the latter, an upper bound. A chosen item's :attr:`Item.recasts` count at
    its recompute and at the moments of its backward while they live
    (:meth:`Item.recast_with`)."""
    recast = {id(s): s.recast_with(chosen) for s in chosen}
    lates = {id(s): s.late_freed(chosen) for s in chosen}
    late = _late(list(lates.values()))
    after = [
        *(
            (
                p,
                b
                - late.points.get(p, 0)
                + sum(s.held_back(p) for s in chosen if s.start <= p <= s.end),
            )
            for p, b in points
        ),
        *((s.start, s.recompute_peak + recast[id(s)][0] - lates[id(s)].first) for s in chosen),
        *(m for s in chosen for m in recast[id(s)][1]),
    ]  # fmt: skip
    during = [
        (p, b + sum(s.held_at(p) for s in chosen if s.start < p <= s.end)) for p, b in forward
    ]
    credit = {id(s): s.input_credit(chosen) for s in chosen}
    freed = {id(s): s.freed + s.shared_freed(chosen) + credit[id(s)] for s in chosen}
    in_forward = {id(s): s.freed_in_forward + credit[id(s)] for s in chosen}
    spans = {(c.start, c.end) for c in chosen}
    alive = [
        (s.start, b, until, above)
        for s in chosen
        for b, until, above, earlier in s.alive_inputs
        if not any(h in spans for h in earlier)
    ]
    return max(
        [
            *(
                b
                - sum(freed[id(s)] for s in chosen if s.end < p)
                - sum(size for size, lo, hi, held in late.spans if _between(p, lo, hi, held))
                - sum(size for _, size, _, above in alive if above < p)
                for p, b in after
            ),
            *(
                b
                - sum(in_forward[id(s)] for s in chosen if s.end < p)
                - sum(size for start, size, until, _ in alive if start < p < until)
                for p, b in during
            ),
        ],
        default=0,
    )


def _between(p: int, lo: int, hi: int, held: tuple[tuple[int, int], ...]) -> bool:
    """Whether point ``p`` is strictly between ``lo`` and ``hi`` and in none of ``held``."""
    return lo < p < hi and not any(a <= p <= b for a, b in held)


def _late(lates: Sequence[Late]) -> Late:
    """Chosen items' :meth:`Item.late_freed` together: at a point, the most one of them takes
    off (each counts its copy gone from some stretches on; their sum could count a moment
    twice); ``first`` stays per item (:func:`predict_peak` reads it from each)."""
    found = Late()
    for late in lates:
        found.spans += late.spans
        for p, b in late.points.items():
            found.points[p] = max(found.points.get(p, 0), b)
    return found
