"""What :func:`autoremat.fit` tries: batch sizes profiled on a ``meta`` shadow, each once,
and the :class:`Candidate` each gives (:class:`Prober`; per rank, its subclass
:class:`~autoremat.training.rank_prober.RankProber`)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autoremat.core.devices import model_device
from autoremat.core.huggingface import cache_modules
from autoremat.core.progress import Progress
from autoremat.costs.profile import Profile, profile
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import rehearsal_for
from autoremat.record.shadow import meta_shadow
from autoremat.record.step import Autocast, LossFn
from autoremat.record.tree import ExampleInputsError
from autoremat.training.device_model import DeviceModel
from autoremat.training.device_plan import DevicePlanner
from autoremat.training.optimizer_memory import OptimizerMemory
from autoremat.training.scaled_profile import WINDOWS, NotScalable, ScaledProfiles
from autoremat.training.step_memory import StepMemory, step_memory

__all__ = ["Candidate", "Inputs", "Probe", "Prober", "narrow", "on_meta", "step_seconds"]

logger = logging.getLogger(__name__)
Inputs = Callable[[int], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True)
class Candidate:
    """One batch size considered: the whole step's memory predicted with its ``plan`` (the
    plan at the device's memory; ``None`` when it needs none), with no recompute
    (``without``), and the predicted step seconds and samples per second with the plan."""

    batch: int
    memory: StepMemory
    without: StepMemory
    plan: Plan | None
    seconds: float
    output_bytes: int = 0  # the model's output at this batch

    @property
    def samples_per_second(self) -> float:
        return self.batch / self.seconds if self.seconds > 0 else math.inf

def step_seconds(prof: Profile, plan: Plan | None) -> float:
    """A training step's seconds as ``prof`` prices it: the forward's ops (timed, or on
    ``meta`` estimated from FLOPs and bytes written) and their per-op overhead, three times
    (forward and a backward of about twice its work), plus what ``plan``'s recomputes add."""
    root = prof[prof.tree.path]
    forward = root.op_seconds + root.ops * prof.op_overhead
    return 3 * forward + (0.0 if plan is None else plan.recompute_seconds or 0.0)


@dataclass
class Probe:
    """One batch size profiled on ``meta``: its inputs, profile, and the planner of its plans
    (a :class:`DevicePlanner`, or a rank's); :attr:`lowest`, the whole step's memory with the
    lowest plan, its plans run when first asked."""

    batch: int
    inputs: tuple[Any, dict[str, Any]]
    profile: Profile
    planner: Any

    @functools.cached_property
    def lowest(self) -> StepMemory:
        return self.planner.lowest()


class Prober:
    """Profiles the model's ``meta`` shadow at batch sizes, each once; or, for a model whose
    step cannot run on ``meta``, scales real steps at small batches
    (:mod:`autoremat.training.scaled_profile`)."""

    def __init__(self, model: nn.Module, make_inputs: Inputs, opt: OptimizerMemory,
                 dm: DeviceModel, loss_fn: LossFn | None, selective: bool,
                 autocast: Autocast | None = None) -> None:  # fmt: skip
        self.model, self.shadow = model, meta_shadow(model)
        self.make_inputs, self.opt, self.dm = make_inputs, opt, dm
        self.loss_fn, self.selective, self.autocast = loss_fn, selective, autocast
        self.seen: dict[int, Probe] = {}
        self.plain: dict[int, StepMemory] = {}
        self.caches = bool(cache_modules(self.shadow))  # a Hugging Face model's
        self.progress = Progress("fitting", 40, "batch sizes profiled on meta")
        self.scaled: ScaledProfiles | None = None
        self.not_on_meta = ""  # why the step cannot run on meta, once it could not
        self.by_allocator = False  # real steps on the CPU, by its allocator (on_the_device)
        self.hands: set[int] | None = None  # the hand plans each lowest runs (None: all)

    def meta_inputs(self, batch: int) -> tuple[Any, Any]:
        """``make_inputs(batch)`` made under ``torch.device("meta")``, every tensor on it."""
        with torch.device("meta"):
            args, kwargs = self.make_inputs(batch)
        return tree_map(on_meta, (args, kwargs))

    def probe(self, batch: int) -> Probe:
        if batch not in self.seen:
            args, kwargs = self.meta_inputs(batch)
            prof = self.profile(batch, args, kwargs)
            found = DevicePlanner(self.model, prof, self.dm, self.opt, self.rehearsal(batch, prof),
                                  self.selective, inputs=(args, kwargs))  # fmt: skip
            found.planner.hands = self.hands
            self.seen[batch] = Probe(batch, (args, kwargs), prof, found)
            self.progress.step(f"batch {batch}")
        return self.seen[batch]

    def rehearsal(self, batch: int, prof: Profile) -> Any:
        """What runs the plans' steps at ``batch``: the profile's own step (counted as the
        model's device holds it; by its allocator on the device), or real steps scaled."""
        if self.scaled is not None and prof.step is None:
            return self.scaled.rehearsal_at(batch, self.dm.device)
        memory = "allocator" if self.by_allocator else "tensors"
        return rehearsal_for(prof, self.dm.device, memory)

    def profile(self, batch: int, args: Any, kwargs: Any) -> Profile:
        """The step's profile at ``batch`` (``args``, ``kwargs`` on ``meta``): the shadow's,
        or, once the shadow cannot run and the real model can, scaled from real steps."""
        if self.by_allocator:
            return self.real(batch, timed=False)
        if self.scaled is None:
            try:
                return profile(self.shadow, args, kwargs, loss_fn=self.loss_fn,
                               autocast=self.autocast)  # fmt: skip
            except Exception as exc:
                if model_device(self.model).type == "meta":
                    raise
                first = self.real(batch)  # (its own error, when the real step fails too)
                self.not_on_meta = _why_not_on_meta(exc)
                self.scaled = ScaledProfiles(self.real, batch, first)
                logger.warning(
                    "fit: sizing %s from real steps on %s at batches %d, %d and %d (up to %d), "
                    "scaled, as its step cannot run on meta, where fit sizes a model without "
                    "its memory (%s); no action needed", type(self.model).__name__,
                    model_device(self.model), 2 * batch, 4 * batch, 6 * batch,
                    2 * (WINDOWS + 2) * batch, self.not_on_meta,
                )  # fmt: skip
        try:
            return self.scaled.at(batch)
        except NotScalable as exc:
            raise NotScalable(
                f"fit cannot size {type(self.model).__name__}: its step cannot run on meta "
                f"({self.not_on_meta}), and scaling real steps fails: {exc}. Plan a fixed "
                f"batch instead (autoremat.plan(model, args, kwargs, device_memory=...))"
            ) from None

    def real(self, batch: int, timed: bool = True) -> Profile:
        """A real step of the model on its device at ``batch``, profiled (``timed`` as
        :func:`~autoremat.costs.profile.profile` has it)."""
        device = model_device(self.model)
        args, kwargs = tree_map(
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, self.make_inputs(batch)
        )
        return profile(self.model, args, kwargs, loss_fn=self.loss_fn, autocast=self.autocast,
                       timed=timed)  # fmt: skip

    def on_the_device(self, top: int) -> Prober:
        """A prober like this one that profiles real steps on the model's device and runs
        their plans counted by the CPU allocator (kernels' scratch included); its lowest
        plans run, beside the walk's own, only the hand plan that was the lowest at ``top``
        on ``meta`` (each a real step: the same plan is the lowest at nearby batches)."""
        found = Prober(self.model, self.make_inputs, self.opt, self.dm, self.loss_fn,
                        self.selective, self.autocast)  # fmt: skip
        found.by_allocator = True
        planner = self.probe(top).planner.planner
        planner.lowest()
        found.hands = set() if planner.won is None else {planner.won}
        found.progress = Progress("checking", 12, "batch sizes profiled on the device")
        return found

    def settle(self, guess: int, recompute: bool = True) -> int:
        """The largest batch up to ``guess`` that fits as this prober sees it, by runs (the
        lowest plan's, or no recompute), when ``guess + 1`` is known not to (0: none): a
        handful of steps (:func:`narrow`), ``guess`` first."""
        memory_of = (lambda b: self.probe(b).lowest) if recompute else self.without
        return narrow(0, guess + 1, memory_of, self.dm.limit, guess, bounded=True)

    def without(self, batch: int) -> StepMemory:
        """The whole step's memory of the model's own step at ``batch``, no recompute: a
        Hugging Face model fills its key/value cache then (no applied plan lets it), so that
        step is run once more, only for the batches asked."""
        if batch not in self.plain:
            probe = self.probe(batch)
            planner = probe.planner
            peak = probe.profile.peak
            if (self.caches or self.by_allocator) and probe.profile.step is not None:
                peak = planner.planner.rehearsal.peak(None)
            self.plain[batch] = step_memory(self.shadow, probe.inputs, peak, self.opt, self.dm,
                                            scratch=self.by_allocator)  # fmt: skip
        return self.plain[batch]

    def need(self, batch: int, recompute: bool = True) -> StepMemory:
        """``batch``'s whole step with the lowest plan (``recompute``) or none, as
        :meth:`largest` first judges it: the walk's own lowest price when it fits (its guess:
        :meth:`largest` checks the batch it finds by runs), else the runs' lowest."""
        if not recompute:
            return self.without(batch)
        probe = self.probe(batch)
        bound = probe.planner.bound()
        if bound is not None and bound.device <= self.dm.limit:
            return bound
        return probe.lowest

    def smallest_running(self, top: int) -> int:
        """The smallest of 1, 2, 4, ... (up to ``top``) whose step runs: a model normalising
        over one value per channel at batch 1 (timm LeViT's BatchNorm on its last stage's
        single token) runs from batch 2 on. Raises the first batch's error when none runs."""
        batch, first = 1, None
        while True:
            try:
                self.probe(batch)
                return batch
            except ExampleInputsError as exc:
                first = first or exc
                if 2 * batch > top:
                    raise first from None
                batch *= 2

    def largest(self, top: int, recompute: bool = True) -> int:
        """The largest batch in ``1..top`` that fits (0: none), from the smallest batch that
        runs (:meth:`smallest_running`) by the line through the memory of the batches tried
        (:func:`narrow`), each judged by :meth:`need`; the one found is checked by runs
        (:meth:`need` may take the walk's word, which can be a little low)."""
        first = self.smallest_running(top)
        # (from first - 1, which fits or runs not: first is the first batch judged)
        memory_of = lambda b: self.need(b, recompute)  # noqa: E731
        lo = narrow(first - 1, top + 1, memory_of, self.dm.limit, first, bounded=False)
        if lo < first:
            return 0
        if recompute and self.probe(lo).lowest.device > self.dm.limit:
            return self.settle(lo - 1)
        return lo

    def candidate(self, batch: int) -> Candidate:
        """``batch`` planned at what the device leaves for the step."""
        probe = self.probe(batch)
        prof = probe.profile
        plan, memory = probe.planner.planned()
        chosen = plan if plan.modules else None
        out = prof[prof.tree.path].output_bytes
        return Candidate(batch, memory, self.without(batch), chosen, step_seconds(prof, chosen),
                         out)  # fmt: skip


def on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def narrow(lo: int, hi: int, memory_of: Callable[[int], StepMemory], limit: int, batch: int,
           bounded: bool) -> int:  # fmt: skip
    """The largest batch in ``lo..hi - 1`` whose device memory (``memory_of``) is within
    ``limit``, when ``lo`` fits or is not judged (0, or the batch below the first that runs:
    ``lo`` comes back when nothing above it fits) and ``hi`` does not (``bounded``) or is
    beyond the batches allowed, trying ``batch`` first. Pure: ``memory_of`` is asked once per
    batch tried.

    The step's memory grows about linearly with the batch, so each next batch tried is where
    the line through the two nearest tried (:func:`_crossing`: while none above was tried, the
    two largest below) meets ``limit``, kept strictly between ``lo`` and ``hi``; from the third
    on, every other try bisects instead, or doubles ``lo`` while nothing bounds it (the line
    may be off)."""
    need: dict[int, int] = {}
    while hi - lo > 1:
        memory = memory_of(batch)
        need[batch] = memory.device
        fixed = memory.parameters + memory.buffers + memory.optimizer_state
        lo, hi = (batch, hi) if need[batch] <= limit else (lo, batch)
        guess = _crossing(need, lo, hi, fixed, limit)
        if len(need) >= 3 and len(need) % 2:  # (then bisection: the line may be off)
            guess = (lo + hi) // 2 if bounded or hi in need else 2 * lo
        batch = min(hi - 1, max(lo + 1, guess))
    return lo


def _crossing(need: dict[int, int], lo: int, hi: int, fixed: int, limit: int) -> int:
    """The batch at which the line through the memory needed at two batches tried reaches
    ``limit``, rounded down: ``lo`` and ``hi`` when both were tried, else the two largest tried
    up to ``lo`` (else ``fixed`` bytes at batch 0 and the one). More than ``fixed`` does not
    grow with the batch (the gradients, the optimizer's step, a rank's FSDP2 gathers), so a
    line from batch 0 would undershoot."""
    if lo in need and hi in need:
        (b0, m0), (b1, m1) = (lo, need[lo]), (hi, need[hi])
    else:
        known = [(b, need[b]) for b in sorted(need) if b <= lo] or [(hi, need[hi])]
        (b0, m0), (b1, m1) = [(0, fixed), *known][-2:]
    if m1 <= m0:
        return b1
    return math.floor(b0 + (limit - m0) * (b1 - b0) / (m1 - m0))


def _why_not_on_meta(exc: Exception) -> str:
    """What failed on ``meta``, in a line: the module and the error it raised (not the advice
    on example inputs an :class:`ExampleInputsError` gives: those ran on the device)."""
    if not isinstance(exc, ExampleInputsError) or exc.__cause__ is None:
        return str(exc).splitlines()[0][:200]
    cause = exc.__cause__
    return (
        f"in module {exc.where or '(root)'!r}: "
        f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}"
    )
