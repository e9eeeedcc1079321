"""Measure one training step of a model: peak memory, memory saved for backward, FLOPs, time.

:func:`measure` runs ``forward -> loss -> backward`` on example inputs, starting with every
``.grad`` at ``None`` (as after ``optimizer.zero_grad(set_to_none=True)``), and leaves the model
exactly as it found it (see :func:`autoremat.snapshot.preserved`). Memory comes from
:class:`autoremat.memory.LiveMemory` (tensor storages created by the step, exact to the byte and
the same on the ``meta`` device as on a real one), FLOPs from
:class:`torch.utils.flop_counter.FlopCounterMode`, time from separate runs without either.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoremat.memory import CudaMemory, LiveMemory
from autoremat.snapshot import preserved
from autoremat.tree import iter_tensors, run_model

__all__ = ["Measurement", "default_loss", "measure"]

_MiB = 2**20


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
            f"peak {self.peak / _MiB:.1f} MiB, saved {self.saved / _MiB:.1f} MiB, "
            f"{self.flops / 1e9:.3f} GFLOP, {self.seconds * 1e3:.1f} ms/step"
        )


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output.

    The output's ``loss`` (a key of a mapping, or an attribute, as on a Hugging Face
    ``ModelOutput``) when there is one and it is a tensor, returned as it is; otherwise the sum
    of every floating-point tensor found in the output (nested tuples, lists, dicts,
    dataclasses; see :func:`autoremat.tree.iter_tensors`), each summed with ``.sum()`` into a
    float32 scalar and added, as a float32 scalar.

    Raises:
        ValueError: the output holds no floating-point tensor.
    """
    loss = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    total: torch.Tensor | None = None
    for _, t in iter_tensors(output):
        if t.is_floating_point():
            part = t.sum(dtype=torch.float32)
            total = part if total is None else total + part
    if total is None:
        raise ValueError(
            f"default_loss found no floating-point tensor in the model output "
            f"({type(output).__name__}); pass loss_fn=... that turns the output into a scalar"
        )
    return total


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"loss_fn returned {type(loss).__name__}, not a tensor; return a scalar tensor "
            f"computed from the model output (e.g. lambda out: out.sum())"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; backward needs a single "
            f"number: reduce it (e.g. .sum() or .mean()) in loss_fn"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: no parameter or input it depends on requires grad "
            "(all frozen? the model run under torch.no_grad or with detached outputs?), so there "
            "is no backward pass to measure"
        )
    return loss


def _leaf_inputs(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Input tensors that backward would give a ``.grad``: leaves that require grad."""
    found = {id(t): t for _, t in iter_tensors((args, kwargs)) if t.requires_grad and t.is_leaf}
    return list(found.values())


@contextlib.contextmanager
def _restored(model: nn.Module, inputs: list[torch.Tensor]) -> Iterator[None]:
    """:func:`~autoremat.snapshot.preserved` for the model, and the inputs' ``.grad`` too."""
    grads = [(t, t.grad) for t in inputs]
    try:
        with preserved(model):
            yield
    finally:
        for t, g in grads:
            t.grad = g


def _step(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None,
    loss_fn: Callable[[Any], torch.Tensor],
    inputs: list[torch.Tensor],
    after_forward: Callable[[], Any] | None = None,
) -> None:
    """One training step from ``.grad = None`` (parameters and leaf inputs that require grad):
    forward, loss, backward."""
    for t in [*model.parameters(), *inputs]:
        t.grad = None
    with torch.enable_grad():
        output = run_model(model, args, kwargs)
        loss = _check_loss(loss_fn(output))
        if after_forward is not None:
            after_forward()
        loss.backward()


def _uses_cuda(model: nn.Module, args: Any, kwargs: Any) -> bool:
    tensors = [t for _, t in iter_tensors((args, kwargs))]
    tensors += list(model.parameters()) + list(model.buffers())
    return any(t.device.type == "cuda" for t in tensors)


def measure(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 1,
) -> Measurement:
    """Measure one training step of ``model(*args, **kwargs)``.

    The step: every parameter's ``.grad`` set to ``None``, ``output = model(*args, **kwargs)``,
    ``loss = loss_fn(output)`` (:func:`default_loss` when ``loss_fn`` is None),
    ``loss.backward()``. It runs in the model's current mode (``train()``/``eval()``) with
    gradients enabled, once under :class:`~autoremat.memory.LiveMemory` (for ``peak`` and
    ``saved``; :class:`~autoremat.memory.CudaMemory`, the allocator's statistics, when the
    model or inputs are on CUDA), once under ``FlopCounterMode`` (for ``flops``), then
    ``repeats`` times without either (for ``seconds``). Every run starts from the same global
    RNG state, so dropout draws the same masks in each, and from ``.grad = None`` also for
    input tensors that are leaves requiring grad. ``args`` may be a single tensor.

    The model is left as found: buffers (BatchNorm statistics included), ``.grad`` of every
    parameter and of every leaf input that requires grad (the same tensor objects, or None),
    training flags and the global RNG state are restored, also when the step raises.
    Parameters are not changed by a step (no optimizer runs).

    On the ``meta`` device (model and inputs) nothing is computed or allocated, yet ``peak``,
    ``saved`` and ``flops`` come out equal to the CPU figures (checked on linear chains with
    and without (selective) checkpointing, a GPT-2-like model, a BatchNorm CNN and Hugging
    Face GPT-2); ``seconds`` is then meaningless. Figures for another device can differ where
    the device picks other kernels (``scaled_dot_product_attention`` backends on CUDA save
    other tensors), and code that reads tensor values (``.item()``, data-dependent shapes)
    fails on ``meta``.

    See :class:`Measurement` for the exact definitions, and :mod:`autoremat.memory` for what
    the memory tracker cannot see (scratch buffers inside kernels, allocator rounding).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``repeats`` is below 1; ``loss_fn`` returned something other than a tensor
            with a single element (reduce it with ``.sum()``/``.mean()``); the loss does not
            require grad (nothing to backpropagate); :func:`default_loss` found no
            floating-point tensor in the output.
        Exception: whatever the model's forward or backward raises, unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    loss_fn = default_loss if loss_fn is None else loss_fn
    inputs = _leaf_inputs(args, kwargs)

    def run(after_forward: Callable[[], Any] | None = None) -> None:
        _step(model, args, kwargs, loss_fn, inputs, after_forward)

    # Memory and FLOPs come from two runs: FlopCounterMode's module tracker keeps the autograd
    # nodes of checkpoint recomputes alive (their recomputed activations with them) until it
    # exits, which would inflate the peak of a checkpointed model.
    # On CUDA, the allocator's own statistics (what an out-of-memory error is about).
    cuda = _uses_cuda(model, args, kwargs)
    tracker: LiveMemory | CudaMemory = CudaMemory() if cuda else LiveMemory()
    with _restored(model, inputs), tracker as memory:
        run(after_forward=lambda: memory.snapshot("forward"))
    with _restored(model, inputs), FlopCounterMode(display=False) as flops:
        run()

    times = []
    for _ in range(repeats):
        with _restored(model, inputs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)

    return Measurement(
        peak=memory.peak,
        saved=memory.marks["forward"],
        flops=flops.get_total_flops(),
        seconds=statistics.median(times),
    )
