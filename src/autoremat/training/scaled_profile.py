"""Profiles at large batches from real steps at small ones, for models that cannot run on ``meta``.

:func:`autoremat.fit` sizes a model by profiling a copy of it on ``meta`` at each candidate
batch. Code that reads tensor values (``.item()`` in a mask, a kernel whose ``meta`` version
wants other dtypes) cannot run there. :class:`ScaledProfiles` sizes such a model instead from
real steps on its device at small batches ``2 b``, ``4 b`` and ``6 b`` (``b``: the smallest
that runs; batch 1 left out, where some code takes shortcuts): every figure of a profile
(bytes at each point, what each node frees and holds, its recompute's peak, seconds) is taken
as affine in the batch, extrapolated from the first two (:func:`between`), and checked against
the third before any is used: every point, every node's freed bytes and recompute peak must
be exactly affine (storage bytes are whole products of the shapes, so a step whose tensors all
grow with the batch is). A step whose structure changes with the batch (other calls, other
points) or with a term that grows faster (a batch x batch product) is refused with
:class:`NotScalable`, which says so. The peak is the most of the points scaled (a maximum of
affine figures is not affine itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from autoremat.costs.profile import Profile

__all__ = ["NotScalable", "ScaledProfiles", "between", "scaled"]


class NotScalable(ValueError):
    """The step's profile is not affine in the batch: it cannot be extrapolated."""


def between(first: Any, second: Any, t: float) -> Any:
    """``first + (second - first) * t`` through a profile's figures: integers (rounded) and
    floats; tuples, dicts and dataclasses field by field; anything else (names, the tree of
    calls) must be equal and is kept from ``second``.

    Raises:
        NotScalable: the two differ in structure (lengths, keys, names, types).
    """
    if type(first) is not type(second):
        raise NotScalable(f"{type(first).__name__} against {type(second).__name__}")
    if isinstance(first, bool) or first is None or isinstance(first, str):
        if first != second:
            raise NotScalable(f"{first!r} against {second!r}")
        return second
    if isinstance(first, int):
        return round(first + (second - first) * t)
    if isinstance(first, float):  # (seconds: never below none)
        return max(0.0, first + (second - first) * t)
    if isinstance(first, tuple):
        if len(first) != len(second):
            raise NotScalable(f"{len(first)} entries against {len(second)}")
        return tuple(between(a, b, t) for a, b in zip(first, second, strict=True))
    if isinstance(first, dict):
        if first.keys() != second.keys():
            odd = sorted(first.keys() ^ second.keys())[:3]
            raise NotScalable(f"the calls differ from one step to another ({odd} in one only)")
        return {k: between(first[k], second[k], t) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        # (a profile's trees of calls and modules: the second's, whose nodes name the model's)
        kept = ("tree", "module_tree") if isinstance(first, Profile) else ()
        changes = {
            f.name: between(getattr(first, f.name), getattr(second, f.name), t)
            for f in dataclasses.fields(first)
            if f.name not in kept
        }
        return dataclasses.replace(second, **changes)
    return second


def scaled(first: Profile, second: Profile, t: float) -> Profile:
    """:func:`between` two profiles, the peak the most of the points between (a maximum over
    moments is not affine in the batch: which moment is highest changes with it)."""
    found = between(first, second, t)
    peak = max(b for phase in (found.forward_points, found.backward_points) for _, b in phase)
    return dataclasses.replace(found, peak=peak)


class ScaledProfiles:
    """Profiles of a model's step at any batch from real steps at ``2 b``, ``4 b`` and ``6 b``
    (module docstring), ``b`` the smallest batch that runs, whose profile is ``first``.
    ``real(batch)`` profiles one real step at ``batch``."""

    def __init__(self, real: Callable[[int], Profile], b: int, first: Profile) -> None:
        self.real, self.b1 = real, 2 * b
        self.seen: dict[int, Profile] = {b: first}
        self.checked = False

    def profiled(self, batch: int) -> Profile:
        if batch not in self.seen:
            self.seen[batch] = self.real(batch)
        return self.seen[batch]

    def at(self, batch: int) -> Profile:
        """The profile at ``batch``: a real one up to ``6 b`` (one already profiled, or one
        of ``2 b``, ``4 b``, ``6 b``), else scaled from ``2 b`` and ``4 b``.

        Raises:
            NotScalable: the step is not affine in the batch (checked at ``6 b`` first).
        """
        b1, b2 = self.b1, 2 * self.b1
        if batch in self.seen or batch in (b1, b2, 3 * b1) or batch < b1:
            return self.profiled(batch)
        if not self.checked:
            self.check()
        return scaled(self.profiled(b1), self.profiled(b2), (batch - b1) / (b2 - b1))

    def check(self) -> None:
        """Extrapolate to ``6 b`` and compare with the real profile there: the peak, every
        point, every node's freed bytes and recompute peak, to the byte."""
        b1 = self.b1
        real = self.profiled(3 * b1)
        guess = scaled(self.profiled(b1), self.profiled(2 * b1), 2.0)
        pairs = [(guess.peak, real.peak)]
        pairs += [(guess.costs[k].recompute_peak, real.costs[k].recompute_peak) for k in real.costs]
        for phase in ("forward_points", "backward_points"):
            mine, theirs = getattr(guess, phase), getattr(real, phase)
            if [p for p, _ in mine] != [p for p, _ in theirs]:
                raise NotScalable(f"the step's {phase.replace('_', ' ')} change with the batch")
            pairs += [(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True)]
        pairs += [(guess.costs[k].freed, real.costs[k].freed) for k in real.costs]
        worst = max(abs(a - b) for a, b in pairs)
        if worst:
            raise NotScalable(
                f"its step is not linear in the batch: extrapolated from batches {b1} and "
                f"{2 * b1} to {3 * b1}, a figure is off by {worst} bytes "
                f"({worst / real.peak:.2%} of the peak)"
            )
        self.checked = True
