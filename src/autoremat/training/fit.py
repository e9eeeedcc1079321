"""Fitting a device: the largest batch whose cheapest plan fits, and the fastest plan for it.

:func:`fit` answers "my GPU has 24 GiB: what is the biggest batch I can train, and how do I
get there with the least slowdown?" without running the model at each candidate size:

1. a *shadow* of the model on ``meta`` (its structure, no memory, no copy of the weights) is
   profiled at each candidate batch (inputs made by ``make_inputs(batch)`` under
   ``torch.device("meta")``); the profile on ``meta`` predicts what the real one would
   (``tests/test_calls.py``, ``tests/test_measure.py``);
2. a batch *fits* when the whole step's memory (:mod:`autoremat.training.step_memory`: parameters,
   buffers, inputs, optimizer state and step, and the step peak of the plan at the lowest budget)
   fits the device (:mod:`autoremat.training.device_model`); the largest such batch is found
   where the line through the memory of the batches tried meets the device's limit, every
   other try from the third bisecting or doubling (one ``meta`` profile per batch tried:
   7 for the ``looped`` example at 96 MiB, where doubling then bisecting took 14);
3. the plan for it is the cheapest whose predicted peak fits what the device leaves for the
   step; with ``objective="throughput"`` a few smaller batches are planned too, and the one
   with the most predicted samples per second is chosen (:func:`step_seconds`);
4. on a CPU (when checking, within the RAM available), ``meta`` cannot show kernels' scratch,
   so the batch is sized again from real steps profiled by the CPU allocator
   (``profile(memory="allocator")``), a few batches at and below the one found on ``meta``
   (:meth:`Prober.settle`): the batch returned fits by the allocator's figure, the next size
   up does not;
5. once, on the device: the plan applied, real optimizer steps at that batch
   (:func:`autoremat.measure_memory`; on a CPU by its allocator too), the model put back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autoremat.core.devices import model_device
from autoremat.core.sizes import format_size
from autoremat.core.words import first_few
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.memory import cpu_allocator_countable
from autoremat.record.shadow import meta_shadow
from autoremat.record.step import Autocast, LossFn, StepHow, step_autocast
from autoremat.training.device_model import DeviceModel, available_memory, device_model
from autoremat.training.measure_memory import MemoryMeasurement, measure_memory
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.plan import eval_mode_warning
from autoremat.training.prober import (
    Candidate,
    Inputs,
    Probe,
    Prober,
    step_seconds,
)
from autoremat.training.rank_prober import RankProber
from autoremat.training.sharding import Sharding, sharding_of
from autoremat.training.step_memory import StepMemory
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

# What fit maximises (``fit(objective=...)``), each with what its summary says of it.
_AIMS = {
    "batch": "objective 'batch': the largest batch; 'throughput' picks the most samples/s",
    "throughput": "objective 'throughput': the most samples per second",
}
FIT_OBJECTIVES = tuple(_AIMS)


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
    measured: MemoryMeasurement | None = None
    objective: str = "batch"
    chosen: Candidate | None = field(default=None, repr=False)
    # why the check on the device did not run ("": it ran, or verify=False / meta)
    not_verified: str = ""
    # the batches sized again from real steps by the CPU allocator (kernels' scratch)
    by_allocator: tuple[int, ...] = ()
    # each batch the search tried, with the whole step's memory at its most recompute
    tried: tuple[tuple[int, StepMemory], ...] = field(default=(), repr=False)
    # the optimizer whose state was counted, in words ("adamw", "AdamW", "none")
    optimizer: str = ""

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
        entries = self.plan.modules
        named = first_few([p or "(root)" for p in entries[:3]], 3, len(entries))
        lines = [
            f"batch {self.batch} fits {self.device}; the largest without recompute: "
            f"{self.largest_without_recompute} ({_AIMS[self.objective]})",
            f"plan: {len(entries)} entries{f' ({named})' if entries else ''}, recompute adds "
            f"{(self.plan.recompute_flops or 0) / 1e9:.3f} GFLOP (each in .plan.summary())",
        ]
        if self.chosen is not None:
            counted = f" (optimizer {self.optimizer})" if self.optimizer else ""
            lines += [f"predicted memory{counted}:", str(self.chosen.memory)]
            kept = self.chosen.output_bytes  # (not named when a few bytes: a loss alone)
            lines.append(
                "assumed: each step's tensors are freed before the next forward"
                + (f"; a loop that keeps the output alive through it needs {format_size(kept)} "
                   f"more (reserve=..., --reserve)" if kept * 1000 >= self.device.limit else "")
            )  # fmt: skip
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
    sharding: Sharding | None = None,
) -> Fit:
    """The largest batch of ``model`` whose training step fits ``device_memory``, and the
    cheapest plan for it (module docstring).

    ``make_inputs(batch)`` returns ``(args, kwargs)`` for that batch size (for instance
    ``lambda b: autoremat.scale_batch(args, kwargs, b)``); it is called
    under ``torch.device("meta")`` for sizing, and once as it is for the check. ``device_memory``:
    bytes, a size (``"24GiB"``) or a fraction (``"90%"``) of the model's device
    (:mod:`autoremat.training.device_model`). ``optimizer`` as :func:`autoremat.predict_memory`
    takes it. ``autocast`` (``torch.bfloat16``: the model's device's, ``cuda``'s on ``meta``;
    or ``(device_type, dtype)``): forward and loss under ``torch.autocast``, on ``meta`` with
    its casts. ``objective``: ``"batch"`` (the largest) or ``"throughput"`` (of it and a few
    smaller ones, the most predicted samples per second). With ``verify``, the plan is
    applied, real steps run at that batch on the model's device and the model is put back
    (not on ``meta``; not beyond a CPU's available RAM: ``Fit.not_verified``). ``reserve``
    (bytes, a size): left free (:class:`Fit` says for what). Logs and shows progress; the
    model must not be wrapped. Per rank (``sharding``, a :class:`~autoremat.Sharding`: see
    ``rank_prober``), ``device_memory`` and the batch are one rank's, and not checked on a device.

    Raises:
        BudgetTooLow: (a ValueError) even a batch of 1 does not fit with the most recompute
            (the message gives what its step needs, one part a line).
        ValueError: an unknown objective or optimizer, a malformed ``device_memory`` or
            ``reserve``, a ``max_batch`` below 1.
        TypeError: ``make_inputs`` is not callable (the message shows a call that is).
    """
    _check(objective, make_inputs, max_batch)
    dm = device_model(device_memory, model_device(model), reserve)
    spec = step_autocast(autocast, model)
    ranks = sharding_of(model, sharding)
    prober = _prober(model, make_inputs, optimizer, dm, (loss_fn, spec), selective, ranks)
    prober, top, without = _sized(prober, max_batch, verify and ranks is None)
    candidates = [prober.candidate(b) for b in _ladder(without, top, objective)]
    fastest = max(candidates, key=lambda c: (c.samples_per_second, c.batch))
    chosen = fastest if objective == "throughput" else candidates[-1]
    plan = chosen.plan or _no_recompute(model, prober.probe(chosen.batch))
    _warn(model, plan)
    measured, unsafe = _checked(model, make_inputs, chosen, plan, optimizer, (loss_fn, spec),
                                verify, ranks)  # fmt: skip
    found = Fit(chosen.batch, plan, dm, tuple(candidates), without, measured, objective, chosen,
                unsafe, tuple(prober.seen) if prober.by_allocator else (),
                _tried(prober), _named(optimizer))  # fmt: skip
    if found.fits is False:  # (a warning, and the Fit says so)
        logger.warning("batch %d was predicted to fit but measured %s", found.batch, measured)
    return found


def _warn(model: nn.Module, plan: Plan) -> None:
    """Log what the chosen plan says of modules left out, and of a model in eval mode (added to
    its warnings as ``"eval_mode"``)."""
    if not model.training:
        plan.warnings["eval_mode"] = eval_mode_warning(model, "the device's memory")
    for kind in ("left_out", "eval_mode"):
        if kind in plan.warnings:
            logger.warning("%s", plan.warnings[kind])


def _check(objective: str, make_inputs: Inputs, max_batch: int) -> None:
    """:func:`fit`'s ``objective``, ``make_inputs`` and ``max_batch`` checked before anything
    runs."""
    if objective not in FIT_OBJECTIVES:
        raise ValueError(f"objective must be one of {FIT_OBJECTIVES}, got {objective!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a whole number of at least 1, got {max_batch!r}")
    if not callable(make_inputs):
        raise TypeError(
            f"make_inputs must be a function of the batch size that returns (args, kwargs), "
            f"such as lambda b: autoremat.scale_batch(args, kwargs, b); got "
            f"{type(make_inputs).__name__} {getattr(make_inputs, '__name__', '')}".rstrip()
        )


def _named(optimizer: OptimizerLike) -> str:
    """``optimizer`` in words: its name, its class's, or "none"."""
    if optimizer is None or isinstance(optimizer, str):
        return str(optimizer).lower()
    return getattr(optimizer, "__name__", type(optimizer).__name__)


def _tried(prober: Prober) -> tuple[tuple[int, StepMemory], ...]:
    """Each batch ``prober`` tried whose step with the most recompute it sized."""
    probes = sorted(prober.seen.items())
    return tuple((b, p.lowest) for b, p in probes if "lowest" in vars(p))


def _no_recompute(model: nn.Module, probe: Probe) -> Plan:
    """The empty plan for ``probe``'s batch (no recompute needed)."""
    rehearsal = probe.planner.planner.rehearsal
    return plan_from_profile(model, probe.profile, 1.0, rehearsal=rehearsal)


def _prober(model: nn.Module, make_inputs: Inputs, optimizer: OptimizerLike, dm: DeviceModel,
            how: StepHow, selective: bool, ranks: Sharding | None) -> Prober:  # fmt: skip
    """The prober for one device, or for one rank of ``ranks``' job."""
    loss_fn, spec = how
    if ranks is None:
        opt = optimizer_memory(model, optimizer)
        return Prober(model, make_inputs, opt, dm, loss_fn, selective, spec)
    return RankProber(model, make_inputs, optimizer, dm, loss_fn, selective, spec, ranks)


def _sized(prober: Prober, max_batch: int, verify: bool) -> tuple[Prober, int, int]:
    """The largest batch that fits with recompute and without, found on ``meta`` (or scaled
    real steps); then on a CPU, from real steps by its allocator (:func:`_by_allocator`),
    with the prober that found them."""
    top = prober.largest(max_batch)
    if top == 0:
        raise _none_fits(prober, max_batch)
    without = prober.largest(top, recompute=False)
    if _by_allocator(prober, top, verify):
        prober = prober.on_the_device(top)
        top = prober.settle(top)
        if top == 0:
            raise _none_fits(prober, max_batch)
        without = prober.settle(min(without, top), recompute=False) if without else 0
    return prober, top, without


def _by_allocator(prober: Prober, top: int, verify: bool) -> bool:
    """Whether to size again from real steps by the CPU allocator (kernels' scratch, which
    ``meta`` cannot show): on a CPU, when checking (``verify``), outside a profiler session of
    the caller's (the allocator's count needs its own), and when the batch found on ``meta``
    needs no more than the machine has available (else the check is skipped too)."""
    device = model_device(prober.model)
    if not verify or not cpu_allocator_countable(device):
        return False
    return prober.probe(top).lowest.device <= available_memory(device)


def _checked(model: nn.Module, make_inputs: Inputs, chosen: Candidate, plan: Plan,
             optimizer: OptimizerLike, how: StepHow, verify: bool,
             ranks: Sharding | None = None) -> tuple[MemoryMeasurement | None, str]:  # fmt: skip
    """The check on the device (:func:`_verify`) unless not asked, on ``meta`` (nothing runs
    there), per rank of ``ranks`` (not here) or beyond what a CPU machine has available (then
    why, :func:`_beyond_available`)."""
    if ranks is not None:
        return None, f"sized per rank, {ranks}: measure it on the ranks"
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


def _none_fits(prober: Prober, max_batch: int) -> BudgetTooLow:
    batch = prober.smallest_running(max_batch)
    probe = prober.probe(batch)
    need, dm = probe.lowest, prober.dm
    return BudgetTooLow(
        f"even a batch of {batch} does not fit {dm}: its training step needs "
        f"{format_size(need.device)} with the most recompute:\n{need}\nUse a device with "
        f"more memory, a lower precision, or an optimizer with less state",
        need.step_peak,
        probe.profile.peak,
    )


def _ladder(without: int, top: int, objective: str) -> list[int]:
    """The batches planned: the largest, and for ``"throughput"`` up to three smaller ones
    between the largest without recompute and it (geometric steps), ascending."""
    if objective == "batch" or without >= top:
        return sorted({max(without, 1), top} - {0})
    steps = [round(without * (top / max(without, 1)) ** (k / 3)) for k in range(4)]
    return sorted({b for b in [*steps, top] if 1 <= b <= top})


def _verify(model: nn.Module, make_inputs: Inputs, batch: int, plan: Plan,
            optimizer: OptimizerLike, how: StepHow) -> MemoryMeasurement:  # fmt: skip
    """Real training steps at ``batch`` with ``plan`` applied; the model is put back."""
    device = model_device(model)
    args, kwargs = tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, make_inputs(batch)
    )
    plan.apply(model)
    try:
        loss_fn, autocast = how
        return measure_memory(
            model, args, kwargs, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast
        )
    finally:
        remove(model)
