"""Measuring a whole training step: memory around real optimizer steps.

:func:`measure_memory` runs ``steps`` real training steps (``zero_grad(set_to_none=True)``,
forward, loss, backward, ``optimizer.step()``) with a fresh optimizer and reports, for the
last one (the optimizer's state then exists, as in every step after the first), the most bytes
tensors held at once, those live before it included (parameters, buffers, optimizer state,
inputs): what :class:`~autoremat.training.step_memory.StepMemory` predicts as ``tensors``.
On the CPU it also reports the CPU allocator's most (``allocated``: the same, kernels' scratch
and checkpoints' RNG states included, :class:`~autoremat.record.memory.CpuAllocatorMemory`).
On CUDA it reports the caching allocator's most reserved bytes
(``torch.cuda.max_memory_reserved``) and the device's used memory
(``torch.cuda.mem_get_info``), what an out-of-memory error and ``nvidia-smi`` are about.

The model is put back afterwards: parameters and buffers get their values back (from a copy
held on the host meanwhile), each parameter's ``.grad`` its tensor (or ``None``), each module
its attributes and hooks (:func:`autoremat.record.snapshot.modules_kept`), and the global
random generators (torch's, Python's and NumPy's) are restored.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.core.host_rng import generators_kept
from autoremat.core.nested import tensor_bytes
from autoremat.core.sizes import format_size
from autoremat.record.memory import CpuAllocatorMemory, LiveMemory, cpu_allocator_countable
from autoremat.record.snapshot import fsdp_classes, modules_kept
from autoremat.record.step import (
    Autocast,
    LossFn,
    StepHow,
    default_loss,
    no_ambient_autocast,
    step_autocast,
    train_step,
)
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_factory

__all__ = ["MemoryMeasurement", "measure_memory"]


@dataclass(frozen=True)
class MemoryMeasurement:
    """``tensors``: the most bytes tensors held at once in the measured step, those live
    before it included; ``reserved`` and ``device_used``: on CUDA, the allocator's most
    reserved bytes in that step and the device memory in use after it (``None`` elsewhere);
    ``allocated``: on the CPU, the allocator's most, those live before it included (``None``
    inside a ``torch.profiler`` session of the caller's, which the allocator's count needs)."""

    tensors: int
    reserved: int | None = None
    device_used: int | None = None
    allocated: int | None = None

    def __str__(self) -> str:
        text = f"tensors at most {format_size(self.tensors)}"
        if self.allocated is not None:
            text += f", CPU allocator at most {format_size(self.allocated)}"
        if self.reserved is not None:
            text += f", allocator reserved {format_size(self.reserved)}"
        if self.device_used is not None:
            text += f", device in use {format_size(self.device_used)}"
        return text


def measure_memory(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    optimizer: OptimizerLike = "adamw",
    loss_fn: LossFn | None = None,
    steps: int = 2,
    autocast: Autocast | torch.dtype | None = None,
) -> MemoryMeasurement:
    """Measure the memory of training ``model`` on these inputs with ``optimizer`` (a name of
    :data:`autoremat.training.optimizer_memory.OPTIMIZERS`, an optimizer to copy, a function from
    parameters to one, or ``None``): see the module docstring. ``steps`` >= 1 steps run; the
    last is measured. ``autocast`` (a dtype, or ``(device_type, dtype)``): forward and loss
    under ``torch.autocast``.

    Raises:
        ValueError: ``steps`` below 1, an unknown optimizer name; see :func:`autoremat.measure`
            for the loss.
        Exception: whatever the model or the optimizer raises (the model is put back first).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unseen = _unseen(model)
    if unseen:
        warnings.warn(
            f"measure_memory counts this process's step as one device's: {unseen} are not "
            f"seen, so its figure is not a rank's; autoremat.predict_memory(..., sharding="
            f"autoremat.Sharding(...)) predicts a rank's to the byte (docs/scale.md)",
            stacklevel=2,
        )
    make = optimizer_factory(optimizer)
    loss_fn = default_loss if loss_fn is None else loss_fn
    how: StepHow = (loss_fn, step_autocast(autocast, model))  # (before the region is off)
    saved = _Saved(model)
    try:
        with generators_kept(_cuda_devices(model)), modules_kept(model), \
                no_ambient_autocast():
            return _run(model, args, kwargs or {}, make, how, steps)
    finally:
        saved.restore()


def _unseen(model: nn.Module) -> str:
    """What a rank holds that this measure does not see: DDP's gradient buckets (from outside
    the step), FSDP2's gathers (``UntypedStorage.resize_``, which no op shows); ``""``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "DDP's gradient buckets"
    fsdp = fsdp_classes()
    if fsdp and any(isinstance(m, fsdp) for m in model.modules()):
        return "FSDP's gathers and frees (UntypedStorage.resize_)"
    return ""


def _run(
    model: nn.Module, args: Any, kwargs: Any, make: Any, how: StepHow, steps: int
) -> MemoryMeasurement:
    opt = None if make is None else make([p for p in model.parameters() if p.requires_grad])
    cuda = any(p.is_cuda for p in model.parameters())
    for _ in range(steps - 1):
        _step(model, args, kwargs, opt, how)
    state = [] if opt is None else [v for s in opt.state.values() for v in s.values()]
    before = tensor_bytes([*model.parameters(), *model.buffers(), state, args, kwargs])
    for p in model.parameters():  # (as the step does first: the allocator's start without them)
        p.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    by_allocator = cpu_allocator_countable(model_device(model))
    watched = CpuAllocatorMemory() if by_allocator else contextlib.nullcontext()
    with watched, LiveMemory() as live:
        _step(model, args, kwargs, opt, how)
    if isinstance(watched, CpuAllocatorMemory):
        return MemoryMeasurement(tensors=before + live.peak, allocated=before + watched.peak)
    if not cuda:
        return MemoryMeasurement(tensors=before + live.peak)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return MemoryMeasurement(before + live.peak, torch.cuda.max_memory_reserved(), total - free)


def _step(model: nn.Module, args: Any, kwargs: Any, opt: Any, how: StepHow) -> None:
    loss_fn, autocast = how  # grads set to None first, as zero_grad does:
    train_step(model, args, kwargs, loss_fn, autocast=autocast)
    if opt is not None:
        opt.step()


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})


class _Saved:
    """The values of a model's parameters and buffers (copied to the host) and its
    parameters' ``.grad``, to put back."""

    def __init__(self, model: nn.Module) -> None:
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        with torch.no_grad():
            self.values = [(t, t.detach().to("cpu", copy=True)) for t in tensors.values()]
        self.grads = [(p, p.grad) for p in model.parameters()]

    def restore(self) -> None:
        with torch.no_grad():
            for t, value in self.values:
                t.copy_(value)
        for p, grad in self.grads:
            p.grad = grad
