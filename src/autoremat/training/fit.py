"""Fitting a device: the largest batch whose cheapest plan fits, and the fastest plan for it.

:func:`fit` answers "my GPU has 24 GiB: what is the biggest batch I can train, and how do I
get there with the least slowdown?" without running the model at each candidate size:

1. a *shadow* of the model on ``meta`` (its structure, no memory, no copy of the weights) is
   profiled at each candidate batch (inputs made by ``make_inputs(batch)`` under
   ``torch.device("meta")``); the profile on ``meta`` predicts what the real one would
   (``tests/test_calls.py``, ``tests/test_measure.py``);
2. a batch *fits* when the whole step's memory (:mod:`autoremat.training.step_memory`: parameters,
   buffers, inputs, optimizer state and step, and the step peak of the plan at the lowest budget)
   fits the device (:mod:`autoremat.training.device_model`); the largest such batch is found by
   doubling, then bisection (one ``meta`` profile per candidate);
3. the plan for it is the cheapest whose predicted peak fits what the device leaves for the
   step; with ``objective="throughput"`` a few smaller batches are planned too, and the one
   with the most predicted samples per second is chosen (:func:`step_seconds`);
4. on a CPU (when checking, within the RAM available), ``meta`` cannot show kernels' scratch,
   so the batch is sized again from real steps profiled by the CPU allocator
   (``profile(memory="allocator")``), a few batches at and below the one found on ``meta``
   (:meth:`_Prober.settle`): the batch returned fits by the allocator's figure, the next size
   up does not;
5. once, on the device: the plan applied, real optimizer steps at that batch
   (:func:`autoremat.measure_training`; on a CPU by its allocator too), the model put back.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autoremat.core.devices import model_device
from autoremat.core.huggingface import cache_modules
from autoremat.core.progress import Progress
from autoremat.core.sizes import format_size
from autoremat.costs.profile import Profile, profile
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.plans import Plan
from autoremat.record.memory import cpu_allocator_countable
from autoremat.record.step import Autocast, LossFn, StepHow, autocast_spec
from autoremat.record.tree import ExampleInputsError
from autoremat.training.device_model import DeviceModel, available_memory, device_model
from autoremat.training.measure_training import TrainingMeasurement, measure_training
from autoremat.training.optimizer_memory import OptimizerLike, OptimizerMemory, optimizer_memory
from autoremat.training.plan_for_device import plan_fitting
from autoremat.training.scaled_profile import NotScalable, ScaledProfiles
from autoremat.training.step_memory import (
    StepMemory,
    buffer_copies,
    checkpointed_calls,
    step_memory,
)
from autoremat.wrap.wrapping import remove

__all__ = [
    "FIT_OBJECTIVES",
    "Candidate",
    "Fit",
    "fit",
    "meta_shadow",
    "step_seconds",
]

logger = logging.getLogger(__name__)

# What fit maximises (``fit(objective=...)``).
FIT_OBJECTIVES = ("batch", "throughput")
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


@dataclass(frozen=True)
class Fit:
    """What :func:`fit` found: the ``batch`` and its ``plan`` (empty when it needs no
    recompute), the device, the candidates planned, the largest batch without recompute, and
    the check on the device (``measured``; ``None`` when not verified)."""

    batch: int
    plan: Plan
    device: DeviceModel
    candidates: tuple[Candidate, ...]
    largest_without_recompute: int
    measured: TrainingMeasurement | None = None
    objective: str = "batch"
    chosen: Candidate | None = field(default=None, repr=False)
    # why the check on the device did not run ("": it ran, or verify=False / meta)
    not_verified: str = ""
    # the batches sized again from real steps by the CPU allocator (kernels' scratch)
    by_allocator: tuple[int, ...] = ()

    @property
    def fits(self) -> bool | None:
        """Whether the measured step fitted the device (``None``: not verified): on CUDA the
        allocator's most reserved bytes plus the runtime's, on the CPU its allocator's most,
        elsewhere the tensors'."""
        if self.measured is None:
            return None
        return self.seen <= self.device.limit

    @property
    def seen(self) -> int:
        """What the device held at most in the measured step, as :attr:`fits` counts it."""
        assert self.measured is not None, "not verified"
        if self.measured.allocated is not None:
            return self.measured.allocated
        if self.measured.reserved is None:
            return self.measured.tensors
        return self.measured.reserved + self.device.runtime

    def __str__(self) -> str:
        lines = [
            f"batch {self.batch} fits {self.device}; the largest without recompute: "
            f"{self.largest_without_recompute} (objective {self.objective})",
            f"plan: {len(self.plan.modules)} entries, recompute adds "
            f"{(self.plan.recompute_flops or 0) / 1e9:.3f} GFLOP",
        ]
        if self.chosen is not None:
            lines += ["predicted memory:", str(self.chosen.memory)]
            lines.append(
                f"assumed: each step's tensors are freed before the next forward; a loop that "
                f"keeps the output alive through it needs {format_size(self.chosen.output_bytes)} "
                f"more (reserve=..., --reserve)"
            )
        if self.by_allocator:
            tried = ", ".join(map(str, sorted(self.by_allocator)))
            lines.append(f"sized from real steps by the CPU allocator (kernels' scratch counted) "
                         f"at batches {tried}")  # fmt: skip
        if self.measured is not None:
            lines.append(f"measured: {self.measured} ({'fits' if self.fits else 'DOES NOT FIT'})")
        elif self.device.device == "meta":
            lines.append("measured: not verified (the model is on meta, where nothing runs)")
        elif self.not_verified:
            lines.append(f"measured: not verified ({self.not_verified})")
        else:
            lines.append("measured: not verified (verify=False)")
        lines.append("candidates: batch, predicted device memory, predicted samples/s")
        lines += [
            f"  {c.batch:>6}  {format_size(c.memory.device):>11}  {c.samples_per_second:>10.1f}"
            for c in self.candidates
        ]
        return "\n".join(lines)


def meta_shadow(model: nn.Module, shared: tuple[object, ...] = ()) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta``: the same structure
    and attributes, no memory, no copy of the values; the objects of ``shared`` (a trainer a
    module refers to) are referred to, not copied."""
    memo: dict[int, Any] = {id(obj): obj for obj in shared}
    for t in [*model.parameters(), *model.buffers()]:
        shadow = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            shadow = nn.Parameter(shadow, requires_grad=t.requires_grad)
        memo[id(t)] = shadow
    return copy.deepcopy(model, memo)


def step_seconds(prof: Profile, plan: Plan | None) -> float:
    """A training step's seconds as ``prof`` prices it: the forward's ops (timed, or on
    ``meta`` estimated from FLOPs and bytes written) and their per-op overhead, three times
    (forward and a backward of about twice its work), plus what ``plan``'s recomputes add."""
    root = prof[prof.tree.path]
    forward = root.op_seconds + root.ops * prof.op_overhead
    return 3 * forward + (0.0 if plan is None else plan.recompute_seconds or 0.0)


@dataclass(frozen=True)
class _Probe:
    """One batch size profiled on ``meta``: its inputs, profile, and the whole step's memory
    at the lowest budget."""

    batch: int
    inputs: tuple[Any, dict[str, Any]]
    profile: Profile
    lowest: StepMemory
    lowest_plan: Plan | None = None  # the plan at the lowest budget, when its calls count


class _Prober:
    """Profiles the model's ``meta`` shadow at batch sizes, each once; or, for a model whose
    step cannot run on ``meta``, scales real steps at small batches
    (:mod:`autoremat.training.scaled_profile`)."""

    def __init__(self, model: nn.Module, make_inputs: Inputs, opt: OptimizerMemory,
                 dm: DeviceModel, loss_fn: LossFn | None, selective: bool,
                 autocast: Autocast | None = None) -> None:  # fmt: skip
        self.model, self.shadow = model, meta_shadow(model)
        self.make_inputs, self.opt, self.dm = make_inputs, opt, dm
        self.loss_fn, self.selective, self.autocast = loss_fn, selective, autocast
        self.seen: dict[int, _Probe] = {}
        self.plain: dict[int, StepMemory] = {}
        self.caches = bool(cache_modules(self.shadow))  # a Hugging Face model's
        self.buffers = any(True for _ in model.buffers())
        self.progress = Progress("fitting", 40, "batch sizes profiled on meta")
        self.scaled: ScaledProfiles | None = None
        self.not_on_meta = ""  # why the step cannot run on meta, once it could not
        self.by_allocator = False  # real steps on the CPU, by its allocator (on_the_device)

    def probe(self, batch: int) -> _Probe:
        if batch not in self.seen:
            with torch.device("meta"):
                args, kwargs = self.make_inputs(batch)
            args, kwargs = tree_map(_on_meta, (args, kwargs))
            prof = self.profile(batch, args, kwargs)
            low = profile_lowest(prof, selective=self.selective)
            plan = None  # (the RNG states and buffer copies its checkpoints keep count)
            if (self.dm.rng_state or self.buffers) and low < prof.peak:
                plan = plan_from_profile(self.model, prof, low, selective=self.selective)
            calls, copies = checkpointed_calls(plan, prof), buffer_copies(plan, prof)
            memory = step_memory(self.shadow, (args, kwargs), low, self.opt, self.dm, calls,
                                 copies, self.by_allocator)  # fmt: skip
            self.seen[batch] = _Probe(batch, (args, kwargs), prof, memory, plan)
            self.progress.step(f"batch {batch}")
        return self.seen[batch]

    def profile(self, batch: int, args: Any, kwargs: Any) -> Profile:
        """The step's profile at ``batch`` (``args``, ``kwargs`` on ``meta``): the shadow's,
        or, once the shadow cannot run and the real model can, scaled from real steps."""
        if self.by_allocator:
            return self.real(batch, memory="allocator")
        if self.scaled is None:
            try:
                return profile(self.shadow, args, kwargs, loss_fn=self.loss_fn,
                               autocast=self.autocast)  # fmt: skip
            except Exception as exc:
                if model_device(self.model).type == "meta":
                    raise
                first = self.real(batch)  # (its own error, when the real step fails too)
                self.not_on_meta = str(exc).splitlines()[0][:200]
                self.scaled = ScaledProfiles(self.real, batch, first)
                logger.warning(
                    "fit: %s cannot be sized on meta (%s): sizing it from real steps on %s "
                    "at batches %d, %d and %d, scaled", type(self.model).__name__,
                    self.not_on_meta, model_device(self.model), 2 * batch, 4 * batch, 6 * batch,
                )  # fmt: skip
        try:
            return self.scaled.at(batch)
        except NotScalable as exc:
            raise NotScalable(
                f"fit cannot size {type(self.model).__name__}: its step cannot run on meta "
                f"({self.not_on_meta}), and scaling real steps fails: {exc}. Plan a fixed "
                f"batch instead (autoremat.plan_for_device(model, args, kwargs, "
                f"device_memory=...))"
            ) from None

    def real(self, batch: int, memory: str = "tensors", hf_cache: bool = False) -> Profile:
        """A real step of the model on its device at ``batch``, profiled (``memory`` and
        ``hf_cache`` as :func:`~autoremat.costs.profile.profile` has them; by the allocator
        untimed, as on ``meta``)."""
        device = model_device(self.model)
        args, kwargs = tree_map(
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, self.make_inputs(batch)
        )
        how = {"loss_fn": self.loss_fn, "autocast": self.autocast, "hf_cache": hf_cache}
        timed = memory == "tensors"
        return profile(self.model, args, kwargs, memory=memory, timed=timed, **how)  # type: ignore[arg-type]

    def on_the_device(self) -> _Prober:
        """A prober like this one that profiles real steps on the model's device, by the CPU
        allocator (kernels' scratch counted: ``profile(memory="allocator")``)."""
        found = _Prober(self.model, self.make_inputs, self.opt, self.dm, self.loss_fn,
                        self.selective, self.autocast)  # fmt: skip
        found.by_allocator = True
        found.progress = Progress("checking", 12, "batch sizes profiled on the device")
        return found

    def settle(self, guess: int, recompute: bool = True) -> int:
        """The largest batch up to ``guess`` that fits as this prober sees it, when
        ``guess + 1`` is known not to (0: none). The step's memory grows about linearly
        with the batch, so each next batch tried is where the line through the two nearest
        tried (one, at first: through no memory beyond what does not grow) meets the
        device's limit, kept strictly between the largest that fits and the smallest that
        does not; from the third on, every other try bisects instead (the line may be off):
        a handful of real steps."""
        need = {}  # batch -> the device memory it needs
        lo, hi, batch = 0, guess + 1, guess
        while hi - lo > 1:
            memory = self.probe(batch).lowest if recompute else self.without(batch)
            need[batch] = memory.device
            fixed = memory.parameters + memory.buffers + memory.optimizer_state
            lo, hi = (batch, hi) if need[batch] <= self.dm.limit else (lo, batch)
            guess = _crossing(need, lo, hi, fixed, self.dm.limit)
            if len(need) >= 3:  # (then bisection: the line may be off)
                guess = (lo + hi) // 2 if len(need) % 2 else guess
            batch = min(hi - 1, max(lo + 1, guess))
        return lo

    def without(self, batch: int) -> StepMemory:
        """The whole step's memory of the model's own step at ``batch``, no recompute: a
        Hugging Face model fills its key/value cache then (no applied plan lets it), so it is
        profiled once more with it, only for the batches asked."""
        if batch not in self.plain:
            probe = self.probe(batch)
            peak = probe.profile.peak
            if self.caches and self.by_allocator:
                peak = self.real(batch, memory="allocator", hf_cache=True).peak
            elif self.caches and self.scaled is None:  # (scaled: priced without the cache)
                args, kwargs = probe.inputs
                how = {"loss_fn": self.loss_fn, "autocast": self.autocast, "hf_cache": True}
                peak = profile(self.shadow, args, kwargs, **how).peak  # type: ignore[arg-type]
            self.plain[batch] = step_memory(self.shadow, probe.inputs, peak, self.opt, self.dm,
                                            scratch=self.by_allocator)  # fmt: skip
        return self.plain[batch]

    def fits(self, batch: int, recompute: bool = True) -> bool:
        memory = self.probe(batch).lowest if recompute else self.without(batch)
        return memory.device <= self.dm.limit

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
        """The largest batch in ``1..top`` that fits (0: none), by doubling then bisection
        from the smallest batch that runs (:meth:`smallest_running`)."""
        lo = self.smallest_running(top)
        if not self.fits(lo, recompute):
            return 0
        hi = top + 1
        while 2 * lo <= top:
            if not self.fits(2 * lo, recompute):
                hi = 2 * lo
                break
            lo *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, recompute) else (lo, mid)
        return lo

    def candidate(self, batch: int) -> Candidate:
        """``batch`` planned at what the device leaves for the step."""
        probe = self.probe(batch)
        prof = probe.profile
        room = self.dm.for_tensors() - probe.lowest.resident
        chosen = None
        if room < prof.peak:  # (the largest batch is near its lowest budget by design)
            chosen = plan_fitting(self.model, prof, room, self.dm.rng_state, self.selective,
                                  fallback=probe.lowest_plan)  # fmt: skip
        peak = prof.peak if chosen is None else chosen.estimated_peak or 0
        calls, copies = checkpointed_calls(chosen, prof), buffer_copies(chosen, prof)
        memory = step_memory(self.shadow, probe.inputs, peak, self.opt, self.dm, calls, copies,
                             self.by_allocator)  # fmt: skip
        seconds = step_seconds(prof, chosen)
        out = prof[prof.tree.path].output_bytes
        return Candidate(batch, memory, self.without(batch), chosen, seconds, out)


def _on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def fit(
    model: nn.Module,
    make_inputs: Inputs,
    *,
    device_memory: int | float | str,
    optimizer: OptimizerLike = "adamw",
    loss_fn: LossFn | None = None,
    autocast: Autocast | torch.dtype | None = None,
    objective: str = "batch",
    max_batch: int = 2**16,
    selective: bool = True,
    verify: bool = True,
    reserve: int | str = 0,
) -> Fit:
    """The largest batch of ``model`` whose training step fits ``device_memory``, and the
    cheapest plan for it (module docstring).

    ``make_inputs(batch)`` returns ``(args, kwargs)`` for that batch size (for instance
    ``lambda b: autoremat.scale_batch(args, kwargs, b)``); it is called under
    ``torch.device("meta")`` for sizing, and once as it is for the check. ``device_memory``:
    bytes, a size (``"24GiB"``) or a fraction (``"90%"``) of the model's device
    (:mod:`autoremat.training.device_model`). ``optimizer``: a name (``"sgd"``, ``"adam"``,
    ``"adamw"``), an optimizer to copy, a function from parameters to one, or ``None``.
    ``autocast`` (``torch.bfloat16``: the model's device's, ``cuda``'s on ``meta``; or
    ``(device_type, dtype)``): forward and loss under ``torch.autocast``, on ``meta`` with its
    casts (:mod:`autoremat.record.autocast_meta`). ``objective``: ``"batch"`` (the largest) or
    ``"throughput"`` (of it and a few smaller ones, the most predicted samples per second).
    With ``verify``, the plan is applied, real steps run at that batch on the model's device
    and the model is put back (not on ``meta``; not beyond a CPU machine's available RAM:
    ``Fit.not_verified``). ``reserve`` (bytes, a size): left free, for a loop keeping an
    output through the next forward (:class:`Fit` says how much) or anything else. Logs and
    shows progress; the model must not be wrapped.

    Raises:
        ValueError: even a batch of 1 does not fit (the message gives what it needs), an
            unknown objective or optimizer, a malformed ``device_memory`` or ``reserve``.
    """
    if objective not in FIT_OBJECTIVES:
        raise ValueError(f"objective must be one of {FIT_OBJECTIVES}, got {objective!r}")
    dm = device_model(device_memory, model_device(model), reserve)
    spec = autocast_spec(autocast, model)
    opt = optimizer_memory(model, optimizer)
    prober, top, without = _sized(
        _Prober(model, make_inputs, opt, dm, loss_fn, selective, spec), max_batch, verify
    )
    candidates = [prober.candidate(b) for b in _ladder(without, top, objective)]
    fastest = max(candidates, key=lambda c: (c.samples_per_second, c.batch))
    chosen = fastest if objective == "throughput" else candidates[-1]
    plan = chosen.plan or plan_from_profile(model, prober.probe(chosen.batch).profile, 1.0)
    if "left_out" in plan.warnings:
        logger.warning("%s", plan.warnings["left_out"])
    how: StepHow = (loss_fn, spec)
    measured, unsafe = _checked(model, make_inputs, chosen, plan, optimizer, how, verify)
    found = Fit(chosen.batch, plan, dm, tuple(candidates), without, measured, objective, chosen,
                unsafe, tuple(prober.seen) if prober.by_allocator else ())  # fmt: skip
    if found.fits is False:
        logger.warning("batch %d was predicted to fit but measured %s", chosen.batch, measured)
    return found


def _crossing(need: dict[int, int], lo: int, hi: int, fixed: int, limit: int) -> int:
    """The batch at which the line through the memory needed at ``lo`` and ``hi`` (those
    tried; else through ``fixed`` bytes at batch 0) reaches ``limit``, rounded down."""
    known = [(b, need[b]) for b in (lo, hi) if b in need] or [(0, fixed)]
    (b0, m0), (b1, m1) = [(0, fixed), *known][-2:]
    if m1 == m0:
        return b1
    return math.floor(b0 + (limit - m0) * (b1 - b0) / (m1 - m0))


def _sized(prober: _Prober, max_batch: int, verify: bool) -> tuple[_Prober, int, int]:
    """The largest batch that fits with recompute and without, found on ``meta`` (or scaled
    real steps); then on a CPU, from real steps by its allocator (:func:`_by_allocator`),
    with the prober that found them."""
    top = prober.largest(max_batch)
    if top == 0:
        raise _none_fits(prober, max_batch)
    without = prober.largest(top, recompute=False)
    if _by_allocator(prober, top, verify):
        prober = prober.on_the_device()
        top = prober.settle(top)
        if top == 0:
            raise _none_fits(prober, max_batch)
        without = prober.settle(min(without, top), recompute=False) if without else 0
    return prober, top, without


def _by_allocator(prober: _Prober, top: int, verify: bool) -> bool:
    """Whether to size again from real steps by the CPU allocator (kernels' scratch, which
    ``meta`` cannot show): on a CPU, when checking (``verify``), outside a profiler session of
    the caller's (the allocator's count needs its own), and when the batch found on ``meta``
    needs no more than the machine has available (else the check is skipped too)."""
    device = model_device(prober.model)
    if not verify or not cpu_allocator_countable(device):
        return False
    return prober.probe(top).lowest.device <= available_memory(device)


def _checked(model: nn.Module, make_inputs: Inputs, chosen: Candidate, plan: Plan,
             optimizer: OptimizerLike, how: StepHow,
             verify: bool) -> tuple[TrainingMeasurement | None, str]:  # fmt: skip
    """The check on the device (:func:`_verify`) unless not asked, on ``meta`` (nothing runs
    there) or beyond what a CPU machine has available (then why, :func:`_beyond_available`)."""
    device = model_device(model)
    if not verify or device.type == "meta":
        return None, ""
    unsafe = _beyond_available(chosen, device)
    if unsafe:
        return None, unsafe
    return _verify(model, make_inputs, chosen.batch, plan, optimizer, how), ""


def _beyond_available(chosen: Candidate, device: torch.device) -> str:
    """Why running the chosen step on a CPU would take more memory than the machine has
    available now ("" when it would not): the check would push the host into swap or the
    out-of-memory killer, where a GPU would only raise its out-of-memory error."""
    if device.type == "cuda":
        return ""
    need, free = chosen.memory.device, available_memory(device)
    if need <= free:
        return ""
    why = (
        f"batch {chosen.batch} needs {format_size(need)} and this machine has "
        f"{format_size(free)} available now; give a smaller device_memory to check on this "
        f"machine, or check on the target device"
    )
    logger.warning("fit: the check on the device is skipped: %s", why)
    return why


def _none_fits(prober: _Prober, max_batch: int) -> ValueError:
    batch = prober.smallest_running(max_batch)
    need, dm = prober.probe(batch).lowest, prober.dm
    return ValueError(
        f"even a batch of {batch} does not fit {dm}: its training step needs "
        f"{format_size(need.device)} with the most recompute:\n{need}\nUse a device with "
        f"more memory, a lower precision, or an optimizer with less state"
    )


def _ladder(without: int, top: int, objective: str) -> list[int]:
    """The batches planned: the largest, and for ``"throughput"`` up to three smaller ones
    between the largest without recompute and it (geometric steps), ascending."""
    if objective == "batch" or without >= top:
        return sorted({max(without, 1), top} - {0})
    steps = [round(without * (top / max(without, 1)) ** (k / 3)) for k in range(4)]
    return sorted({b for b in [*steps, top] if 1 <= b <= top})


def _verify(model: nn.Module, make_inputs: Inputs, batch: int, plan: Plan,
            optimizer: OptimizerLike, how: StepHow) -> TrainingMeasurement:  # fmt: skip
    """Real training steps at ``batch`` with ``plan`` applied; the model is put back."""
    device = model_device(model)
    args, kwargs = tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, make_inputs(batch)
    )
    plan.apply(model)
    try:
        loss_fn, autocast = how
        return measure_training(
            model, args, kwargs, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast
        )
    finally:
        remove(model)
