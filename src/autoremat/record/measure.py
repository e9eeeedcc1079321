"""Measure one training step of a model: peak memory, memory saved for backward, FLOPs, time.

:func:`measure` says what the step is, how each figure is taken and what it leaves as found;
:class:`Measurement` defines the figures.

Memory trackers (``measure(memory=...)``): ``"tensors"`` is
:class:`~autoremat.record.memory.LiveMemory` (tensor storages created by the step, exact to the
byte and the same on the ``meta`` device as on a real one; :mod:`autoremat.record.memory` says
what it cannot see: scratch buffers inside kernels, allocator rounding); ``"allocator"`` what
the allocator reports (:class:`~autoremat.record.memory.CudaMemory` on CUDA, what an
out-of-memory error is about; :class:`~autoremat.record.memory.CpuAllocatorMemory` on CPU);
``"auto"`` (the default) is the allocator on CUDA and for a compiled model, tensors otherwise.

On the ``meta`` device (model and inputs) nothing is computed or allocated, yet ``peak``,
``saved`` and ``flops`` come out equal to the CPU figures (checked on linear chains with
and without (selective) checkpointing, a GPT-2-like model, a BatchNorm CNN and Hugging
Face GPT-2); ``seconds`` is then meaningless. Figures for another device can differ where
the device picks other kernels (``scaled_dot_product_attention`` backends on CUDA save
other tensors), and code that reads tensor values (``.item()``, data-dependent shapes)
fails on ``meta``.

A model compiled by ``torch.compile`` is measured by the allocator: a dispatch mode would make
dynamo run it eagerly (:mod:`autoremat.record.compiled`; docs/guide.md, "Under torch.compile").
The step should be warm (compiled before), or the compile's own memory is counted. Its
``flops`` are those of the eager step: the compiled graphs may recompute other ops.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoremat.core.clock import timed
from autoremat.core.devices import model_device, uses_cuda
from autoremat.core.sizes import format_size
from autoremat.record.compiled import is_compiled, running_eagerly
from autoremat.record.memory import CpuAllocatorMemory, CudaMemory, LiveMemory
from autoremat.record.snapshot import preserved
from autoremat.record.step import (
    LossFn,
    default_loss,
    leaf_inputs,
    no_ambient_autocast,
    step_autocast,
    train_step,
)

__all__ = ["MEMORY", "Measurement", "measure"]

# What measure(memory=...) accepts (the module docstring says what each means).
MEMORY = ("auto", "tensors", "allocator")


@dataclass(frozen=True)
class Measurement:
    """What one training step (forward, loss, backward) of a model cost.

    Attributes:
        peak: bytes; the most tensor memory alive at once during the forward and backward,
            counting only storages the step created (activations, the loss, temporaries,
            recomputed activations, gradients), i.e. above what was alive before the step.
        saved: bytes; the tensor memory created during the forward (loss included) that is
            still alive when the loss has been computed, just before backward: the activations
            held for backward, selective-checkpoint caches, the model's outputs and the loss.
        flops: floating-point operations the step executed, forward and backward, recompute
            included, as counted by ``FlopCounterMode`` (matmuls, convolutions, attention;
            elementwise ops count zero).
        seconds: wall time of one step, the median of ``repeats`` runs made without any
            tracking mode active.
    """

    peak: int
    saved: int
    flops: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"peak {format_size(self.peak)}, held for backward {format_size(self.saved)}, "
            f"{self.flops / 1e9:.3f} GFLOP, {self.seconds * 1e3:.1f} ms/step"
        )


def measure(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
    repeats: int = 1,
    memory: str = "auto",
    autocast: Any = None,
) -> Measurement:
    """Measure one training step of ``model(*args, **kwargs)``.

    The step: every parameter's ``.grad`` set to ``None``, ``output = model(*args, **kwargs)``,
    ``loss = loss_fn(output)`` (:func:`~autoremat.record.step.default_loss` when ``loss_fn`` is
    None), ``loss.backward()``. It runs in the model's current mode (``train()``/``eval()``) with
    gradients enabled, once under a memory tracker (for ``peak`` and ``saved``: ``memory``, one of
    :data:`MEMORY`, see the module docstring), once under ``FlopCounterMode`` (for ``flops``), then
    ``repeats`` times without either (for ``seconds``). Every run starts from the same global RNG
    state, so dropout draws the same masks in each, and from ``.grad = None`` also for leaf inputs
    requiring grad. ``args`` may be a single tensor. ``autocast`` (a dtype, or ``(device_type,
    dtype)``; ``None`` inside an autocast region: the region's): forward and loss under
    autocast, backward outside, as a budget assumes. LayerDrop is off: every layer runs, the
    most a step holds (:mod:`autoremat.core.layerdrop`).

    The model is left as found (buffers, the ``.grad`` of parameters and of leaf inputs,
    training flags, the global RNG state), also when the step raises (no optimizer runs).
    :class:`Measurement` defines the figures.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``repeats`` is below 1; ``memory`` not one of :data:`MEMORY`, or
            ``"tensors"`` for a compiled model; ``loss_fn`` returned something other than a tensor
            with a single element (reduce it with ``.sum()``/``.mean()``); the loss does not
            require grad (nothing to backpropagate); :func:`default_loss` found no
            floating-point tensor in the output.
        Exception: whatever the model's forward or backward raises, unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    inputs = leaf_inputs(args, kwargs)
    loss, cast = loss_fn or default_loss, step_autocast(autocast, model)
    run = functools.partial(train_step, model, args, kwargs, loss, autocast=cast)
    # Memory and FLOPs from two runs: FlopCounterMode's module tracker keeps checkpoint
    # recomputes' autograd nodes (and activations) alive until it exits, inflating the peak.
    cuda = uses_cuda(model, (args, kwargs))
    tracker = _tracker(memory, model, cuda)
    counter = FlopCounterMode(display=False)
    with no_ambient_autocast():  # (forward and loss in a region of their own: step_autocast)
        with preserved(model, inputs), tracker as tracked:
            run(after_forward=lambda: tracked.snapshot("forward"))
        with preserved(model, inputs), running_eagerly(model), counter as flops:
            run()
        seconds = []
        for _ in range(repeats):  # (each from the model's state on entry)
            with preserved(model, inputs):
                seconds.append(timed(run, cuda)[1])
        peak, saved = tracked.peak, tracked.marks["forward"]
        return Measurement(peak, saved, flops.get_total_flops(), statistics.median(seconds))


def _tracker(memory: str, model: nn.Module, cuda: bool) -> Any:
    """The memory tracker ``memory`` names for this model (see :func:`measure`); the tensors'
    as the model's device holds them (:meth:`LiveMemory.counting_as`)."""
    if memory not in MEMORY:
        raise ValueError(f"memory must be one of {', '.join(MEMORY)}, got {memory!r}")
    compiled = is_compiled(model)
    if memory == "tensors" and compiled:
        raise ValueError(
            "memory='tensors' cannot measure a compiled model (dynamo would run it eagerly "
            "under the tracker); use memory='allocator' or 'auto'"
        )
    if memory == "tensors" or not (cuda or memory == "allocator" or compiled):
        return LiveMemory.counting_as(model_device(model))
    return CudaMemory() if cuda else CpuAllocatorMemory()
