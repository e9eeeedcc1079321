"""Curves made light and put on one axis (pure: no torch).

A step has thousands of moments and a figure a thousand pixel columns: :func:`decimated`
keeps, of each column's moments, the lowest and the highest, in the order they came, so every
peak survives. :func:`aligned` places a step without recompute on the axis of the planned
step, whose backward is longer by its recomputes: phase by phase (forward, loss, backward),
each stretched linearly.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned", "decimated", "spans"]


def decimated(xs: Sequence[float], ys: Sequence[int], columns: int) -> list[tuple[float, int]]:
    """The points ``(x, y)`` of a curve with at most about ``2 * columns`` of them: ``xs``
    (ascending, from 0) split into ``columns`` equal stretches of the axis up to its last
    ``x``, each giving its lowest and highest point in their order (one when they are the
    same). The highest point of the curve is always kept."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values for {len(ys)} y values: give one x per y")
    if len(xs) <= 2 * columns:
        return list(zip(xs, ys, strict=True))
    width = (xs[-1] or 1) / columns
    buckets: dict[int, list[int]] = {}
    for k, x in enumerate(xs):
        buckets.setdefault(min(int(x / width), columns - 1), []).append(k)
    points: list[tuple[float, int]] = []
    for members in buckets.values():
        low = min(members, key=lambda k: ys[k])
        high = max(members, key=lambda k: ys[k])
        points += [(xs[k], ys[k]) for k in sorted({low, high})]
    return points


def aligned(lengths: Sequence[int], onto: Sequence[int]) -> list[float]:
    """The x of each moment of a step whose phases last ``lengths`` moments, on the axis of a
    step whose phases last ``onto`` (the same phases, in order): each phase's moments spread
    evenly over its span there."""
    if len(lengths) != len(onto):
        raise ValueError(f"{len(lengths)} phases against {len(onto)}: give the same phases")
    xs: list[float] = []
    start = 0
    for n, m in zip(lengths, onto, strict=True):
        xs += [start + k * m / n for k in range(n)]
        start += m
    return xs


def spans(labels: Sequence[str]) -> list[tuple[int, int, str]]:
    """The runs of equal labels: ``(first, end, label)`` with ``end`` exclusive, labels
    ``""`` left out."""
    found: list[tuple[int, int, str]] = []
    start = 0
    for k in range(1, len(labels) + 1):
        if k == len(labels) or labels[k] != labels[start]:
            if labels[start]:
                found.append((start, k, labels[start]))
            start = k
    return found
