"""Profiles at large batches from real steps at small ones, for models that cannot run on ``meta``.

:func:`autoremat.fit` sizes a model by profiling a copy of it on ``meta`` at each candidate batch.
Code that reads tensor values (``.item()`` in a mask, a kernel whose ``meta`` version wants other
dtypes) cannot run there. :class:`ScaledProfiles` sizes such a model instead from real steps on its
device at small batches ``2 b``, ``4 b`` and ``6 b`` (``b``: the smallest that runs; batch 1 left
out, where some code takes shortcuts): every figure of a profile (bytes at each point, what each
node frees and holds, its recompute's peak, seconds) is taken as affine in the batch, extrapolated
from the first two (:func:`between`), and checked against the third before any is used (when that
fails, the next window, 4 b and 6 b against 8 b, up to :data:`WINDOWS`: a figure that is the most of
several, a recompute's highest moment, becomes affine once one moment stays the highest): every
point, every node's freed bytes and recompute peak must be exactly affine (storage bytes are whole
products of the shapes, so a step whose tensors all grow with the batch is). A step whose structure
changes with the batch (other calls, other points) or with a term that grows faster (a batch x batch
product) is refused with :class:`NotScalable`, which says so. The peak is the most of the points
scaled (a maximum of affine figures is not affine itself).

A step whose memory depends on values drawn at random (Wav2Vec2's SpecAugment masks, drawn from
NumPy's generator, index the hidden states: their count changes the bytes) is never exactly
affine. When no window is, the last window's third batch is profiled again: if the two draws
differ, the step is *jittery*, and a window missing by at most :data:`JITTER` of its peak is
taken, every point scaled raised by that miss in proportion to the batch
(:meth:`ScaledProfiles.headroom`). A deterministic step (two draws the same) still has to be
exact: a batch x batch term is refused, however small. A batch x batch term hidden in a jittery
step is not seen; ``fit``'s check on the device (``verify``) is what catches it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from autoremat.core.host_rng import generators_kept
from autoremat.costs.profile import Profile
from autoremat.planning.rehearsal import CannotRun, PlanFields, Rehearsal, rehearsal_for

__all__ = [
    "JITTER",
    "WINDOWS",
    "NotScalable",
    "ScaledProfiles",
    "ScaledRehearsal",
    "between",
    "off_by",
    "scaled",
]


class NotScalable(ValueError):
    """The step's profile is not affine in the batch: it cannot be extrapolated."""


def between(first: Any, second: Any, t: float, where: str = "profile") -> Any:
    """``first + (second - first) * t`` through a profile's figures: integers (rounded) and
    floats; tuples, dicts and dataclasses field by field; anything else (names, the tree of
    calls) must be equal and is kept from ``second``.

    Raises:
        NotScalable: the two differ in structure (lengths, keys, names, types); the message
            names the figure (``where``, as ``profile.costs['block'].ways``).
    """
    if type(first) is not type(second):
        raise NotScalable(f"{where}: {type(first).__name__} against {type(second).__name__}")
    if isinstance(first, bool) or first is None or isinstance(first, str):
        if first != second:
            raise NotScalable(f"{where}: {first!r} against {second!r}")
        return second
    if isinstance(first, int):
        return round(first + (second - first) * t)
    if isinstance(first, float):  # (seconds: never below none)
        return max(0.0, first + (second - first) * t)
    if isinstance(first, tuple):
        if len(first) != len(second):
            raise NotScalable(f"{where}: {len(first)} entries against {len(second)}")
        return tuple(
            between(a, b, t, f"{where}[{i}]")
            for i, (a, b) in enumerate(zip(first, second, strict=True))
        )
    if isinstance(first, dict):
        if first.keys() != second.keys():
            odd = sorted(map(str, first.keys() ^ second.keys()))[:3]
            raise NotScalable(f"{where}: the calls differ ({odd} in one only)")
        return {k: between(first[k], second[k], t, f"{where}[{k!r}]") for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        # (a profile's trees of calls and modules: the second's, whose nodes name the model's)
        kept = ("tree", "module_tree", "step") if isinstance(first, Profile) else ()
        changes = {
            f.name: between(
                getattr(first, f.name), getattr(second, f.name), t, f"{where}.{f.name}"
            )
            for f in dataclasses.fields(first)
            if f.name not in kept
        }
        return dataclasses.replace(second, **changes)
    return second


def scaled(first: Profile, second: Profile, t: float, headroom: int = 0) -> Profile:
    """:func:`between` two profiles, every point raised by ``headroom`` bytes, the peak the
    most of the points (a maximum over moments is not affine in the batch: which moment is
    highest changes with it)."""
    found = between(first, second, t)
    forward, backward = (
        tuple((p, b + headroom) for p, b in phase)
        for phase in (found.forward_points, found.backward_points)
    )
    peak = max(b for _, b in (*forward, *backward))
    return dataclasses.replace(  # (no step ran at that batch)
        found, peak=peak, forward_points=forward, backward_points=backward, step=None
    )


WINDOWS = 3  # batches tried: (2b, 4b, 6b), then (4b, 6b, 8b), then (6b, 8b, 10b)
JITTER = 0.0025  # the most a jittery step's window may miss, a fraction of its third's peak
REDRAW_SEED = 20_260_701  # the generators' seed for the second draw (ScaledProfiles.redrawn)


class ScaledRehearsal:
    """Plans' steps at a batch no step ran at (``batch``, beyond those of ``profiles``, a
    :class:`ScaledProfiles`): each plan's step run for real at small batches and its peak
    extrapolated affinely, from the first window of three batches whose first two give the
    third to the byte (a peak is the most of several moments, and which is highest changes
    with the batch: from a window where one stays highest, the line holds). ``device``: as
    :func:`~autoremat.planning.rehearsal.rehearsal_for` takes it."""

    way, eager = "real", True

    def __init__(self, profiles: ScaledProfiles, batch: int, device: str | None = None):
        self.profiles, self.batch, self.device = profiles, batch, device
        self.rng_state = self.run(profiles.b1).rng_state
        self.how = f"real steps at smaller batches, scaled to batch {batch}"
        if profiles.jitter is not None:  # (jittery: module docstring)
            self.how += (
                f", plus {profiles.headroom(batch):,} bytes or more of headroom (the memory of "
                f"its steps varies between draws)"
            )

    def run(self, batch: int) -> Rehearsal:
        return rehearsal_for(self.profiles.profiled(batch), self.device)

    def peak(self, plan: PlanFields | None) -> int:
        """The step's peak at the batch with ``plan`` (as :meth:`Rehearsal.peak`).

        Raises:
            CannotRun: no window of :data:`WINDOWS` extrapolates its third batch."""
        b1, misses, jittery = self.profiles.b1, [], self.profiles.jitter is not None
        for k in range(1, WINDOWS + 1):
            low, high, third = k * b1, (k + 1) * b1, (k + 2) * b1
            first, second, last = (self.run(b).peak(plan) for b in (low, high, third))
            slope = (second - first) / (high - low)
            off = round(first + slope * (third - low)) - last
            if abs(off) <= (JITTER * last if jittery else 0):
                headroom = self.profiles.headroom(self.batch, abs(off))
                return round(first + slope * (self.batch - low)) + headroom
            misses.append(f"from {low} and {high} to {third}: {off:+d} B")
        raise CannotRun(f"its step is not linear in the batch ({'; '.join(misses)})")


class ScaledProfiles:
    """Profiles of a model's step at any batch from real steps at ``2 b``, ``4 b`` and ``6 b``
    (module docstring), ``b`` the smallest batch that runs, whose profile is ``first``.
    ``real(batch)`` profiles one real step at ``batch``. A figure that is the most of several
    (a node's recompute peak: its highest moment) is affine only once one moment stays the
    highest: when the check at ``6 b`` fails, the next window (``4 b`` and ``6 b`` checked at
    ``8 b``), up to :data:`WINDOWS`, is tried before the step is refused."""

    def __init__(self, real: Callable[[int], Profile], b: int, first: Profile) -> None:
        self.real, self.b1 = real, 2 * b
        self.seen: dict[int, Profile] = {b: first}
        self.base: tuple[int, int] | None = None  # the two batches scaled from, once checked
        # a jittery step's (module docstring): the most a figure missed, and at which batch
        self.jitter: tuple[int, int] | None = None

    def headroom(self, batch: int, missed: int = 0) -> int:
        """The bytes added to a figure scaled to ``batch``: none for a step that scaled
        exactly; for a jittery one, the most a figure missed (or ``missed``, if more), in
        proportion to the batch (the draws are made per sample)."""
        if self.jitter is None:
            return 0
        worst, third = self.jitter
        return math.ceil(max(worst, missed) * batch / third)

    def profiled(self, batch: int) -> Profile:
        if batch not in self.seen:
            self.seen[batch] = self.real(batch)
        return self.seen[batch]

    def at(self, batch: int) -> Profile:
        """The profile at ``batch``: a real one below the checked window's second batch (or
        one already profiled), else scaled from the checked window's first two batches.

        Raises:
            NotScalable: the step is not affine in the batch (checked before any is scaled).
        """
        if batch in self.seen or batch < self.b1:
            return self.profiled(batch)
        if self.base is None:
            self.base = self.check()
        low, high = self.base
        if batch < high:
            return self.profiled(batch)
        t = (batch - low) / (high - low)
        return scaled(self.profiled(low), self.profiled(high), t, self.headroom(batch))

    def rehearsal_at(self, batch: int, device: str | None = None) -> Any:
        """What runs plans' steps at ``batch``: real steps there (below the window checked,
        or profiled already), else real steps at smaller batches, scaled
        (:class:`ScaledRehearsal`)."""
        if batch in self.seen or batch < self.b1:
            return rehearsal_for(self.profiled(batch), device)
        if self.base is None:
            self.base = self.check()
        if batch < self.base[1]:
            return rehearsal_for(self.profiled(batch), device)
        return ScaledRehearsal(self, batch, device)

    def check(self) -> tuple[int, int]:
        """The first window ``(k b1, (k + 1) b1)`` whose extrapolation to ``(k + 2) b1`` is
        the real profile there to the byte (:func:`off_by`); when none is, for a jittery step
        (module docstring), the first that misses by at most :data:`JITTER` of its peak.

        Raises:
            NotScalable: none is; the message gives each window's miss.
        """
        found = []
        for low, high, third in ((k * self.b1, (k + 1) * self.b1, (k + 2) * self.b1)
                                 for k in range(1, WINDOWS + 1)):  # fmt: skip
            try:
                worst = off_by(
                    scaled(self.profiled(low), self.profiled(high), 2.0), self.profiled(third)
                )
            except NotScalable as exc:
                raise NotScalable(
                    f"its step is not the same at batches {low}, {high} and {third}: {exc}"
                ) from None
            if not worst:
                return low, high
            found.append((low, high, third, worst))
        last = found[-1][2]
        try:
            jitter = off_by(self.profiled(last), self.redrawn(last))
        except NotScalable as exc:
            raise NotScalable(f"two draws at batch {last} differ: {exc}") from None
        for low, high, third, worst in found:
            if jitter and worst <= JITTER * self.profiled(third).peak:
                self.jitter = (max(worst, jitter), third)
                return low, high
        misses = [
            f"from {low} and {high} to {third}, a figure is off by {worst} bytes "
            f"({worst / self.profiled(third).peak:.2%} of the peak)"
            for low, high, third, worst in found
        ]
        why = f"; two draws at batch {last} differ by {jitter} bytes" if jitter else ""
        raise NotScalable(
            f"its step is not linear in the batch: extrapolated {'; '.join(misses)}{why}"
        )

    def redrawn(self, batch: int) -> Profile:
        """A real step at ``batch`` again, every random generator (torch's, Python's and NumPy's)
        drawing from another seed; all put back after it."""
        cuda = torch.cuda.is_initialized()  # (no step ran on CUDA if not)
        with generators_kept(range(torch.cuda.device_count()) if cuda else ()):
            random.seed(REDRAW_SEED)
            torch.default_generator.manual_seed(REDRAW_SEED)
            if cuda:
                torch.cuda.manual_seed_all(REDRAW_SEED)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(REDRAW_SEED)
            return self.real(batch)


def off_by(guess: Profile, real: Profile) -> int:
    """The most bytes by which ``guess`` misses ``real``: the peak, every point, every node's
    freed bytes and recompute peak (0: to the byte).

    Raises:
        NotScalable: the two have other points.
    """
    if guess.costs.keys() != real.costs.keys():
        odd = sorted(map(str, guess.costs.keys() ^ real.costs.keys()))[:3]
        raise NotScalable(f"profile.costs: the calls differ ({odd} in one only)")
    pairs = [(guess.peak, real.peak)]
    pairs += [(guess.costs[k].recompute_peak, real.costs[k].recompute_peak) for k in real.costs]
    for phase in ("forward_points", "backward_points"):
        mine, theirs = getattr(guess, phase), getattr(real, phase)
        if [p for p, _ in mine] != [p for p, _ in theirs]:
            raise NotScalable(f"the step's {phase.replace('_', ' ')} change with the batch")
        pairs += [(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True)]
    pairs += [(guess.costs[k].freed, real.costs[k].freed) for k in real.costs]
    return max(abs(a - b) for a, b in pairs)
